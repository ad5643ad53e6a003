"""Linformer attention (Wang et al., "Linformer: Self-Attention with Linear Complexity", 2020).

head = softmax(Q (E K)ᵀ / √d) (F V), with learned E, F ∈ R^{k×n} projecting the n keys and values
down to k (paper Eq. 7). One E, F per layer shared by all heads (the paper's "headwise sharing");
`share_kv=True` also ties F = E ("key-value sharing"). k is `num_landmarks`, to match the other
attentions' keyword. E and F have n columns, so the sequence length is fixed: pass `seq_len`; inside a model that knows
its token count (structformer's ViTs, `shape_sequence_projections`) they are shaped when it is built;
otherwise they are created at the first forward from its N (with a warning: build the optimizer after
one forward pass then); any later call with another N raises.
"""
import math
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from ..lazy import drop_lazy_hooks, is_uninitialized

from .registry import register_attention
from ...arguments import positive_int
from .softmax import AttentionBase, check_no_mask


def linformer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor, f: torch.Tensor,
                        dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(Q (E K)ᵀ/√d)(F V) for q, k, v [..., n, d] and e, f [k, n]; O(n·k) memory."""
    k_proj = torch.einsum('pn,...nd->...pd', e, k)
    v_proj = torch.einsum('pn,...nd->...pd', f, v)
    return F.scaled_dot_product_attention(q, k_proj, v_proj, dropout_p=dropout_p)


def linformer_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor,
                                  f: torch.Tensor) -> torch.Tensor:
    """Paper Eq. 7 head by head, each product written out. For tests."""
    lead, (n, d) = q.shape[:-2], q.shape[-2:]
    qs, ks, vs = (t.reshape(-1, n, t.shape[-1]) for t in (q, k, v))
    heads = []
    for qh, kh, vh in zip(qs, ks, vs):
        context = torch.softmax(qh @ (e @ kh).T / math.sqrt(d), dim=-1)   # P̄ of Eq. 7: [n, k]
        heads.append(context @ (f @ vh))
    return torch.stack(heads).reshape(*lead, n, -1)


class SequenceProjection(LazyModuleMixin, nn.Module):
    """Linformer's E (and F): [proj_len, seq_len] maps along the token axis, created lazily if seq_len is None."""

    def __init__(self, proj_len: int, seq_len: Optional[int] = None, share_kv: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.proj_len = proj_len
        self.share_kv = share_kv
        if seq_len is None:
            self.e = nn.UninitializedParameter(device=device, dtype=dtype)
            self.f = None if share_kv else nn.UninitializedParameter(device=device, dtype=dtype)
        else:
            self._check(seq_len)
            self.e = nn.Parameter(torch.empty(proj_len, seq_len, device=device, dtype=dtype))
            self.f = None if share_kv else nn.Parameter(torch.empty(proj_len, seq_len, device=device, dtype=dtype))
            self.reset_parameters()
            drop_lazy_hooks(self)

    def _check(self, seq_len: int) -> None:
        if self.proj_len > seq_len:
            raise ValueError(f"num_landmarks={self.proj_len} (Linformer's k) exceeds the sequence length n={seq_len}")

    @property
    def seq_len(self) -> Optional[int]:
        return None if is_uninitialized(self.e) else self.e.shape[-1]

    def reset_parameters(self) -> None:
        if self.has_uninitialized_params():
            return
        # std 1/√n keeps each projected token at the scale of one token (a sum over n tokens)
        for p in (self.e, self.f):
            if p is not None:
                nn.init.normal_(p, std=p.shape[-1] ** -0.5)

    def materialize(self, seq_len: int, device=None) -> None:
        """Shape E (and F) for `seq_len` tokens now and draw them (a model that knows its token count at build,
        so that its parameters are complete before an optimiser or a state_dict load); no-op once shaped."""
        if not self.has_uninitialized_params():
            return
        self._check(seq_len)
        with torch.no_grad():
            for p in (self.e, self.f):
                if p is not None:
                    p.materialize((self.proj_len, seq_len), device=device)
        self.reset_parameters()
        drop_lazy_hooks(self)

    def initialize_parameters(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.has_uninitialized_params():
            n = k.shape[-2]
            self.materialize(n, device=k.device)
            warnings.warn(f"Linformer projections E, F created at the first forward for seq_len={n}; build the "
                          "optimizer after one forward pass, pass seq_len= at construction, or shape them when the "
                          "model is built (structformer.models.attention_swap.shape_sequence_projections(model), "
                          "or build it with structformer's build_model / swap_attention, which do)")

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """-> (E, F) after checking that the token count matches."""
        if k.shape[-2] != self.e.shape[-1]:
            raise ValueError(f"Linformer was built for seq_len={self.e.shape[-1]} tokens, got N={k.shape[-2]}")
        return self.e, self.e if self.f is None else self.f

    def extra_repr(self) -> str:
        return f"proj_len={self.proj_len}, seq_len={self.seq_len}, share_kv={self.share_kv}"


@register_attention('linformer')
class LinformerAttention(AttentionBase):
    """Linformer with timm's `attn_layer` signature. Kwargs: `num_landmarks` (k, default 49),
    `seq_len` (n; None = taken from the first forward), `share_kv` (F = E). `grid_size` is ignored."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.,
                 norm_layer=None, *, num_landmarks: int = 49, seq_len: Optional[int] = None, share_kv: bool = False,
                 attn_head_dim: Optional[int] = None, device=None, dtype=None):
        super().__init__(dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop,
                         norm_layer, attn_head_dim=attn_head_dim, device=device, dtype=dtype)
        positive_int('num_landmarks', num_landmarks)
        if seq_len is not None:
            positive_int('seq_len', seq_len)
        self.num_landmarks = num_landmarks
        self.seq_proj = SequenceProjection(num_landmarks, seq_len, share_kv, device=device, dtype=dtype)

    def check_num_tokens(self, num_tokens: int) -> None:
        """E, F map n tokens to k: k must not exceed n, and E, F built for another n do not fit."""
        self.seq_proj._check(num_tokens)
        if self.seq_proj.seq_len is not None and self.seq_proj.seq_len != num_tokens:
            raise ValueError(f"Linformer was built for seq_len={self.seq_proj.seq_len} tokens, the model has "
                             f"N={num_tokens}")

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                grid_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        check_no_mask(type(self).__name__, attn_mask, is_causal)
        q, k, v = self.project(x)
        e, f = self.seq_proj(k, v)
        out = linformer_attention(q, k, v, e.to(k.dtype), f.to(v.dtype),
                                  dropout_p=self.attn_drop.p if self.training else 0.)
        return self.merge(out)
