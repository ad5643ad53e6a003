"""`TunedLinear`: `nn.Linear` whose products run on the GEMM kernels this machine runs fastest.

torch's CPU `nn.Linear` calls MKL's sgemm. On an AMD EPYC with AVX-512, MKL runs its non-Intel code while oneDNN's
JIT kernels use AVX-512: CRATE-T's 3152 × 384 × 384 training products ran 1.4–1.7× faster on oneDNN there, and on
an Intel Xeon MKL's were the faster. `TunedLinear` computes `functional.onednn_linear.linear` instead of
`F.linear`: in float32 on an x86-64 CPU the kernels chosen for the product's shape class (`functional.autotune`,
choice 'linear_kernel'), `F.linear` everywhere else (other dtypes and devices, autocast, torch.compile, export).
Parameters, state dict, initialisation and `isinstance(m, nn.Linear)` are nn.Linear's, so checkpoints, weight
converters, `factorize` and timm's init treat it as one; outputs and gradients equal nn.Linear's within float32
rounding (tests/test_autotune.py).
"""
import torch.nn.functional as F
from torch import nn

from ...arguments import positive_int
from ...functional.onednn_linear import linear
from ...functional.tracing import recording_graph

__all__ = ['TunedLinear']


class TunedLinear(nn.Linear):
    """nn.Linear on the kernels this machine chose (module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
        positive_int('in_features', in_features)        # nn.Linear's -1: "Trying to create tensor with negative ..."
        positive_int('out_features', out_features)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x):
        if recording_graph():              # export / tracing / FX: nn.Linear's own op, which every exporter knows
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)
