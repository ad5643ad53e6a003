"""The permuted Kronecker (PK) layer, Def. 5.1 of "MLP-Mixer as a wide and sparse MLP":

    PK_W(x; J₁, J₂) = J₂ (I_n ⊗ W) J₁ x,      x ∈ R^{n·b_in},  W ∈ R^{b_out × b_in}

computed as an index shuffle, one small matmul over the n blocks, and another shuffle; the m×m matrix
is never formed. With J₁ = J_c, J₂ = J_cᵀ it is the Mixer's token mixing (Eq. S.10–S.11), with
J₁ = J₂ = I its channel mixing (Eq. S.12), with fixed random J₁, J₂ the RP-Mixer's layer (Eq. S.13).

Vectorisation convention (ours, row-major as torch stores tensors): a token table X ∈ R^{S×C} is the
flat vector x = X.flatten() = vec(Xᵀ) in the paper's column-major notation. Channel mixing is then the
block-diagonal I_S ⊗ V (blocks of C), and token mixing needs the transpose shuffle first.

Permutation specs: 'identity', 'transpose' (J_c of the grid [b_in, n] on input, the inverse shuffle
of [n, b_out] on output, so that J₂ = J_cᵀ undoes J₁ = J_c when b_in = b_out), 'random' (from `seed`),
or an explicit index vector. Identity and transpose run as views; random and explicit ones as gathers.
The indices are int64 buffers in the state dict; a checkpoint that holds other indices for an
identity or transpose layer is refused, since the fast path would ignore them.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .base import StructuredLinear
from .permutation import (PermutationSpec, check_permutation, identity_permutation, inverse_permutation,
                          permute_features, random_permutation)

__all__ = ['PKLinear']


class PKLinear(StructuredLinear):
    """J₂ (I_{num_blocks} ⊗ W) J₁ x + b, Def. 5.1, with W shared by every block.

    Args:
        num_blocks: n, the number of diagonal blocks (C for token mixing, S for channel mixing).
        block_in, block_out: W is [block_out, block_in]; in_features = n·block_in, out = n·block_out.
        perm_in, perm_out: J₁ and J₂ ('identity' | 'transpose' | 'random' | int64 index vector).
        seed: seeds the random permutations (J₂ uses seed + 1), so a layer is rebuilt exactly.
        bias: a [block_out] bias shared by the blocks (as a Mixer MLP's), added before J₂.
    """

    def __init__(self, num_blocks: int, block_in: int, block_out: int, perm_in: PermutationSpec = 'identity',
                 perm_out: PermutationSpec = 'identity', seed: int = 0, bias: bool = True, device=None, dtype=None):
        for name, value in (('num_blocks', num_blocks), ('block_in', block_in), ('block_out', block_out)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PKLinear {name} must be a positive integer, got {value!r}")
        super().__init__(num_blocks * block_in, num_blocks * block_out, bias=False, device=device, dtype=dtype)
        self.num_blocks, self.block_in, self.block_out, self.seed = num_blocks, block_in, block_out, int(seed)
        self.weight = nn.Parameter(torch.empty(block_out, block_in, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(block_out, device=device, dtype=dtype)) if bias else None
        self.perm_in_kind, perm_in = self._resolve(perm_in, 'perm_in', self.in_features, (block_in, num_blocks), self.seed)
        self.perm_out_kind, perm_out = self._resolve(perm_out, 'perm_out', self.out_features, (num_blocks, block_out),
                                                     self.seed + 1)
        self.register_buffer('perm_in', perm_in.to(device))
        self.register_buffer('perm_out', perm_out.to(device))
        # inverses for the gather-only backward; derived, so not saved
        self.register_buffer('perm_in_inverse', inverse_permutation(perm_in).to(device), persistent=False)
        self.register_buffer('perm_out_inverse', inverse_permutation(perm_out).to(device), persistent=False)
        self.reset_parameters()

    @staticmethod
    def _resolve(spec: PermutationSpec, name: str, m: int, grid, seed: int):
        if spec is None or (isinstance(spec, str) and spec == 'identity'):
            return 'identity', identity_permutation(m)
        if isinstance(spec, str) and spec == 'transpose':
            rows, cols = grid
            return 'transpose', torch.arange(m, dtype=torch.int64).view(rows, cols).t().reshape(-1)
        if isinstance(spec, str) and spec == 'random':
            return 'random', random_permutation(m, seed)
        if isinstance(spec, str):
            raise ValueError(f"PKLinear {name}={spec!r}: expected 'identity', 'transpose', 'random' or an index vector")
        return 'explicit', check_permutation(spec, m, f"PKLinear {name}")

    def reset_parameters(self) -> None:
        # nn.Linear's default for a block_in → block_out map, so PKLinear drops in where Linear was
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.block_in)
            nn.init.uniform_(self.bias, -bound, bound)

    # ---- the fast path -------------------------------------------------------------------------
    def _shuffle_in(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if self.perm_in_kind == 'identity':
            return x.reshape(*lead, self.num_blocks, self.block_in)
        if self.perm_in_kind == 'transpose':
            return x.reshape(*lead, self.block_in, self.num_blocks).transpose(-1, -2)
        return permute_features(x, self.perm_in, self.perm_in_inverse).reshape(*lead, self.num_blocks, self.block_in)

    def _shuffle_out(self, y: torch.Tensor) -> torch.Tensor:
        lead = y.shape[:-2]
        if self.perm_out_kind == 'identity':
            return y.reshape(*lead, self.out_features)
        if self.perm_out_kind == 'transpose':
            return y.transpose(-1, -2).reshape(*lead, self.out_features)
        return permute_features(y.reshape(*lead, self.out_features), self.perm_out, self.perm_out_inverse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"PKLinear expects inputs [..., {self.in_features}] (num_blocks {self.num_blocks} × "
                             f"block_in {self.block_in}), got {tuple(x.shape)}")
        return self._shuffle_out(F.linear(self._shuffle_in(x), self.weight, self.bias))

    # ---- the materialised oracle ---------------------------------------------------------------
    def to_dense(self) -> torch.Tensor:
        """J₂ (I ⊗ W) J₁ as an [out, in] matrix: rows of the Kronecker product picked by perm_out,
        columns placed by perm_in (x[perm_in] = J₁x, so column perm_in[j] of the result is column j)."""
        eye = torch.eye(self.num_blocks, device=self.weight.device, dtype=self.weight.dtype)
        block_diagonal = torch.kron(eye, self.weight)            # I ⊗ W: [n·out, n·in]
        dense = torch.empty_like(block_diagonal)
        dense[:, self.perm_in] = block_diagonal
        return dense[self.perm_out]

    def dense_bias(self) -> Optional[torch.Tensor]:
        if self.bias is None:
            return None
        return self.bias.repeat(self.num_blocks)[self.perm_out]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        for name, kind in (('perm_in', self.perm_in_kind), ('perm_out', self.perm_out_kind)):
            if prefix + name not in state_dict:
                continue
            perm = getattr(self, name)
            try:
                check_permutation(perm.cpu(), perm.numel(), f"{prefix}{name}")
            except ValueError as e:
                error_msgs.append(str(e))
                continue
            if kind in ('identity', 'transpose'):
                expected = self._resolve(kind, name, perm.numel(), self._grid(name), 0)[1]
                if not torch.equal(perm.cpu(), expected):
                    error_msgs.append(f"{prefix}{name}: the checkpoint holds another permutation than this "
                                      f"layer's {kind!r} one")
                    continue
            getattr(self, name + '_inverse').copy_(inverse_permutation(perm))

    def _grid(self, name: str):
        return (self.block_in, self.num_blocks) if name == 'perm_in' else (self.num_blocks, self.block_out)

    def extra_repr(self) -> str:
        return (f'num_blocks={self.num_blocks}, block_in={self.block_in}, block_out={self.block_out}, '
                f'perm_in={self.perm_in_kind}, perm_out={self.perm_out_kind}, bias={self.bias is not None}')
