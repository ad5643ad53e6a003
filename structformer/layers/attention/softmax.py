"""Softmax attention baselines (Vaswani et al., 2017; SOFT Eq. 3) and the plumbing every attention
in this package shares: timm's `attn_layer` constructor, head split / merge, output projection.

`"softmax"` calls `F.scaled_dot_product_attention` (fused kernels where available);
`"softmax_naive"` forms softmax(QKᵀ/√d) explicitly, the O(n²)-memory baseline for benchmarks.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ...arguments import optional_positive_int, positive_int, rate
from .registry import register_attention


def check_no_mask(name: str, attn_mask: Optional[torch.Tensor], is_causal: bool) -> None:
    """Linearised attentions never form QKᵀ, so there is nothing to mask: refuse rather than ignore."""
    if attn_mask is not None or is_causal:
        raise NotImplementedError(f"{name} does not support attn_mask / is_causal (it never forms the n×n "
                                  "attention matrix); use 'softmax' for masked attention")


def refuse_attn_drop(name: str, attn_drop: float) -> None:
    """For attentions that never form attention weights (FAVOR+, Nyström's factored product): an `attn_drop`
    there would be silently ignored (as the public code does), so a non-zero one is refused by name."""
    if attn_drop:
        raise ValueError(f"attn_drop={attn_drop}: {name} never forms the attention weights, so there is nothing to "
                         "drop; pass attn_drop=0 (attn_drop_rate=0 in a ViT; proj_drop and drop_path still apply)")


def check_dropouts(attn_drop, proj_drop) -> None:
    """Both dropout rates in [0, 1): torch's nn.Dropout named neither ("dropout probability has to be between 0
    and 1") and took NaN."""
    rate('attn_drop', attn_drop)
    rate('proj_drop', proj_drop)


def check_head_sizes(dim: int, num_heads: int, attn_head_dim: Optional[int]) -> int:
    """Validate timm's attention sizes before any tensor is built; returns the head width (dim // num_heads
    unless attn_head_dim is given). Raises a ValueError naming the argument, not a torch shape error."""
    positive_int('dim', dim)
    positive_int('num_heads', num_heads)
    optional_positive_int('attn_head_dim', attn_head_dim)
    if attn_head_dim is None:
        if dim % num_heads:
            raise ValueError(f"dim={dim} must be divisible by num_heads={num_heads} (or pass attn_head_dim)")
        return dim // num_heads
    return attn_head_dim


class AttentionBase(nn.Module):
    """timm `attn_layer` signature plus head split / merge. Subclasses implement `forward`.

    `shared_qk=True` builds one projection for Q = K (SOFT §3.1) and one for V, so `project`
    returns k = q. `qk_norm` normalises q (and k) per head with `norm_layer(head_dim)`;
    `scale_norm` normalises the merged heads before `proj`, as timm's `Attention` does.
    """

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0.,
                 proj_drop: float = 0., norm_layer=None, *, attn_head_dim: Optional[int] = None,
                 shared_qk: bool = False, device=None, dtype=None):
        super().__init__()
        attn_head_dim = check_head_sizes(dim, num_heads, attn_head_dim)
        check_dropouts(attn_drop, proj_drop)
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError("qk_norm / scale_norm need a norm_layer (timm's Block passes one)")
        dd = {'device': device, 'dtype': dtype}
        self.num_heads = num_heads
        self.head_dim = attn_head_dim
        self.shared_qk = shared_qk
        inner = num_heads * attn_head_dim
        self.qkv = nn.Linear(dim, inner * (2 if shared_qk else 3), bias=qkv_bias, **dd)
        self.q_norm = norm_layer(attn_head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = nn.Identity() if (shared_qk or not qk_norm) else norm_layer(attn_head_dim, **dd)
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(inner, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(inner, dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, N, C] -> q, k, v of shape [B, heads, N, head_dim] (k is q when shared_qk)."""
        parts = rearrange(self.qkv(x), 'b n (s h d) -> s b h n d', h=self.num_heads, d=self.head_dim)
        if self.shared_qk:
            q, v = parts.unbind(0)
            q = self.q_norm(q)
            return q, q, v
        q, k, v = parts.unbind(0)
        return self.q_norm(q), self.k_norm(k), v

    def check_num_tokens(self, num_tokens: int) -> None:
        """Refuse, when the model is built, a token count this layer cannot attend over (a model with a fixed
        input size calls it with its N: patches + prefix tokens), so an impossible option is named at build
        time rather than by every forward. Layers without such a limit accept any N."""

    def merge(self, heads: torch.Tensor) -> torch.Tensor:
        """[B, heads, N, head_dim] -> [B, N, C] through norm, proj and dropout."""
        out = rearrange(heads, 'b h n d -> b n (h d)')
        return self.proj_drop(self.proj(self.norm(out)))


def softmax_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                scale: Optional[float] = None,
                                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Eq. 3 of SOFT, written out: softmax(QKᵀ·scale + mask) V, scale = 1/√d by default.

    A boolean mask keeps the True entries (SDPA's convention); a float mask is added.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q @ k.transpose(-2, -1)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            logits = logits.masked_fill(~attn_mask, float('-inf'))
        else:
            logits = logits + attn_mask
    return logits.softmax(-1) @ v


@register_attention('softmax')
class SoftmaxAttention(AttentionBase):
    """Standard multi-head softmax attention via `F.scaled_dot_product_attention`.

    Same constructor and call as the other attentions here; `grid_size` is accepted and unused.
    Supports `attn_mask` and `is_causal` (SDPA semantics). `fused_attn` is timm's switch (as on timm's
    `Attention`, an alias of `fused`): False runs the explicit softmax, whose weights pass through `attn_drop`,
    where hooks read attention maps.
    """
    fused = True

    @property
    def fused_attn(self) -> bool:
        return self.fused

    @fused_attn.setter
    def fused_attn(self, value: bool) -> None:
        # timm users switch `attn.fused_attn = False` to read attention maps: it set an unused attribute here
        self.fused = bool(value)

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0.,
                 proj_drop: float = 0., norm_layer=None, *, attn_head_dim: Optional[int] = None,
                 device=None, dtype=None):
        super().__init__(dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop,
                         norm_layer, attn_head_dim=attn_head_dim, device=device, dtype=dtype)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                grid_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        q, k, v = self.project(x)
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                 dropout_p=self.attn_drop.p if self.training else 0.)
        else:
            out = self._explicit(q, k, v, attn_mask, is_causal)
        return self.merge(out)

    def _explicit(self, q, k, v, attn_mask, is_causal):
        logits = (q @ k.transpose(-2, -1)) * self.scale
        if is_causal:
            if attn_mask is not None:      # SDPA refuses the pair; the mask was silently replaced here
                raise ValueError("attn_mask and is_causal=True together: pass one (as F.scaled_dot_product_attention)")
            n = q.shape[-2]
            attn_mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                logits = logits.masked_fill(~attn_mask, float('-inf'))
            else:
                logits = logits + attn_mask
        return self.attn_drop(logits.softmax(-1)) @ v


@register_attention('softmax_naive')
class NaiveSoftmaxAttention(SoftmaxAttention):
    """Softmax attention with the n×n matrix formed explicitly (O(n²) memory): a benchmark baseline."""
    fused = False
