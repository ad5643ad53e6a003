"""`structformer bench models`: CRATE-T against timm's ViT-T at the same input size.

Each model is measured in its own subprocess, so the peak resident memory of one does not hide the
other's. Reported: training images/s (forward + backward + AdamW step), inference images/s (eval,
no_grad), each the median step after 2 warm-up steps, and the growth of peak memory over the
model-and-batch baseline during training, with ratios to ViT-T computed from numbers taken in this
one run. Then (`--pairs`) every model's training step once more, all in one process and timed back to
back (`harness.paired_ratios`): the median per-round ratio to ViT-T, the figure the CRATE-T goal is
judged on, because on a machine whose speed drifts it moves far less than a ratio of two medians taken
minutes apart. Subprocess, timers, memory reader and writers are the shared ones of `harness.py`.
"""
from __future__ import annotations

import sys

from .harness import (MeasurementFailed, PeakMemory, environment, measure_in_subprocess, median_seconds,
                      paired_ratios, write_json)

CANDIDATES = [
    # (label, model name, model kwargs, also measured compiled by default)
    ('ViT-T (timm)', 'vit_tiny_patch16_224', {}, True),
    ('CRATE-T', 'crate_tiny_patch16_224', {}, True),
    ('CRATE-T, SDPA attention', 'crate_tiny_patch16_224', {'ssa_impl': 'sdpa'}, False),
    ('CRATE-T reference ISTA', 'crate_tiny_patch16_224', {'fused_ista': False}, False),
]
PATCH_SIZE = 16                        # of every candidate
MODES = ('eager', 'compiled')
GOAL_RATIO = 0.9                       # CRATE-T's training speed over ViT-T's, eager or compiled
EXAMPLES = """examples:
  structformer bench models                      # CRATE-T vs ViT-T, train/infer img/s and peak memory
  structformer bench models --batch-size 16 --img-size 224 --steps 5"""


def add_arguments(p):
    p.add_argument('--batch-size', type=int, default=16)
    p.add_argument('--img-size', type=int, default=224)
    p.add_argument('--steps', type=int, default=5, help='timed steps per measurement (after 2 warm-up steps)')
    p.add_argument('--rounds', type=int, default=2,
                   help='measure every model this many times, interleaved, and keep each one\'s best '
                        '(so a burst of load on a shared machine does not decide the ratio)')
    p.add_argument('--threads', type=int, default=0, help='torch threads (0 = torch default)')
    p.add_argument('--modes', nargs='+', default=list(MODES), choices=MODES,
                   help='eager, and/or torch.compile (inductor; the 2 warm-up steps include compiling, '
                        'whose time is reported apart). Compiled rows: ViT-T and CRATE-T, or all with --compile-all')
    p.add_argument('--compile-all', action='store_true', help='measure every candidate compiled too')
    p.add_argument('--pairs', type=int, default=10,
                   help='then time the training steps of all models back to back in one process for this many '
                        'rounds and report the median per-round ratio to ViT-T with its quartiles (10; 0 skips)')
    p.add_argument('--output', default=None, help='write the results as JSON here')


def _training_setup(name, kwargs, batch_size, img_size):
    """A fresh model (seed 0) in train mode, a batch, and its training step (forward, cross-entropy,
    backward, AdamW step)."""
    import torch
    import timm

    import structformer  # noqa: F401
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=img_size, num_classes=1000, **kwargs)
    images = torch.randn(batch_size, 3, img_size, img_size)
    targets = torch.randint(0, 1000, (batch_size,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step():
        loss = torch.nn.functional.cross_entropy(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    model.train()
    return model, images, train_step


def measure_one(name, kwargs, batch_size, img_size, steps, threads=0, compiled=False) -> dict:
    import time

    import torch
    if threads:
        torch.set_num_threads(threads)
    memory = PeakMemory('cpu')
    model, images, train_step = _training_setup(name, kwargs, batch_size, img_size)
    compile_s = None
    if compiled:
        model.compile()
        start = time.perf_counter()
        train_step()                                  # compiles the training graphs, then one more warm-up
        compile_s = time.perf_counter() - start
    train_s = median_seconds(train_step, steps, 2, 'cpu')
    peak = memory.growth_mib()
    model.eval()
    with torch.no_grad():
        if compiled:
            model(images)                             # eval mode and no_grad compile graphs of their own
        infer_s = median_seconds(lambda: model(images), steps, 2, 'cpu')
    return {'model': name, 'kwargs': kwargs, 'params': sum(p.numel() for p in model.parameters()),
            'mode': 'compiled' if compiled else 'eager', 'first_compiled_step_s': compile_s,
            'train_img_per_s': batch_size / train_s, 'infer_img_per_s': batch_size / infer_s,
            'train_peak_mib_over_baseline': peak, 'threads': torch.get_num_threads()}


def measure_paired(plan, batch_size, img_size, rounds, threads=0) -> dict:
    """Training steps of every planned model in one process, timed back to back (`paired_ratios`):
    {label: ratio stats} with each mode's ratios to ViT-T of that mode. `plan`: (label, model, kwargs,
    compiled) as `_plan` makes it."""
    import torch
    if threads:
        torch.set_num_threads(threads)
    steps = {}
    for label, name, kwargs, compiled in plan:
        model, _, train_step = _training_setup(name, kwargs, batch_size, img_size)
        if compiled:
            model.compile()
            train_step()                              # compiling happens here, not inside a timed round
        steps[label] = train_step
    result = {}
    for compiled in (False, True):
        group = {label: steps[label] for label, _, _, c in plan if c == compiled}
        reference = next((label for label, name, _, c in plan if c == compiled and name == CANDIDATES[0][1]), None)
        if group and reference:
            result.update(paired_ratios(group, reference, rounds))
    return result


def _measure_in_subprocess(name, kwargs, args, compiled) -> dict:
    try:
        return measure_in_subprocess('structformer.bench.models:measure_one', name, kwargs, args.batch_size,
                                     args.img_size, args.steps, args.threads, compiled)
    except MeasurementFailed as e:
        raise RuntimeError(f"measuring {name} {kwargs} ({'compiled' if compiled else 'eager'}) failed: {e}") from None


def _plan(args):
    """(label, model, kwargs, compiled) in the order measured and printed: eager rows, then compiled."""
    plan = []
    for mode in MODES:
        if mode in args.modes:
            plan += [(label if mode == 'eager' else f'{label}, compiled', name, kwargs, mode == 'compiled')
                     for label, name, kwargs, by_default in CANDIDATES
                     if mode == 'eager' or by_default or args.compile_all]
    return plan


def run(args) -> int:
    import torch
    for flag in ('batch_size', 'img_size', 'steps', 'rounds'):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.pairs < 0:
        raise ValueError(f"--pairs must be >= 0 (0 skips the paired timing), got {args.pairs}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = torch's default), got {args.threads}")
    if args.img_size % PATCH_SIZE:
        raise ValueError(f"--img-size must be a multiple of the patch size {PATCH_SIZE} (ViT-T and CRATE-T are "
                         f"patch16 models), got {args.img_size}")
    if args.threads:
        torch.set_num_threads(args.threads)              # so the environment record names the threads used
    best = {}
    plan = _plan(args)
    for round_index in range(args.rounds):
        for label, name, kwargs, compiled in plan:
            row = _measure_in_subprocess(name, kwargs, args, compiled)
            row['label'] = label
            if label in best:   # keep the fastest of the rounds, and the smallest memory growth
                row['train_img_per_s'] = max(row['train_img_per_s'], best[label]['train_img_per_s'])
                row['infer_img_per_s'] = max(row['infer_img_per_s'], best[label]['infer_img_per_s'])
                row['train_peak_mib_over_baseline'] = min(row['train_peak_mib_over_baseline'],
                                                          best[label]['train_peak_mib_over_baseline'])
            best[label] = row
            print(f"round {round_index + 1}/{args.rounds}: measured {label}", file=sys.stderr, flush=True)
    rows = [best[label] for label, _, _, _ in plan]
    paired = {}
    if args.pairs:
        paired = _measure_paired_in_subprocess(plan, args)
        print(f"paired: {args.pairs} rounds measured", file=sys.stderr, flush=True)
    env = environment('cpu')
    print(f"\nbatch {args.batch_size}, {args.img_size} px, {rows[0]['threads']} threads, best of {args.rounds} rounds, "
          f"{env['cpu']}, torch {env['torch']}")
    print("ratios: to ViT-T in the same mode (eager rows to eager ViT-T, compiled rows to compiled ViT-T)")
    width = max(24, *(len(r['label']) for r in rows))
    print(f"{'model':<{width}} {'params':>8} {'train img/s':>12} {'ratio':>6} {'infer img/s':>12} {'ratio':>6} "
          f"{'train peak MiB':>15} {'ratio':>6} {'compile s':>10}  paired train ratio (quartiles)")
    reference = {r['mode']: r for r in rows if r['model'] == CANDIDATES[0][1]}
    for r in rows:
        ref = reference.get(r['mode'], rows[0])
        r['train_ratio'] = r['train_img_per_s'] / ref['train_img_per_s']
        r['infer_ratio'] = r['infer_img_per_s'] / ref['infer_img_per_s']
        r['memory_ratio'] = r['train_peak_mib_over_baseline'] / max(ref['train_peak_mib_over_baseline'], 1e-9)
        compile_s = '' if r['first_compiled_step_s'] is None else f"{r['first_compiled_step_s']:.1f}"
        pair = paired.get(r['label'])
        r['paired_train'] = pair
        pair_text = f"  {pair['ratio']:.2f} ({pair['ratio_q1']:.2f}–{pair['ratio_q3']:.2f})" if pair else ''
        print(f"{r['label']:<{width}} {r['params'] / 1e6:>7.2f}M {r['train_img_per_s']:>12.2f} {r['train_ratio']:>6.2f} "
              f"{r['infer_img_per_s']:>12.2f} {r['infer_ratio']:>6.2f} {r['train_peak_mib_over_baseline']:>15.0f} "
              f"{r['memory_ratio']:>6.2f} {compile_s:>10}{pair_text}")
    verdict = goal(rows)
    if verdict:
        print(verdict)
    if args.output:
        write_json(args.output, {'batch_size': args.batch_size, 'img_size': args.img_size, 'environment': env,
                                 'pairs': args.pairs, 'rows': rows, 'goal': verdict})
    return 0


def _measure_paired_in_subprocess(plan, args) -> dict:
    try:
        return measure_in_subprocess('structformer.bench.models:measure_paired', plan, args.batch_size,
                                     args.img_size, args.pairs, args.threads)
    except MeasurementFailed as e:
        raise RuntimeError(f"the paired timing failed: {e}") from None


def goal(rows) -> str:
    """The CRATE-T goal (≥ 0.9× ViT-T's training speed, eager or compiled) judged on the paired ratios
    when they were taken (steadier on a drifting machine), else on the best-of-rounds ratios."""
    crate = [r for r in rows if r['model'] == CANDIDATES[1][1] and r['kwargs'] == CANDIDATES[1][2]]
    if not crate or not any(r['model'] == CANDIDATES[0][1] for r in rows):
        return ''
    source = 'paired' if all(r.get('paired_train') for r in crate) else 'best-of-rounds'
    measured = {r['mode']: r['paired_train']['ratio'] if source == 'paired' else r['train_ratio'] for r in crate}
    best = max(measured.values())
    found = ", ".join(f"{value:.3f}× {mode}" for mode, value in measured.items())   # 0.896 is not 0.90
    return (f"goal: CRATE-T trains at >= {GOAL_RATIO}x ViT-T's speed (eager or compiled): "
            f"{'met' if best >= GOAL_RATIO else 'not met'} ({source}: {found})")
