"""Where an eager training step's time goes on a GPU: the measurement behind "launch-bound" in docs/gpu.md.

For each model, one bfloat16 training step (224 px, batch 128, AdamW, as `structformer bench gpu` times it) under
torch.profiler after warm-up steps: the step's wall time, the time the GPU was busy with kernels (the sum of the
device operations' durations: an upper bound on busy time where they overlap, which one stream's do not), the number
of device operations (kernels, copies, memsets), and the ops with the most GPU time. A step whose kernels keep the
GPU busy for a small part of its wall time is bound by the host that launches them (`gpu_busy_share` well below 1).
Run on a lent GPU by tools/gpu_check.sh; writes `--output` (JSON). On a CPU it runs at a tiny size with CPU
activities only (no kernels: the GPU columns are 0), which is how the default suite checks it.

    python3 tools/gpu_profile.py --output $OUT/profile.json
"""
import argparse
import platform
import sys
import time

import torch
import torch.nn.functional as F

import structformer  # noqa: F401  (registers the models)
from structformer.models.factory import build_model
from structformer.records import write_json

MODELS = [('ViT-T', 'vit_tiny_patch16_224'), ('CRATE-T', 'crate_tiny_patch16_224'), ('SOFT-T', 'soft_tiny_224')]
TOP = 12


def _device_events(profile) -> list:
    """The profiler's device-side events (kernels, copies and memsets on the GPU; none on a CPU)."""
    from torch.autograd import DeviceType
    return [e for e in profile.events() if e.device_type == DeviceType.CUDA]


def profile_step(name: str, side: int, batch: int, device) -> dict:
    from timm.optim import create_optimizer_v2
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    model, _ = build_model(name, dict(img_size=side, num_classes=1000), None, [])
    model.to(device).train()
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-4, weight_decay=0.05)
    images = torch.randn(batch, 3, side, side, device=device)
    targets = torch.randint(0, 1000, (batch,), device=device)
    cuda = device.type == 'cuda'
    dtype = torch.bfloat16

    def step():
        with torch.autocast(device.type, dtype=dtype):
            loss = F.cross_entropy(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(3):                                       # warm-up: allocator, cuBLAS handles, autotuning
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - start
    on_device = _device_events(prof)
    busy_us = sum(e.time_range.elapsed_us() for e in on_device)
    key = 'self_device_time_total' if cuda else 'self_cpu_time_total'
    table = sorted(prof.key_averages(), key=lambda a: getattr(a, key, 0), reverse=True)[:TOP]
    return {'wall_ms': wall * 1e3, 'gpu_busy_ms': busy_us / 1e3, 'gpu_busy_share': busy_us / 1e3 / (wall * 1e3),
            'device_ops': len(on_device),
            'kernels': sum(1 for e in on_device if getattr(e, 'activity_type', 'kernel') == 'kernel'),
            'top_ops': [{'op': a.key, 'calls': a.count, 'self_ms': getattr(a, key, 0) / 1e3} for a in table]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--output', required=True)
    p.add_argument('--budget-s', type=float, default=40.0, help='start no new model after this many seconds')
    args = p.parse_args(argv)
    if not args.budget_s > 0:
        p.error(f'--budget-s must be > 0, got {args.budget_s}')
    cuda = torch.cuda.is_available()
    device = torch.device('cuda' if cuda else 'cpu')
    side, batch = (224, 128) if cuda else (32, 2)
    start = time.perf_counter()
    record = {'command': 'python3 tools/gpu_profile.py ' + ' '.join(sys.argv[1:] if argv is None else argv),
              'device': torch.cuda.get_device_name() if cuda else platform.processor() or 'cpu',
              'torch': torch.__version__, 'batch_size': batch, 'img_size': side, 'dtype': 'bfloat16',
              'models': {}, 'errors': []}
    for label, name in MODELS:
        if time.perf_counter() - start > args.budget_s:
            record['errors'].append(f'{label}: not run (budget)')
            continue
        try:
            row = profile_step(name, side, batch, device)
            record['models'][label] = row
            print(f"{label}: step {row['wall_ms']:.1f} ms, kernels busy {row['gpu_busy_ms']:.1f} ms "
                  f"({row['gpu_busy_share']:.0%}), {row['device_ops']} device operations", flush=True)
        except Exception as e:                                  # one model's failure must not lose the rest
            record['errors'].append(f'{label}: {type(e).__name__}: {str(e)[:200]}')
        if cuda:
            torch.cuda.empty_cache()
        write_json(args.output, record)
    record['wall_s'] = time.perf_counter() - start
    write_json(args.output, record)
    return 0 if record['models'] else 1


if __name__ == '__main__':
    sys.exit(main())
