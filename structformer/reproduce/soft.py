"""`structformer reproduce soft`: SOFT Table 2 (attention swapped in the Tiny backbone) on MNIST.

The paper trains on ImageNet (300 epochs, V100s); this trains every `*_tiny_*_mnist` variant (Table 1's
Tiny depths and head width, small-image stem, `--width` narrowing the channels; see
`structformer.models.soft`) with ONE recipe on `mnist:PATH` and reports, per attention: parameters,
final and best val top-1, and, measured on one batch of the trained model after training, training
img/s (forward + backward + AdamW step), inference img/s and activation memory. Absolute numbers are
not comparable with the paper's; the ranking and ratios are what this measures. Speeds are timed in
a short window per model after training (`--measure-only` repeats just that on the saved runs), so
a machine busy during the long training phase does not skew them; the engine's own epoch img/s
(which includes data loading) is kept in results.json as `epoch_img_per_s`. Each row records the machine's load
while it was timed (`bench.load`: `load` in results.json); a row timed while other processes used the cores is
marked BUSY in the report, to be re-timed with `--measure-only` on a quiet machine. The report ends with
`verdicts`: Table 2's accuracy claim read against two binomial standard errors, its speed claim marked untested.
A finished run in --output/runs of the same settings, trained by this code (`reproduce.finished_run`), is reused
(its speeds timed again), so an interrupted study continues where it stopped; another setting or other code trains
anew.

Memory: Table 2 reports training memory. Here `act_mem_mb` is the bytes of tensors autograd saves
for backward in one training forward (the part of training memory that depends on the attention),
measured the same way on CPU and GPU; on CUDA `cuda_peak_mb` (max allocated during forward+backward)
is added. Timer, memory readers, environment record and writers are those of `bench/harness.py`.

`--ablate` (issue 14): plain SOFT and SOFT++ with each difference of the public code switched on alone
(sampler LayerNorm + GELU, V depthwise conv, post-LN, its inverse rule, unrolled backward) and all five
together (`ABLATIONS['all']`: not the public code, whose other differences, `NOT_ABLATED`, no row switches on;
`official=True` builds them all), same recipe; per row val top-1 (after epoch 1, final, best) and the conditioning of the
landmark kernel A (2-norm condition number over every SOFT layer, head and image of one validation
batch: median and max, at initialisation and after training). No speed measurements.
"""
from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List

from . import check_distinct, command_line, finished_run, mnist_spec
from ..bench.harness import PeakMemory, median_seconds, saved_tensor_bytes
from ..bench.load import row_flag
from ..records import environment, write_json, write_text
from ..cli_args import ParseKwargs
from ..errors import UsageError

if TYPE_CHECKING:
    import torch


ADVICE_BUSY = 're-time them with --measure-only on a quiet machine'
ATTENTIONS = ('softmax', 'linformer', 'performer', 'nystrom', 'soft', 'softpp')
# Table 1 Tiny has dims 64/128/320/512 and heads 2/4/10/16 (head width 32). Narrower widths keep the depths,
# the head width and the sampling ratios, and halve the heads, so a CPU can train every row (half is the
# default; docs/soft.md has the measured speeds).
WIDTHS = {'full': {}, 'half': dict(dims=(32, 64, 160, 256), num_heads=(1, 2, 5, 8)),
          'quarter': dict(dims=(16, 32, 80, 128), num_heads=(1, 1, 2, 4))}
PAPER_TABLE2 = {   # SOFT Table 2 (ImageNet, Tiny): params, GFLOPs, train / infer img/s, memory, top-1
    # memory at batch 1024, except the Transformer's (†: batch 256, the most its GPUs held)
    'softmax': ('13M', '3.9G', '1073 / 3240', '19.0GB at batch 256', 80.0), 'linformer': ('13M', '1.9G', '2767 / 3779', '11.7GB', 78.2),
    'performer': ('13M', '2.2G', '2037 / 3657', '15.0GB', 76.1), 'nystrom': ('13M', '2.0G', '1891 / 3518', '17.2GB', 80.1),
    'soft': ('13M', '1.9G', '1730 / 3436', '15.8GB', 80.9), 'softpp': ('13M', '1.9G', '1730 / 3436', '15.8GB', 80.9),
}


# issue 14: each difference of the public SOFT code, switched on alone (model kwargs, `attn_kwargs` merged);
# '{rule}' is the public rule of the family ('soft' for SOFT, 'softpp' for SOFT++)
ABLATIONS = {
    'paper': {},
    'landmark_norm': {'attn_kwargs': {'landmark_norm': True}},
    'value_conv': {'value_conv': [9, 5, 3, 3]},
    'post_norm': {'post_norm': [True, True, True, False]},
    'newton_rule': {'attn_kwargs': {'newton_rule': '{rule}'}},
    'unrolled': {'attn_kwargs': {'newton_backward': 'unrolled'}},
}
# 'all': the rows above switched on together (their union, so a new row joins it). It is NOT the public code: the
# public code's other differences below are left out of every row; `official=True` (soft_*_official_224) builds them.
ABLATIONS['all'] = {k: v for row in ABLATIONS.values() for k, v in row.items() if k != 'attn_kwargs'}
ABLATIONS['all']['attn_kwargs'] = {k: v for row in ABLATIONS.values() for k, v in row.get('attn_kwargs', {}).items()}
NOT_ABLATED = {
    'pos_embed': 'position embeddings per stage (the zero-padded convs already carry position)',
    'last_stage_attn': "softmax in stage 4 (every row keeps SOFT there, the attention under study)",
    'conv_bias': 'conv biases before BatchNorm (redundant with its shift)',
    'mlp_act': 'tanh-approximated GELU in stages 1-3',
    'branch_dropout': 'residual-branch Dropout instead of DropPath (the rows train without drop path: no effect)',
    'sampler_init': "nn.Conv2d's kaiming init of the landmark conv (ours starts as average pooling)",
    'landmark_border': "grids the sampling ratio does not divide cut to whole windows (MNIST's 14x14 and 7x7 stage "
                       "grids at k = 4, 3: 3x3 and 2x2 landmarks instead of 4x4 and 3x3)",
}


def ablation_kwargs(attn: str, variant: str, base: Dict) -> Dict:
    """Model kwargs of one ablation row: `base` (width, user's kwargs) plus the variant's switches."""
    rule = {'soft': 'soft', 'softpp': 'softpp'}[attn]
    extra = ABLATIONS[variant]
    out = dict(base, **{k: v for k, v in extra.items() if k != 'attn_kwargs'})
    attn_kwargs = dict(base.get('attn_kwargs') or {})
    attn_kwargs.update({k: (rule if v == '{rule}' else v) for k, v in extra.get('attn_kwargs', {}).items()})
    if attn_kwargs:
        out['attn_kwargs'] = attn_kwargs
    return out


def landmark_conditioning(model: torch.nn.Module, images: torch.Tensor) -> Dict[str, float]:
    """2-norm condition numbers of every SOFT layer's landmark kernel A on `images` (one forward):
    median, 90th percentile and max over layers, heads and images (computed in float64), and the median
    per stage (`stage_median`; SoftNet's `stages.i`). MNIST's blank borders give identical landmarks,
    so some A are exactly singular whatever the layer does: the max says little, the median and p90 more."""
    import torch
    from ..layers.attention.soft import SoftAttention
    conds, handles = {}, []

    def hook_for(stage):
        def hook(module, args, kwargs):
            a = module.landmark_kernel(args[0], kwargs.get('grid_size'))
            conds.setdefault(stage, []).append(torch.linalg.cond(a.double()).flatten())
        return hook

    for name, module in model.named_modules():
        if isinstance(module, SoftAttention):
            parts = name.split('.')
            stage = int(parts[1]) if parts[0] == 'stages' else 0
            handles.append(module.register_forward_pre_hook(hook_for(stage), with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(images)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not conds:
        return {}
    c = torch.cat([t for stage in sorted(conds) for t in conds[stage]])
    return {'median': c.median().item(), 'p90': c.quantile(0.9).item(), 'max': c.max().item(),
            'stage_median': [torch.cat(conds[s]).median().item() for s in sorted(conds)]}


def model_name(attn: str) -> str:
    """Registered small-image model for an attention name (see structformer.models.soft)."""
    return {'soft': 'soft_tiny_mnist', 'softpp': 'softpp_tiny_mnist'}.get(attn, f'soft_tiny_{attn}_mnist')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--data', default=None,
                        help='folder of MNIST IDX files (relative to the current directory)')
    parser.add_argument('--attn', nargs='+', default=None, choices=ATTENTIONS,
                        help='attentions to train (one model each; default: all, or soft softpp with --ablate)')
    parser.add_argument('--ablate', action='store_true',
                        help='issue 14: SOFT and SOFT++ with each public-code difference switched on alone and all '
                             'together; reports top-1 and the condition number of the landmark kernel A per row')
    parser.add_argument('--variants', nargs='+', default=list(ABLATIONS), choices=list(ABLATIONS),
                        help='ablation rows to train with --ablate (default: all)')
    parser.add_argument('--width', default='half', choices=sorted(WIDTHS),
                        help="Tiny's widths (full: Table 1, 14M parameters) or narrower with the same depths and "
                             "head width 32 (half: 3.6M, the default, sized for a CPU; quarter: 0.9M)")
    parser.add_argument('--epochs', type=int, default=4)
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--lr', type=float, default=1e-3)
    parser.add_argument('--weight-decay', type=float, default=0.05)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--limit-train-batches', type=int, default=0, help='0 = every batch')
    parser.add_argument('--val-fraction', type=float, default=0.2,
                        help='held-out tail of a single MNIST file pair (0.2: first 8,000 train, last 2,000 val)')
    parser.add_argument('--model-kwargs', nargs='*', action=ParseKwargs, default={}, metavar='KEY=VALUE',
                        help='passed to every model after --width, e.g. depths="(1,1,2,1)"')
    parser.add_argument('--output', default='outputs/reproduce_soft')
    parser.add_argument('--measure-only', action='store_true',
                        help='skip training: re-measure speed and memory of the runs already in --output '
                             '(their attentions, held-out split and batch size, as results.json records them; e.g. '
                             'on a quiet machine) and rewrite the report')


def _train_step_seconds(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor, lr: float,
                        weight_decay: float, repeats: int) -> float:
    """Median seconds of forward + backward + AdamW step on a copy of `model` (freed on return)."""
    import torch
    student = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=weight_decay)

    def step():
        loss = torch.nn.functional.cross_entropy(student(images), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return median_seconds(step, repeats, 1, images.device)


def measure(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor, lr: float = 1e-3,
            weight_decay: float = 0.05, repeats: int = 5) -> Dict[str, float]:
    """On one batch: inference img/s (eval, no_grad), training img/s (forward, backward and an AdamW step
    of a copy of the model, so `model` is unchanged) and training memory. Each speed is the median of
    `repeats` timed calls after one warm-up (`bench.harness.median_seconds`); the data loader is left
    out, so rows differ only by the model."""
    import torch
    out: Dict[str, float] = {}
    batch = images.shape[0]
    model.eval()
    with torch.no_grad():
        out['infer_img_per_s'] = batch / median_seconds(lambda: model(images), repeats, 1, images.device)
    out['train_img_per_s'] = batch / _train_step_seconds(model, images, targets, lr, weight_decay, repeats)
    cuda_memory = PeakMemory(images.device) if images.is_cuda else None
    out['act_mem_mb'] = saved_tensor_bytes(model, images) / 2 ** 20
    if cuda_memory is not None:
        out['cuda_peak_mb'] = cuda_memory.peak_mib()
    model.eval()
    return out


def verdicts(rows: List[Dict], labels: List[int]) -> Dict[str, str]:
    """Table 2's claims against these rows. Accuracy (SOFT 80.9 % and SOFT++ 80.9 % vs softmax 80.0 %): the
    difference of held-out top-1 read against two binomial standard errors on the `labels`' images; higher beyond
    them HOLDS, lower beyond them DOES NOT HOLD, inside them CANNOT TELL, and so does a softmax row that did not
    learn (`reproduce.learned`). Speed and memory: not tested (this stem's largest grid is 14 × 14 = 196 tokens,
    where fixed costs rule; Table 2's first stage has 56 × 56 = 3,136), said so."""
    import math

    from . import learned
    n = len(labels)
    by = {r['attention']: r for r in rows}
    out = {}
    softmax = by.get('softmax')
    for attn, name in (('soft', 'SOFT'), ('softpp', 'SOFT++')):
        if attn not in by:
            continue
        if softmax is None:                  # said, not left out: the report would read as if nothing was claimed
            out[f'{attn}_accuracy'] = (f"'{name} is more accurate than softmax' NOT TESTED: --attn has no softmax "
                                       "row to compare with")
            continue
        a, b = by[attn]['val_top1'], softmax['val_top1']
        two_se = 200 * math.sqrt((a / 100 * (1 - a / 100) + b / 100 * (1 - b / 100)) / n)
        base = learned(b, labels)
        if not base['learned']:
            verdict = (f"CANNOT TELL at this scale: softmax did not learn (within two standard errors of the most "
                       f"frequent class's share, {base['majority_class']:.2f}%)")
        elif a - b > two_se:
            verdict = 'HOLDS'
        elif b - a > two_se:
            verdict = 'DOES NOT HOLD'
        else:
            verdict = 'CANNOT TELL at this scale (inside two standard errors)'
        out[f'{attn}_accuracy'] = (
            f"{name} vs softmax held-out top-1: {a:.2f}% vs {b:.2f}% ({a - b:+.2f} ± {two_se:.2f} points, 2 SE, {n} "
            f"images, one seed; the paper: {PAPER_TABLE2[attn][4]} vs {PAPER_TABLE2['softmax'][4]} on ImageNet). "
            f"'{name} is more accurate than softmax' {verdict} here.")
    if out:
        out['speed_memory'] = ("Speed and memory (Table 2: SOFT trains 1.6× faster than softmax in less memory): NOT "
                               "TESTED here: the largest grid is 14 × 14 = 196 tokens, where the fixed costs of "
                               "landmarks and the pseudo-inverse rule; Table 2's first stage has 3,136 "
                               "(`structformer bench attention` measures the n-dependence).")
    return out


def _report(rows: List[Dict], recipe: Dict, split: str, found: Dict[str, str] = None) -> str:
    lines = [f"# SOFT Table 2 on MNIST (Tiny depths, {recipe.get('width', 'full')} width, attention swapped)", '',
             f"Recipe (identical for every row): {json.dumps(recipe, default=str)}", '', f"Data: {split}", '',
             '| attention | model | params | train img/s | infer img/s | act. memory (MB) | val top-1 % (best) '
             '| paper (ImageNet): params, FLOPs, train/infer img/s, memory, top-1 |',
             '|---|---|---|---|---|---|---|---|']
    for r in rows:
        params, flops, speed, memory, top1 = PAPER_TABLE2[r['attention']]
        paper = f"{params}, {flops}, {speed.replace(' ', '')} img/s, {memory}, {top1}%"
        busy = row_flag(r.get('load'))
        lines.append(f"| {r['attention']} | {r['model']} | {r['params'] / 1e6:.2f}M | "
                     f"{r['train_img_per_s']:.0f}{busy} | {r['infer_img_per_s']:.0f}{busy} | {r['act_mem_mb']:.1f} | "
                     f"{r['val_top1']:.2f} ({r['best_val_top1']:.2f}) | {paper} |")
    lines += ['', 'Speeds: one batch of the trained model, timed after training (forward + backward + AdamW step '
              'for training). Memory: tensors saved for backward in one training forward of one batch (see '
              'module docstring); the paper reports whole-GPU training memory at batch 1024 (softmax: 256). Measured on this '
              'machine, not a V100.']
    busy = [r['attention'] for r in rows if (r.get('load') or {}).get('busy')]
    if busy:
        lines += ['', f"BUSY: other processes used the cores while {', '.join(busy)} were timed ({ADVICE_BUSY})."]
    if found:
        lines += ['', '## Verdicts', ''] + [f'- {v}' for v in found.values()]
    return '\n'.join(lines) + '\n'


def _check(args: argparse.Namespace) -> None:
    """Flags this command uses itself before training (the engine checks the rest): the validation batch it
    measures and probes is read with --batch-size, so 0 must be refused here, not by the DataLoader."""
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be an integer >= 1, got {args.batch_size}")
    if not 0 < args.val_fraction < 1:           # by its flag: the data reader names it val_fraction
        raise UsageError(f"--val-fraction must be in (0, 1), got {args.val_fraction:g}")
    check_distinct(args.attn, '--attn')
    check_distinct(args.variants, '--variants')


def _recipe_flags(args: argparse.Namespace, recipe: Dict) -> None:
    """--measure-only: the training flags set to the saved runs' recipe, so the record's `command` names the runs it
    timed (with the flags' defaults it read --width half --epochs 4 beside a quarter-width, 1-epoch recipe), and the
    timed AdamW step uses their lr and weight decay. --model-kwargs keeps what the width does not already give."""
    for key in ('epochs', 'lr', 'weight_decay', 'limit_train_batches', 'width'):
        if key in recipe:
            setattr(args, key, recipe[key])
    if 'model_kwargs' in recipe:
        width = {k: list(v) for k, v in WIDTHS.get(args.width, {}).items()}     # the record holds tuples as lists
        args.model_kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in recipe['model_kwargs'].items()
                             if width.get(k) != v}


def run(args: argparse.Namespace) -> int:
    _check(args)
    if args.ablate:
        return run_ablation(args)
    output = Path(args.output)
    saved = None
    if args.measure_only:                    # the saved runs' recipe, attentions and held-out split, not the flags'
        previous = output / 'results.json'
        if not previous.is_file():
            raise FileNotFoundError(f"--measure-only: {previous} not found; run without --measure-only first")
        from ..records import read_record
        saved = read_record(previous, 'the results.json of `reproduce soft`', ('recipe', 'rows'),
                            'run without --measure-only to make it')
        if args.attn is None:
            args.attn = [r['attention'] for r in saved['rows']]
        for key in ('seed', 'val_fraction', 'batch_size'):
            value = saved['recipe'].get(key, getattr(args, key))
            if value != getattr(args, key):
                print(f"--measure-only: the saved runs' --{key.replace('_', '-')} {value} "
                      f"(not {getattr(args, key)})", flush=True)
            setattr(args, key, value)
        _recipe_flags(args, saved['recipe'])
    if args.attn is None:
        args.attn = list(ATTENTIONS)
    import torch
    import structformer  # noqa: F401  (registers the models)
    from ..data import build_datasets
    from ..train import TrainConfig, load_model, train

    spec = mnist_spec(args.data)
    _, val_set, info = build_datasets(spec, seed=args.seed, val_fraction=args.val_fraction)
    recipe = dict(epochs=args.epochs, batch_size=args.batch_size, opt='adamw', lr=args.lr,
                  weight_decay=args.weight_decay, sched='cosine', warmup_epochs=min(1.0, args.epochs / 3),
                  label_smoothing=0.1, seed=args.seed, val_fraction=args.val_fraction,
                  limit_train_batches=args.limit_train_batches)
    model_kwargs = dict(WIDTHS[args.width], **(args.model_kwargs or {}))
    recipe_shown = dict(recipe, width=args.width, model_kwargs=model_kwargs)
    if saved is not None:                    # report the recipe the saved runs were trained with
        recipe_shown = saved['recipe']
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')   # where the engine trains
    loader = torch.utils.data.DataLoader(val_set, batch_size=args.batch_size)
    images, targets = next(iter(loader))
    rows = []
    from ..bench.load import LoadWatch
    watch = LoadWatch(torch.get_num_threads())
    for attn in args.attn:
        name = model_name(attn)
        run_dir = output / 'runs' / name
        settings = dict(model=name, model_kwargs=model_kwargs, **recipe)
        if not args.measure_only and finished_run(run_dir, settings, spec):    # an interrupted study goes on
            print(f'reusing the finished run in {run_dir}', flush=True)
        elif not args.measure_only:
            train(TrainConfig(data=spec, output=str(run_dir), **settings), progress=False, overwrite=True)
        elif not (run_dir / 'summary.json').is_file():
            raise FileNotFoundError(f"--measure-only: no finished run at {run_dir}; run without --measure-only first")
        model, _ = load_model(run_dir, map_location=device)
        summary = json.loads((run_dir / 'summary.json').read_text())
        epochs = [json.loads(line) for line in (run_dir / 'metrics.jsonl').read_text().splitlines() if line]
        mark = watch.mark()                  # was the machine busy while this row was timed? (bench/load.py)
        speeds = measure(model, images.to(device), targets.to(device), args.lr, args.weight_decay)
        row = {'attention': attn, 'model': name, 'params': sum(p.numel() for p in model.parameters()),
               'val_top1': summary['final_val_top1'], 'best_val_top1': summary['best_val_top1'],
               'epoch_img_per_s': epochs[-1]['train_img_per_s'], **speeds, 'load': watch.since(mark)}
        rows.append(row)
        print(f"{attn:>10}: top-1 {row['val_top1']:.2f}%  train {row['train_img_per_s']:.0f} img/s  "
              f"infer {row['infer_img_per_s']:.0f} img/s  act. mem {row['act_mem_mb']:.1f} MB"
              f"{row_flag(row['load'])}", flush=True)
    found = verdicts(rows, [int(y) for y in val_set.targets])
    write_json(output / 'results.json', {'command': command_line(args, 'soft'), 'recipe': recipe_shown,
                                         'data': info.description, 'environment': environment(device), 'rows': rows,
                                         'verdicts': found}, default=str)
    write_text(output / 'report.md', _report(rows, recipe_shown, info.description, found))
    print('\n'.join(found.values()))
    print(f"wrote {output / 'results.json'} and {output / 'report.md'}")
    return 0


def _ablation_report(rows: List[Dict], recipe: Dict, split: str) -> str:
    lines = [f"# SOFT vs SOFT++: the public code's differences one at a time (MNIST, {recipe.get('width')} width)", '',
             f"Recipe (identical for every row): {json.dumps(recipe, default=str)}", '', f"Data: {split}", '',
             '| attention | variant | params | val top-1 % epoch 1 | final (best) | cond(A) init: median / p90 '
             '| cond(A) trained: median / p90 | trained, median per stage | train s |',
             '|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        ci, ct = r['cond_init'], r['cond_trained']
        stages = ' / '.join(f'{c:.3g}' for c in ct['stage_median'])
        lines.append(f"| {r['attention']} | {r['variant']} | {r['params'] / 1e6:.3f}M | {r['epoch1_top1']:.2f} | "
                     f"{r['val_top1']:.2f} ({r['best_val_top1']:.2f}) | {ci['median']:.3g} / {ci['p90']:.3g} | "
                     f"{ct['median']:.3g} / {ct['p90']:.3g} | {stages} | {r['train_seconds']:.0f} |")
    lines += ['', 'cond(A): 2-norm condition number of the landmark kernel exp(Q̃ ⊖ Q̃) of every SOFT layer, head and '
              'image of the first validation batch, before and after training (median and 90th percentile; '
              "MNIST's blank borders make some landmarks identical, so some A are singular in every row).", '',
              "'all' is the ablated differences together, not the public code; no row switches on its others: "
              + '; '.join(f'`{k}` ({v})' for k, v in NOT_ABLATED.items()) + '.']
    return '\n'.join(lines) + '\n'


def run_ablation(args: argparse.Namespace) -> int:
    """`--ablate`: train every (attention, variant) row with one recipe; see the module docstring."""
    import time

    import torch
    import timm
    import structformer  # noqa: F401  (registers the models)
    from ..data import build_datasets
    from ..train import TrainConfig, load_model, train

    attns = args.attn or ['soft', 'softpp']
    others = [a for a in attns if a not in ('soft', 'softpp')]
    if others:
        raise UsageError(f"--ablate applies to --attn soft softpp only, got {' '.join(others)}")
    if args.measure_only:
        raise UsageError("--ablate does not measure speeds; drop --measure-only")
    spec = mnist_spec(args.data)
    _, val_set, info = build_datasets(spec, seed=args.seed, val_fraction=args.val_fraction)
    output = Path(args.output)
    recipe = dict(epochs=args.epochs, batch_size=args.batch_size, opt='adamw', lr=args.lr,
                  weight_decay=args.weight_decay, sched='cosine', warmup_epochs=min(1.0, args.epochs / 3),
                  label_smoothing=0.1, seed=args.seed, val_fraction=args.val_fraction,
                  limit_train_batches=args.limit_train_batches)
    base = dict(WIDTHS[args.width], **(args.model_kwargs or {}))
    images, _ = next(iter(torch.utils.data.DataLoader(val_set, batch_size=args.batch_size)))
    rows = []
    for attn in attns:
        for variant in args.variants:
            name, kwargs = model_name(attn), ablation_kwargs(attn, variant, base)
            run_dir = output / 'runs' / f'{attn}_{variant}'
            torch.manual_seed(args.seed)            # the engine seeds the same way: the same initial model
            fresh = timm.create_model(name, **kwargs)
            cond_init = landmark_conditioning(fresh, images)
            start = time.perf_counter()
            train(TrainConfig(model=name, model_kwargs=kwargs, data=spec, output=str(run_dir), **recipe),
                  progress=False, overwrite=True)
            seconds = time.perf_counter() - start
            model, _ = load_model(run_dir, map_location='cpu')
            summary = json.loads((run_dir / 'summary.json').read_text())
            epochs = [json.loads(line) for line in (run_dir / 'metrics.jsonl').read_text().splitlines() if line]
            row = {'attention': attn, 'variant': variant, 'model': name, 'model_kwargs': kwargs,
                   'params': sum(p.numel() for p in model.parameters()),
                   'epoch1_top1': epochs[0]['val_top1'], 'val_top1': summary['final_val_top1'],
                   'best_val_top1': summary['best_val_top1'], 'train_seconds': seconds,
                   'cond_init': cond_init, 'cond_trained': landmark_conditioning(model, images)}
            rows.append(row)
            print(f"{attn:>7} {variant:<14} top-1 {row['val_top1']:.2f}% (epoch 1: {row['epoch1_top1']:.2f}%)  "
                  f"cond(A) median {row['cond_trained']['median']:.3g} (init {cond_init['median']:.3g})  "
                  f"{seconds:.0f} s", flush=True)
            recipe_shown = dict(recipe, width=args.width, model_kwargs=base)
            write_json(output / 'results.json', {'command': command_line(args, 'soft'), 'recipe': recipe_shown,
                                                 'data': info.description,
                                                 'environment': environment(torch.device('cpu')), 'rows': rows},
                       default=str)
            write_text(output / 'report.md', _ablation_report(rows, recipe_shown, info.description))
    print(f"wrote {output / 'results.json'} and {output / 'report.md'}")
    return 0
