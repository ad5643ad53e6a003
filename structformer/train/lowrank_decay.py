"""Regularisers of factorised layers (seed 004, §3.3) and their loss terms.

L2 on the factors, λ/2 (‖U‖²_F + ‖V‖²_F), is ordinary weight decay on U and V; at its minimum over
factorisations of the same W it equals λ‖UVᵀ‖_* (Srebro & Shraibman), a nuclear-norm penalty, which
shrinks the small singular values fastest and lowers the effective rank.

Frobenius decay, λ/2 ‖UVᵀ‖²_F, penalises the product instead. It is computed without forming UVᵀ:
‖UVᵀ‖²_F = tr(V UᵀU Vᵀ) = tr((UᵀU)(VᵀV)), two r×r Gram matrices, O(r²(m + n)) instead of O(mnr).
When it is used the factors must leave the optimiser's weight decay (else they are decayed twice):
`factor_parameter_names` lists them for the engine's parameter groups.

Registered loss terms (weights in a phase's `losses:`, e.g. {ce: 1.0, frobenius_decay: 5e-4}, on a run whose
weight decay does not already decay the factors: weight_decay 0, or --factor-decay frobenius for factor_l2; the
configuration refuses the others, train/config_checks.py):
  frobenius_decay   ½ Σ_layers ‖U Vᵀ‖²_F
  factor_l2         ½ Σ_layers (‖U‖²_F + ‖V‖²_F)
"""
from typing import List

import torch
from torch import nn

from ..layers.linear.factorized import FACTORIZED_TYPES
from ..train.phases import LossContext, register_loss_term

__all__ = ['frobenius_decay', 'frobenius_decay_reference', 'factor_l2', 'factor_parameter_names']


def _factor_pairs(model: nn.Module):
    for module in model.modules():
        if isinstance(module, FACTORIZED_TYPES):
            yield module.factors()


def frobenius_norm_sq(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """‖U Vᵀ‖²_F as tr((UᵀU)(VᵀV)) = Σ_ij (UᵀU)_ij (VᵀV)_ij (both Grams are symmetric)."""
    return ((u.T @ u) * (v.T @ v)).sum()


def frobenius_decay(model: nn.Module) -> torch.Tensor:
    """½ Σ over factorised layers of ‖U Vᵀ‖²_F (multiply by λ outside)."""
    terms = [frobenius_norm_sq(u, v) for u, v in _factor_pairs(model)]
    if not terms:
        return _zero(model)
    return 0.5 * torch.stack(terms).sum()


def frobenius_decay_reference(model: nn.Module) -> torch.Tensor:
    """The slow, obvious form: ½ Σ ‖U Vᵀ‖²_F with the product formed. For tests."""
    terms = [(u @ v.T).pow(2).sum() for u, v in _factor_pairs(model)]
    return 0.5 * torch.stack(terms).sum() if terms else _zero(model)


def factor_l2(model: nn.Module) -> torch.Tensor:
    """½ Σ over factorised layers of (‖U‖²_F + ‖V‖²_F)."""
    terms = [u.pow(2).sum() + v.pow(2).sum() for u, v in _factor_pairs(model)]
    return 0.5 * torch.stack(terms).sum() if terms else _zero(model)


def _zero(model: nn.Module) -> torch.Tensor:
    p = next(model.parameters(), None)
    return torch.zeros((), device=p.device if p is not None else None)


def factor_parameter_names(model: nn.Module) -> List[str]:
    """Names of every U and V parameter (what Frobenius decay takes out of the optimiser's weight decay)."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, FACTORIZED_TYPES):
            names += [f'{prefix}.U' if prefix else 'U', f'{prefix}.V' if prefix else 'V']
    return names


@register_loss_term('frobenius_decay')
def frobenius_decay_term(ctx: LossContext) -> torch.Tensor:
    """½ Σ ‖UVᵀ‖²_F over the factorised layers (zero for a model without any)."""
    return frobenius_decay(ctx.model)


@register_loss_term('factor_l2')
def factor_l2_term(ctx: LossContext) -> torch.Tensor:
    """½ Σ (‖U‖² + ‖V‖²) over the factorised layers."""
    return factor_l2(ctx.model)
