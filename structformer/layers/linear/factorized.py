"""Low-rank (factorised) layers: W = U Vᵀ for a linear map, and its convolutional form (seed 004, §3.1).

`FactorizedLinear`: W ∈ R^{m×n} (m = out_features, n = in_features) as U ∈ R^{m×r}, V ∈ R^{n×r}; the
forward is x ↦ (x V) Uᵀ + b, O(r(m + n)) per token instead of O(mn) (§3.1.1). It is worth it only
when r < mn / (m + n) (`saves_parameters`).

`FactorizedConv2d` (§3.1.2): a kernel W ∈ R^{c_out × c_in × h × w} read as the matrix
[c_out, c_in·h·w] = U Vᵀ, run as an h×w convolution from c_in to r channels (weight V, with the
original stride, padding and dilation) followed by a 1×1 convolution from r to c_out (weight U, with
the bias).

Both keep the interface of the layer they replace and provide `factors()` → (U, V) as matrices (the
regularisers and the spectra read them) and `to_dense()`, the reference the tests compare against.
Ranks are an integer count or a fraction of min(m, n) (`resolve_rank`, the paper's "rank 0.1").
"""
import math
from typing import Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ...arguments import image_size, positive_int
from ...functional.onednn_linear import linear
from ...functional.precision import float32_island
from .base import StructuredLinear

__all__ = ['FactorizedLinear', 'FactorizedConv2d', 'resolve_rank', 'saves_parameters', 'INITS',
           'spectral_factors', 'FACTORIZED_TYPES']

INITS = ('spectral', 'spectral_ones', 'he')


def resolve_rank(rank: Union[int, float], out_features: int, in_features: int, name: str = 'rank') -> int:
    """The integer rank for a [out, in] matrix: an int is a count in [1, min(out, in)], a float a
    fraction in (0, 1] of min(out, in), rounded to the nearest count and at least 1."""
    full = min(out_features, in_features)
    if isinstance(rank, bool) or not isinstance(rank, (int, float)) or not math.isfinite(rank):
        raise ValueError(f"{name} must be an integer in [1, min(out, in)] or a fraction in (0, 1], got {rank!r}")
    if isinstance(rank, int):
        if not 1 <= rank <= full:
            raise ValueError(f"{name}={rank} is out of range for a {out_features}x{in_features} weight: accepted "
                             f"an integer in [1, {full}] or a fraction in (0, 1]")
        return rank
    if not 0 < rank <= 1:
        raise ValueError(f"{name}={rank} is out of range: accepted a fraction in (0, 1] of min(out, in) "
                         f"or an integer count")
    return max(1, min(full, int(round(rank * full))))


def saves_parameters(rank: int, out_features: int, in_features: int) -> bool:
    """True when r(m + n) < mn, i.e. r < mn / (m + n): the factors are smaller than W (§3.1.1)."""
    return rank * (out_features + in_features) < out_features * in_features


def spectral_factors(weight: torch.Tensor, rank: int, ones: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of a [m, n] matrix (Eq. 3): U = Û_r Σ_r^{½}, V = V̂_r Σ_r^{½}, so U Vᵀ = SVD_r(W);
    `ones=True` ("spectral ones"): Σ replaced by I, keeping only the singular directions.
    Computed in float64 for accuracy; returned in `weight`'s dtype."""
    u, s, vh = torch.linalg.svd(weight.detach().double(), full_matrices=False)
    u, s, v = u[:, :rank], s[:rank], vh[:rank].T
    scale = torch.ones_like(s) if ones else s.sqrt()
    return (u * scale).to(weight.dtype), (v * scale).to(weight.dtype)


def he_factors(out_features: int, in_features: int, rank: int, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """He (Kaiming-normal, fan-in) init of each factor as a layer of its own: V maps n → r (std √(2/n)),
    U maps r → m (std √(2/r)). The paper's baseline."""
    v = torch.randn(in_features, rank, dtype=like.dtype, device=like.device) * math.sqrt(2.0 / in_features)
    u = torch.randn(out_features, rank, dtype=like.dtype, device=like.device) * math.sqrt(2.0 / rank)
    return u, v


def _init_factors(weight: torch.Tensor, rank: int, init: str) -> Tuple[torch.Tensor, torch.Tensor]:
    if init == 'spectral':
        return spectral_factors(weight, rank)
    if init == 'spectral_ones':
        return spectral_factors(weight, rank, ones=True)
    if init == 'he':
        return he_factors(weight.shape[0], weight.shape[1], rank, weight)
    raise ValueError(f"init={init!r} is not a factor initialisation: accepted {', '.join(INITS)}")


class FactorizedLinear(StructuredLinear):
    """y = x V Uᵀ + b with U: [out, rank], V: [in, rank] (W = U Vᵀ, §3.1.1).

    `rank` is an int or a fraction of min(in, out). A fresh layer is initialised like `nn.Linear`
    and then factorised by `init` ('spectral' by default: U Vᵀ is the truncated SVD of that init).
    `from_linear(layer, rank, init)` factorises a trained layer.
    Dtype policy: under autocast both products run in the autocast dtype through `F.linear` / `matmul` (the
    oneDNN path of `functional.onednn_linear` is float32-only and is not taken under autocast), so the output
    is in the autocast dtype; `to_dense()` is U Vᵀ in the parameters' dtype, autocast or not.
    """

    def __init__(self, in_features: int, out_features: int, rank: Union[int, float] = 0.25, bias: bool = True,
                 init: str = 'spectral', device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        if init not in INITS:
            raise ValueError(f"init={init!r} is not a factor initialisation: accepted {', '.join(INITS)}")
        self.rank = resolve_rank(rank, out_features, in_features)
        self.init = init
        self.U = nn.Parameter(torch.empty(out_features, self.rank, device=device, dtype=dtype))
        self.V = nn.Parameter(torch.empty(in_features, self.rank, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of the dense weight and bias, the weight factorised by `init` (the constructor's;
        also what torch's deferred initialisation calls after a meta-device build and `to_empty`)."""
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=self.U.device,
                          dtype=self.U.dtype)
        self.set_from_dense(dense.weight, self.init)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.copy_(dense.bias)

    @classmethod
    def from_linear(cls, layer: nn.Linear, rank: Union[int, float], init: str = 'spectral') -> 'FactorizedLinear':
        """A factorised copy of `layer` (same device, dtype and bias), factors from its weight by `init`."""
        w = layer.weight
        new = cls(layer.in_features, layer.out_features, rank, bias=layer.bias is not None, init='he',
                  device=w.device, dtype=w.dtype)
        new.set_from_dense(w, init)
        new.init = init
        if layer.bias is not None:
            with torch.no_grad():
                new.bias.copy_(layer.bias)
        return new

    @torch.no_grad()
    def set_from_dense(self, weight: torch.Tensor, init: str = 'spectral') -> None:
        """Set U, V from a dense [out, in] weight: its truncated SVD ('spectral', 'spectral_ones'), or
        independent He draws ('he', which ignores the weight's values)."""
        u, v = _init_factors(weight, self.rank, init)
        self.U.copy_(u)
        self.V.copy_(v)

    def factors(self) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.U, self.V

    def to_dense(self) -> torch.Tensor:
        with float32_island(self.U.device.type):   # the weight, not a bf16 copy
            return self.U @ self.V.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (x V) Uᵀ + b as two `linear` calls: oneDNN's kernels for float32 on CPU (14–16 % faster products
        # than torch.mm's on the project's AMD EPYC, functional/onednn_linear.py), F.linear elsewhere
        return linear(linear(x, self.V.t()), self.U, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f', rank={self.rank}'


class FactorizedConv2d(nn.Module):
    """An h×w convolution c_in → r (weight V: [r, c_in, h, w], the original stride / padding /
    dilation), then a 1×1 convolution r → c_out (weight U: [c_out, r, 1, 1], the bias): the kernel as
    the matrix [c_out, c_in·h·w] = U Vᵀ (§3.1.2). Groups and non-zero padding modes are not factorised.
    Under autocast both convolutions run in the autocast dtype (that dtype out); `to_dense()` stays in the
    parameters' dtype."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, rank: Union[int, float] = 0.25,
                 stride=1, padding=0, dilation=1, bias: bool = True, init: str = 'spectral', device=None, dtype=None):
        super().__init__()
        if init not in INITS:
            raise ValueError(f"init={init!r} is not a factor initialisation: accepted {', '.join(INITS)}")
        positive_int('in_channels', in_channels)
        positive_int('out_channels', out_channels)
        # an integer or an (H, W) pair each: nn.Conv2d took a negative, a string or a three-entry stride (and the
        # same padding or dilation) and failed at the first forward; kernel_size=2.5 failed as "not iterable"
        kernel_size, stride, dilation = (image_size(name, value) for name, value in (
            ('kernel_size', kernel_size), ('stride', stride), ('dilation', dilation)))
        if not isinstance(padding, str):            # 'same' / 'valid': nn.Conv2d checks the name and the stride
            pair = tuple(padding) if isinstance(padding, (tuple, list)) else (padding, padding)
            if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in pair):
                raise ValueError(f"padding={padding!r} must be an integer >= 0, an (H, W) pair of them, or "
                                 "'same' / 'valid'")
        dense = nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                          dilation=dilation, bias=bias, device=device, dtype=dtype)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.stride, self.padding, self.dilation = (
            dense.kernel_size, dense.stride, dense.padding, dense.dilation)
        fan_in = in_channels * dense.kernel_size[0] * dense.kernel_size[1]
        self.rank = resolve_rank(rank, out_channels, fan_in)
        self.V = nn.Parameter(torch.empty(self.rank, in_channels, *dense.kernel_size, device=device, dtype=dtype))
        self.U = nn.Parameter(torch.empty(out_channels, self.rank, 1, 1, device=device, dtype=dtype))
        self.bias = dense.bias
        self.init = init
        self.set_from_dense(dense.weight, init)

    def reset_parameters(self) -> None:
        """nn.Conv2d's initialisation of the dense kernel and bias, the kernel factorised by `init` (the constructor's;
        also what torch's deferred initialisation calls after a meta-device build and `to_empty`)."""
        dense = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, bias=self.bias is not None,
                          device=self.V.device, dtype=self.V.dtype)
        self.set_from_dense(dense.weight, self.init)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.copy_(dense.bias)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, rank: Union[int, float], init: str = 'spectral') -> 'FactorizedConv2d':
        if conv.groups != 1 or conv.padding_mode != 'zeros' or isinstance(conv.padding, str):
            raise ValueError(f"FactorizedConv2d needs groups=1, zero padding and numeric padding; got "
                             f"groups={conv.groups}, padding={conv.padding!r}, padding_mode={conv.padding_mode!r}")
        w = conv.weight
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, rank, stride=conv.stride,
                  padding=conv.padding, dilation=conv.dilation, bias=conv.bias is not None, init='he',
                  device=w.device, dtype=w.dtype)
        new.set_from_dense(w, init)
        new.init = init
        if conv.bias is not None:
            with torch.no_grad():
                new.bias.copy_(conv.bias)
        return new

    @torch.no_grad()
    def set_from_dense(self, weight: torch.Tensor, init: str = 'spectral') -> None:
        u, v = _init_factors(weight.flatten(1), self.rank, init)
        self.U.copy_(u[:, :, None, None])
        self.V.copy_(v.T.reshape(self.V.shape))

    def factors(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(U [c_out, r], V [c_in·h·w, r]) as matrices, sharing storage with the parameters."""
        return self.U.flatten(1), self.V.flatten(1).T

    def to_dense(self) -> torch.Tensor:
        """The [c_out, c_in, h, w] kernel this layer applies (in the parameters' dtype, autocast or not)."""
        u, v = self.factors()
        with float32_island(u.device.type):
            return (u @ v.T).reshape(self.out_channels, self.in_channels, *self.kernel_size)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.to_dense(), self.bias, self.stride, self.padding, self.dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.conv2d(x, self.V, None, self.stride, self.padding, self.dilation)
        return F.conv2d(h, self.U, self.bias)

    def extra_repr(self) -> str:
        return (f'{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, '
                f'padding={self.padding}, rank={self.rank}, bias={self.bias is not None}')


FACTORIZED_TYPES = (FactorizedLinear, FactorizedConv2d)
