"""A short account of how a state dict differs from a model's: shared by checkpoints (train/), pretrained
filters and converters (weights/), so a mismatch reads the same wherever weights are loaded."""
from typing import Dict

import torch


def describe_mismatch(expected: Dict[str, torch.Tensor], weights: Dict[str, torch.Tensor], show: int = 3) -> str:
    """'' if `weights` fit a model with state dict `expected`, else a short account: counts of missing,
    unexpected and wrongly shaped tensors with the first few names (not thousands of keys)."""
    def names(keys):
        keys = sorted(keys)
        return ', '.join(keys[:show]) + (f', ... ({len(keys)} in all)' if len(keys) > show else '')
    missing = set(expected) - set(weights)
    unexpected = set(weights) - set(expected)
    shapes = {k for k in set(expected) & set(weights) if tuple(expected[k].shape) != tuple(weights[k].shape)}
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing ({names(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({names(unexpected)})")
    if shapes:
        k = sorted(shapes)[0]
        parts.append(f"{len(shapes)} of another shape (e.g. {k}: {list(weights[k].shape)} vs {list(expected[k].shape)})")
    return '; '.join(parts)
