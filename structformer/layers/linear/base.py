"""The interface every structured linear layer implements (see the package docstring)."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...arguments import positive_int


class StructuredLinear(nn.Module):
    """A linear map x ↦ x Wᵀ + b whose W ([out_features, in_features]) has structure.

    Subclasses store their factors, implement `to_dense()` (W, materialised: the oracle for tests and
    the source of spectra) and override `forward` with their fast path. The default `forward` is the
    slow, obvious reference `F.linear(x, to_dense(), bias)`, which `forward_reference` always is.
    `bias` is a Parameter of shape [out_features] or None, as in `nn.Linear`.

    Dtype policy (every subclass, tested in tests/test_autocast_policy.py): under autocast `forward` behaves as
    `nn.Linear` does, its products run in the autocast dtype and the output (bias included) is in that dtype,
    because the layers are matmuls and bf16/fp16 is what autocast asks of matmuls; `to_dense()` is the weight in
    the parameters' dtype whether or not autocast is on (it is a weight, read by analysis and tests).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        positive_int('in_features', in_features)
        positive_int('out_features', out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.bias: Optional[nn.Parameter] = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None)

    def to_dense(self) -> torch.Tensor:
        """The [out_features, in_features] weight this layer applies."""
        raise NotImplementedError(f"{type(self).__name__} must implement to_dense()")

    def dense_bias(self) -> Optional[torch.Tensor]:
        """The [out_features] bias this layer adds (layers that share a bias across blocks expand it)."""
        return self.bias

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.to_dense(), self.dense_bias())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_reference(x)

    def extra_repr(self) -> str:
        return f'in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}'


def linear_weight(layer: nn.Module) -> torch.Tensor:
    """The [out, in] matrix a linear layer applies, whether a plain `nn.Linear` or a structured one
    (materialised by `to_dense()`): for code that reads weights (tied outputs, white-box analysis) and
    must keep working after `factorize` or a structured swap."""
    if isinstance(layer, StructuredLinear):
        return layer.to_dense()
    if isinstance(layer, nn.Linear):
        return layer.weight
    raise TypeError(f"expected an nn.Linear or a StructuredLinear, got {type(layer).__name__}")
