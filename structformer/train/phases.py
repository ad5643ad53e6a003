"""Training phases: which parameters train, and which loss terms apply, for a span of epochs.

A phase is a dict in the config's `phases` list, e.g. (two-stage schedules of Sparsifiner §4):
    - {name: predictor, epochs: 5, trainable: ['*.predictor.*'], losses: {attn_distill: 1.0}}
    - {name: joint, epochs: 40, losses: {ce: 1.0, distill_kl: 0.5}}
`trainable` / `frozen` are fnmatch patterns over parameter names; a phase without `trainable`
trains everything not `frozen`. Without phases, one phase `main` trains all epochs on `ce`.
Loss terms are looked up in `LOSS_TERMS`, which later issues extend (distillation, decay terms).
"""
import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from ..functional.precision import upcast


@dataclass
class LossContext:
    """What a loss term may look at for one batch."""
    model: torch.nn.Module
    images: torch.Tensor
    targets: torch.Tensor
    logits: torch.Tensor
    label_smoothing: float = 0.0
    extras: Dict[str, object] = field(default_factory=dict)

    def __post_init__(self):
        # the losses read the logits in float32 (docs/precision.md): CUDA autocast runs (log_)softmax in float32, CPU
        # autocast leaves it in bfloat16, where timm's SoftTargetCrossEntropy (Mixup) and the distillation KL take
        # the log of 8-bit probabilities; near the teacher that KL came out negative. B x classes: a cheap cast.
        self.logits = upcast(self.logits)


LOSS_TERMS: Dict[str, Callable[[LossContext], torch.Tensor]] = {}


def register_loss_term(name: str):
    def wrap(fn):
        LOSS_TERMS[name] = fn
        return fn
    return wrap


@register_loss_term('ce')
def cross_entropy_term(ctx: LossContext) -> torch.Tensor:
    """Cross-entropy with label smoothing (the recipes of CRATE and SOFT both smooth by 0.1); per token
    for a language model's logits [B, T, V] with targets [B, T]. Soft targets [B, classes] (Mixup / CutMix,
    train/mixing.py) already hold the smoothing, as timm's Mixup folds it in: they take timm's
    SoftTargetCrossEntropy. With --bce-loss (`extras['bce']`), timm's BinaryCrossEntropy on either kind of target."""
    bce = ctx.extras.get('bce')
    if bce is not None:               # --bce-loss: timm's BinaryCrossEntropy (hard or mixed targets; smoothing its own)
        return bce(ctx.logits, ctx.targets)
    if ctx.targets.is_floating_point():
        from timm.loss import SoftTargetCrossEntropy
        return SoftTargetCrossEntropy()(ctx.logits, ctx.targets)
    if ctx.logits.dim() == 3:
        return F.cross_entropy(ctx.logits.flatten(0, 1), ctx.targets.flatten(), label_smoothing=ctx.label_smoothing)
    return F.cross_entropy(ctx.logits, ctx.targets, label_smoothing=ctx.label_smoothing)


@dataclass
class Phase:
    name: str
    epochs: int
    trainable: Optional[List[str]] = None
    frozen: List[str] = field(default_factory=list)
    losses: Dict[str, float] = field(default_factory=lambda: {'ce': 1.0})

    def trains(self, param_name: str) -> bool:
        if any(fnmatch.fnmatch(param_name, pat) for pat in self.frozen):
            return False
        return self.trainable is None or any(fnmatch.fnmatch(param_name, pat) for pat in self.trainable)

    def apply(self, model: torch.nn.Module) -> int:
        """Set requires_grad per this phase; returns how many parameter tensors train."""
        count = 0
        for name, param in model.named_parameters():
            param.requires_grad_(self.trains(name))
            count += param.requires_grad
        if count == 0:
            raise ValueError(f"phase {self.name!r} leaves no parameter trainable; check its patterns")
        return count

    def loss(self, ctx: LossContext) -> Dict[str, torch.Tensor]:
        return {name: weight * LOSS_TERMS[name](ctx) for name, weight in self.losses.items() if weight}


def build_phases(specs: List[dict], total_epochs: int) -> List[Phase]:
    if not specs:
        return [Phase('main', total_epochs)]
    phases = []
    for i, spec in enumerate(specs):
        spec = dict(spec)
        spec.setdefault('name', f'phase{i}')
        try:
            phase = Phase(**spec)
        except TypeError as e:
            raise ValueError(f"phases[{i}]: {e}; accepted keys name, epochs, trainable, frozen, losses") from None
        unknown = sorted(set(phase.losses) - set(LOSS_TERMS))
        if unknown:
            raise ValueError(f"phases[{i}].losses: unknown terms {unknown}; accepted: {sorted(LOSS_TERMS)}")
        if phase.epochs < 1:
            raise ValueError(f"phases[{i}].epochs={phase.epochs} must be >= 1")
        phases.append(phase)
    if sum(p.epochs for p in phases) != total_epochs:
        raise ValueError(f"phases cover {sum(p.epochs for p in phases)} epochs but --epochs={total_epochs}")
    return phases


def phase_for_epoch(phases: List[Phase], epoch: int) -> Phase:
    """The phase of 1-based `epoch`."""
    end = 0
    for phase in phases:
        end += phase.epochs
        if epoch <= end:
            return phase
    return phases[-1]
