"""Effective rank and singular-value spectra of a model's layers (seed 004, §3.3, Table 1).

Effective rank (Martin & Mahoney): ‖W‖_* / ‖W‖_op, the sum of the singular values over the largest;
it is n for an orthogonal n×n matrix, 1 for a rank-one one, and falls when a few directions grow faster
than the rest (what L2 on the factors does, "the rich get richer").

A factorised layer's singular values are those of U Vᵀ, read without forming it: with U = Q_u R_u and
V = Q_v R_v (thin QR), U Vᵀ = Q_u (R_u R_vᵀ) Q_vᵀ, so they are the singular values of the r×r matrix
R_u R_vᵀ. Dense layers (conv kernels as [c_out, c_in·h·w]) use `torch.linalg.svdvals` directly.
"""
from typing import Dict, Optional

import torch
from torch import nn

from ..layers.linear.factorized import FACTORIZED_TYPES

__all__ = ['effective_rank', 'singular_values', 'layer_spectra', 'effective_ranks']


def effective_rank(matrix_or_singular_values: torch.Tensor, eps: float = 0.0) -> float:
    """‖W‖_* / ‖W‖_op of a matrix (2-d), or of a vector of its singular values (1-d). 0 for W = 0."""
    t = matrix_or_singular_values.detach()
    s = t if t.dim() == 1 else torch.linalg.svdvals(t.double())
    s = s.double().abs()
    top = s.max() if s.numel() else torch.zeros(())
    if top <= eps:
        return 0.0
    return float(s.sum() / top)


@torch.no_grad()
def singular_values(module: nn.Module) -> Optional[torch.Tensor]:
    """Descending singular values (float64, on the CPU) of the weight a layer applies; None for a module
    without one. Factorised layers go through the r×r core (see the module docstring)."""
    if isinstance(module, FACTORIZED_TYPES):
        u, v = (f.detach().double().cpu() for f in module.factors())
        _, ru = torch.linalg.qr(u)
        _, rv = torch.linalg.qr(v)
        return torch.linalg.svdvals(ru @ rv.T)
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        return torch.linalg.svdvals(module.weight.detach().double().cpu().flatten(1))
    return None


def layer_spectra(model: nn.Module, factorized_only: bool = False) -> Dict[str, torch.Tensor]:
    """Singular values of every nn.Linear / nn.Conv2d / factorised layer by module name."""
    out = {}
    for name, module in model.named_modules():
        if factorized_only and not isinstance(module, FACTORIZED_TYPES):
            continue
        if isinstance(module, FACTORIZED_TYPES) or isinstance(module, (nn.Linear, nn.Conv2d)):
            s = singular_values(module)
            if s is not None:
                out[name] = s
    return out


def effective_ranks(model: nn.Module, factorized_only: bool = True) -> Dict[str, float]:
    """Effective rank of every (factorised) layer by name."""
    return {name: effective_rank(s) for name, s in layer_spectra(model, factorized_only).items()}
