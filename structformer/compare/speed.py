"""What a row costs: parameters, FLOPs per image, training and inference speed, peak training memory.

Speed is measured on this machine, separately from training, so that accuracy cells can train on a busy machine
and the timings be taken again in a quiet window (`compare --measure-only`):

- `measure_paired` runs in ONE fresh process: every row's trained model (its first seed's cell), one batch of the
  training data (no augmentation), the recipe's optimiser, loss and precision; the training steps of all rows are
  timed back to back, round after round in a rotating order (`bench.harness.paired_ratios`), then the inference
  forwards the same way. A row's images/s is its median step; its ratio to the reference row (the ViT) is the
  median of the per-round ratios, which a machine whose speed drifts moves far less. The step is the model's own:
  Sparsifiner's teacher and the distillation terms are left out (they are a cost of its training recipe, not of
  the model).
- `measure_memory` runs in a fresh process per row: the growth of peak memory (VmHWM on a CPU, max allocated on
  CUDA) over the model-and-batch baseline during three training steps, as `bench models` reads it.
- `estimate` is the dry run's: one training step and one inference forward per row, timed after one warm-up, in
  this process, times the steps each remaining cell will take; in wall time, and in this process's CPU time per
  thread, which another process's load inflates far less (what a quiet machine would take, roughly).
The command wraps each phase in the load watch (`bench.load`), so a measurement taken while others used the cores
says BUSY.
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Tuple

RECIPE_KEYS = ('opt', 'lr', 'weight_decay', 'momentum', 'label_smoothing', 'amp', 'amp_dtype', 'clip_grad',
               'clip_mode')


def resolve_device(name: str):
    import torch
    if name in ('auto', None):
        return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    return torch.device(name)


def data_batch(data: str, batch: int, seed: int = 0, val_fraction: float = 0.2, device='cpu'):
    """The first `batch` training images and labels of `data` (digits or mnist:PATH), without augmentation: MNIST's
    built-in random shift is on by default, and SOFT's FLOPs (its Newton iterations stop at convergence) would be
    those of a random shift of the first image."""
    from torch.utils.data import default_collate

    from ..data import build_datasets
    train, _, info = build_datasets(data, seed=seed, val_fraction=val_fraction, augment=False)
    images, targets = default_collate([train[i] for i in range(min(batch, len(train)))])
    return images.to(device), targets.to(device), info


def step_functions(model, images, targets, recipe: Dict, device):
    """(training step, inference forward) of `model` on one batch, with the recipe's optimiser (timm's
    create_optimizer_v2, as the engine builds it), label smoothing, gradient clipping and precision."""
    import torch
    import torch.nn.functional as F
    from timm.optim import create_optimizer_v2

    from ..train.precision import Precision, clip_parameters
    precision = Precision.create(bool(recipe.get('amp')), recipe.get('amp_dtype'), torch.device(device))
    optimizer = create_optimizer_v2(model, opt=recipe.get('opt', 'adamw'), lr=recipe.get('lr', 1e-3),
                                    weight_decay=recipe.get('weight_decay', 0.05), momentum=recipe.get('momentum', 0.9))
    smoothing, clip = recipe.get('label_smoothing', 0.1), recipe.get('clip_grad')
    clip_mode = recipe.get('clip_mode') or 'norm'
    clipped = clip_parameters(model, clip_mode)

    def train_step():
        with precision.autocast():
            loss = F.cross_entropy(model(images), targets, label_smoothing=smoothing)
        optimizer.zero_grad(set_to_none=True)
        precision.backward(loss)
        precision.step(optimizer, clipped, clip, clip_mode)

    def infer_step():
        with torch.no_grad(), precision.autocast():
            model(images)

    return train_step, infer_step


def costs(model, sample) -> Dict:
    """Effective parameters (a masked layer counts what its mask keeps) and forward FLOPs of one image
    (FlopCounterMode: matmuls and convolutions, a multiply-add counted as 2)."""
    from ..bench.flops import forward_flops
    from ..models.inventory import effective_parameter_count
    flops, _ = forward_flops(model, sample[:1])
    return {'params': effective_parameter_count(model), 'flops_per_image': int(flops)}


def measure_paired(runs: Dict[str, str], data: str, batch: int, rounds: int, recipe: Dict, threads: int = 0,
                   device: str = 'auto', reference: Optional[str] = None) -> Dict:
    """{'train': {key: stats}, 'infer': {key: stats}} of every run's model, timed back to back (module docstring);
    stats as `paired_ratios` gives them plus images/s. Meant for a fresh process (`measure_in_subprocess`)."""
    import torch

    from ..bench.harness import paired_ratios
    from ..records import environment
    from ..train.checkpoint import load_model
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(device)
    images, targets, _ = data_batch(data, batch, val_fraction=recipe.get('val_fraction', 0.2), device=device)
    models, train_calls, infer_calls = {}, {}, {}
    for key, run in runs.items():
        models[key], _ = load_model(run, map_location=device)
        train_calls[key], infer_calls[key] = step_functions(models[key], images, targets, recipe, device)
    reference = reference if reference in runs else next(iter(runs))
    out = {}
    for phase, calls, training in (('train', train_calls, True), ('infer', infer_calls, False)):
        for model in models.values():
            model.train(training)
        stats = paired_ratios(calls, reference, rounds, warmup=2, device=device)
        for key, s in stats.items():
            s['img_per_s'] = images.shape[0] / s['median_s']
            s.pop('times_s', None)
        out[phase] = stats
    return {**out, 'reference': reference, 'batch_size': int(images.shape[0]), 'rounds': rounds,
            'environment': environment(device)}


def measure_memory(run: str, data: str, batch: int, recipe: Dict, threads: int = 0, device: str = 'auto',
                   steps: int = 3) -> Dict:
    """Peak training memory of one run's model (MiB over the model-and-batch baseline): a fresh process each."""
    import torch

    from ..bench.harness import PeakMemory
    from ..train.checkpoint import load_model
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(device)
    images, targets, _ = data_batch(data, batch, val_fraction=recipe.get('val_fraction', 0.2), device=device)
    model, _ = load_model(run, map_location=device)
    model.train()
    train_step, _ = step_functions(model, images, targets, recipe, device)
    memory = PeakMemory(device)
    for _ in range(steps):
        train_step()
    return {'peak_train_mib': memory.growth_mib(), 'memory_kind': 'cuda max allocated' if device.type == 'cuda'
            else 'process peak RSS (VmHWM)'}


def _one_step_seconds(fn, device) -> Tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call after one warm-up. On a busy machine the wall time
    grows with the others' load while the CPU time our threads needed stays near what a quiet machine takes."""
    from ..bench.harness import _synchroniser
    sync = _synchroniser(device)
    fn()
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def estimate(cells, data: str, recipe: Dict, device: str = 'auto') -> List[Dict]:
    """The dry run's time per row: one measured training step and inference forward of each row's model (built for
    the data, untrained), times the steps its cells still have to take (steps and evaluations only)."""
    import torch

    from ..models.factory import build_model
    from ..models.inventory import effective_parameter_count
    from .grid import cell_state, epochs_done
    device = resolve_device(device)
    threads = torch.get_num_threads() if device.type == 'cpu' else 1
    batch = int(recipe['batch_size'])
    images, targets, info = data_batch(data, batch, val_fraction=recipe.get('val_fraction', 0.2), device=device)
    from ..data import build_datasets
    train_set, val_set, _ = build_datasets(data, seed=0, val_fraction=recipe.get('val_fraction', 0.2))
    limit = int(recipe.get('limit_train_batches') or 0)
    batches = math.ceil(len(train_set) / batch) if not limit else min(limit, math.ceil(len(train_set) / batch))
    eval_batches = len(val_set) / batch
    first = {}
    for cell in cells:
        first.setdefault(cell.row.key, cell)
    timed: Dict[str, Dict] = {}
    for key, cell in first.items():
        cfg = cell.config
        transforms = list(cfg.transforms) + ([cfg.factorize_spec()] if cfg.factorize_spec() else [])
        torch.manual_seed(0)
        model, _ = build_model(cfg.model, dict(cfg.model_kwargs), info, transforms)
        model.to(device).train()
        train_step, infer_step = step_functions(model, images, targets, recipe, device)
        train_s, train_cpu = _one_step_seconds(train_step, device)
        model.eval()
        infer_s, infer_cpu = _one_step_seconds(infer_step, device)
        timed[key] = {'params': effective_parameter_count(model), 'train_step_s': train_s, 'infer_step_s': infer_s,
                      'train_cpu_s': train_cpu / threads,
                      'infer_cpu_s': infer_cpu / threads}
    rows = []
    for key, cell in first.items():
        t = timed[key]
        teacher = teacher_cpu = 0.0
        if cell.row.entry.teacher and cell.depends:
            teacher, teacher_cpu = (timed[cell.depends.row.key][k] for k in ('infer_step_s', 'infer_cpu_s'))
        epoch_s = batches * (t['train_step_s'] + teacher) + eval_batches * t['infer_step_s']
        epoch_cpu_s = batches * (t['train_cpu_s'] + teacher_cpu) + eval_batches * t['infer_cpu_s']
        remaining = 0
        for c in (c for c in cells if c.row.key == key):
            state = cell_state(c)
            if state in ('finished', 'diverged'):
                continue
            done = epochs_done(c) if state == 'partial' else 0
            if c.row.entry.pretrained and state == 'new':
                done = c.config.factorize_at          # its dense epochs are the dense cell's
            remaining += c.config.epochs - done
        rows.append({'key': key, 'params': t['params'], 'train_step_ms': 1e3 * t['train_step_s'], 'infer_step_ms': 1e3 * t['infer_step_s'],
                     'train_step_cpu_ms': 1e3 * t['train_cpu_s'], 'teacher_ms': 1e3 * teacher, 'epoch_s': epoch_s,
                     'epoch_cpu_s': epoch_cpu_s, 'remaining_epochs': remaining, 'remaining_s': remaining * epoch_s,
                     'remaining_cpu_s': remaining * epoch_cpu_s})
    return rows
