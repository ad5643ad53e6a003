"""`structformer reproduce lowrank`: the low-rank training study (seed 004) at a scale a CPU runs.

The seed trains WRN-28-10 on CIFAR-100 (200 epochs), ResNet-50 on ImageNet and GPT-2 on LM1B. Here, on
data that ships on this machine:
  vision  a WRN-10-2 on the MNIST test set (--data, 8,000 train / 2,000 held out), SGD (lr 0.2,
          momentum 0.9, weight decay 5e-4, cosine schedule), every conv but the first factorised;
  lm      the byte-level GPT (`gpt2_byte_tiny`) on the standard library's sources (`--data pysource`),
          AdamW, QKV and both FFN matrices factorised at rank 0.62 (the seed's Table 4 rank); factorised runs
          at half the dense lr, the pre-trained one halved again at the switch (App. A.2; --lm-lr-scale).
Experiments (each a full `structformer train` run in --output/<part>/<name>):
  baseline  the dense network;
  init      He vs spectral vs spectral-ones at each rank (Tables 2–4), L2 (= the optimiser's decay);
  decay     Frobenius decay vs L2 with spectral init, effective rank ‖W‖_*/‖W‖_op at the end (Tables 1, 5);
  pretrain  dense for the first third of the epochs (at least one), then factorised by truncated SVD
            (Tables 8–9, Fig. 1), at the middle vision rank and the LM rank;
and the interpolation of held-out loss between the dense baseline and the pre-trained-then-factorised
run vs the from-scratch low-rank run (Fig. 2). Writes results.json, results.md, lowrank.png (inits,
effective rank per epoch, held-out loss per epoch), spectra.png (final singular values, FD vs L2) and
interpolation.png.
A finished run of the same settings (its summary.json present, its config.yaml the planned one: seed, epochs,
data, lr, factorisation) is reused, so an interrupted reproduction continues; another setting trains anew.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

from ..cli_args import MAX_INTERPOLATE_STEPS, interpolate_steps
from ..records import environment, label_axes, write_json, write_png, write_text
from ..errors import UsageError
from . import check_distinct, command_line

EXAMPLES = """examples:
  structformer reproduce lowrank --parts vision --data /data/mnist --ranks 0.2 --epochs 2 --limit-train-batches 2 \\
      --output /tmp/lr_quick                                                           # smoke run, ~5 min
  structformer reproduce lowrank --data /data/mnist --output outputs/reproduce_lowrank  # both parts, ~25 min on 2 cores
  structformer reproduce lowrank --parts lm --output outputs/reproduce_lowrank_lm       # the LM part needs no --data"""

INITS = ('he', 'spectral', 'spectral_ones')
LM_LR = 3e-3                     # AdamW's lr of the dense LM
VISION_HELD_OUT = 2000           # the vision part's held-out images (val_fraction 0.2 of the 10,000)
GROUPS = ('init', 'decay', 'pretrain')
PAPER = {   # seed 004: Table 2 (WRN-28-10, CIFAR-100 top-1), Table 4 (GPT-2, LM1B perplexity), Table 5, Table 1;
    # each pair or triple named as in the record a reader gets (results.json's 'paper'), not bare tuples
    'table2': {'baseline': 81.08, **{r: dict(zip(INITS, v)) for r, v in
                                     ((0.1, (77.94, 79.84, 79.07)), (0.2, (80.37, 81.35, 81.27)),
                                      (0.3, (80.87, 81.53, 81.61)))}},
    'table4': {'baseline': 37.67, 0.62: dict(zip(INITS, (39.6, 38.78, 38.47)))},
    'table5': {0.1: {'frobenius': 79.84, 'l2': 73.12}, 0.2: {'frobenius': 81.35, 'l2': 78.22}},
    'table1_effective_rank': {m: {'frobenius': fd, 'l2': l2} for m, (fd, l2) in
                              (('WRN', (39.87, 16.4)), ('ResNet-50', (68.72, 58.00)), ('LM', (206.93, 205.70)))},
}


def add_arguments(p):
    p.add_argument('--parts', nargs='+', default=['vision', 'lm'], choices=['vision', 'lm'])
    p.add_argument('--data', default=None, help='MNIST folder for the vision part (folder of MNIST IDX files (required; see `structformer train --help` or docs/data.md for where to get them))')
    p.add_argument('--ranks', type=float, nargs='+', default=[0.1, 0.2, 0.3], help='vision ranks (fractions)')
    p.add_argument('--lm-rank', type=float, default=0.62, help='LM rank (fraction; the seed uses 0.62)')
    p.add_argument('--lm-lr-scale', type=float, default=0.5,
                   help="the LM's lr factor for factorised runs, applied to the base lr of every factorised run and "
                        "again at the switch of the pre-trained one (seed 004 App. A.2: 0.5; 1 = the dense lr)")
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('--limit-train-batches', type=int, default=20, help='batches per epoch (0 = all)')
    p.add_argument('--lm-max-bytes', type=int, default=600_000, help='standard-library bytes for the LM part')
    p.add_argument('--interpolate-steps', type=interpolate_steps, default=11, metavar='N',
                   help=f'points on each interpolation line, t = 0, 1/(N-1), ..., 1 (2 … {MAX_INTERPOLATE_STEPS}; '
                        'default 11)')
    p.add_argument('--groups', nargs='+', default=list(GROUPS), choices=GROUPS,
                   help='experiments to run (the dense baseline always runs): split a reproduction across processes')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--output', default='outputs/reproduce_lowrank')


def _check(args) -> None:
    if args.epochs < 2:
        raise UsageError(f"--epochs must be >= 2 (pre-training takes the first third, at least one epoch); got {args.epochs}")
    if args.limit_train_batches < 0:
        raise UsageError(f"--limit-train-batches must be >= 0; got {args.limit_train_batches}")
    check_distinct([f'{r:g}' for r in args.ranks], '--ranks')      # as the run folders name them (r0.1_he)
    for r in list(args.ranks) + [args.lm_rank]:
        if not 0 < r <= 1:
            raise UsageError(f"--ranks / --lm-rank: {r} is out of range: accepted fractions in (0, 1]")
    if not 0 < args.lm_lr_scale <= 1:
        raise UsageError(f"--lm-lr-scale must be a factor in (0, 1]; got {args.lm_lr_scale}")
    if not 2 <= args.interpolate_steps <= MAX_INTERPOLATE_STEPS:       # the parser's range, for a Namespace built by hand
        raise UsageError(f"--interpolate-steps must be an integer in [2, {MAX_INTERPOLATE_STEPS}], got "
                         f"{args.interpolate_steps!r}")
    if 'lm' in args.parts:
        if args.lm_max_bytes < 0:
            raise UsageError(f"--lm-max-bytes must be an integer >= 0 (0 = all of the standard library); got "
                             f"{args.lm_max_bytes}")
        from ..data import build_datasets
        from ..train import TrainConfig
        held_out = TrainConfig.__dataclass_fields__['val_fraction'].default       # what _config's runs use
        try:        # the text is on this machine and small: its refusal is --lm-max-bytes's, before any run
            build_datasets('pysource', seed=args.seed, val_fraction=held_out, max_bytes=args.lm_max_bytes)
        except ValueError as e:
            # the data's own words name --data-kwargs seq_len, which this command does not take: its reason only
            reason = str(e).splitlines()[0].split(': ', 1)[-1]
            raise UsageError(f"--lm-max-bytes {args.lm_max_bytes}: too little text for the LM part's windows of 128 "
                             f"bytes ({reason})") from None
    _check_ranks_save(args)
    if 'vision' in args.parts and not (args.data and Path(args.data).is_dir()):
        from ..data.spec import MNIST_HOWTO
        raise UsageError(f"--data {args.data}: no such folder (the MNIST IDX files; or run --parts lm)" if args.data
                         else f"--data PATH is required for the vision part (or run --parts lm). {MNIST_HOWTO}")


_MODELS = {'vision': 'wrn_16_2_mnist', 'lm': 'gpt2_byte_tiny'}        # _config's models (the WRN at depth 10)


def _check_ranks_save(args) -> None:
    """Each rank must factorise some layer of its part's model with a saving (what `factorize` asks): a rank such
    as 1.0 was refused only when its first run started, after the dense baseline had trained, and the refusal
    pointed at `--transform factorize`, which this command does not take."""
    import timm

    from ..models.factorize import check_factorization
    parts = (([('vision', '--ranks', r) for r in args.ranks] if 'vision' in args.parts else [])
             + ([('lm', '--lm-rank', args.lm_rank)] if 'lm' in args.parts else []))
    models = {}
    for part, flag, rank in parts:
        if part not in models:        # the untrained models of _config's runs: the layers' shapes are all it reads
            models[part] = timm.create_model(_MODELS[part], **({'depth': 10} if part == 'vision' else {}))
        try:
            check_factorization(models[part], rank)
        except ValueError as e:
            raise UsageError(f"{flag} {rank:g} ({part} part, `{_MODELS[part]}`): {str(e).split('; lower')[0]}; "
                             "choose a smaller fraction") from None


def _plan(args) -> List[Dict]:
    """Every run: (part, group, name, factorisation settings)."""
    runs = []
    k = max(1, args.epochs // 3)
    if 'vision' in args.parts:
        runs.append(dict(part='vision', group='baseline', name='dense', rank=None))
        for r in args.ranks:
            runs += [dict(part='vision', group='init', name=f'r{r:g}_{i}', rank=r, init=i) for i in INITS]
        for r in args.ranks[:2]:
            runs.append(dict(part='vision', group='decay', name=f'r{r:g}_spectral_frobenius', rank=r, init='spectral',
                             decay='frobenius'))
        for r in args.ranks[len(args.ranks) // 2:len(args.ranks) // 2 + 1]:     # the middle rank: the seed's
            runs.append(dict(part='vision', group='pretrain', name=f'r{r:g}_spectral_pretrain{k}', rank=r,  # vision
                             init='spectral', at=k))                    # finding is a negative one, one rank shows it
    if 'lm' in args.parts:
        r = args.lm_rank
        runs.append(dict(part='lm', group='baseline', name='dense', rank=None))
        runs += [dict(part='lm', group='init', name=f'r{r:g}_{i}', rank=r, init=i) for i in INITS]
        runs.append(dict(part='lm', group='decay', name=f'r{r:g}_spectral_frobenius', rank=r, init='spectral',
                         decay='frobenius'))
        runs.append(dict(part='lm', group='pretrain', name=f'r{r:g}_spectral_pretrain{k}', rank=r, init='spectral', at=k))
    return [r for r in runs if r['group'] == 'baseline' or r['group'] in getattr(args, 'groups', GROUPS)]


def _config(run: Dict, args, out: Path):
    from ..train import TrainConfig
    common = dict(epochs=args.epochs, limit_train_batches=args.limit_train_batches, seed=args.seed,
                  label_smoothing=0.0, warmup_epochs=0, output=str(out / run['part'] / run['name']),
                  factorize_rank=run['rank'], factorize_init=run.get('init', 'spectral'),
                  factorize_at=run.get('at'), factor_decay=run.get('decay', 'l2'))
    if run['part'] == 'vision':
        return TrainConfig(model='wrn_16_2_mnist', model_kwargs={'depth': 10}, data=f'mnist:{args.data}',
                           batch_size=128, opt='sgd', lr=0.2, momentum=0.9, weight_decay=5e-4, **common)
    # seed 004 App. A.2: factorised transformer runs halve the base lr, and the pre-trained run halves it again at
    # the switch: the dense part of a pre-trained run at lr·s, its factorised part (and a from-scratch run) at ·s more.
    # The recipes (gpt2_lowrank_pretrain_lm1b.yaml) now read App. A.2 as one halving, of the factorised steps only;
    # this runner keeps the earlier two-halving reading because docs/lowrank.md's committed records were made with it.
    scale = getattr(args, 'lm_lr_scale', 1.0) if run['rank'] is not None else 1.0
    lr = LM_LR * (scale if run.get('at') else 1.0)
    return TrainConfig(model='gpt2_byte_tiny', data='pysource', data_kwargs={'max_bytes': args.lm_max_bytes},
                       batch_size=32, eval_batch_size=64, opt='adamw', lr=lr, weight_decay=0.01,
                       factorize_lr_scale=scale, **common)


# what makes a finished run the planned one: a run in --output that differs in any of these is trained anew
_REUSE_KEYS = ('model', 'model_kwargs', 'data', 'data_kwargs', 'epochs', 'limit_train_batches', 'batch_size', 'opt',
               'lr', 'momentum', 'weight_decay', 'seed', 'label_smoothing', 'warmup_epochs', 'factorize_rank',
               'factorize_init', 'factorize_at', 'factor_decay', 'factorize_lr_scale')


def reusable(folder: Path, config) -> bool:
    """Whether `folder` holds a finished run of `config` (a TrainConfig): its summary, and its config.yaml equal in
    every key of _REUSE_KEYS. Another --seed, --epochs or --data into the same --output trains anew instead of
    reporting the old runs' numbers under the new arguments."""
    import yaml
    if not (folder / 'summary.json').is_file() or not (folder / 'config.yaml').is_file():
        return False
    saved = yaml.safe_load((folder / 'config.yaml').read_text()) or {}
    from ..train.data_paths import absolute_data
    planned = json.loads(json.dumps(config.to_dict()))
    planned['data'] = absolute_data(planned['data'])[0]          # the engine stores the data's path absolute
    saved['data'] = absolute_data(str(saved.get('data')))[0]
    return all(json.loads(json.dumps(saved.get(k))) == planned.get(k) for k in _REUSE_KEYS)


def _train(run: Dict, args, out: Path) -> Dict:
    from ..train import Trainer
    folder = out / run['part'] / run['name']
    config = _config(run, args, out)
    if not reusable(folder, config):
        Trainer(config, overwrite=True, progress=False).fit()
    history = [json.loads(line) for line in (folder / 'metrics.jsonl').read_text().splitlines()]
    last = history[-1]
    spectra = {}
    if run['rank'] is not None:                  # the factorised layers' singular values at the end
        from ..models.lowrank_spectra import layer_spectra
        from ..train.checkpoint import load_model
        model, _ = load_model(folder)
        spectra = {name: s.tolist() for name, s in layer_spectra(model, factorized_only=True).items()}
    import yaml
    trained = yaml.safe_load((folder / 'config.yaml').read_text())     # a reused run keeps its own settings
    return {**run, 'folder': str(folder), 'val_top1': last['val_top1'], 'val_loss': last['val_loss'],
            'epochs': trained['epochs'], 'limit_train_batches': trained['limit_train_batches'],
            'batch_size': trained['batch_size'], 'model': trained['model'],
            'model_kwargs': trained.get('model_kwargs') or {}, 'data': trained['data'],
            'val_perplexity': last.get('val_perplexity'), 'effective_rank_mean': last.get('effective_rank_mean'),
            'curve': [{'epoch': h['epoch'], 'val_loss': h['val_loss'], 'val_top1': h['val_top1'],
                       'effective_rank_mean': h.get('effective_rank_mean')} for h in history],
            'spectra': spectra,
            'switch': {k: last_k for k, last_k in history[min(len(history) - 1, run.get('at') or 0)].items()
                       if k.startswith('factorized_val_')}}


def _interpolations(results: List[Dict], args, out: Path) -> Dict:
    """Fig. 2: dense baseline → pre-trained-then-factorised, and → from-scratch spectral, at one rank."""
    from torch.utils.data import DataLoader

    from ..data import build_datasets
    from ..analysis.interpolate import interpolation_curve
    from ..train.checkpoint import load_model
    curves = {}
    ts = [i / (args.interpolate_steps - 1) for i in range(args.interpolate_steps)]
    for part in sorted({r['part'] for r in results}):
        rows = [r for r in results if r['part'] == part]
        base = next(r for r in rows if r['group'] == 'baseline')
        pre = [r for r in rows if r['group'] == 'pretrain']
        if not pre:
            continue
        rank = pre[len(pre) // 2]['rank']                  # the middle rank (0.2 by default; the LM's only one)
        pre = next(r for r in pre if r['rank'] == rank)
        scratch = next(r for r in rows if r['group'] == 'init' and r['rank'] == rank and r['init'] == 'spectral')
        config = _config(base, args, out)
        _, val, _ = build_datasets(config.data, seed=config.seed, val_fraction=config.val_fraction, **config.data_kwargs)
        # the whole held-out split the tables score, so the line's ends are the runs' own held-out losses (the
        # record of 2026-11-25 scored the first 1,000 samples only: 'samples' says how many a line saw)
        dense_model, _ = load_model(base['folder'])
        curves[part] = {'rank': rank, 'samples': len(val), 'held_out': len(val)}
        for label, run in (('pretrained', pre), ('from scratch', scratch)):
            model, _ = load_model(run['folder'])
            curves[part][label] = interpolation_curve(dense_model, model, DataLoader(val, batch_size=128), ts)
    return curves


def _tables(results: List[Dict], curves: Dict, heading: str = '##') -> str:
    lines = ['# Low-rank training (seed 004), reproduced small', '']
    by = {(r['part'], r['name']): r for r in results}
    for part, metric, fmt in (('vision', 'val_top1', '{:.2f}'), ('lm', 'val_perplexity', '{:.2f}')):
        rows = [r for r in results if r['part'] == part]
        if not rows:
            continue
        label = 'held-out top-1 (%)' if part == 'vision' else 'held-out perplexity (bytes)'
        base = by[(part, 'dense')]
        data = base['data'].partition(':')[0]       # the data set, not the folder it was read from
        built = ', '.join(f'{k}={v}' for k, v in (base.get('model_kwargs') or {}).items())   # WRN-10-2: depth=10
        lines += [f"{part}: `{base['model']}`{f' ({built})' if built else ''} on `{data}`, {base['epochs']} epochs of "
                  f"{base['limit_train_batches'] or 'all'} batches of {base['batch_size']}, one seed per row.", '']
        lines += [f'{heading} {part}: initialisation ({label}; dense baseline {fmt.format(base[metric])})', '',
                  '| rank | He | spectral | spectral ones |', '|---|---|---|---|']
        for rank in sorted({r['rank'] for r in rows if r['group'] == 'init'}):
            cells = [fmt.format(by[(part, f'r{rank:g}_{i}')][metric]) for i in INITS]
            lines.append(f'| {rank:g} | ' + ' | '.join(cells) + ' |')
        lines += ['', f'{heading} {part}: Frobenius decay vs L2 (spectral init)', '',
                  f'| rank | L2: {label} | L2: eff. rank | FD: {label} | FD: eff. rank |', '|---|---|---|---|---|']
        for r in [r for r in rows if r['group'] == 'decay']:
            l2 = by[(part, f"r{r['rank']:g}_spectral")]
            lines.append(f"| {r['rank']:g} | {fmt.format(l2[metric])} | {l2['effective_rank_mean']:.2f} | "
                         f"{fmt.format(r[metric])} | {r['effective_rank_mean']:.2f} |")
        lines += ['', f'{heading} {part}: pre-training (dense for {next((r["at"] for r in rows if r.get("at")), 0)} epoch(s), '
                      'then SVD) vs low-rank from the start (spectral)', '',
                  '| rank | from scratch | pre-trained | right after the switch |', '|---|---|---|---|']
        for r in [r for r in rows if r['group'] == 'pretrain']:
            scratch = by[(part, f"r{r['rank']:g}_spectral")]
            after = r['switch'].get('factorized_val_perplexity' if part == 'lm' else 'factorized_val_top1')
            lines.append(f"| {r['rank']:g} | {fmt.format(scratch[metric])} | {fmt.format(r[metric])} | "
                         f"{fmt.format(after) if after is not None else ''} |")
        if part in curves:
            c = curves[part]
            peak = peak_losses(c)
            seen = interpolation_samples(c)
            lines += ['', f"Interpolation from the dense baseline (rank {c['rank']:g}): highest held-out loss on the "
                          f"line {peak['pretrained']:.3f} to the pre-trained run, {peak['from scratch']:.3f} to the "
                          f"from-scratch run{seen}.", '']
    return '\n'.join(lines) + '\n'


def _plots(results: List[Dict], curves: Dict, out: Path) -> None:
    def draw(plt):
        parts = sorted({r['part'] for r in results})
        fig, axes = plt.subplots(len(parts), 3, figsize=(13, 3.4 * len(parts)), squeeze=False)
        for row, part in enumerate(parts):
            rows = [r for r in results if r['part'] == part]
            metric = 'val_top1' if part == 'vision' else 'val_perplexity'
            ax = axes[row][0]
            base = next(r for r in rows if r['group'] == 'baseline')
            for init in INITS:
                pts = sorted((r['rank'], r[metric]) for r in rows if r['group'] == 'init' and r['init'] == init)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o', label=init)
            ax.axhline(base[metric], color='k', ls='--', label='dense')
            label_axes(ax, 'rank (fraction)', metric, f'{part}: initialisation', legend_size=7)
            ax = axes[row][1]
            for r in rows:
                if r['group'] in ('decay', 'init') and r.get('init') == 'spectral' and \
                        any(d['rank'] == r['rank'] for d in rows if d['group'] == 'decay'):
                    ax.plot([c['epoch'] for c in r['curve']], [c['effective_rank_mean'] for c in r['curve']],
                            marker='o', label=f"r={r['rank']:g} {r.get('decay', 'l2')}")
            label_axes(ax, 'epoch', 'mean effective rank', f'{part}: Frobenius decay vs L2', legend_size=7)
            ax = axes[row][2]
            for r in rows:
                if r['group'] == 'baseline' or (r['group'] == 'pretrain') or \
                        (r['group'] == 'init' and r['init'] == 'spectral'):
                    if r['group'] != 'baseline' and r['rank'] != (curves.get(part) or {}).get('rank', r['rank']):
                        continue
                    ax.plot([c['epoch'] for c in r['curve']], [c['val_loss'] for c in r['curve']], marker='o',
                            label=r['name'])
            label_axes(ax, 'epoch', 'held-out loss', f'{part}: pre-training (Fig. 1)', legend_size=7)
        fig.tight_layout()
        return fig
    write_png(out / 'lowrank.png', draw)
    decay = [r for r in results if r['group'] == 'decay']
    if decay:
        def draw_spectra(plt):
            fig, axes = plt.subplots(1, len(decay), figsize=(4.5 * len(decay), 3.4), squeeze=False)
            for ax, fd in zip(axes[0], decay):
                l2 = next(r for r in results if r['part'] == fd['part'] and r['group'] == 'init'
                          and r['rank'] == fd['rank'] and r['init'] == 'spectral')
                layer = sorted(fd['spectra'])[len(fd['spectra']) // 2]          # a middle factorised layer
                for label, run in (('L2', l2), ('Frobenius decay', fd)):
                    s = run['spectra'][layer]
                    ax.semilogy(range(1, len(s) + 1), [v / s[0] for v in s], label=label)
                label_axes(ax, 'index', 'σ_i / σ_1', f"{fd['part']} r={fd['rank']:g}: {layer}", legend_size=7,
                           title_size=8)
            fig.tight_layout()
            return fig
        write_png(out / 'spectra.png', draw_spectra)
    if curves:
        def draw_interp(plt):
            fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.4), squeeze=False)
            for ax, (part, c) in zip(axes[0], sorted(curves.items())):
                for label in ('pretrained', 'from scratch'):
                    ax.plot([p['t'] for p in c[label]], [p['loss'] for p in c[label]], marker='o', label=label)
                label_axes(ax, 't (0: dense baseline, 1: low-rank run)', 'held-out loss',
                           f"{part}: interpolation at rank {c['rank']:g} (Fig. 2)", legend_size=7)
            fig.tight_layout()
            return fig
        write_png(out / 'interpolation.png', draw_interp)


def interpolation_samples(curve: Dict) -> str:
    """'' when the interpolation scored the whole held-out split (the tables' numbers), else the clause naming the
    subset it scored: its losses then differ from the tables' even at the line's ends."""
    samples, held_out = curve.get('samples'), curve.get('held_out')
    if samples is None or held_out is None or samples >= held_out:
        return ''
    return (f" (scored on the first {samples:,} of the {held_out:,} held-out samples, not the tables' whole split: "
            "its ends differ from the tables' numbers)")


def peak_losses(curve: Dict) -> Dict[str, float]:
    """The highest held-out loss on each interpolation line (Fig. 2), from its points or, in a record that kept
    only them, its 'peak_loss'."""
    if 'peak_loss' in curve:
        return dict(curve['peak_loss'])
    return {k: max(p['loss'] for p in curve[k]) for k in ('pretrained', 'from scratch')}


def two_standard_errors(a: float, b: float, held_out: int = VISION_HELD_OUT) -> float:
    """Two binomial standard errors, in points, of the difference of two top-1 % on `held_out` images."""
    p1, p2 = a / 100, b / 100
    return 200 * ((p1 * (1 - p1) + p2 * (1 - p2)) / held_out) ** 0.5


def _tally(pairs) -> str:
    """'k of n rank(s)' for vision accuracies (a, b): a ahead of b beyond two standard errors, and how many are
    behind beyond them or within them, so a one-seed lead inside the noise is not counted as a win."""
    pairs = list(pairs)
    ahead = sum(a - b > two_standard_errors(a, b) for a, b in pairs)
    behind = sum(b - a > two_standard_errors(a, b) for a, b in pairs)
    return (f"{ahead} of {len(pairs)} rank(s) beyond two standard errors ({behind} behind beyond them, "
            f"{len(pairs) - ahead - behind} within them)")


def vision_pretraining_verdict(pretrained: float, scratch: float, held_out: int = VISION_HELD_OUT,
                               majority: Optional[Dict] = None) -> str:
    """The seed's vision claim is parity, not a loss: pre-training neither helps nor hurts (Table 8, WRN-28-10 at
    rank 0.2: 81.35 % from scratch, 81.33-81.56 % after 15-75 pre-training epochs). Our tolerance for one seed on
    `held_out` images: two standard errors of a difference of two accuracies. Inside it: parity reproduced;
    outside: which way it fell. With `majority` (`reproduce.learned` of the held-out labels): two runs neither of
    which beats a constant prediction of the most frequent class are equal because neither learnt; that cannot
    tell, it is no parity."""
    if majority is not None and not any(top1 - majority['majority_class'] > majority['two_standard_errors']
                                        for top1 in (pretrained, scratch)):
        return (f"vision: pre-trained {pretrained:.2f}% vs from scratch {scratch:.2f}%; seed: parity (Table 8); "
                f"cannot tell at this scale: neither run learnt (both within two standard errors, "
                f"{majority['two_standard_errors']:.2f} points, of the most frequent class's share "
                f"{majority['majority_class']:.2f}%)")
    tolerance = two_standard_errors(pretrained, scratch, held_out)
    delta = pretrained - scratch
    inside = abs(delta) <= tolerance
    fell = 'parity holds' if inside else ('pre-training helped' if delta > 0 else 'pre-training hurt')
    return (f"vision: pre-trained {pretrained:.2f}% vs from scratch {scratch:.2f}% ({delta:+.2f} points); seed: parity "
            f"(81.35% from scratch vs 81.33-81.56% pre-trained, Table 8); tolerance ±{tolerance:.2f} points (2 SE, "
            f"{held_out} held-out images): {'inside' if inside else 'outside'}, {fell}")


def findings(results: List[Dict], curves: Dict, majority: Optional[Dict] = None) -> List[str]:
    """The seed's claims, each checked against these runs (printed and written to results.md)."""
    out = []
    by = {(r['part'], r['name']): r for r in results}
    for part in sorted({r['part'] for r in results}):
        better = (lambda a, b: a > b) if part == 'vision' else (lambda a, b: a < b)
        metric = 'val_top1' if part == 'vision' else 'val_perplexity'
        ranks = sorted({r['rank'] for r in results if r['part'] == part and r['group'] == 'init'})
        decay = [r for r in results if r['part'] == part and r['group'] == 'decay']
        keeps = [r['effective_rank_mean'] > by[(part, f"r{r['rank']:g}_spectral")]['effective_rank_mean'] for r in decay]
        if part == 'vision':    # accuracies on held-out images: a lead counts beyond its binomial noise
            spectral_vs_he = _tally((by[(part, f'r{k:g}_spectral')][metric], by[(part, f'r{k:g}_he')][metric])
                                    for k in ranks)
            decay_vs_l2 = _tally((r[metric], by[(part, f"r{r['rank']:g}_spectral")][metric]) for r in decay)
        else:                   # perplexities of one seed: no standard error here, point comparisons, said so
            wins = [better(by[(part, f'r{k:g}_spectral')][metric], by[(part, f'r{k:g}_he')][metric]) for k in ranks]
            acc = [better(r[metric], by[(part, f"r{r['rank']:g}_spectral")][metric]) for r in decay]
            spectral_vs_he = f"{sum(wins)} of {len(wins)} rank(s), point comparisons of one seed"
            decay_vs_l2 = f"{sum(acc)} of {len(acc)}, point comparisons of one seed"
        out.append(f"{part}: spectral init beats He at {spectral_vs_he} (seed: at every rank)")
        out.append(f"{part}: Frobenius decay keeps a higher effective rank than L2 at {sum(keeps)} of {len(keeps)} "
                   f"rank(s), and scores better at {decay_vs_l2} (seed: both, at every rank)")
        pre = [r for r in results if r['part'] == part and r['group'] == 'pretrain']
        if part == 'lm':
            helps = [better(r[metric], by[(part, f"r{r['rank']:g}_spectral")][metric]) for r in pre]
            out.append(f"{part}: pre-training beats low-rank from the start at {sum(helps)} of {len(helps)} rank(s) "
                       "(seed: pre-training helps the LM)")
        for r in pre if part == 'vision' else []:
            out.append(vision_pretraining_verdict(r[metric], by[(part, f"r{r['rank']:g}_spectral")][metric],
                                                  majority=majority))
        if part in curves:
            c = curves[part]
            peaks = peak_losses(c)
            closer = peaks['pretrained'] < peaks['from scratch']
            out.append(f"{part}: the pre-trained run is {'closer to' if closer else 'not closer to'} the dense "
                       "baseline by the highest loss on the interpolation line (seed: closer)")
    return out


RECORD = Path(__file__).resolve().parents[2] / 'docs' / 'lowrank' / 'reproduce_lowrank.json'


def tables_from_record(record: Dict, heading: str = '##') -> str:
    """docs/lowrank.md's reproduction tables and findings (there with heading '####'), regenerated from a record (a
    run's results.json, or the committed docs/lowrank/reproduce_lowrank.json): tests/test_lowrank_reproduce.py
    checks that the page holds exactly this text."""
    runs, curves = record['runs'], record['interpolation']
    tables = _tables(runs, curves, heading)
    if heading != '##':                            # inside a page: without the results.md title
        tables = tables.split('\n', 2)[2]
    return (tables + f'\n{heading} Findings\n\n'
            + '\n'.join(f'- {c}' for c in findings(runs, curves, record.get('vision_majority'))) + '\n')


def run(args) -> int:
    _check(args)
    out = Path(args.output)
    results = []
    for spec in _plan(args):
        print(f"== {spec['part']} {spec['name']}", flush=True)
        results.append(_train(spec, args, out))
    if set(args.groups) != set(GROUPS):         # a share of the plan: the tables need every group
        print(f"trained {len(results)} run(s) in {out}; run again without --groups for the tables and plots")
        return 0
    curves = _interpolations(results, args, out)
    majority = None
    if 'vision' in args.parts:          # what a constant prediction scores on the vision part's held-out images
        from ..data import build_datasets
        from . import learned
        config = _config(next(r for r in results if r['part'] == 'vision'), args, out)    # the runs' own split
        held_out = build_datasets(config.data, seed=config.seed, val_fraction=config.val_fraction)[1]
        majority = {k: v for k, v in learned(0.0, [int(y) for y in held_out.targets]).items()
                    if k in ('majority_class', 'two_standard_errors', 'held_out')}
    claims = findings(results, curves, majority)
    text = tables_from_record({'runs': results, 'interpolation': curves, 'vision_majority': majority})
    write_text(out / 'results.md', text)
    write_json(out / 'results.json', {'command': command_line(args, 'lowrank'),
                                      'environment': environment('cpu'), 'args': {k: v for k, v in vars(args).items()
                                                                                  if k != 'func'},
                                      'runs': results, 'interpolation': curves, 'vision_majority': majority,
                                      'findings': claims, 'paper': {
                                          k: {str(kk): vv for kk, vv in v.items()} for k, v in PAPER.items()}})
    _plots(results, curves, out)
    print('\n' + text)
    print(f"written: {out / 'results.md'}, results.json, lowrank.png, spectra.png, interpolation.png")
    return 0
