"""Mixup / CutMix (timm.data.Mixup) for the training loop, and the soft-target cross-entropy that goes with it.

timm's Mixup mixes a batch and turns the labels into soft targets with the label smoothing folded in, so the
`ce` loss term then takes `timm.loss.SoftTargetCrossEntropy` (train/phases.py). Its draws come from numpy's
global RNG in the training process, which every checkpoint saves, so a resumed run mixes as the uninterrupted
one. timm drops the last, smaller batch of an epoch when mixing (pairs need an even batch); so do we.
"""
from typing import Optional

from ..errors import UsageError


def build_mixup(config, num_classes: int, language_model: bool = False):
    """timm's Mixup for the run's settings, or None when neither Mixup nor CutMix is on."""
    if not (config.mixup > 0 or config.cutmix > 0 or config.cutmix_minmax is not None):
        return None
    if language_model:
        raise UsageError("--mixup / --cutmix mix images; --data is a language-modelling set (token ids)")
    if config.batch_size % 2:
        raise UsageError(f"--mixup / --cutmix need an even -b/--batch-size (they mix each image with another of "
                         f"the batch); got {config.batch_size}")
    from timm.data import Mixup
    return Mixup(mixup_alpha=config.mixup, cutmix_alpha=config.cutmix, cutmix_minmax=config.cutmix_minmax,
                 prob=config.mixup_prob, switch_prob=config.mixup_switch_prob, mode=config.mixup_mode,
                 label_smoothing=config.label_smoothing, num_classes=num_classes)


def mixing_active(mixup, config, epoch: int) -> bool:
    """timm's --mixup-off-epoch E: the first E epochs are mixed, the later ones not (targets stay soft). `epoch`
    counts from 1 here; timm's train.py counts from 0 and stops mixing at its epoch E (`epoch >= E`), which is
    our epoch E + 1."""
    return mixup is not None and not (config.mixup_off_epoch and epoch > config.mixup_off_epoch)


def hard_labels(targets):
    """Class indices from hard or soft targets (for the running train accuracy)."""
    return targets.argmax(-1) if targets.is_floating_point() else targets
