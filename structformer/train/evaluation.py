"""Held-out metrics of a model, and a digest of its parameters (the engine's evaluation and its check that
processes trained the same weights)."""
import contextlib
import hashlib
import math
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from .distributed import all_reduce_sum
from .precision import Precision, low_precision_failure


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device, precision: Optional[Precision] = None,
             distributed: bool = False, per_class: bool = False) -> Dict[str, float]:
    """Mean cross-entropy, top-1 and top-5 accuracy (%) over a loader; for a language model (logits
    [B, T, V]) per token, with the perplexity exp(loss) added. `precision`: evaluate under the run's
    autocast (as timm's validate does); `distributed`: each process holds a disjoint part of the data and the
    counts are summed over all of them, so every process returns the exact global metrics. A sample whose target
    is negative (data/imagefolder.py's LEFT_OUT: unreadable under bad_images=skip) is counted nowhere; 'left_out'
    says how many, if any. `per_class`: also 'per_class_images' and 'per_class_top1_hits', lists indexed by the
    true class (one process)."""
    model.eval()
    total, loss_sum, top1_hits, top5_hits, lm, left_out = 0, 0.0, 0, 0, False, 0
    class_images = class_hits = None
    for images, targets in loader:
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        try:
            with precision.autocast() if precision is not None else contextlib.nullcontext():
                logits = model(images)
        except (RuntimeError, NotImplementedError) as e:      # no kernel in the autocast dtype: one line
            low = low_precision_failure(e, precision)
            if low is None:
                raise
            raise low from None
        logits = logits.float()
        if logits.dim() == 3:                        # next-token prediction: every position is a sample
            lm, logits, targets = True, logits.flatten(0, 1), targets.flatten()
        counted = targets >= 0                       # LEFT_OUT (-1): an unreadable held-out image (bad_images=skip)
        if not bool(counted.all()):
            left_out += int((~counted).sum())
            logits, targets = logits[counted], targets[counted]
        # whole counts, not per-batch float32 percentages: the result does not depend on the batch size
        hits = logits.topk(min(5, logits.shape[-1]), dim=-1).indices == targets[:, None]
        top1_hits += int(hits[:, 0].sum())
        if per_class:
            n = logits.shape[-1]
            images = torch.bincount(targets.cpu(), minlength=n)
            right = torch.bincount(targets.cpu(), weights=hits[:, 0].cpu().double(), minlength=n)
            class_images = images if class_images is None else class_images + images
            class_hits = right if class_hits is None else class_hits + right
        top5_hits += int(hits.any(dim=-1).sum())
        loss_sum += F.cross_entropy(logits, targets, reduction='sum').item()
        total += targets.shape[0]
    if distributed:
        total, top1_hits, top5_hits, loss_sum, lm, left_out = all_reduce_sum(
            [total, top1_hits, top5_hits, loss_sum, int(lm), left_out])
        lm = bool(lm)
    metrics = {'loss': loss_sum / total, 'top1': 100.0 * top1_hits / total, 'top5': 100.0 * top5_hits / total}
    if lm:
        metrics['perplexity'] = math.exp(min(metrics['loss'], 700.0))
    if left_out:                                     # said only where it happened: the record of a clean run is as it was
        metrics['left_out'] = left_out
    if per_class and class_images is not None:
        metrics['per_class_images'] = [int(v) for v in class_images]
        metrics['per_class_top1_hits'] = [int(v) for v in class_hits]
    return metrics


def parameter_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
