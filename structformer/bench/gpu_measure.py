"""The measurements of `structformer bench gpu` (bench/gpu.py), run in a worker process that streams its rows.

`main(payload)` takes a list of items, each a section and its settings, measures them in order and prints one
line per row, `@@row {json}`, as soon as it is measured, so the parent keeps every row taken before a time
budget ran out or a compile hung (it kills the worker then). An item whose soft deadline has passed is not
started: its row says `not timed` and why. A CUDA out-of-memory error is a row (`oom`), any other failure a row
with its first line (`error`); the worker goes on with the next item.

Four sections, every one under the autocast `dtype` with float32 weights (as `structformer train --amp` runs):
- `pairs`: a goal's two models (CRATE-T and ViT-T; factorised and dense ViT-S), their training steps timed back to
  back round by round in one process, the median per-round speed ratio and its quartiles;
- `models`: a training step (forward, cross-entropy, backward, timm's AdamW step) of a model built by
  `models.factory.build_model` (transforms applied), images/s = batch / median step time, and the peak memory
  allocated over the whole step (weights, optimiser state and activations);
- `attention`: one attention layer as `bench attention` builds it (`attention.build_layer`, SOFT-Tiny stage-1
  widths), forward time (eval, no_grad), forward + backward time and its peak memory;
- `sparse`: one Sparsifiner path against dense SDPA, paired round by round (`sparse_attention.measure`, the
  realised key density beside it); compiled, the layer and timm's dense twin are both compiled.

Timers are `harness.median_seconds` / `harness.paired_ratios` (synchronised on CUDA); memory is
`harness.PeakMemory` (max_memory_allocated on CUDA, the resident set on a CPU).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time

from .harness import PeakMemory, median_seconds, paired_ratios

ROW_PREFIX = '@@row '
GIB = 2 ** 30


def emit(row: dict) -> None:
    print(ROW_PREFIX + json.dumps(row), flush=True)


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def _release(device) -> None:
    gc.collect()
    if str(device).startswith('cuda'):
        import torch
        torch.cuda.empty_cache()


def _precision(dtype: str, device):
    from ..train.precision import Precision
    return Precision.create(dtype != 'float32', None if dtype == 'float32' else dtype, device)


def _compile(module, backend: str, mode=None):
    """torch.compile from a clean cache: the models of one worker share forward code (every timm ViT's), and
    their graphs must not count towards dynamo's recompile limit. `mode` (inductor's; None for other backends)
    as `attention_compile_mode` gives it."""
    import torch
    torch._dynamo.reset()
    return torch.compile(module, backend=backend, mode=mode)


def attention_compile_mode(device_type: str, backend: str):
    """The compiled attention rows on a GPU replay CUDA graphs ('reduce-overhead'): SOFT's eager forward is bound by
    its ~220 kernel launches (the Newton–Schulz loop stays one opaque op under plain compile, launching as before),
    and a graph replay is what removes them. Elsewhere none."""
    return 'reduce-overhead' if device_type == 'cuda' and backend == 'inductor' else None


# ---- models ---------------------------------------------------------------------------------------------

def training_setup(name: str, side: int, batch: int, device, kwargs=None, transforms=()) -> tuple:
    """(model, optimizer, images, targets) of one training step as every GPU measurement takes it (this bench, the
    check's probes tools/gpu_tf32.py and tools/gpu_profile.py): seed 0, the model built by `build_model` with
    1,000 classes (transforms applied) in train mode on `device`, timm's AdamW as the engine makes it, and a
    random batch of `batch` images of `side` px with their labels."""
    import torch
    from timm.optim import create_optimizer_v2

    from ..models.factory import build_model
    torch.manual_seed(0)
    model, _ = build_model(name, dict(kwargs or {}, img_size=side, num_classes=1000), None, list(transforms))
    model.to(device).train()
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-4, weight_decay=0.05)
    images = torch.randn(batch, 3, side, side, device=device)
    targets = torch.randint(0, 1000, (batch,), device=device)
    return model, optimizer, images, targets


def _training_step(runner, model, optimizer, images, targets, precision):
    """One training step as the engine takes it: autocast forward, cross-entropy, backward, the optimiser's step."""
    import torch.nn.functional as F

    def step():
        with precision.autocast():
            loss = F.cross_entropy(runner(images), targets)
        optimizer.zero_grad(set_to_none=True)
        precision.backward(loss)
        precision.step(optimizer, model.parameters(), None)
    return step


def measure_model(item: dict, settings: dict) -> dict:
    """images/s and peak memory of one model's training step (eager, or compiled: the first step's time,
    compiling included, is `compile_s`)."""
    import torch

    device = torch.device(settings['device'])
    batch, side = settings['batch_size'], settings['img_size']
    precision = _precision(settings['dtype'], device)
    memory = PeakMemory(device)
    model, optimizer, images, targets = training_setup(item['model'], side, batch, device, item['kwargs'],
                                                       item['transforms'])
    runner = _compile(model, settings['compile_backend']) if item['mode'] == 'compiled' else model
    step = _training_step(runner, model, optimizer, images, targets, precision)
    compile_s = None
    if item['mode'] == 'compiled':
        start = time.perf_counter()
        step()
        if device.type == 'cuda':
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
    seconds = median_seconds(step, settings['steps'], settings['warmup'], device)
    return {'params': sum(p.numel() for p in model.parameters()), 'step_ms': seconds * 1e3,
            'train_img_per_s': batch / seconds, 'peak_gib': memory.peak_mib() / 1024, 'compile_s': compile_s}


def measure_pair(item: dict, settings: dict) -> dict:
    """A goal's two models (eager) in one process, their training steps timed back to back round by round
    (`harness.paired_ratios`, order rotated): `ratio` is the median per-round time(reference) / time(subject),
    i.e. the subject's images/s over the reference's, with its quartiles. The `models` rows time each model in turn
    over a few steps, so a host whose speed moves between them moves their ratio (two H200 hosts gave CRATE-T /
    ViT-T 0.87x and 1.04x on 2026-11-27); a pair sees the same host within each round."""
    import torch

    device = torch.device(settings['device'])
    steps = {}
    for role in ('subject', 'reference'):
        spec = item[role]
        model, optimizer, images, targets = training_setup(spec['model'], settings['img_size'],
                                                           settings['batch_size'], device, spec['kwargs'],
                                                           spec['transforms'])
        precision = _precision(settings['dtype'], device)        # each model its own (a float16 loss scaler)
        steps[role] = _training_step(model, model, optimizer, images, targets, precision)
    paired = paired_ratios(steps, 'reference', settings['pair_rounds'], settings['warmup'], device)
    got = paired['subject']
    return {'ratio': got['ratio'], 'ratio_q1': got['ratio_q1'], 'ratio_q3': got['ratio_q3'],
            'rounds': got['rounds'], 'subject_ms': got['median_s'] * 1e3,
            'reference_ms': paired['reference']['median_s'] * 1e3}


# ---- attention alone: SOFT / SOFT++ against SDPA ------------------------------------------------------------

def measure_attention(item: dict, settings: dict) -> dict:
    """Forward (eval, no_grad) and forward + backward times of one attention layer at one grid, and the peak
    memory of forward + backward over the layer-and-input baseline."""
    import torch

    from .attention import build_layer
    device = torch.device(settings['device'])
    precision = _precision(settings['dtype'], device)
    grid = tuple(item['grid'])
    n = grid[0] * grid[1]
    torch.manual_seed(0)
    layer = build_layer(item['attention'], settings['attention_dim'], settings['attention_heads'],
                        settings['attention_landmarks'], grid, device)
    x = torch.randn(settings['attention_batch'], n, settings['attention_dim'], device=device, requires_grad=True)
    mode = attention_compile_mode(device.type, settings['compile_backend'])
    runner = _compile(layer, settings['compile_backend'], mode) if item['mode'] == 'compiled' else layer

    def forward():
        with torch.no_grad(), precision.autocast():
            runner(x, grid_size=grid)

    def forward_backward():
        with precision.autocast():
            out = runner(x, grid_size=grid)
        out.float().sum().backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None

    row = {'tokens': n}
    if item['mode'] == 'compiled' and mode:
        row['compile_mode'] = mode
    compile_s = None
    start = time.perf_counter()
    layer.eval()
    forward()                                   # compiles the inference graph (compiled mode)
    if device.type == 'cuda':
        torch.cuda.synchronize()
    if item['mode'] == 'compiled':
        compile_s = time.perf_counter() - start
    try:
        row['forward_ms'] = median_seconds(forward, settings['repeats'], settings['warmup'], device) * 1e3
    except torch.cuda.OutOfMemoryError as e:
        return dict(row, status='oom', note=f"forward: {_first_line(e)}")
    _release(device)
    layer.train()
    memory = PeakMemory(device)
    try:
        forward_backward()
        row['peak_mib'] = memory.growth_mib()
        row['forward_backward_ms'] = median_seconds(forward_backward, settings['repeats'],
                                                    max(settings['warmup'] - 1, 0), device) * 1e3
    except torch.cuda.OutOfMemoryError as e:
        row.update(status='oom', note=f"forward + backward: {_first_line(e)} (the forward alone ran)")
    return dict(row, compile_s=compile_s)


# ---- Sparsifiner paths against SDPA ---------------------------------------------------------------------

def _sparse_args(item: dict, settings: dict):
    return argparse.Namespace(tokens=[item['tokens']], keep=[item['keep']], paths=[item['path']], dim=384, heads=6,
                              block_size=64, batch=settings['sparse_batch'], threads=0, device=settings['device'],
                              dtype=settings['dtype'], train=False, repeats=settings['repeats'],
                              warmup=settings['warmup'], max_gib=settings['sparse_max_gib'])


def measure_sparse(item: dict, settings: dict) -> list:
    """Eager: `sparse_attention.measure` for one (n, keep, path): the path's row (its time against dense SDPA,
    paired, and the realised key density), the dense row, and on CUDA the attention-alone rows of the tile paths.
    Compiled: the layer on this path and timm's dense Attention with the same weights, both compiled, paired."""
    if item['mode'] == 'eager':
        from .sparse_attention import measure
        return measure(_sparse_args(item, settings))
    return [_measure_sparse_compiled(item, settings)]


def _measure_sparse_compiled(item: dict, settings: dict) -> dict:
    import torch

    from ..layers.attention.sparsifiner import SparsifinerAttention
    from ..functional.sparsifiner import budget
    from .sparse_attention import (BLOCK_TILE_PATHS, _block_forward, _configure, _dense_twin, _gib, _layer_flops,
                                   _timer)
    device, dtype = torch.device(settings['device']), getattr(torch, settings['dtype'])
    n, path, backend = item['tokens'], item['path'], settings['compile_backend']
    need = _gib(path, n, budget(n, item['keep']), _sparse_args(item, settings))
    if need > settings['sparse_max_gib']:       # as the eager rows: not attempted (a compile would be wasted)
        return {'tokens': n, 'keep': item['keep'], 'path': path, 'ms': None,
                'note': f"skipped: ~{need:.1f} GiB > {settings['sparse_max_gib']:g}"}
    torch.manual_seed(0)
    layer = SparsifinerAttention(384, 6, qkv_bias=True, seq_len=n, block_size=64, basis_init='scaled')
    dense = _dense_twin(layer)
    layer, dense = layer.to(device, dtype).eval(), dense.to(device, dtype).eval()
    _configure(layer, path, item['keep'])
    x = torch.randn(settings['sparse_batch'], n, 384, device=device, dtype=dtype)
    fn = _block_forward(layer, layer.impl) if path in BLOCK_TILE_PATHS else layer
    compiled, compiled_dense = _compile(fn, backend), torch.compile(dense, backend=backend)
    start = time.perf_counter()
    with torch.no_grad():
        compiled(x)
        compiled_dense(x)
    compile_s = time.perf_counter() - start
    paired = paired_ratios({'dense SDPA': _timer(compiled_dense, x, False, dense), path: _timer(compiled, x, False,
                                                                                                 layer)},
                           'dense SDPA', settings['repeats'], settings['warmup'], device)
    flops = _layer_flops(layer, x[:1], path)
    return {'tokens': n, 'keep': item['keep'], 'path': path, 'ms': paired[path]['median_s'] * 1e3,
            'dense_ms': paired['dense SDPA']['median_s'] * 1e3, 'vs_dense': 1 / paired[path]['ratio'],
            'density': flops['nnz'] / (n * n), 'compile_s': compile_s, 'note': 'both compiled'}


# ---- the worker ---------------------------------------------------------------------------------------------

MEASURE = {'pairs': measure_pair, 'models': measure_model, 'attention': measure_attention,
           'sparse': measure_sparse}


def _rows_of(item: dict, settings: dict) -> list:
    import torch
    base = {k: v for k, v in item.items() if k != 'deadline'}
    if time.time() > item['deadline']:
        return [dict(base, status='not timed', note="its section's share of --budget-s had run out")]
    try:
        got = MEASURE[item['section']](item, settings)
    except torch.cuda.OutOfMemoryError as e:
        return [dict(base, status='oom', note=_first_line(e))]
    except Exception as e:                      # one row's failure is its row; the sweep goes on
        return [dict(base, status='error', note=_first_line(e))]
    finally:
        _release(settings['device'])
    rows = got if isinstance(got, list) else [got]
    return [dict(base, **{'status': 'ok', **row}) for row in rows]


def main(payload: dict) -> None:
    import torch

    import structformer  # noqa: F401  (registers the models and attentions)
    settings = payload['settings']
    if settings['device'] == 'cpu' and settings.get('threads'):
        torch.set_num_threads(settings['threads'])
    for item in payload['items']:
        for row in _rows_of(item, settings):
            emit(row)


if __name__ == '__main__':
    main(json.loads(sys.argv[1]))
