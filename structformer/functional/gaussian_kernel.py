"""Gaussian self-attention kernel of SOFT (Lu et al., IJCV 2024, Eq. 4–5).

`S_ij = exp(−‖q_i − k_j‖² / (2√d))`, written `exp(Q ⊖ K)` in the paper. With Q = K (one shared
projection, §3.1) S is symmetric, lies in [0, 1] and has a unit diagonal.
"""
import math
from typing import Optional

import torch

from .precision import float32_island

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _default_scale(d: int, scale: Optional[float]) -> float:
    return 1.0 / (2.0 * math.sqrt(d)) if scale is None else scale


def gaussian_kernel(q: torch.Tensor, k: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """exp(−scale · ‖q_i − k_j‖²) for q [..., n, d], k [..., m, d] -> [..., n, m] (SOFT Eq. 5).

    `scale` defaults to 1/(2√d). The squared distance is expanded as ‖q‖² + ‖k‖² − 2qkᵀ so only
    the n×m result (never an n×m×d difference tensor) is materialised; rounding can make the
    expansion slightly negative, so it is clamped at 0 and the kernel never exceeds 1.
    Dtype policy: computes in float32 under any autocast context (autocast off, float16/bfloat16 inputs
    upcast), because the expansion subtracts numbers of similar size and bf16 cancellation there gives
    exponent errors of order scale·‖q‖²·2⁻⁸ exactly where the kernel is not negligible (q ≈ k).
    Returns float32 for half inputs, the input dtype otherwise (float32 / float64).
    """
    scale = _default_scale(q.shape[-1], scale)
    with float32_island(q.device.type):
        if q.dtype in _LOW_PRECISION or k.dtype in _LOW_PRECISION:
            q, k = q.float(), k.float()
        # squared norms by a reduction that forms no n×d temporary (pow then sum writes one)
        q_sq = torch.linalg.vector_norm(q, dim=-1, keepdim=True).square()            # [..., n, 1]
        k_sq = torch.linalg.vector_norm(k, dim=-1).square().unsqueeze(-2)           # [..., 1, m]
        if q.shape[:-2] == k.shape[:-2] and q.dim() >= 2:
            # baddbmm forms 2·scale·qkᵀ − scale·‖k‖² (the k term broadcast, so no n×m offset tensor
            # is allocated), then the q term, clamp and exp run in place: one n×m buffer, written
            # once and updated three times, instead of a chain of fresh n×m temporaries
            n, d, m = q.shape[-2], q.shape[-1], k.shape[-2]
            q_flat, k_flat = q.reshape(-1, n, d), k.reshape(-1, m, d)
            exponent = torch.baddbmm(k_sq.reshape(-1, 1, m), q_flat, k_flat.transpose(1, 2),
                                     beta=-scale, alpha=2.0 * scale)
            exponent = exponent.sub_(scale * q_sq.reshape(-1, n, 1))
            return exponent.clamp_max_(0.0).exp_().reshape(*q.shape[:-2], n, m)
        sq_dist = (q_sq + k_sq - 2.0 * (q @ k.transpose(-2, -1))).clamp_min(0.0)
        return torch.exp(-scale * sq_dist)


def gaussian_kernel_reference(q: torch.Tensor, k: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Slow, obvious Eq. 5: explicit pairwise differences (memory n·m·d). For tests only."""
    scale = _default_scale(q.shape[-1], scale)
    diff = q.unsqueeze(-2) - k.unsqueeze(-3)                   # [..., n, m, d]
    return torch.exp(-scale * diff.pow(2).sum(-1))
