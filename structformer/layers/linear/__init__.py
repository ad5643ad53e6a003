"""Structured weights: drop-in replacements for `nn.Linear` whose weight matrix has structure.

The families fill this folder, one module each, all subclasses of `StructuredLinear`:
  permuted.py    PK / RP layers (MLP-Mixer as a wide sparse MLP, Def. 5.1): J₂ (I ⊗ W) J₁
  kronecker.py   V ⊗ W acting on vec X without materialising it
  monarch.py     Monarch: two block-diagonal factors with a fixed permutation between them
  masked.py      SW-MLP: a dense weight under a frozen Bernoulli(p) mask
  factorized.py  low-rank training: W = U Vᵀ (and its conv variant beside it)
and, not structured, tuned.py: `TunedLinear`, nn.Linear on the GEMM kernels this machine runs fastest.

Every layer keeps `nn.Linear`'s interface (`in_features`, `out_features`, `bias`, input [..., in],
output [..., out]) and provides `to_dense()`, the [out, in] matrix it applies: tests compare each
fast path against `F.linear(x, layer.to_dense(), layer.bias)`, and the analysis reads spectra from it.
"""
from .base import StructuredLinear, linear_weight
from .factorized import FactorizedConv2d, FactorizedLinear
from .kronecker import KroneckerLinear
from .masked import MaskedLinear
from .monarch import MonarchLinear
from .permutation import random_permutation, transpose_permutation
from .permuted import PKLinear
from .tuned import TunedLinear

__all__ = ['StructuredLinear', 'linear_weight', 'PKLinear', 'KroneckerLinear', 'MonarchLinear', 'MaskedLinear',
           'random_permutation', 'transpose_permutation', 'FactorizedLinear', 'FactorizedConv2d',
           'TunedLinear']
