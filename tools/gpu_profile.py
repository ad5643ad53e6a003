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
import sys
import time

import torch
import torch.nn.functional as F

import structformer  # noqa: F401  (registers the models)
from structformer.bench.gpu_measure import training_setup
from structformer.bench.probes import probe_arguments, probe_device, probe_record, run_parts

MODELS = [('ViT-T', 'vit_tiny_patch16_224'), ('CRATE-T', 'crate_tiny_patch16_224'), ('SOFT-T', 'soft_tiny_224')]
TOP = 12


def _device_events(profile) -> list:
    """The profiler's device-side events (kernels, copies and memsets on the GPU; none on a CPU)."""
    from torch.autograd import DeviceType
    return [e for e in profile.events() if e.device_type == DeviceType.CUDA]


def profile_step(name: str, side: int, batch: int, device) -> dict:
    from torch.profiler import ProfilerActivity, profile
    model, optimizer, images, targets = training_setup(name, side, batch, device)
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


def _line(label: str):
    return lambda row: (f"{label}: step {row['wall_ms']:.1f} ms, kernels busy {row['gpu_busy_ms']:.1f} ms "
                        f"({row['gpu_busy_share']:.0%}), {row['device_ops']} device operations")


def main(argv=None) -> int:
    args = probe_arguments(__doc__.splitlines()[0], 40.0, argv)
    device = probe_device()
    side, batch = (224, 128) if device.type == 'cuda' else (32, 2)
    record = probe_record('tools/gpu_profile.py', argv, device, ['models'], batch_size=batch, img_size=side,
                          dtype='bfloat16')
    parts = [('models', label, lambda n=name: profile_step(n, side, batch, device), _line(label))
             for label, name in MODELS]
    return run_parts(record, parts, args.budget_s, args.output, device)

if __name__ == '__main__':
    sys.exit(main())
