"""Permutations of the feature axis as int64 index vectors, never as m×m matrices (Mixer paper, App. A.2.3).

Convention: a permutation J of length m is stored as an index vector `perm`, and applying it means
`(J x)[i] = x[perm[i]]`, i.e. `x[..., perm]`. Its transpose (= inverse) is `argsort(perm)`.

`permute_features` is the fast path: a gather forward and, since J⁻¹ = Jᵀ, a gather with the inverse
index backward, where plain indexing would scatter-add the gradient (`index_put_` with accumulate, a
slower kernel on CPU). The inverse costs one O(m) scatter per call, nothing beside a [batch, m] gather,
so it is not stored: a layer keeps only its m int64 indices. `permute_features_reference` is the obvious version the tests compare it with.
"""
from typing import Optional, Union

import torch

PermutationSpec = Union[str, torch.Tensor, None]
KINDS = ('identity', 'transpose', 'random')


# index vectors are always made on the CPU (then moved), so a layer also builds under torch.device('meta')
def identity_permutation(m: int) -> torch.Tensor:
    return torch.arange(m, dtype=torch.int64, device='cpu')


def transpose_permutation(rows: int, cols: int) -> torch.Tensor:
    """J_c of Eq. (S.9): the x ↦ vec(Xᵀ) shuffle of a row-major [rows, cols] grid, as an index vector.

    `x[..., transpose_permutation(r, c)]` equals `x.view(..., r, c).transpose(-1, -2).flatten(-2)`.
    """
    return torch.arange(rows * cols, dtype=torch.int64, device='cpu').view(rows, cols).t().reshape(-1)


def random_permutation(m: int, seed: int) -> torch.Tensor:
    """A uniformly random permutation of m indices, regenerated exactly from `seed` on any machine."""
    generator = torch.Generator().manual_seed(int(seed))
    return torch.randperm(m, generator=generator, dtype=torch.int64, device='cpu')


def check_permutation(perm: torch.Tensor, m: int, name: str = 'permutation') -> torch.Tensor:
    """`perm` as an int64 CPU vector, or a ValueError naming what is wrong (length, range, repeats)."""
    if not isinstance(perm, torch.Tensor):
        perm = torch.as_tensor(perm)
    if perm.dim() != 1 or perm.dtype.is_floating_point or perm.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer index vector, got dtype {perm.dtype} and shape "
                         f"{tuple(perm.shape)}")
    if perm.numel() != m:
        raise ValueError(f"{name} must have length {m} (the features it permutes), got {perm.numel()}")
    perm = perm.to(device='cpu', dtype=torch.int64)
    if m and (int(perm.min()) < 0 or int(perm.max()) >= m):
        raise ValueError(f"{name} must hold indices in [0, {m - 1}], got values from {int(perm.min())} "
                         f"to {int(perm.max())}")
    counts = torch.bincount(perm, minlength=m)
    if bool((counts != 1).any()):
        repeated = torch.nonzero(counts > 1).flatten()[:5].tolist()
        raise ValueError(f"{name} is not a permutation: index(es) {repeated} repeat "
                         f"({int((counts == 0).sum())} of {m} indices missing)")
    return perm


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), dtype=perm.dtype, device=perm.device)
    return inverse


class _PermuteFeatures(torch.autograd.Function):
    """y = x[..., perm]; dL/dx = (dL/dy)[..., argsort(perm)]: a gather both ways."""

    @staticmethod
    def forward(x, perm, inverse):
        return x.index_select(-1, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        return grad.index_select(-1, inverse), None, None


def permute_features(x: torch.Tensor, perm: torch.Tensor, inverse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """J x along the last axis (the fast path; pass the precomputed inverse where it is kept)."""
    if inverse is None:
        inverse = inverse_permutation(perm)
    return _PermuteFeatures.apply(x, perm, inverse)


def permute_features_reference(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """J x by plain advanced indexing (autograd scatters the gradient back)."""
    return x[..., perm]
