"""`structformer analyze`: white-box measurements of trained CRATE checkpoints (CRATE §3.1, Fig. 3–7).

Writes, into --output: analysis.json (every number, per checkpoint), compression_per_layer.png and
sparsity_per_layer.png (one line per checkpoint), training_curves.png (every measured epoch, Fig. 4),
coherence_<ckpt>.png, tokens_<ckpt>.png,
angles_<ckpt>.png (synthetic-subspaces data only) and report.md linking them. A model with Sparsifiner
attention gets its mask accounting and pictures instead (analysis/sparsifiner.py: sparsifiner.json, PNGs).
Figures of the same kind that an earlier analysis left in --output and this one did not draw are removed.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Dict, Optional

from ..cli_args import MAX_INTERPOLATE_STEPS, interpolate_steps, seed_value
from ..errors import UsageError
from .samples import load_samples, recorded_data

# torch and the measurement modules are imported where they are used: the CLI builds this command's
# parser for `structformer --help`, which must not pay for importing torch

__all__ = ['ANALYZE_EXAMPLES', 'add_analyze_arguments', 'run_analyze', 'resolve_compare']

DESCRIPTION = 'Per-layer coding rates, sparsity, subspace coherence and token maps (CRATE §3.1).'

ANALYZE_EXAMPLES = """examples:
  # the newest checkpoint of a run against its random init (epoch_0000), on the run's own val split
  structformer analyze --checkpoint outputs/demo --compare init

  # the training trajectory, as in CRATE Fig. 4 (init / epoch 1 / 10 / last); the epochs must still be on
  # disk: train with --save-every 1 (or 10), since by default a run keeps only its last 2 and epoch_0000
  structformer train --model crate_digits --data digits --epochs 20 --save-every 1 --output outputs/trajectory
  structformer analyze --checkpoint outputs/trajectory --compare init epoch:1 epoch:10 --num-samples 128

  # every saved epoch (train with --save-every 1) in one figure, training_curves.png
  structformer analyze --checkpoint outputs/demo --compare all --num-samples 1000

  # mini-batch CKA between the residual branches of two models (Mixer paper Fig. 2; --cka-features blocks:
  # the block outputs, of any two models)
  structformer analyze --checkpoint outputs/mixer --cka outputs/swmlp --cka-features branches --num-samples 256

  # a run trained with --rank (not CRATE): the per-layer effective ranks and spectra it logged, spectra.png
  structformer analyze --checkpoint outputs/lowrank

  # loss / accuracy between a dense and a low-rank run (low-rank training Fig. 2)
  structformer analyze --checkpoint outputs/dense --interpolate outputs/lowrank --interpolate-steps 11

  # one checkpoint directory, other data, explicit output folder
  structformer analyze --checkpoint outputs/syn/checkpoints/epoch_0020 --data synthetic-subspaces \\
      --estimator paper --eps 0.5 --output /tmp/syn_analysis
"""


def add_analyze_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    if not parser.epilog:
        parser.epilog = ANALYZE_EXAMPLES
    parser.add_argument('--checkpoint', required=True, metavar='PATH',
                        help='a run directory (its newest checkpoint is used) or a checkpoint directory')
    parser.add_argument('--compare', nargs='+', default=[], metavar='SPEC',
                        help="more checkpoints to measure alongside: paths, 'init' (the run's epoch_0000, "
                             "its random initialisation), 'epoch:N' (epoch_000N of the same run) or 'all' (every "
                             "saved epoch of the run; keep them with train --save-every 1)")
    parser.add_argument('--data', default=None, metavar='SPEC',
                        help="data to measure on (default: the checkpoint's training data, with its options, "
                             "seed and val_fraction, so the held-out split is the one training used)")
    parser.add_argument('--num-samples', type=int, default=None, metavar='B',
                        help='validation samples to average over (>= 1; default 256; capped at the split size)')
    parser.add_argument('--estimator', default=None, choices=['official', 'paper'],
                        help="R_c estimator: 'official' (CRATE's public code: tokens scaled to unit norm per head, "
                             "ε² = 0.01; default) or 'paper' (Eq. 8 with orthonormalised U_k); both on LN1(Z)")
    parser.add_argument('--eps', type=float, default=None,
                        help='ε of the R_c estimator (1e-100 … 1e100; default 0.1 for official, 0.5 for paper)')
    parser.add_argument('--exclude-cls', action='store_true',
                        help='measure patch tokens only (default: all tokens, cls included, as the model sees them)')
    parser.add_argument('--output', default=None, metavar='DIR',
                        help='output folder (default: <run>/analysis, or <checkpoint>/analysis outside a run)')
    parser.add_argument('--cka', default=None, metavar='CHECKPOINT',
                        help='instead of the white-box measures: mini-batch CKA between every block output of '
                             '--checkpoint and of this checkpoint (any two models, e.g. a Mixer and an SW-MLP; '
                             'Mixer paper Fig. 2), written to cka.json and cka.png')
    parser.add_argument('--cka-batch-size', type=int, default=None, metavar='B',
                        help='mini-batch size of the CKA estimate (>= 4; default 64)')
    parser.add_argument('--cka-features', default=None, choices=['blocks', 'branches'],
                        help="what --cka compares: 'blocks', every block's output (after its residual add; any "
                             "model; default), or 'branches', every residual branch just before its skip "
                             "connection, a Mixer's token- and channel-mixing MLPs counted separately (Mixer paper "
                             "Fig. 2, App. C.1; Mixers and SW-MLPs)")
    parser.add_argument('--interpolate', default=None, metavar='CHECKPOINT',
                        help='instead of the white-box measures: held-out loss and accuracy along the straight line '
                             'from --checkpoint to this checkpoint, factorised layers read densely (low-rank '
                             'training Fig. 2), written to interpolation.json and interpolation.png')
    parser.add_argument('--interpolate-steps', type=interpolate_steps, default=None, metavar='N',
                        help=f'points on the line, t = 0, 1/(N-1), ..., 1 (2 … {MAX_INTERPOLATE_STEPS}; default 11)')
    parser.add_argument('--query-patch', default=None, metavar='ROW,COL|INDEX',
                        help='Sparsifiner models: the query patch whose kept keys and attention rows are drawn, '
                             'as ROW,COL or a row-major patch index (default: the centre patch)')
    parser.add_argument('--layers', nargs='+', default=None, metavar='L',
                        help='Sparsifiner models: the layers drawn, numbered from 1 (default: the first six); '
                             'the numbers in sparsifiner.json cover every layer')
    parser.add_argument('--ema', action='store_true',
                        help='measure the weight average of runs trained with --model-ema instead of their weights '
                             '(as eval --ema): every checkpoint read, --compare, --cka and --interpolate too')
    parser.add_argument('--seed', type=seed_value, default=None,
                        help='seed of the analysis itself: which validation samples, heat-map rows/columns, '
                             'random baseline (default 0)')
    return parser


def _check_args(args) -> None:
    for flag, key in (('--cka', 'cka'), ('--interpolate', 'interpolate')):
        value = getattr(args, key, None)
        if value is not None and not str(value).strip():      # '' was falsy: the white-box analysis ran instead
            raise UsageError(f"{flag}: give the second checkpoint (a run directory or a checkpoint folder); got ''")
    if getattr(args, 'cka', None) and getattr(args, 'interpolate', None):
        raise UsageError("--cka and --interpolate are two analyses; give one of them (each writes its own record)")
    b = getattr(args, 'num_samples', None)
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
        raise ValueError(f"--num-samples must be an integer >= 1; got {b!r}")
    if getattr(args, 'cka', None) and b is not None and b < 4:
        raise ValueError(f"--num-samples {b}: --cka's unbiased HSIC needs at least 4 samples")
    if getattr(args, 'cka_batch_size', None) is not None and args.cka_batch_size < 4:
        raise ValueError(f"--cka-batch-size must be an integer >= 4 (the unbiased HSIC needs 4 samples); "
                         f"got {args.cka_batch_size}")
    if args.eps is not None:
        from .whitebox import check_eps
        check_eps(args.eps, '--eps')


# options with no effect in some analyses, and the analyses that use them (an option not given is None, so not
# asked for; `_DEFAULTS` fills in its value afterwards); given where they do nothing, they are refused rather than
# silently ignored (--estimator paper beside --cka, --cka-batch-size beside --interpolate, ... did nothing)
_SAMPLED = ('crate', 'sparsifiner', 'cka', 'interpolate')
_USED_BY = {'--compare': ('compare', ('crate',)), '--eps': ('eps', ('crate',)),
            '--estimator': ('estimator', ('crate',)), '--exclude-cls': ('exclude_cls', ('crate',)),
            '--query-patch': ('query_patch', ('sparsifiner',)), '--layers': ('layers', ('sparsifiner',)),
            '--cka-batch-size': ('cka_batch_size', ('cka',)), '--cka-features': ('cka_features', ('cka',)),
            '--interpolate-steps': ('interpolate_steps', ('interpolate',)),
            '--ema': ('ema', _SAMPLED),     # a low-rank run's spectra were logged from its weights, not the average
            '--data': ('data', _SAMPLED), '--num-samples': ('num_samples', _SAMPLED), '--seed': ('seed', _SAMPLED)}
_DEFAULTS = {'estimator': 'official', 'cka_batch_size': 64, 'cka_features': 'blocks', 'interpolate_steps': 11, 'num_samples': 256, 'seed': 0}
_ANALYSES = {'crate': 'the white-box measures of a CRATE checkpoint', 'sparsifiner': 'a Sparsifiner checkpoint',
             'cka': '--cka', 'interpolate': '--interpolate', 'spectra': "a low-rank run's logged spectra"}


def refuse_unused_options(args, analysis: str, what: str) -> None:
    """Refuse, by name, an option given that `analysis` (a key of _ANALYSES) does not read; `what` names the
    checkpoint's model for the message."""
    for flag, (key, users) in _USED_BY.items():
        if analysis not in users and getattr(args, key, None) not in (None, [], False):
            raise UsageError(f"{flag} does not apply here: {what} is analysed as {_ANALYSES[analysis]}; {flag} is "
                             f"for {' and '.join(_ANALYSES[u] for u in users)}")
    for key, value in _DEFAULTS.items():            # the options left out take their defaults now
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def _run_dir(checkpoint: Path) -> Optional[Path]:
    return checkpoint.parent.parent if checkpoint.parent.name == 'checkpoints' else None


def resolve_compare(spec: str, run: Optional[Path]) -> Path:
    """'init' -> <run>/checkpoints/epoch_0000, 'epoch:N' -> epoch_{N:04d}, anything else a path."""
    from ..train.checkpoint import checkpoint_folders, checkpoint_name, resolve_checkpoint
    m = re.fullmatch(r'epoch:(\d+)', spec.strip())
    if spec.strip() == 'init' or m:
        name = checkpoint_name(int(m.group(1)) if m else 0)
        if run is None:
            raise ValueError(f"--compare {spec}: the keyword needs --checkpoint inside a run "
                             "(<run>/checkpoints/epoch_NNNN); pass a checkpoint path instead")
        path = run / 'checkpoints' / name
        if not path.is_dir():
            have = [p.name for p in checkpoint_folders(run / 'checkpoints')]
            raise FileNotFoundError(f"--compare {spec}: {path} does not exist; this run has {', '.join(have) or 'none'}")
        return resolve_checkpoint(path)
    try:
        return resolve_checkpoint(spec)
    except (FileNotFoundError, ValueError) as e:    # its message blames --checkpoint: this is --compare
        reason = str(e).split(f'{spec} ', 1)[-1] if str(e).startswith('--checkpoint: ') else str(e)
        raise type(e)(f"--compare {spec}: {reason}; accepted init, epoch:N, all, or a checkpoint path") from None


def _label(state: Dict, path: Path) -> str:
    epoch = state.get('epoch')
    if epoch is None:
        return path.name
    return f'epoch {epoch} (init)' if epoch == 0 else f'epoch {epoch}'


def _slug(label: str, taken: set) -> str:
    base = re.sub(r'[^A-Za-z0-9]+', '_', label).strip('_').lower() or 'checkpoint'
    slug, k = base, 2
    while slug in taken:
        slug, k = f'{base}_{k}', k + 1
    taken.add(slug)
    return slug


def _analyse_one(model, state, path: Path, images, args, info, out: Path, slug: str, label: str) -> Dict:
    from .plots import plot_coherence, plot_principal_angles, plot_token_heatmaps
    from .subspaces import coherence_summary, subspace_coherence, subspace_energy, subspace_recovery
    from .whitebox import layer_bases, measure_layers, token_heatmaps
    measure = measure_layers(model, images, eps=args.eps, estimator=args.estimator, include_cls=not args.exclude_cls)
    measure.pop('samples')
    bases = layer_bases(model)
    coherences = [subspace_coherence(u) for u in bases]
    figures = {
        'coherence': plot_coherence(coherences, bases[0].shape[0], out / f'coherence_{slug}.png',
                                    f'{label}: |UᵀU| per layer (Fig. 7)').name,
        'tokens': plot_token_heatmaps(token_heatmaps(model, images[:1], seed=args.seed, include_cls=not args.exclude_cls), out / f'tokens_{slug}.png',
                                      f'{label}: |Z^ℓ| of one sample, ≤50 tokens × ≤50 features (Fig. 6)').name,
    }
    result = {'label': label, 'path': str(path), 'model': state.get('model'), 'epoch': state.get('epoch'),
              'measure': measure,
              'coherence': [dict(layer=i + 1, **coherence_summary(c, bases[i].shape[0]))
                            for i, c in enumerate(coherences)],
              'subspace_recovery': None, 'figures': figures}
    true = info.extra.get('subspace_bases') if getattr(info, 'extra', None) else None
    if true is not None:
        patch_dim = model.patch_embed.proj.in_features
        if true.shape[1] == patch_dim:
            result['subspace_recovery'] = subspace_recovery(model, true, seed=args.seed)
            labels = info.extra.get('val_token_subspaces')
            if labels is not None:
                result['subspace_energy'] = subspace_energy(model, images, labels, true.shape[0], seed=args.seed)
            figures['angles'] = plot_principal_angles(
                result['subspace_recovery'], out / f'angles_{slug}.png',
                f'{label}: learned vs true subspaces').name
        else:
            result['subspace_recovery_skipped'] = (f'true bases are {true.shape[1]}-dim tokens, the model '
                                                   f'embeds {patch_dim}-dim patches')
    return result


def run_analyze(args) -> int:
    """`structformer analyze`; an analysis that fails (bad data for the model, an unreadable second checkpoint)
    leaves no output folder it created behind."""
    from ..records import check_writable, removed_on_failure
    from ..train.checkpoint_paths import resolve_checkpoint
    _check_args(args)
    main_path = resolve_checkpoint(args.checkpoint)
    run = _run_dir(main_path)
    out = Path(args.output) if args.output else (run or main_path) / 'analysis'
    from ..train.run_dir import sigterm_as_interrupt
    check_writable(out, '--output')              # before any work: a long analysis never dies at its first figure
    before, existed = _file_stamps(out), out.exists()
    try:
        # SIGTERM (a scheduler's stop, `kill`) as Ctrl-C: it ended the process on the spot, leaving the folder this
        # analysis had made, with a figure's empty temporary in it
        with sigterm_as_interrupt(), removed_on_failure(out):
            status = _analyze(args, main_path, run, out)
    except KeyboardInterrupt as e:
        e.said = (f"the files already written into {out} are complete (each written by a rename)" if existed
                  else f"the output folder it had made, {out}, was removed")
        raise
    _remove_stale_figures(out, before)
    return status


# each analysis kind's record, and the figures it draws beside it (some per checkpoint, layer or sample)
_KIND_FIGURES = {'analysis.json': ('compression_per_layer.png', 'sparsity_per_layer.png', 'training_curves.png',
                                   'coherence_*.png', 'tokens_*.png', 'angles_*.png'),
                 'cka.json': ('cka.png',), 'interpolation.json': ('interpolation.png',),
                 'sparsifiner.json': ('sparsifiner_*.png',), 'spectra.json': ('spectra.png',)}


def _file_stamps(out: Path) -> Dict[str, tuple]:
    """(inode, mtime) of each file in `out`: every record and figure is written by a rename, so a file whose stamp
    is unchanged after the analysis was not written by it."""
    if not out.is_dir():
        return {}
    return {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in out.iterdir() if f.is_file()}


def _remove_stale_figures(out: Path, before: Dict[str, tuple]) -> None:
    """An analysis into a folder that holds an earlier one of the same kind: the figures of that kind which this
    run did not draw (other checkpoints' coherence_/tokens_ maps, a training_curves.png, more Sparsifiner layers,
    or any figure when matplotlib is missing) would be read as this run's; they are removed. Other kinds'
    records and figures, and files of no kind, are left."""
    import fnmatch
    after = _file_stamps(out)
    for record, patterns in _KIND_FIGURES.items():
        if record not in after or after[record] == before.get(record):
            continue                                    # this run did not write this kind's record
        stale = sorted(name for name, stamp in after.items() if before.get(name) == stamp
                       and any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns))
        for name in stale:
            (out / name).unlink(missing_ok=True)
        if stale:
            print(f"removed {len(stale)} figure(s) of an earlier analysis in {out} that this one did not draw: "
                  f"{', '.join(stale)}")


def _analyze(args, main_path: Path, run, out: Path) -> int:
    from ..records import write_json
    from ..train.checkpoint import load_model
    from .plots import plot_layer_curves
    from .report import write_report
    from .sparsifiner import run_sparsifiner_analysis, sparsifiner_layers
    from .whitebox import check_crate
    if getattr(args, 'interpolate', None):
        refuse_unused_options(args, 'interpolate', str(main_path))
        from .interpolate import run_interpolation
        return run_interpolation(args, main_path, out)
    if args.cka:
        refuse_unused_options(args, 'cka', str(main_path))
        from .cka_cli import run_cka_analysis
        return run_cka_analysis(args, main_path, out, load_samples)
    paths = [main_path]
    for spec in args.compare:
        if spec.strip() == 'all':
            if run is None:
                raise ValueError("--compare all: the keyword needs --checkpoint inside a run "
                                 "(<run>/checkpoints/epoch_NNNN)")
            from .curves import run_checkpoints
            found = run_checkpoints(run)
        else:
            found = [resolve_compare(spec, run)]
        for p in found:
            if p.resolve() not in {q.resolve() for q in paths}:       # the same checkpoint twice adds nothing
                paths.append(p)
    loaded = []
    from .samples import load_named
    for p in paths:
        model, state = load_model(p, ema=args.ema) if p is main_path else load_named('--compare', p, ema=args.ema)
        what = f"{p} (model {state.get('model')!r})"
        if p is main_path and sparsifiner_layers(model):      # Sparsifiner: its own accounting and pictures
            refuse_unused_options(args, 'sparsifiner', what)
            return run_sparsifiner_analysis(args, model, state, main_path, out, load_samples)
        try:
            check_crate(model)
        except ValueError as e:
            if p is main_path:
                from .lowrank_runs import run_spectra_analysis, spectra_history
                if spectra_history(run):                       # a low-rank run: its logged ranks and spectra
                    refuse_unused_options(args, 'spectra', what)
                    return run_spectra_analysis(run, out, state.get('epoch'))     # up to this checkpoint
            flag = '--checkpoint' if p is main_path else '--compare'       # blame the flag that named it
            raise ValueError(f"{flag} {p}: model {state.get('model')!r} is not CRATE: {e}. For other "
                             "models: --cka CHECKPOINT, --interpolate CHECKPOINT, and for runs trained with "
                             "--rank the effective ranks and spectra they logged") from None
        if p is main_path:
            refuse_unused_options(args, 'crate', what)
        loaded.append((model, state, p))

    spec, options, data_seed, val_fraction = recorded_data(loaded[0][1], args.data, main_path)
    images, info, idx = load_samples(spec, options, data_seed, val_fraction, args.num_samples, args.seed)
    if len(idx) < args.num_samples:
        print(f"note: the validation split of {spec} has {len(idx)} samples; measuring all of them "
              f"instead of --num-samples {args.num_samples}")
    from ..train.scoring_data import check_model_input
    from .samples import check_takes_images
    for model, state, p in loaded:      # data the models cannot take: one line before the output folder is made
        if p is main_path:
            check_takes_images(spec, images, p, model, state)
        else:       # blamed on --compare: the data is --checkpoint's (or --data's when given)
            check_model_input(model, images[:2], None, f"--compare {p}: its model ({state.get('model')}) cannot take "
                                                       f"the images of {spec}, the data --checkpoint is measured on")

    out.mkdir(parents=True, exist_ok=True)
    taken: set = set()
    results = []
    for model, state, p in loaded:
        label = _label(state, p)
        if any(r['label'] == label for r in results):
            label = f'{label} [{p}]'
        results.append(_analyse_one(model, state, p, images, args, info, out, _slug(label, taken), label))

    measures = {r['label']: r['measure'] for r in results}
    analysis = {
        'data': spec, 'data_kwargs': options, 'data_seed': data_seed, 'val_fraction': val_fraction,
        'num_samples': len(idx), 'sample_indices': idx, 'estimator': args.estimator,
        'eps': results[0]['measure']['eps'],
        'include_cls': not args.exclude_cls, 'seed': args.seed, 'weights': 'ema' if args.ema else 'model',
        'figures': {'R_c': plot_layer_curves(measures, 'R_c', out / 'compression_per_layer.png').name,
                    'sparsity': plot_layer_curves(measures, 'sparsity', out / 'sparsity_per_layer.png').name},
        'checkpoints': results,
    }
    # Fig. 4: every measured epoch of ONE run in one figure, one line per epoch (checkpoints of other runs given to
    # --compare drew lines labelled with the same epoch, indistinguishable, under 'over training')
    def in_run(path: str) -> bool:
        found = _run_dir(Path(path))
        return run is None or (found is not None and found.resolve() == run.resolve())
    own = [r for r in results if r['epoch'] is not None and in_run(r['path'])]
    by_epoch = sorted(own, key=lambda r: r['epoch'])
    if len(by_epoch) >= 2 and len({r['epoch'] for r in by_epoch}) == len(by_epoch):
        from .plots import plot_training_curves
        analysis['figures']['training'] = plot_training_curves(
            [dict(r['measure'], epoch=r['epoch']) for r in by_epoch], out / 'training_curves.png',
            'R_c and sparsity per layer over training').name
    json_path = out / 'analysis.json'
    write_json(json_path, analysis)                        # atomically, as every record
    report = write_report(analysis, out / 'report.md')
    pngs = list(analysis['figures'].values()) + [f for r in results for f in r['figures'].values()]
    print(f'analysis: {json_path}')
    print(f'report:   {report}')
    for name in pngs:
        print(f'figure:   {out / name}')
    return 0


# the names the command table (structformer/commands) calls
EXAMPLES = ANALYZE_EXAMPLES
add_arguments, run = add_analyze_arguments, run_analyze
