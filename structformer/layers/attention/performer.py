"""Performer attention: FAVOR+ (Choromanski et al., "Rethinking Attention with Performers", ICLR 2021).

The softmax kernel exp(qᵀk/√d) is the expectation of φ(q')ᵀφ(k') with q' = q/d^¼, k' = k/d^¼ and
positive random features (paper Lemma 1)

    φ(x) = exp(ωᵢᵀx − ‖x‖²/2)_{i=1..m} / √m,   ω ~ N(0, I_d),

with the ωᵢ drawn as orthogonal blocks (paper §2.4, "ORF"). Attention is then
D̂⁻¹ φ(Q')(φ(K')ᵀ V), D̂ = diag(φ(Q')(φ(K')ᵀ 1_n)), linear in n. The features are a buffer (saved
with the model, one set per layer shared by the heads) and change only when `redraw_features()`
is called (by hand, or every `redraw_interval` training forwards).
"""
import math
from typing import Optional, Tuple

import torch

from ...functional.precision import float32_island
from .registry import register_attention
from ...arguments import positive_int
from .softmax import AttentionBase, check_no_mask, refuse_attn_drop


def orthogonal_random_features(num_features: int, dim: int, generator: Optional[torch.Generator] = None,
                               device=None, dtype=None) -> torch.Tensor:
    """[num_features, dim] rows ω: orthonormal within each block of `dim` rows, each row rescaled
    by an independent χ_d norm so its marginal is N(0, I_d) (FAVOR+ "regularized" ORF, §2.4)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32   # QR has no half kernels
    blocks = []
    for _ in range(math.ceil(num_features / dim)):
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=work))
        blocks.append((q * torch.sign(torch.diagonal(r))).T)     # sign fix makes Q Haar-distributed
    directions = torch.cat(blocks)[:num_features]
    norms = torch.randn(num_features, dim, generator=generator, dtype=work).norm(dim=1, keepdim=True)
    return (norms * directions).to(device=device, dtype=dtype)


_HALF = (torch.float16, torch.bfloat16)


def _feature_dtype(dtype):
    """The dtype ω is kept in for a layer built in `dtype`: float32 for half precision (see `_apply`)."""
    return torch.float32 if dtype in _HALF else dtype


def _scaled(q: torch.Tensor, k: torch.Tensor):
    s = q.shape[-1] ** -0.25                                        # q'ᵀk' = qᵀk/√d
    return q * s, k * s


def performer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """FAVOR+ estimate of softmax(QKᵀ/√d) V; q, k, v [..., n, d], projection ω [m, d]. O(n·m) memory.

    Stabilisers cancel in D̂⁻¹: each query's features are divided by their row maximum, all keys'
    by one maximum per head, so exp never overflows; 1/√m cancels as well and is omitted.
    """
    q, k = _scaled(q, k)
    log_q = q @ projection.T - q.pow(2).sum(-1, keepdim=True) / 2   # log φ(q'), up to −log √m
    log_k = k @ projection.T - k.pow(2).sum(-1, keepdim=True) / 2
    phi_q = torch.exp(log_q - log_q.amax(-1, keepdim=True).detach())
    phi_k = torch.exp(log_k - log_k.amax((-2, -1), keepdim=True).detach())
    context = phi_k.transpose(-2, -1) @ v                          # φ(K')ᵀV: [..., m, d]
    normaliser = phi_q @ phi_k.sum(-2).unsqueeze(-1)               # D̂: [..., n, 1]
    return (phi_q @ context) / normaliser.clamp_min(torch.finfo(normaliser.dtype).tiny)


def performer_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  projection: torch.Tensor) -> torch.Tensor:
    """FAVOR+ written out: explicit φ, the n×n Â = φ(Q')φ(K')ᵀ, then D̂⁻¹ Â V. For tests."""
    q, k = _scaled(q, k)
    m = projection.shape[0]

    def phi(x):
        return torch.exp(x @ projection.T - x.pow(2).sum(-1, keepdim=True) / 2) / math.sqrt(m)

    a_hat = phi(q) @ phi(k).transpose(-2, -1)
    return (a_hat / a_hat.sum(-1, keepdim=True)) @ v


@register_attention('performer')
class PerformerAttention(AttentionBase):
    """FAVOR+ attention with timm's `attn_layer` signature.

    Kwargs: `num_features` (m; default ⌈d·ln d⌉ per head, the paper's choice, and at least d: a head of width 1
    has ⌈d·ln d⌉ = 0), `redraw_features()`
    to draw new ω, `redraw_interval` (None: ω fixed, as before; N: a new ω before every N-th training forward, the
    public performer-pytorch's feature redrawing, 1000 there; the forward count is a buffer, so a reload keeps
    the schedule). `attn_drop` must be 0 (there are no attention weights to drop: refused, not ignored);
    `grid_size` is ignored.
    """

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.,
                 norm_layer=None, *, num_features: Optional[int] = None, redraw_interval: Optional[int] = None,
                 attn_head_dim: Optional[int] = None, device=None, dtype=None):
        super().__init__(dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop,
                         norm_layer, attn_head_dim=attn_head_dim, device=device, dtype=dtype)
        refuse_attn_drop(type(self).__name__, attn_drop)
        if num_features is None:
            num_features = max(self.head_dim, math.ceil(self.head_dim * math.log(self.head_dim)))
        positive_int('num_features', num_features)
        self.num_features = num_features
        self.register_buffer('projection', orthogonal_random_features(num_features, self.head_dim, device=device,
                                                                      dtype=_feature_dtype(dtype)))
        if redraw_interval is not None:
            positive_int('redraw_interval', redraw_interval)
            # only with redrawing on: the state dict of a fixed-feature layer is unchanged
            self.register_buffer('training_forwards', torch.zeros((), dtype=torch.long, device=device))
        self.redraw_interval = redraw_interval

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` / `.half()` / `.bfloat16()` cast the layer, but ω stays float32 (moved with it): the forward
        computes the features in float32 (it upcasts q, k, v), and an ω rounded to 8 mantissa bits (bfloat16) is
        orthogonal only to ~4e-3 instead of ~3e-7, which changes φ(q')ᵀφ(k') for nothing (ω is m x d_head numbers
        per layer). performer-pytorch casts its projection_matrix with the model; here a cast model computes the
        same attention as its float32 original from the same q, k, v. A float64 cast follows (gradcheck)."""
        features = self.projection
        super()._apply(fn, recurse)
        if self.projection.dtype in _HALF and features.dtype not in _HALF:
            self.projection = features.to(device=self.projection.device, dtype=torch.float32)
        return self

    def reset_parameters(self) -> None:
        """A fresh ω (from the global generator, as the constructor draws it) and the redraw count at 0: the layer's
        own state, which torch's deferred initialisation (a meta-device build, `to_empty`, then `reset_parameters` on
        every module) must fill in; `to_empty` leaves it uninitialised memory. The q/k/v and output maps reset
        themselves."""
        self.redraw_features()
        if self.redraw_interval is not None:
            with torch.no_grad():
                self.training_forwards.zero_()

    @torch.no_grad()
    def redraw_features(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw a new ω (the only time the features change), in the buffer's dtype: a float64 layer's redraw
        was drawn in float32 (orthogonal to 3e-7 instead of 4e-16)."""
        self.projection.copy_(orthogonal_random_features(self.num_features, self.head_dim, generator,
                                                         dtype=self.projection.dtype))

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                grid_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        check_no_mask(type(self).__name__, attn_mask, is_causal)
        if self.training and self.redraw_interval is not None:
            done = int(self.training_forwards)
            if done and done % self.redraw_interval == 0:
                self.redraw_features()
            self.training_forwards += 1
        q, k, v = self.project(x)
        with float32_island(x.device.type):
            # exp of a difference of large dot products: bf16 there gives wrong weights
            q, k, v32 = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (q, k, v))
            out = performer_attention(q, k, v32, self.projection.to(q.dtype))
        return self.merge(out.to(v.dtype))

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_features={self.num_features}"
                + (f", redraw_interval={self.redraw_interval}" if self.redraw_interval else ""))
