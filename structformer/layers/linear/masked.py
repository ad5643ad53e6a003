"""SW-MLP's static sparse weight (Mixer paper, App. A.2.5, Eq. S.16–S.17): M ⊙ W with M a frozen
Bernoulli(p) mask drawn once before training.

The mask is a bool buffer (saved, and regenerated from `seed`); entries of W off the mask start at
zero and get zero gradient, so no optimiser (weight decay included) ever moves them. Kept entries start
N(0, 1/(p·in_features)): the paper's mask value 1/√p times N(0, 1/in) (§4.3), i.e. an init scaled to
the kept fan-in. The layer stores the dense [out, in] weight: this is what makes SW-MLP's memory grow
as m² (Table S.3), so a large one warns with its byte count before allocating.
"""
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ...arguments import count
from .base import StructuredLinear

__all__ = ['MaskedLinear', 'masked_linear_bytes']

WARN_BYTES = 1 << 30


def masked_linear_bytes(in_features: int, out_features: int, bytes_per_weight: int = 4) -> int:
    """Bytes of a MaskedLinear's dense weight and bool mask (bias ignored)."""
    return in_features * out_features * (bytes_per_weight + 1)


class MaskedLinear(StructuredLinear):
    """x ↦ (M ⊙ W) x + b with M ~ Bernoulli(density) frozen.

    Args:
        density: p ∈ (0, 1], the expected fraction of kept weights (the paper's 1 − sparsity).
        seed: seeds the mask, so the same layer is rebuilt exactly.
        warn_bytes: warn (with the byte count) when weight + mask exceed this many bytes.
    Under autocast: M ⊙ W formed in the weight's dtype, then `F.linear` in the autocast dtype (that dtype out).
    """

    def __init__(self, in_features: int, out_features: int, density: float = 1.0, bias: bool = True, seed: int = 0,
                 warn_bytes: int = WARN_BYTES, device=None, dtype=None):
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"MaskedLinear density must be in (0, 1] (the kept fraction p), got {density!r}")
        count('seed', seed)
        count('warn_bytes', warn_bytes)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        bytes_needed = masked_linear_bytes(in_features, out_features,
                                           torch.empty((), dtype=dtype).element_size())
        if bytes_needed > warn_bytes:
            warnings.warn(f"MaskedLinear {out_features}x{in_features} stores a dense weight and mask: "
                          f"{bytes_needed:,} bytes ({bytes_needed / 2**30:.1f} GiB)", ResourceWarning, stacklevel=2)
        self.density, self.seed = float(density), int(seed)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        # drawn by reset_parameters (also what fills it in after a meta-device build and `to_empty`)
        self.register_buffer('mask', torch.empty(out_features, in_features, dtype=torch.bool,
                                                 device=self.weight.device))
        self.reset_parameters()

    def _draw_mask(self) -> torch.Tensor:
        """M ~ Bernoulli(p), drawn on the CPU from `seed` alone: the same mask on every device."""
        generator = torch.Generator().manual_seed(self.seed)
        return torch.rand(self.out_features, self.in_features, generator=generator, device='cpu') < self.density

    def kept_weights(self) -> int:
        """How many weights the mask keeps (on the meta device: of the mask the seed draws on a real one)."""
        return int((self._draw_mask() if self.mask.is_meta else self.mask).count_nonzero())

    def reset_parameters(self) -> None:
        """The mask drawn from `seed` and the kept weights N(0, 1/(p·in)). On the meta device (parameter counts, dry
        runs) the mask has no values and is not drawn (~1 s per swmlp_cifar; `kept_weights()` draws it when a count
        needs it); after `to_empty` (torch's deferred initialisation) this fills in the seed's mask, not the
        uninitialised memory `to_empty` leaves."""
        with torch.no_grad():
            if not self.mask.is_meta:
                self.mask.copy_(self._draw_mask())
            nn.init.normal_(self.weight, std=1 / math.sqrt(self.density * self.in_features))
            self.weight.mul_(self.mask)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)

    def to_dense(self) -> torch.Tensor:
        return self.weight * self.mask

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        # entry by entry, without the mask product: the kept weights gathered, summed per output row
        rows, cols = self.mask.nonzero(as_tuple=True)
        out = x.new_zeros(*x.shape[:-1], self.out_features)
        out = out.index_add(-1, rows, x[..., cols] * self.weight[rows, cols])
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + f', density={self.density}'
