"""`structformer bench models`: CRATE-T against timm's ViT-T at the same input size.

Each model is measured in its own subprocess, so peak resident memory (ru_maxrss) of one does not
hide the other's. Reported: training images/s (forward + backward + AdamW step), inference
images/s (eval, no_grad) and the growth of peak memory over the model-and-batch baseline during
training, with ratios to ViT-T computed from numbers taken in this one run.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time


from ._subprocess import MeasurementFailed, python_json

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


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0   # Linux reports KiB


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
    baseline = _maxrss_mib()

    def train_step():
        loss = torch.nn.functional.cross_entropy(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    model.train()
    for _ in range(2):
        train_step()
    start = time.perf_counter()
    for _ in range(steps):
        train_step()
    train_s = (time.perf_counter() - start) / steps
    peak = _maxrss_mib()
    model.eval()
    with torch.no_grad():
        for _ in range(2):
            model(images)
        start = time.perf_counter()
        for _ in range(steps):
            model(images)
        infer_s = (time.perf_counter() - start) / steps
    return {'model': name, 'kwargs': kwargs, 'params': sum(p.numel() for p in model.parameters()),
            'train_img_per_s': batch_size / train_s, 'infer_img_per_s': batch_size / infer_s,
            'train_peak_mib_over_baseline': peak - baseline, 'threads': torch.get_num_threads()}


def _measure_in_subprocess(name, kwargs, args) -> dict:
    call = (f"import json; from structformer.bench.models import measure_one; "
            f"print(json.dumps(measure_one({name!r}, {kwargs!r}, {args.batch_size}, {args.img_size}, "
            f"{args.steps}, {args.threads})))")
    try:
        return python_json(call)
    except MeasurementFailed as e:
        raise RuntimeError(f"measuring {name} {kwargs} failed: {e}") from None


def run_model_bench(args) -> int:
    import torch
    for flag in ('batch_size', 'img_size', 'steps', 'rounds'):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
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
    print(f"\nbatch {args.batch_size}, {args.img_size} px, {rows[0]['threads']} threads, best of {args.rounds} rounds, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
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
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, 'w') as f:
            json.dump({'batch_size': args.batch_size, 'img_size': args.img_size, 'rows': rows}, f, indent=1)
    return 0
