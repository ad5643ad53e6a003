"""Nyströmformer attention (Xiong et al., "Nyströmformer: A Nyström-Based Algorithm for
Approximating Self-Attention", AAAI 2021).

Landmarks are segment means of Q and K (paper Eq. 14), and softmax attention is approximated as

    F̃ Ã⁺ B̃ V,  F̃ = softmax(Q K̃ᵀ/√d),  Ã = softmax(Q̃ K̃ᵀ/√d),  B̃ = softmax(Q̃ Kᵀ/√d)   (paper Eq. 15)

evaluated right to left (memory linear in n). Ã⁺ comes from `newton_pinv`: Ã is row-stochastic,
not symmetric, and newton_pinv's X₀ = Ãᵀ/(‖Ã‖₁‖Ã‖_∞) is the paper's own initialisation; we iterate
Newton–Schulz (order 2) rather than the paper's order-3 scheme, so take ~1.6× the steps (paper: 6).
When m does not divide n, segment i covers tokens ⌊i·n/m⌋ … ⌊(i+1)·n/m⌋ − 1 (the paper pads to a
multiple of m instead). `conv_kernel_size` adds the paper's depthwise-conv skip on V (off by default).
"""
from typing import Optional, Tuple

import torch
from torch import nn

from ...functional.newton_pinv import newton_pinv
from ...functional.precision import float32_island
from .registry import register_attention
from ...arguments import positive_int
from .softmax import AttentionBase, check_no_mask, refuse_attn_drop

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def segment_means(x: torch.Tensor, num_landmarks: int) -> torch.Tensor:
    """[..., n, d] -> [..., m, d]: mean of each of m contiguous, nearly equal segments of tokens."""
    n = x.shape[-2]
    if not 1 <= num_landmarks <= n:
        raise ValueError(f"num_landmarks={num_landmarks} must be between 1 and the number of tokens n={n}")
    bounds = [(i * n) // num_landmarks for i in range(num_landmarks + 1)]
    averaging = torch.zeros(num_landmarks, n, dtype=x.dtype, device=x.device)
    for i in range(num_landmarks):
        averaging[i, bounds[i]:bounds[i + 1]] = 1.0 / (bounds[i + 1] - bounds[i])
    return averaging @ x


def nystrom_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_landmarks: int,
                      newton_iter: int = 20) -> torch.Tensor:
    """F̃ (Ã⁺ (B̃ V)) of paper Eq. 15 for q, k, v [..., n, d]; float32 inside under autocast."""
    out_dtype = v.dtype
    with float32_island(q.device.type):
        q, k, v = (t.float() if t.dtype in _LOW_PRECISION else t for t in (q, k, v))
        scale = q.shape[-1] ** -0.5
        q_l, k_l = segment_means(q, num_landmarks), segment_means(k, num_landmarks)
        kernel_f = torch.softmax(q @ k_l.transpose(-2, -1) * scale, dim=-1)      # F̃ [n, m]
        kernel_a = torch.softmax(q_l @ k_l.transpose(-2, -1) * scale, dim=-1)    # Ã  [m, m]
        kernel_b = torch.softmax(q_l @ k.transpose(-2, -1) * scale, dim=-1)      # B̃ [m, n]
        out = kernel_f @ (newton_pinv(kernel_a, newton_iter) @ (kernel_b @ v))
    return out.to(out_dtype)


def nystrom_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_landmarks: int) -> torch.Tensor:
    """Paper Eq. 15 written out: forms the n×n F̃ Ã⁺ B̃ with an SVD pseudo-inverse. For tests."""
    scale = q.shape[-1] ** -0.5
    q_l, k_l = segment_means(q, num_landmarks), segment_means(k, num_landmarks)
    kernel_f = torch.softmax(q @ k_l.transpose(-2, -1) * scale, dim=-1)
    kernel_a = torch.softmax(q_l @ k_l.transpose(-2, -1) * scale, dim=-1)
    kernel_b = torch.softmax(q_l @ k.transpose(-2, -1) * scale, dim=-1)
    return (kernel_f @ torch.linalg.pinv(kernel_a) @ kernel_b) @ v


@register_attention('nystrom')
class NystromAttention(AttentionBase):
    """Nyströmformer with timm's `attn_layer` signature. Kwargs: `num_landmarks` (m, default 49;
    must not exceed N), `newton_iter`, `conv_kernel_size` (depthwise skip on V; None = off).
    `attn_drop` must be 0 (no attention matrix is formed: refused, not ignored); `grid_size` is ignored."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.,
                 norm_layer=None, *, num_landmarks: int = 49, newton_iter: int = 20,
                 conv_kernel_size: Optional[int] = None, attn_head_dim: Optional[int] = None,
                 device=None, dtype=None):
        super().__init__(dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop,
                         norm_layer, attn_head_dim=attn_head_dim, device=device, dtype=dtype)
        refuse_attn_drop(type(self).__name__, attn_drop)
        positive_int('num_landmarks', num_landmarks)
        if conv_kernel_size is not None:
            positive_int('conv_kernel_size', conv_kernel_size)
        positive_int('newton_iter', newton_iter)        # True would have run one step
        self.num_landmarks = num_landmarks
        self.newton_iter = newton_iter
        self.conv = None
        if conv_kernel_size is not None and conv_kernel_size % 2 == 0:
            raise ValueError(f"conv_kernel_size must be odd (same-length output), got {conv_kernel_size}")
        if conv_kernel_size is not None:
            # one 1-D filter per head along the token axis (heads as channels of a [N, d] "image")
            self.conv = nn.Conv2d(num_heads, num_heads, (conv_kernel_size, 1), padding=(conv_kernel_size // 2, 0),
                                  groups=num_heads, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                grid_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        check_no_mask(type(self).__name__, attn_mask, is_causal)
        q, k, v = self.project(x)
        self.check_num_tokens(q.shape[-2])
        out = nystrom_attention(q, k, v, self.num_landmarks, self.newton_iter)
        if self.conv is not None:
            out = out + self.conv(v)
        return self.merge(out)

    def check_num_tokens(self, num_tokens: int) -> None:
        """m landmarks are segment means of the n tokens: m must not exceed n."""
        if self.num_landmarks > num_tokens:
            raise ValueError(f"num_landmarks={self.num_landmarks} exceeds the number of tokens n={num_tokens}; "
                             "pass a smaller num_landmarks (at most n)")

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_landmarks={self.num_landmarks}, newton_iter={self.newton_iter}"
