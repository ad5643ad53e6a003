"""Multi-head subspace self-attention (MSSA) of CRATE (Yu et al., 2023, §2.3).

One compression step on the coding rate R_c: each head k projects tokens onto its subspace
U_k (the shared Q = K = V projection) and pulls tokens of the same subspace together.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ...functional import autotune
from ...functional.precision import autocast_dtype
from ...functional.shared_qkv_attention import shared_qkv_attention
from ...functional.tracing import recording_graph
from ..linear.base import linear_weight
from ..linear.tuned import TunedLinear
from .registry import register_attention
from .softmax import check_dropouts, check_head_sizes

# how SSA runs when a backward follows (see MSSA)
SSA_IMPLS = ('auto', 'shared', 'sdpa')
# 'auto' on a CPU where nothing may be timed (`functional.autotune`: under torch.compile, with
# STRUCTFORMER_AUTOTUNE=off): the shared-QKV backward below this many tokens, SDPA from it, the crossovers
# measured on an AVX2 AMD EPYC (docs/benchmarks.md): at head width 16 between N = 145 and 197, at 32–64
# between 257 and 321. Elsewhere the machine times both once per shape class (`ssa_candidates`).
SHARED_BACKWARD_MAX_TOKENS = 128
SHARED_BACKWARD_WIDE_HEAD_DIM = 32
SHARED_BACKWARD_MAX_TOKENS_WIDE = 300


def default_ssa_impl(tokens: int, head_dim: int) -> str:
    """The rule 'auto' follows where it cannot time: 'shared' below the measured crossovers, else 'sdpa'."""
    wide = head_dim >= SHARED_BACKWARD_WIDE_HEAD_DIM
    return 'shared' if tokens < (SHARED_BACKWARD_MAX_TOKENS_WIDE if wide else SHARED_BACKWARD_MAX_TOKENS) else 'sdpa'


def ssa_shape_class(w: torch.Tensor) -> tuple:
    """(token class, head width, compute dtype) of w [images, heads, N, p]: what the speed of the two paths
    depends on per (image, head) pair (both run the pairs alike, so the batch does not enter)."""
    return (autotune.size_class(w.shape[-2]), w.shape[-1], str(autocast_dtype(w.device.type, w.dtype)).replace('torch.', ''))


def ssa_candidates(w: torch.Tensor, scale: float) -> dict:
    """Both paths' forward + backward on a stand-in for w (same N, p, heads, layout, device and dtype; at most
    as many images as give each thread four (image, head) pairs), for `autotune.decide`. Inputs drawn from a
    private generator: the global random stream is not touched."""
    images, heads, n, p = w.shape
    images = max(1, min(images, -(-4 * torch.get_num_threads() // heads)))
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(images, n, heads * p, generator=generator).to(w.dtype).requires_grad_()
    stand_in = flat.view(images, n, heads, p).transpose(1, 2)          # MSSA's rearranged qkv layout
    grad = torch.randn(images, heads, n, p, generator=generator).to(w.dtype)

    def run(attend):
        def call():
            flat.grad = None
            with torch.enable_grad():
                attend().backward(grad)
        return call
    return {'shared': run(lambda: shared_qkv_attention(stand_in, scale)),
            'sdpa': run(lambda: F.scaled_dot_product_attention(stand_in, stand_in, stand_in, scale=scale))}


@register_attention('mssa')
class MSSA(nn.Module):
    """MSSA with timm's `attn_layer` signature.

    `tied_output=False` (default): Eq. 115 / Alg. 3 as the paper trains it — `w = qkv(x)`,
    `softmax(w wᵀ · dim_head^-0.5) w` per head, then a separate trainable `to_out`.
    `tied_output=True`: Eq. 11–12 — the output map is p/(Nε²)[U_1…U_K], i.e. the same weight
    as the projection (App. B.4 "compression-inspired attention"); `eps` sets ε.
    The softmax scale dim_head^-0.5 is kept in both (Eq. 11 writes none; the code uses it).
    `project_out=False`: no output map at all (Alg. 3 / the public code use none when one head spans the model,
    `heads == 1 and dim_head == dim`; `CRATE` applies that rule, the layer alone keeps timm's projection).

    `ssa_impl` picks how SSA runs when a backward will follow: 'sdpa' torch's fused attention,
    'shared' the backward that knows Q = K = V (`functional.shared_qkv_attention`: three N×N×p
    products instead of five, at the cost of keeping the N×N weights), 'auto' (default) on a CPU
    whichever of the two this machine runs faster for the shape class (token class, head width, dtype):
    timed once on first use and cached (`functional.autotune`, choice 'ssa_impl'; overridden by
    STRUCTFORMER_CHOICE_SSA_IMPL), SDPA on GPUs. Where nothing may be timed (torch.compile,
    STRUCTFORMER_AUTOTUNE=off) 'auto' follows `default_ssa_impl`: the shared backward below
    `SHARED_BACKWARD_MAX_TOKENS` (128) tokens, or `SHARED_BACKWARD_MAX_TOKENS_WIDE` (300) at head widths
    of 32 and more, the crossovers of an AVX2 AMD EPYC (MSSA forward + backward, 6 heads, back to back:
    the shared backward 1.05–1.9× faster than SDPA up to N = 145 at every head width and 3–10 % faster
    at widths 32–64 up to N = 257). They move with the CPU: on an AVX-512 AMD EPYC the shared backward
    lost at N = 65 and won at N = 577 (width 64); see docs/benchmarks.md. Without grad, with a mask,
    causal or with attention dropout, SDPA runs whatever `ssa_impl` says.
    """

    def __init__(self, dim: int, num_heads: int = 8, attn_head_dim: Optional[int] = None,
                 qkv_bias: bool = False, qk_norm: bool = False, scale_norm: bool = False,
                 proj_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.,
                 norm_layer=None, tied_output: bool = False, eps: float = 1.0, ssa_impl: str = 'auto',
                 project_out: bool = True, device=None, dtype=None):
        super().__init__()
        if qk_norm or scale_norm:
            raise ValueError("MSSA shares one projection for Q, K and V (CRATE Eq. 11): "
                             "qk_norm / scale_norm are not defined for it; pass qk_norm=False")
        attn_head_dim = check_head_sizes(dim, num_heads, attn_head_dim)
        check_dropouts(attn_drop, proj_drop)
        # an infinite ε made the tied output 0 for every input, silently; None or a string failed in the comparison
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
            raise ValueError(f"eps={eps!r} must be a finite number > 0 (the ε of Eq. 12's p/(Nε²) scaling)")
        if ssa_impl not in SSA_IMPLS:
            raise ValueError(f"ssa_impl={ssa_impl!r}: accepted {', '.join(repr(i) for i in SSA_IMPLS)}")
        self.ssa_impl = ssa_impl
        dd = {'device': device, 'dtype': dtype}
        self.num_heads = num_heads
        self.head_dim = attn_head_dim
        self.scale = attn_head_dim ** -0.5
        self.tied_output = tied_output
        self.eps = eps
        inner = num_heads * attn_head_dim
        # one projection: its rows, per head, are U_kᵀ (CRATE's Q = K = V)
        self.qkv = TunedLinear(dim, inner, bias=qkv_bias, **dd)     # nn.Linear on this machine's fastest GEMM
        self.attn_drop = nn.Dropout(attn_drop)
        # Eq. 12 maps back with U itself, so no separate output weight exists when tied; project_out=False (Alg. 3's
        # rule for one head as wide as the model, which CRATE applies) returns the head itself, no map, no dropout
        if not project_out and not tied_output and inner != dim:
            raise ValueError(f"project_out=False returns the heads as they are: num_heads·head_dim = {inner} must "
                             f"equal dim = {dim}")
        self.proj = TunedLinear(inner, dim, bias=proj_bias, **dd) if project_out and not tied_output else None
        self.proj_drop = nn.Dropout(proj_drop)

    def extra_repr(self) -> str:
        eps = f', eps={self.eps}' if self.tied_output else ''                # ε of Eq. 12: the tied output's only
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, tied_output={self.tied_output}{eps}, "
                f"project_out={self.proj is not None}, ssa_impl={self.ssa_impl!r}")

    def subspace_bases(self) -> torch.Tensor:
        """The learned U_k as a [K, d, p] stack (columns of Wᵀ, head by head)."""
        w = linear_weight(self.qkv)                              # [K·p, d] (also after `factorize`)
        return rearrange(w, '(k p) d -> k d p', k=self.num_heads)

    def _shared_backward_applies(self, w: torch.Tensor, attn_mask, is_causal: bool) -> bool:
        if self.ssa_impl == 'sdpa' or attn_mask is not None or is_causal or not torch.is_grad_enabled():
            return False
        if recording_graph():            # export / ONNX / tracing: SDPA, the same function without the custom ops
            return False
        if not w.requires_grad or (self.training and self.attn_drop.p > 0):
            return False
        if self.ssa_impl == 'shared':
            return True
        if w.device.type != 'cpu':
            return False
        choice = autotune.decide('ssa_impl', ssa_shape_class(w), default_ssa_impl(w.shape[-2], w.shape[-1]),
                                 lambda: ssa_candidates(w, self.scale))
        return choice == 'shared'

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False, grid_size=None) -> torch.Tensor:
        w = rearrange(self.qkv(x), 'b n (h p) -> b h n p', h=self.num_heads)
        if self._shared_backward_applies(w, attn_mask, is_causal):
            heads = shared_qkv_attention(w, self.scale)
        else:
            heads = F.scaled_dot_product_attention(
                w, w, w, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale,
                dropout_p=self.attn_drop.p if self.training else 0.)
        heads = rearrange(heads, 'b h n p -> b n (h p)')
        if self.proj is not None:
            return self.proj_drop(self.proj(heads))
        if not self.tied_output:
            return heads                                           # Alg. 3's project_out = False: nn.Identity
        n = x.shape[-2]
        tied_scale = self.head_dim / (n * self.eps ** 2)           # p/(Nε²) of Eq. 12
        return self.proj_drop(tied_scale * heads @ linear_weight(self.qkv))
