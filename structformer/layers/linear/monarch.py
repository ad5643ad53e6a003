"""Monarch matrices M = P_out L P R (Dao et al. 2022; the linear S-Mixer is one, Mixer paper Cor. 3.4).

R is block-diagonal with b blocks [q, p] (p = in/b), L block-diagonal with b blocks [s, q] (s = out/b),
P the transpose shuffle of the middle vector viewed as [b, q] (→ [q, b], re-cut into b chunks of q), and
P_out the transpose shuffle of the output viewed as [b, s]. With in = out = n and b = √n this is the
square Monarch of the paper (p = q = s = b) and `MonarchLinear.from_dense` projects any n×n matrix onto
it: entry (j·b + l', k·b + l) equals L[l'][j, k]·R[k][l', l], so each (l', k) slice is rank one and its
best rank-one SVD approximation is the Frobenius-optimal projection.

Where b ≠ q the middle shuffle P (read as [b, q], transpose) is the inverse of the one in Dao et al.'s public code
(HazyResearch/fly reads the middle as [q, b] and transposes: P L Pᵀ R): the same connectivity, another labelling of
the middle, so a rectangular fly checkpoint does not load as is. Where b = q (square n = b²) the two coincide.

The forward is two batched matmuls with the shuffle between; `to_dense` builds the same matrix from
block_diag and index permutations, independently of the forward, for the tests.

Layout: a CPU `bmm` whose matrices have no unit stride (the batch innermost, as a permuted tensor has) falls back to
one copy per batch entry, b small copies per call. The shuffled middle is therefore copied once, contiguously, and
the gradients arriving through the two permutations are made contiguous once (`_ContiguousGrad`) before the
backward's four bmm calls. At n = 4096, b = 64, batch 1024, one thread (AMD EPYC Zen 5): nn.Linear / Monarch
training step 8.05× -> 10.66× (`bench mlp`, paired); the products are unchanged. The price: one gradient-sized
buffer more alive during the backward (+15 MiB there, measured with large blocks mmapped; with glibc's default
heap the process's resident high-water mark grew by about 100 MiB, memory the allocator keeps for the next step).
"""
import math

import torch
from torch import nn

from ...arguments import positive_int
from ...functional.precision import float32_island
from ...functional.tracing import recording_graph
from .base import StructuredLinear


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward hands on a contiguous gradient: placed on a bmm output that is then permuted,
    the gradient coming back through the permutation reaches bmm's backward in a layout BLAS takes whole."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(tensor: torch.Tensor) -> torch.Tensor:
    # not while a graph is recorded (export, ONNX, tracing): an exporter should see plain ops, and there is no backward
    if tensor.requires_grad and not recording_graph():
        return _ContiguousGrad.apply(tensor)
    return tensor

__all__ = ['MonarchLinear']


class MonarchLinear(StructuredLinear):
    """x ↦ P_out L P R x + b. Under autocast: two bmm calls in the autocast dtype, bias added in it (that dtype
    out, as `nn.Linear`); `to_dense()` in the parameters' dtype.

    Args:
        nblocks: b, the block count of both factors; must divide in_features and out_features.
        The middle width is b·q with q = min(in/b, out/b) (the cheaper side; flash-attn's choice too).
    """

    def __init__(self, in_features: int, out_features: int, nblocks: int = 4, bias: bool = True, device=None,
                 dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        positive_int('MonarchLinear nblocks', nblocks)
        for name, size in (('in_features', in_features), ('out_features', out_features)):
            if size % nblocks:
                raise ValueError(f"MonarchLinear nblocks={nblocks} must divide {name}={size} "
                                 f"(divisors near it: {_divisors_near(size, nblocks)})")
        self.nblocks = nblocks
        p, s = in_features // nblocks, out_features // nblocks
        q = min(p, s)
        self.block_sizes = (p, q, s)
        self.weight_right = nn.Parameter(torch.empty(nblocks, q, p, device=device, dtype=dtype))   # R
        self.weight_left = nn.Parameter(torch.empty(nblocks, s, q, device=device, dtype=dtype))    # L
        self.reset_parameters()

    def reset_parameters(self) -> None:
        p, q, _ = self.block_sizes
        # each factor N(0, 1/fan_in) of its own blocks: the product keeps unit gain like a dense init
        nn.init.normal_(self.weight_right, std=1 / math.sqrt(p))
        nn.init.normal_(self.weight_left, std=1 / math.sqrt(q))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MonarchLinear expects inputs [..., {self.in_features}], got {tuple(x.shape)}")
        b, (p, q, _) = self.nblocks, self.block_sizes
        lead = x.shape[:-1]
        rows = x.reshape(-1, b, p).transpose(0, 1)                        # [b, N, p]
        mid = _contiguous_grad(torch.bmm(rows, self.weight_right.transpose(1, 2)))   # R: [b, N, q]
        # P: the middle [b, q] read as [q, b] and cut again into b chunks of q; one contiguous copy (where q = b the
        # reshape is a view whose matrices have no unit stride, and bmm would copy them one by one)
        mid = mid.permute(1, 2, 0).reshape(-1, b, q).transpose(0, 1).contiguous()    # [b, N, q]
        out = _contiguous_grad(torch.bmm(mid, self.weight_left.transpose(1, 2)))     # L: [b, N, s]
        out = out.permute(1, 2, 0).reshape(*lead, self.out_features)      # P_out: [b, s] read as [s, b]
        # bias in the products' dtype: a float32 bias would promote a bf16/fp16 autocast output to float32
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def to_dense(self) -> torch.Tensor:
        b, (_, q, s) = self.nblocks, self.block_sizes
        right = torch.block_diag(*self.weight_right)                      # [b·q, b·p]
        left = torch.block_diag(*self.weight_left)                        # [b·s, b·q]
        middle_shuffle = torch.arange(b * q, device=right.device).view(b, q).t().reshape(-1)
        out_shuffle = torch.arange(b * s, device=right.device).view(b, s).t().reshape(-1)
        with float32_island(right.device.type):   # the weight, not a bf16 copy
            return (left @ right[middle_shuffle])[out_shuffle]

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias=None) -> 'MonarchLinear':
        """The square Monarch (b = √n) nearest to an n×n `weight` in Frobenius norm."""
        if weight.dim() != 2 or weight.shape[0] != weight.shape[1]:
            raise ValueError(f"MonarchLinear.from_dense needs a square [n, n] weight, got {tuple(weight.shape)}")
        n = weight.shape[0]
        b = math.isqrt(n)
        if b * b != n:
            raise ValueError(f"MonarchLinear.from_dense needs n to be a perfect square (b = √n blocks), got n={n}")
        layer = cls(n, n, nblocks=b, bias=bias is not None, device=weight.device, dtype=weight.dtype)
        # W[(j, l'), (k, l)] = L[l'][j, k] · R[k][l', l]: one rank-one b×b slice per (l', k)
        slices = weight.detach().reshape(b, b, b, b).permute(1, 2, 0, 3)    # [l', k, j, l]
        u, sigma, vh = torch.linalg.svd(slices)
        root = sigma[..., 0].sqrt()
        with torch.no_grad():
            layer.weight_left.copy_((u[..., :, 0] * root[..., None]).permute(0, 2, 1))   # L[l'][j, k]
            layer.weight_right.copy_((vh[..., 0, :] * root[..., None]).permute(1, 0, 2))  # R[k][l', l]
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    def extra_repr(self) -> str:
        return super().extra_repr() + f', nblocks={self.nblocks}'


def _divisors_near(size: int, target: int):
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    return sorted(divisors, key=lambda d: abs(d - target))[:4]
