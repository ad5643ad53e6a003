"""`structformer bench models`: CRATE-T against timm's ViT-T at the same input size.

Each model is measured in its own subprocess, so the peak resident memory of one does not hide the
other's. Reported: training images/s (forward + backward + AdamW step), inference images/s (eval,
no_grad), each the median step after 2 warm-up steps, and the growth of peak memory over the
model-and-batch baseline during training, with ratios to ViT-T computed from numbers taken in this
one run. Subprocess, timer, memory reader and writers are the shared ones of `harness.py`.
"""
from __future__ import annotations

import sys

from .harness import MeasurementFailed, PeakMemory, environment, measure_in_subprocess, median_seconds, write_json

CANDIDATES = [
    # (label, model name, model kwargs)
    ('ViT-T (timm)', 'vit_tiny_patch16_224', {}),
    ('CRATE-T fused ISTA', 'crate_tiny_patch16_224', {}),
    ('CRATE-T reference ISTA', 'crate_tiny_patch16_224', {'fused_ista': False}),
]


def add_model_bench_arguments(p):
    p.add_argument('--batch-size', type=int, default=16)
    p.add_argument('--img-size', type=int, default=224)
    p.add_argument('--steps', type=int, default=5, help='timed steps per measurement (after 2 warm-up steps)')
    p.add_argument('--rounds', type=int, default=2,
                   help='measure every model this many times, interleaved, and keep each one\'s best '
                        '(so a burst of load on a shared machine does not decide the ratio)')
    p.add_argument('--threads', type=int, default=0, help='torch threads (0 = torch default)')
    p.add_argument('--output', default=None, help='write the results as JSON here')


def measure_one(name, kwargs, batch_size, img_size, steps, threads=0) -> dict:
    import torch
    import timm

    import structformer  # noqa: F401
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=img_size, num_classes=1000, **kwargs)
    images = torch.randn(batch_size, 3, img_size, img_size)
    targets = torch.randint(0, 1000, (batch_size,))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    memory = PeakMemory('cpu')

    def train_step():
        loss = torch.nn.functional.cross_entropy(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    model.train()
    train_s = median_seconds(train_step, steps, 2, 'cpu')
    peak = memory.growth_mib()
    model.eval()
    with torch.no_grad():
        infer_s = median_seconds(lambda: model(images), steps, 2, 'cpu')
    return {'model': name, 'kwargs': kwargs, 'params': sum(p.numel() for p in model.parameters()),
            'train_img_per_s': batch_size / train_s, 'infer_img_per_s': batch_size / infer_s,
            'train_peak_mib_over_baseline': peak, 'threads': torch.get_num_threads()}


def _measure_in_subprocess(name, kwargs, args) -> dict:
    try:
        return measure_in_subprocess('structformer.bench.models:measure_one', name, kwargs, args.batch_size,
                                     args.img_size, args.steps, args.threads)
    except MeasurementFailed as e:
        raise RuntimeError(f"measuring {name} {kwargs} failed: {e}") from None


def run_model_bench(args) -> int:
    import torch
    for flag in ('batch_size', 'img_size', 'steps', 'rounds'):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)              # so the environment record names the threads used
    best = {}
    for round_index in range(args.rounds):
        for label, name, kwargs in CANDIDATES:
            row = _measure_in_subprocess(name, kwargs, args)
            row['label'] = label
            if label in best:   # keep the fastest of the rounds, and the smallest memory growth
                row['train_img_per_s'] = max(row['train_img_per_s'], best[label]['train_img_per_s'])
                row['infer_img_per_s'] = max(row['infer_img_per_s'], best[label]['infer_img_per_s'])
                row['train_peak_mib_over_baseline'] = min(row['train_peak_mib_over_baseline'],
                                                          best[label]['train_peak_mib_over_baseline'])
            best[label] = row
            print(f"round {round_index + 1}/{args.rounds}: measured {label}", file=sys.stderr, flush=True)
    rows = [best[label] for label, _, _ in CANDIDATES]
    ref = rows[0]
    env = environment('cpu')
    print(f"\nbatch {args.batch_size}, {args.img_size} px, {rows[0]['threads']} threads, best of {args.rounds} rounds, "
          f"{env['cpu']}, torch {env['torch']}")
    print(f"{'model':<24} {'params':>8} {'train img/s':>12} {'ratio':>6} {'infer img/s':>12} {'ratio':>6} "
          f"{'train peak MiB':>15} {'ratio':>6}")
    for r in rows:
        r['train_ratio'] = r['train_img_per_s'] / ref['train_img_per_s']
        r['infer_ratio'] = r['infer_img_per_s'] / ref['infer_img_per_s']
        r['memory_ratio'] = r['train_peak_mib_over_baseline'] / max(ref['train_peak_mib_over_baseline'], 1e-9)
        print(f"{r['label']:<24} {r['params'] / 1e6:>7.2f}M {r['train_img_per_s']:>12.2f} {r['train_ratio']:>6.2f} "
              f"{r['infer_img_per_s']:>12.2f} {r['infer_ratio']:>6.2f} {r['train_peak_mib_over_baseline']:>15.0f} "
              f"{r['memory_ratio']:>6.2f}")
    if args.output:
        write_json(args.output, {'batch_size': args.batch_size, 'img_size': args.img_size, 'environment': env,
                                 'rows': rows})
    return 0
