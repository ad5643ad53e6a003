"""`structformer bench models`: CRATE-T against timm's ViT-T at the same input size.

Each model is measured in its own subprocess, so the peak resident memory of one does not hide the
other's. Reported: training images/s (forward + backward + AdamW step), inference images/s (eval,
no_grad), each the median step after 2 warm-up steps, and the growth of peak memory over the
model-and-batch baseline during training, with ratios to ViT-T computed from numbers taken in this
one run. Then (`--pairs`) every model's training step once more, all in one process and timed back to
back (`harness.paired_ratios`): the median per-round ratio to ViT-T, the figure the CRATE-T goal is
judged on, because on a machine whose speed drifts it moves far less than a ratio of two medians taken
minutes apart. Subprocess, timers, memory reader and writers are the shared ones of `harness.py`.

`--amp bfloat16` measures every row in float32 and again under autocast to bfloat16 (float32 weights,
`train.precision.Precision`, as `structformer train --amp` runs), and the paired rounds time each model's
two training steps back to back: the median per-round bfloat16-over-float32 speed ratio per model.
`--families` adds one 224-px model per family (SOFT, Sparsifiner, a factorised ViT-T; CRATE is CRATE-T)
and judges each family's bfloat16 speed-up against its goal, next to what the CPU can do in bfloat16.
"""
from __future__ import annotations

import statistics
import sys
import time

from .harness import MeasurementFailed, PeakMemory, measure_in_subprocess, median_seconds, paired_ratios
from ..cli_args import thread_count
from ..records import check_output_file, environment
from .kinds import add_record_arguments, print_header, verdict_line, write_record
from .load import row_flag, row_mark, row_record, run_record
from .model_goals import CRATE_T, GOAL_AMP_SPEEDUP, VIT_T, amp_goals, goal, kind_goals

CANDIDATES = [
    # (label, model name, model kwargs, also measured compiled by default)
    ('ViT-T (timm)', VIT_T, {}, True),
    ('CRATE-T', CRATE_T, {}, True),
    ('CRATE-T, SDPA attention', 'crate_tiny_patch16_224', {'ssa_impl': 'sdpa'}, False),
    ('CRATE-T reference ISTA', 'crate_tiny_patch16_224', {'fused_ista': False}, False),
]
FAMILIES = [
    # (family, label, model name, model kwargs, transforms as build_model takes them): one 224-px model each;
    # a label already among CANDIDATES is that row, not measured twice. The mixer family is looked up (`_mixer_224`).
    ('CRATE', 'CRATE-T', 'crate_tiny_patch16_224', {}, []),
    ('SOFT', 'SOFT-T', 'soft_tiny_224', {}, []),
    ('Sparsifiner', 'Sparsifiner DeiT-T', 'sparsifiner_deit_tiny_patch16_224', {}, []),
    ('low-rank', 'ViT-T factorized rank 0.5', 'vit_tiny_patch16_224', {},
     [{'name': 'factorize', 'kwargs': {'rank': 0.5}}]),
]
PATCH_SIZE = 16                        # of every candidate
MODES = ('eager', 'compiled')
AMP_DTYPES = ('bfloat16', 'float16')
EXAMPLES = """examples:
  structformer bench models                      # CRATE-T vs ViT-T, train/infer img/s and peak memory
  structformer bench models --batch-size 16 --img-size 224 --steps 5
  structformer bench models --amp bfloat16 --families --modes eager   # bfloat16 against float32, per family"""


def add_arguments(p):
    p.add_argument('--batch-size', type=int, default=16)
    p.add_argument('--img-size', type=int, default=224)
    p.add_argument('--steps', type=int, default=5, help='timed steps per measurement (after 2 warm-up steps)')
    p.add_argument('--rounds', type=int, default=2,
                   help='measure every model this many times, interleaved, and keep each one\'s best '
                        '(so a burst of load on a shared machine does not decide the ratio)')
    p.add_argument('--threads', type=thread_count, default=0, help='torch threads (0 = torch default)')
    p.add_argument('--modes', nargs='+', default=list(MODES), choices=MODES,
                   help='eager, and/or torch.compile (inductor; the 2 warm-up steps include compiling, '
                        'whose time is reported apart). Compiled rows: ViT-T and CRATE-T, or all with --compile-all')
    p.add_argument('--compile-all', action='store_true', help='measure every candidate compiled too')
    p.add_argument('--pairs', type=int, default=10,
                   help='then time the training steps of all models back to back in one process for this many '
                        'rounds and report the median per-round ratio to ViT-T with its quartiles (10; 0 skips)')
    p.add_argument('--amp', default=None, choices=AMP_DTYPES,
                   help='measure every row in float32 and again under autocast to this dtype (float32 weights, '
                        'as `structformer train --amp`); the paired rounds then time each model\'s two training '
                        'steps back to back. float16 only on a CPU with float16 arithmetic (AVX-512 FP16 or AMX-FP16)')
    p.add_argument('--families', action='store_true',
                   help='add one 224-px model per family (SOFT, Sparsifiner, factorised ViT-T; CRATE is CRATE-T) '
                        f'and, with --amp, judge each family\'s speed-up over float32 (goal >= {GOAL_AMP_SPEEDUP}x)')
    p.add_argument('--output', default=None, help='write the results as JSON here')
    add_record_arguments(p)


def _key(label: str, dtype: str) -> str:
    """A row's name: the label for float32 rows (as before --amp existed), 'label [dtype]' for the others."""
    return label if dtype == 'float32' else f'{label} [{dtype}]'


def _precision(dtype: str):
    import torch

    from ..train.precision import Precision
    cpu = torch.device('cpu')
    return Precision.create(False, None, cpu) if dtype == 'float32' else Precision.create(True, dtype, cpu)


def _training_setup(name, kwargs, batch_size, img_size, transforms=()):
    """A fresh model (seed 0, `build_model`, transforms applied) in train mode, a batch, and its training
    step (forward and cross-entropy under the precision's autocast, backward, AdamW step); the step takes a
    `Precision` (float32 when none is given), so one model serves float32 and --amp steps alike."""
    import torch

    from ..models.factory import build_model
    torch.manual_seed(0)
    model, _ = build_model(name, dict(kwargs, img_size=img_size, num_classes=1000), None, list(transforms))
    images = torch.randn(batch_size, 3, img_size, img_size)
    targets = torch.randint(0, 1000, (batch_size,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    float32 = _precision('float32')

    def train_step(precision=None):
        precision = precision or float32
        with precision.autocast():
            loss = torch.nn.functional.cross_entropy(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        precision.backward(loss)
        precision.step(optimizer, model.parameters(), None)

    model.train()
    return model, images, train_step


def measure_one(name, kwargs, batch_size, img_size, steps, threads=0, compiled=False, dtype='float32',
                transforms=()) -> dict:
    import torch
    if threads:
        torch.set_num_threads(threads)
    precision = _precision(dtype)
    model, images, train_step = _training_setup(name, kwargs, batch_size, img_size, transforms)
    memory = PeakMemory('cpu')            # the model-and-batch baseline: the growth is what training adds to them
    compile_s = None
    if compiled:
        model.compile()
        start = time.perf_counter()
        train_step(precision)                         # compiles the training graphs, then one more warm-up
        compile_s = time.perf_counter() - start
    train_s = median_seconds(lambda: train_step(precision), steps, 2, 'cpu')
    peak = memory.growth_mib()
    model.eval()
    with torch.no_grad(), precision.autocast():
        if compiled:
            model(images)                             # eval mode and no_grad compile graphs of their own
        infer_s = median_seconds(lambda: model(images), steps, 2, 'cpu')
    return {'model': name, 'kwargs': kwargs, 'transforms': list(transforms), 'dtype': dtype,
            'params': sum(p.numel() for p in model.parameters()),
            'mode': 'compiled' if compiled else 'eager', 'first_compiled_step_s': compile_s,
            'train_img_per_s': batch_size / train_s, 'infer_img_per_s': batch_size / infer_s,
            'train_peak_mib_over_baseline': peak, 'threads': torch.get_num_threads()}


def _entry(entry):
    """(label, model, kwargs, compiled, transforms) from a plan entry (transforms optional)."""
    label, name, kwargs, compiled, *rest = entry
    return label, name, kwargs, compiled, (rest[0] if rest else [])


def _ratio_stats(reference_times, times) -> dict:
    """Median and quartiles of the per-round ratios time(reference) / time (as `paired_ratios` reports them)."""
    ratios = sorted(r / t for r, t in zip(reference_times, times))
    q1, _, q3 = statistics.quantiles(ratios, n=4, method='inclusive') if len(ratios) > 1 else ratios * 3
    return {'ratio': statistics.median(ratios), 'ratio_q1': q1, 'ratio_q3': q3, 'rounds': len(ratios)}


def paired_by_dtype(steps: dict, reference: str, rounds: int, warmup: int = 2) -> dict:
    """`steps`: {label: {dtype: fn}}, the first dtype float32. Each round calls every label's steps, labels in
    an order rotated from round to round and each label's dtypes back to back (their order alternating from
    round to round), so a model's float32 and --amp steps see the same machine. Returns {_key(label, dtype):
    stats}: the ratio to `reference` in the same dtype (as `paired_ratios`), plus, for the other dtypes,
    'over_float32': the median and quartiles of the per-round ratios time(float32) / time(dtype) of that label."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    labels = list(steps)
    dtypes = list(steps[reference])
    for label in labels:
        for dtype in dtypes:
            for _ in range(warmup):
                steps[label][dtype]()
    times = {(label, dtype): [] for label in labels for dtype in dtypes}
    for round_index in range(rounds):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            for dtype in (dtypes if round_index % 2 == 0 else dtypes[::-1]):
                start = time.perf_counter()
                steps[label][dtype]()
                times[label, dtype].append(time.perf_counter() - start)
    result = {}
    for label in labels:
        for dtype in dtypes:
            stats = dict(_ratio_stats(times[reference, dtype], times[label, dtype]),
                         median_s=statistics.median(times[label, dtype]), times_s=times[label, dtype])
            if dtype != dtypes[0]:
                stats['over_float32'] = _ratio_stats(times[label, dtypes[0]], times[label, dtype])
            result[_key(label, dtype)] = stats
    return result


def measure_paired(plan, batch_size, img_size, rounds, threads=0, dtypes=('float32',)) -> dict:
    """Training steps of every planned model in one process, timed back to back (`paired_ratios`):
    {label: ratio stats} with each mode's ratios to ViT-T of that mode. `plan`: (label, model, kwargs,
    compiled[, transforms]) as `_plan` makes it. With more than float32 in `dtypes` (--amp), the rounds are
    `paired_by_dtype`'s: each row's ratio to ViT-T in its mode and dtype, and each --amp row's over float32."""
    import functools

    import torch
    if threads:
        torch.set_num_threads(threads)
    dtypes = list(dtypes)
    precisions = {dtype: _precision(dtype) for dtype in dtypes}
    plan = [_entry(p) for p in plan]
    steps = {}
    for label, name, kwargs, compiled, transforms in plan:
        model, _, train_step = _training_setup(name, kwargs, batch_size, img_size, transforms)
        if compiled:
            model.compile()
            for dtype in dtypes:
                train_step(precisions[dtype])         # compiling happens here, not inside a timed round
        steps[label] = {dtype: functools.partial(train_step, precisions[dtype]) for dtype in dtypes}
    result = {}
    for compiled in (False, True):
        group = {label: steps[label] for label, _, _, c, _ in plan if c == compiled}
        reference = next((label for label, name, kwargs, c, transforms in plan
                          if c == compiled and name == CANDIDATES[0][1] and not transforms),
                         None)
        if group and reference:
            if len(dtypes) == 1:
                result.update(paired_ratios({label: s[dtypes[0]] for label, s in group.items()}, reference, rounds))
            else:
                result.update(paired_by_dtype(group, reference, rounds))
    return result


def _measure_in_subprocess(entry, args, dtype) -> dict:
    """The row of one measurement, or where its subprocess failed (a model that cannot train at this size or
    batch, killed for memory) a FAILED row {'label', 'model', ..., 'error'}: recorded and gone past, as
    `bench attention` does, so one model does not lose the others' minutes."""
    label, name, kwargs, compiled, transforms = _entry(entry)
    try:
        return measure_in_subprocess('structformer.bench.models:measure_one', name, kwargs, args.batch_size,
                                     args.img_size, args.steps, args.threads, compiled, dtype, transforms)
    except MeasurementFailed as e:
        return {'model': name, 'kwargs': kwargs, 'mode': 'compiled' if compiled else 'eager', 'dtype': dtype,
                'transforms': transforms, 'error': str(e)}


def _error_line(row: dict) -> str:
    """The failure's last line (the exception the subprocess died of), as `bench attention` prints it."""
    lines = [line for line in row['error'].splitlines() if line.strip()]
    return lines[-1].strip() if lines else 'failed'


def _mixer_224():
    """A registered structformer mixer built for 224 px, or None (`structformer models` lists them)."""
    from ..models import list_structformer_models
    return next((n for n in list_structformer_models() if 'mixer' in n and n.endswith('_224')), None)


def _families(args) -> list:
    """(family, label, model, kwargs, transforms) of --families: FAMILIES and, where one is registered, a mixer."""
    if not getattr(args, 'families', False):
        return []
    mixer = _mixer_224()
    return list(FAMILIES) + ([('mixer', mixer, mixer, {}, [])] if mixer else [])


def _plan(args):
    """(label, model, kwargs, compiled, transforms) in the order measured and printed: eager rows (the
    candidates, then the --families models not among them), then compiled."""
    rows = [(label, name, kwargs, by_default, []) for label, name, kwargs, by_default in CANDIDATES]
    rows += [(label, name, kwargs, False, transforms) for _, label, name, kwargs, transforms in _families(args)
             if label not in {r[0] for r in rows}]
    plan = []
    for mode in MODES:
        if mode in args.modes:
            plan += [(label if mode == 'eager' else f'{label}, compiled', name, kwargs, mode == 'compiled', transforms)
                     for label, name, kwargs, by_default, transforms in rows
                     if mode == 'eager' or by_default or args.compile_all]
    return plan


def _check_amp(args) -> None:
    """--amp's dtype as `structformer train --amp` would take it on this CPU (float16 needs AVX-512 FP16 or
    AMX-FP16)."""
    if args.amp is None:
        return
    import torch

    from ..errors import UsageError
    from ..train.precision import Precision
    try:
        Precision.create(True, args.amp, torch.device('cpu'))
    except UsageError as e:
        raise UsageError(str(e).replace('--amp-dtype', '--amp')) from None


def run(args) -> int:
    import torch
    _check_amp(args)
    if args.output:                # before measuring: minutes of timings never die at the write
        check_output_file(args.output, '--output')
    for flag in ('batch_size', 'img_size', 'steps', 'rounds'):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.pairs < 0:
        raise ValueError(f"--pairs must be >= 0 (0 skips the paired timing), got {args.pairs}")
    if args.img_size % PATCH_SIZE:
        raise ValueError(f"--img-size must be a multiple of the patch size {PATCH_SIZE} (ViT-T and CRATE-T are "
                         f"patch16 models), got {args.img_size}")
    if args.threads:
        torch.set_num_threads(args.threads)              # so the environment record names the threads used
    dtypes = ['float32'] + ([args.amp] if args.amp else [])
    best, failed = {}, {}
    plan = _plan(args)
    for round_index in range(args.rounds):
        for entry in plan:
            for dtype in dtypes:
                label = entry[0]
                key = _key(label, dtype)
                mark = row_mark()
                row = _measure_in_subprocess(entry, args, dtype)
                row['label'] = label
                if 'error' in row:
                    failed.setdefault(key, row)
                    print(f"round {round_index + 1}/{args.rounds}: FAILED {key}: {_error_line(row)}", file=sys.stderr,
                          flush=True)
                    continue
                row['machine_load'] = row_record(mark)
                if key in best and best[key]['train_img_per_s'] >= row['train_img_per_s']:
                    # the training figure kept is an earlier round's: so is the load it was measured under (a quiet
                    # earlier round used to vouch for a faster figure taken while the machine was busy)
                    row['machine_load'] = best[key]['machine_load']
                if key in best:   # keep the fastest of the rounds, and the smallest memory growth
                    row['train_img_per_s'] = max(row['train_img_per_s'], best[key]['train_img_per_s'])
                    row['infer_img_per_s'] = max(row['infer_img_per_s'], best[key]['infer_img_per_s'])
                    row['train_peak_mib_over_baseline'] = min(row['train_peak_mib_over_baseline'],
                                                              best[key]['train_peak_mib_over_baseline'])
                best[key] = row
                print(f"round {round_index + 1}/{args.rounds}: measured {key}", file=sys.stderr, flush=True)
    # a model measured in no round in some dtype is a FAILED row in every dtype (its amp row has no float32 base)
    broken = {entry[0] for entry in plan for dtype in dtypes if _key(entry[0], dtype) not in best}
    failures = [failed.get(_key(entry[0], dtype)) or dict(best[_key(entry[0], dtype)], error=(
                    f"not reported: its {', '.join(d for d in dtypes if _key(entry[0], d) not in best)} "
                    "measurement failed")) for entry in plan if entry[0] in broken for dtype in dtypes]
    for row in failures:
        row.update(error_line=_error_line(row))
    plan = [entry for entry in plan if entry[0] not in broken]
    rows = [best[_key(entry[0], dtype)] for entry in plan for dtype in dtypes]
    if not rows:
        for row in failures:
            print(f"{row['label']} {row['dtype']}: FAILED: {row['error_line']}")
        return 1
    paired, paired_load = {}, None
    if args.pairs:
        mark = row_mark()
        paired = _measure_paired_in_subprocess(plan, args, dtypes)
        paired_load = row_record(mark)
        print(f"paired: {args.pairs} rounds measured", file=sys.stderr, flush=True)
    env = environment('cpu')
    print()
    print_header(env)
    print(f"batch {args.batch_size}, {args.img_size} px, {rows[0]['threads']} threads, best of {args.rounds} rounds, "
          f"{env['cpu']}, torch {env['torch']}")
    print("ratios: to ViT-T in the same mode and dtype (eager rows to eager ViT-T, compiled rows to compiled ViT-T)")
    width = max(24, *(len(r['label']) for r in rows + failures))
    print(f"{'model':<{width}} {'dtype':>8} {'params':>8} {'train img/s':>12} {'ratio':>6} {'infer img/s':>12} "
          f"{'ratio':>6} {'train peak MiB':>15} {'ratio':>6} {'compile s':>10}  paired train ratio (quartiles)")
    reference = {(r['mode'], r['dtype']): r for r in rows if r['model'] == CANDIDATES[0][1] and not r['transforms']}
    float32_rows = {(r['label'], r['mode']): r for r in rows if r['dtype'] == 'float32'}
    for r in rows:
        ref = reference.get((r['mode'], r['dtype']), rows[0])
        r['train_ratio'] = r['train_img_per_s'] / ref['train_img_per_s']
        r['infer_ratio'] = r['infer_img_per_s'] / ref['infer_img_per_s']
        r['memory_ratio'] = r['train_peak_mib_over_baseline'] / max(ref['train_peak_mib_over_baseline'], 1e-9)
        compile_s = '' if r['first_compiled_step_s'] is None else f"{r['first_compiled_step_s']:.1f}"
        pair = paired.get(_key(r['label'], r['dtype']))
        r['paired_train'] = pair
        if r['dtype'] != 'float32':
            base = float32_rows[r['label'], r['mode']]
            r['train_over_float32'] = r['train_img_per_s'] / base['train_img_per_s']
            r['infer_over_float32'] = r['infer_img_per_s'] / base['infer_img_per_s']
            r['paired_over_float32'] = pair.get('over_float32') if pair else None
        pair_text = f"  {pair['ratio']:.2f} ({pair['ratio_q1']:.2f}–{pair['ratio_q3']:.2f})" if pair else ''
        print(f"{r['label']:<{width}} {r['dtype']:>8} {r['params'] / 1e6:>7.2f}M {r['train_img_per_s']:>12.2f} "
              f"{r['train_ratio']:>6.2f} {r['infer_img_per_s']:>12.2f} {r['infer_ratio']:>6.2f} "
              f"{r['train_peak_mib_over_baseline']:>15.0f} {r['memory_ratio']:>6.2f} {compile_s:>10}{pair_text}"
              f"{row_flag(r.get('machine_load'))}")
    for row in failures:
        print(f"{row['label']:<{width}} {row['dtype']:>8}  FAILED: {row['error_line']}")
    if paired_load and paired_load['busy']:
        print(f"paired ratios: {paired_load['advice']}")
    if args.amp:
        _print_over_float32(rows, args, width)
    measured_pair = tuple(c[1:3] for c in CANDIDATES[:2])     # the reference and CRATE-T as measured here
    verdict = goal(rows, measured_pair)
    if verdict:
        print(verdict)
    entries = kind_goals(rows, paired_load or run_record(), args.batch_size, args.img_size, measured_pair)
    for entry in entries:
        print(verdict_line(entry))
    families = _families(args)
    verdicts = amp_goals(rows, families, args.amp, measured_pair) if args.amp else []
    for v in verdicts:
        print(v['line'])
    if args.families and not any(f[0] == 'mixer' for f in families):
        print("  (mixer family: no mixer is registered at 224 px (`structformer models`), so none was measured)")
    if args.output:
        settings = {k: v for k, v in vars(args).items() if k not in ('func', 'command', 'target')}
        write_record(args.output, {'batch_size': args.batch_size, 'img_size': args.img_size, 'environment': env,
                                   'args': settings,       # steps, rounds, modes, threads: what made these numbers
                                 'pairs': args.pairs, 'amp': args.amp, 'dtypes': dtypes,
                                 'families': [{'family': f, 'label': label, 'model': name, 'kwargs': kwargs,
                                               'transforms': transforms}
                                              for f, label, name, kwargs, transforms in families],
                                 'rows': rows, 'failed_rows': failures, 'goal': verdict, 'amp_goals': verdicts, 'kind_goals': entries,
                                 'paired_machine_load': paired_load, 'machine_load': run_record()}, args.allow_busy)
    return 1 if failures else 0


def _print_over_float32(rows, args, width) -> None:
    print(f"\n{args.amp} over float32 (speed ratio; paired: each model's float32 and {args.amp} training steps back "
          f"to back, {args.pairs} rounds, median (quartiles))")
    print(f"{'model':<{width}} {'mode':>8} {'train':>6} {'infer':>6}  paired train")
    for r in rows:
        if r['dtype'] == 'float32':
            continue
        pair = r.get('paired_over_float32')
        pair_text = f"  {pair['ratio']:.3f} ({pair['ratio_q1']:.3f}–{pair['ratio_q3']:.3f})" if pair else ''
        print(f"{r['label']:<{width}} {r['mode']:>8} {r['train_over_float32']:>6.2f} {r['infer_over_float32']:>6.2f}"
              f"{pair_text}")


def _measure_paired_in_subprocess(plan, args, dtypes=('float32',)) -> dict:
    try:
        return measure_in_subprocess('structformer.bench.models:measure_paired', plan, args.batch_size,
                                     args.img_size, args.pairs, args.threads, list(dtypes))
    except MeasurementFailed as e:
        raise RuntimeError(f"the paired timing failed: {e}") from None
