"""V ⊗ W acting on a vectorised matrix without forming the product (Mixer paper, Eq. 6–8).

Row-major form of the vec identity: for X ∈ R^{p₁×p₂} stored as x = X.flatten(),
    (A ⊗ B) x = (A X Bᵀ).flatten(),        A ∈ R^{q₁×p₁}, B ∈ R^{q₂×p₂},
which is the paper's vec(W X V) = (Vᵀ ⊗ W) vec(X) with vec column-major (vec(X) = Xᵀ.flatten()).
Two small matmuls cost p₁p₂(q₁ + q₂)-ish multiply-adds against p₁p₂q₁q₂ for the dense product.
"""
import math
from typing import Sequence

import torch
from torch import nn

from .base import StructuredLinear

__all__ = ['KroneckerLinear']


def _pair(value, name):
    if (not isinstance(value, Sequence) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)):
        raise ValueError(f"KroneckerLinear {name} must be two positive integers (rows, cols), got {value!r}")
    return int(value[0]), int(value[1])


class KroneckerLinear(StructuredLinear):
    """x ↦ (A ⊗ B) x + b with x the row-major flattening of a [p₁, p₂] matrix.

    Args:
        in_shape: (p₁, p₂), in_features = p₁·p₂.
        out_shape: (q₁, q₂), out_features = q₁·q₂; A is [q₁, p₁] (mixes rows, e.g. tokens),
            B is [q₂, p₂] (mixes columns, e.g. channels).
    The factors start N(0, 1/p₁) and N(0, 1/p₂), so A ⊗ B has the N(0, 1/fan_in)-scale of a dense init.
    Under autocast: both matmuls in the autocast dtype, bias added in it (that dtype out, as `nn.Linear`).
    """

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], bias: bool = True, device=None, dtype=None):
        (p1, p2), (q1, q2) = _pair(in_shape, 'in_shape'), _pair(out_shape, 'out_shape')
        super().__init__(p1 * p2, q1 * q2, bias=bias, device=device, dtype=dtype)
        self.in_shape, self.out_shape = (p1, p2), (q1, q2)
        self.weight_rows = nn.Parameter(torch.empty(q1, p1, device=device, dtype=dtype))   # A
        self.weight_cols = nn.Parameter(torch.empty(q2, p2, device=device, dtype=dtype))   # B
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight_rows, std=1 / math.sqrt(self.in_shape[0]))
        nn.init.normal_(self.weight_cols, std=1 / math.sqrt(self.in_shape[1]))
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"KroneckerLinear expects inputs [..., {self.in_features}] (in_shape {self.in_shape}), "
                             f"got {tuple(x.shape)}")
        lead = x.shape[:-1]
        matrix = x.reshape(*lead, *self.in_shape)
        y = torch.matmul(torch.matmul(self.weight_rows, matrix), self.weight_cols.t())    # A X Bᵀ
        y = y.reshape(*lead, self.out_features)
        # bias in the products' dtype: a float32 bias would promote a bf16/fp16 autocast output to float32
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def to_dense(self) -> torch.Tensor:
        return torch.kron(self.weight_rows, self.weight_cols)

    def extra_repr(self) -> str:
        return f'in_shape={self.in_shape}, out_shape={self.out_shape}, bias={self.bias is not None}'
