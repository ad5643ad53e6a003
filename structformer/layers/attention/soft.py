"""SOFT and SOFT++: softmax-free attention (Lu et al., "Softmax-free Linear Transformers", IJCV 2024).

Gaussian kernel attention `S = exp(Q ⊖ K)` (Eq. 4–5, Q = K from one projection, §3.1) approximated
by Nyström through m bottleneck tokens Q̃ (Eq. 6–9):

    A = exp(Q̃ ⊖ Q̃)  [m×m],   P = exp(Q̃ ⊖ Q)  [m×n],   Ŝ = Pᵀ A† P               (SOFT, Eq. 9)
    Ŝ = Pᵀ D^-½ A† D^-½ P,   D = diag(A 1_m)                                      (SOFT++, Eq. 17)

A† comes from `newton_pinv` (Eq. 10, implicit backward Eq. 12). `Ŝ V` is evaluated right to left,
`Pᵀ (A† (P V))`, so nothing n×n is formed: time and memory are linear in n.

Interface decisions (the paper leaves them open):
* Token layout: the first `N − H·W` tokens are prefix tokens (e.g. timm's cls token), the rest an
  H×W grid in row-major order. `grid_size=(H, W)` is passed to `forward` (default: the
  constructor's `grid_size`); without either, N − prefix must be a perfect square (prefix =
  `num_prefix_tokens`, or 0 then 1 when that is None), else a ValueError asks for grid_size.
* Prefix tokens are added to the landmarks (m_total = p + m). Nyström reproduces landmark rows
  and columns of S exactly, so the cls token attends, and is attended to, with the exact Gaussian
  kernel, and Ŝ stays one symmetric PSD Nyström approximation. Cost: p more landmarks.
* Samplers (§3.2) on the grid of Q: `conv` (Conv2d over all heads' channels, kernel = stride = k,
  default), `avgpool` (kernel = stride = k), `random` (m grid tokens; a fresh subset every training
  forward, and at eval one fixed subset per (n, m) drawn from `seed`, so evaluation is deterministic).
* k (the paper's sampling ratio "sp"): `sampling_ratio` if given, else k = ⌈√(HW / num_landmarks)⌉, so
  m = ⌈H/k⌉·⌈W/k⌉ ≈ num_landmarks (49 for 56², 28², 14², 7² grids with k = 8, 4, 2, 1). Grids that k
  does not divide: avgpool uses ceil_mode (a border window averages the real tokens it covers);
  conv replicate-pads the grid (never zeros, which would pull border landmarks to the origin), or with
  `landmark_border='drop'` (official) drops the rows and columns past the last whole window, as the public
  code's unpadded Conv2d: m = ⌊H/k⌋·⌊W/k⌋ (at 240 px its stage 1 is 60², 7² = 49 landmarks, not 8² = 64).
* The conv's weight is k×k, so k must be known when it is built: from `sampling_ratio`, from the
  constructor's `grid_size`, or else the weight is created at the first forward (a lazy
  parameter, with a warning: build the optimizer after one forward pass in that case). It is
  initialised as average pooling, so training starts from the `avgpool` sampler.
* Precision under autocast (docs/precision.md): the float32 islands are the kernel exponent (P and A),
  A† and the m-sized products with A† (autocast off, inputs upcast); the n-sized products around them
  (P V, Pᵀ z; folded: P x and the [n, h·m] output product) run in the autocast dtype. Measured against a
  float64 reference on bf16-valued inputs: this order stays at ≤ 1.3·2⁻⁸ relative error for cond(A) from 1
  to 1e6, while A† in bf16 (entries of both signs, cancellation in A† P V) reached 1e-2 at cond 60 and 6e-2 at
  1e6. SOFT's public code has no float32 island at all (under `--amp` its kernel and inverse run in fp16).
* `attn_drop` drops entries of the left factor Pᵀ (query-to-landmark weights): there is no n×n
  attention matrix to drop from.
* Evaluation order: Ŝ's factors are per-head m-row matrices, so the value and output projections
  can be folded into them (`soft_attention_projected`): V and the per-head outputs are never
  formed, and the only n-sized tensors are Q, P, one read of x and the output. Same value and
  gradients as the textbook order (tested); it costs n·h·m·(C_in + C_out) multiply-adds against
  the textbook n·(h·d·(C_in + C_out) + 2·h·m·d), so by default (`fold_projections=None`) each layer
  takes the cheaper order (`SoftAttention.folding_pays`): folded when h·m is small against the width.
* The conv sampler's windows do not overlap (kernel = stride), so it runs as one matmul over
  flattened k×k windows of the token sequence, with `F.conv2d` kept as its reference.

The public code (fudan-zvg/SOFT) differs from the paper's equations; `official=True` follows it, and
each difference is its own argument (landmark LayerNorm + GELU, V depthwise conv, its inverse rules,
unrolled backward, sampler init) so it can be ablated. docs/soft.md has the table; the reference of the
public attention written from its equations is in tests/test_soft_official.py.
"""
import math
from contextlib import nullcontext
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from ...functional.gaussian_kernel import gaussian_kernel, gaussian_kernel_reference
from ...functional.newton_pinv import check_rule, newton_pinv
from ...functional.precision import autocast_dtype, float32_island
from ...functional.precision import upcast as _upcast
from ...functional.tracing import graph_constant, recording_graph
from .registry import register_attention
from .soft_landmarks import SAMPLER_INITS, ConvLandmarkSampler, sampling_ratio_for   # noqa: F401 (re-exported)
from ...arguments import count, image_size, positive_int
from .softmax import AttentionBase, check_no_mask

SAMPLERS = ('conv', 'avgpool', 'random')


def soft_attention(q: torch.Tensor, v: torch.Tensor, landmarks: torch.Tensor, normalize: bool = False,
                   newton_iter: int = 20, ridge: float = 0.0, scale: Optional[float] = None,
                   dropout: Optional[nn.Module] = None, newton_rule: str = 'ours',
                   newton_backward: str = 'closed_form') -> torch.Tensor:
    """Ŝ V for SOFT (Eq. 9) or, with `normalize=True`, SOFT++ (Eq. 17); memory O((m + d)·n + m²).

    q: [..., n, d] (K = Q), v: [..., n, d_v], landmarks Q̃: [..., m, d]. Returns [..., n, d_v] in the autocast
    dtype inside autocast, else v's dtype. `dropout` (if given) is applied to the left factor Pᵀ.
    `newton_rule` / `newton_backward`: see `newton_pinv`.
    Dtype policy: the kernels P, A, the inverse A†, D^-½ and the m-sized products with A† run in float32
    (autocast off, half inputs upcast: A† has large entries of both signs), the two n-sized products P V and
    Pᵀ z in the autocast dtype (v's dtype outside autocast), as the matmuls they are (module docstring).
    """
    device_type = q.device.type
    low = autocast_dtype(device_type, v.dtype)                     # dtype of the n-sized products
    with float32_island(device_type):
        q, landmarks = _upcast(q), _upcast(landmarks)
        p = gaussian_kernel(landmarks, q, scale)                   # exp(Q̃ ⊖ K): [..., m, n], float32 island
        a = gaussian_kernel(landmarks, landmarks, scale)           # exp(Q̃ ⊖ K̃): [..., m, m]
        a_pinv = newton_pinv(a, newton_iter, ridge, rule=newton_rule, backward=newton_backward)
        p_low = p.to(low)                                          # no copy when low is p's dtype
        pv = (p_low @ v.to(low)).to(a_pinv.dtype)                  # rightmost product first (n-sized)
        if normalize:
            d_inv_sqrt = a.sum(-1, keepdim=True).rsqrt()          # D^-½ (row sums ≥ 1: unit diagonal)
            z = d_inv_sqrt * (a_pinv @ (d_inv_sqrt * pv))
        else:
            z = a_pinv @ pv                                        # m-sized, in the island
        left = p_low.transpose(-2, -1)
        if dropout is not None:
            left = dropout(left)
        return left @ z.to(low)                                    # n-sized


def soft_attention_projected(x: torch.Tensor, q: torch.Tensor, landmarks: torch.Tensor, v_weight: torch.Tensor,
                             v_bias: Optional[torch.Tensor], out_weight: torch.Tensor,
                             out_bias: Optional[torch.Tensor], normalize: bool = False, newton_iter: int = 20,
                             ridge: float = 0.0, scale: Optional[float] = None,
                             dropout: Optional[nn.Module] = None, newton_rule: str = 'ours',
                             newton_backward: str = 'closed_form') -> torch.Tensor:
    """`proj(merge(Ŝ V))` with `V = x W_vᵀ + b_v`: the same value as `soft_attention` between the
    value and output projections, with the products re-associated so n-sized data is touched least.

    x: [B, n, C], q: [B, h, n, d], landmarks: [B, h, m, d], v_weight: [h·d, C], out_weight: [C_out, h·d].
    Per head, `P V = (P x) W_vᵀ + (P 1) b_vᵀ`, so V (n×h·d) is never formed; and the head merge plus
    output projection `Σ_h (P_hᵀ z_h) W_o,hᵀ = [P_1ᵀ … P_hᵀ] [z_1 W_o,1ᵀ; …; z_h W_o,hᵀ]` is one
    [n, h·m] × [h·m, C_out] matmul, so neither the per-head output nor its merged copy is formed.
    Everything n-sized is then: P (the kernel), one read of x, and the output. Returns x's dtype, or
    autocast's dtype inside autocast (as the output projection would).
    Dtype policy (as `soft_attention`): the kernels, A†, D^-½ and every m-sized product (the per-head weight
    products included) run in float32 with autocast off; the two n-sized products P x and [P_1ᵀ … P_hᵀ] y (with
    the output bias) run in the autocast dtype (x's dtype outside autocast).
    """
    device_type = x.device.type
    low = autocast_dtype(device_type, x.dtype)                     # dtype of the n-sized products
    with float32_island(device_type):
        q, landmarks = _upcast(q), _upcast(landmarks)
        v_weight, out_weight = _upcast(v_weight), _upcast(out_weight)
        batch, heads, m, d = landmarks.shape
        n, c_out = x.shape[1], out_weight.shape[0]
        p = gaussian_kernel(landmarks, q, scale)                   # exp(Q̃ ⊖ K): [B, h, m, n], float32 island
        a = gaussian_kernel(landmarks, landmarks, scale)
        a_pinv = newton_pinv(a, newton_iter, ridge, rule=newton_rule, backward=newton_backward)
        p_rows = p.reshape(batch, heads * m, n).to(low)            # no copy when low is p's dtype
        px = (p_rows @ x.to(low)).to(a_pinv.dtype).view(batch, heads, m, x.shape[-1])   # P x: [B, h, m, C], n-sized
        # einsum contracts per head without expanding the weights over the batch (a broadcast
        # matmul would copy [B, h, C, d] weights and reduce their [B, h, C, d] gradients)
        pv = torch.einsum('bhmc,hdc->bhmd', px, v_weight.view(heads, d, -1))   # (P x) W_vᵀ
        if v_bias is not None:
            pv = pv + p.sum(-1, keepdim=True) * _upcast(v_bias).view(heads, 1, d)
        if normalize:
            d_inv_sqrt = a.sum(-1, keepdim=True).rsqrt()
            z = d_inv_sqrt * (a_pinv @ (d_inv_sqrt * pv))
        else:
            z = a_pinv @ pv
        y = torch.einsum('bhmd,ohd->bhmo', z, out_weight.view(c_out, heads, d))  # z_h W_o,hᵀ: [B, h, m, C_out]
        left = p_rows.transpose(1, 2)                              # [B, n, h·m]
        if dropout is not None:
            left = dropout(left)
        y = y.reshape(batch, heads * m, c_out).to(low)
        return left @ y if out_bias is None else torch.baddbmm(out_bias.to(low), left, y)   # n-sized


def soft_attention_reference(q: torch.Tensor, v: torch.Tensor, landmarks: torch.Tensor,
                             normalize: bool = False, ridge: float = 0.0, scale: Optional[float] = None,
                             return_attn: bool = False):
    """Slow, obvious Eq. 9 / Eq. 17: forms the full n×n Ŝ with an SVD pseudo-inverse. For tests.

    Returns Ŝ V, or (Ŝ V, Ŝ) with `return_attn=True`.
    """
    p = gaussian_kernel_reference(landmarks, q, scale)
    a = gaussian_kernel_reference(landmarks, landmarks, scale)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    middle = torch.linalg.pinv(a + ridge * eye, hermitian=True)
    if normalize:
        d_inv_sqrt = torch.diag_embed(a.sum(-1).rsqrt())
        middle = d_inv_sqrt @ middle @ d_inv_sqrt
    s_hat = p.transpose(-2, -1) @ middle @ p
    out = s_hat @ v
    return (out, s_hat) if return_attn else out


def exact_gaussian_attention(q: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """S V with the exact n×n Gaussian kernel S = exp(Q ⊖ Q) (Eq. 5); O(n²), for tests and analysis."""
    return gaussian_kernel(q, q, scale) @ v


def _grid_pair(grid_size) -> Tuple[int, int]:
    """A forward's grid_size as (H, W), or a ValueError naming it (`arguments.image_size`'s rule), taking the sizes a
    graph recorder hands over for an image's shape as the integers they stand for: SymInts (torch.compile,
    torch.export) and 0-dim integer tensors (TorchScript's tracer, the ONNX exporter's dynamo=False path)."""
    if isinstance(grid_size, (tuple, list)) and len(grid_size) == 2 and all(
            isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_floating_point()
                                            and v.dtype != torch.bool) for v in grid_size):
        return tuple(grid_size)
    return image_size('grid_size', grid_size)


@register_attention('soft')
class SoftAttention(AttentionBase):
    """SOFT attention (Alg. 1, Eq. 9) with timm's `attn_layer` signature; `normalize=True` gives SOFT++ (Eq. 17).

    Keyword args (paper names): `num_landmarks` (m, default 49), `sampler` ('conv' | 'avgpool' |
    'random'), `newton_iter` (T of Eq. 10), `ridge` (adds ridge·I to A before inverting),
    `num_prefix_tokens` (None: infer 0 or 1), `sampling_ratio` (k; overrides num_landmarks for
    conv/avgpool), `grid_size` (default (H, W) for `forward`, and lets the conv weight be built at
    construction), `seed` (eval subset of the random sampler), `fold_projections` (True: evaluate
    V, attention, head merge and output projection in the re-associated order of
    `soft_attention_projected`; False: one after another as written; None (default): whichever
    `folding_pays` says needs fewer multiply-adds; `scale_norm=True` always runs as written). `qk_norm` normalises the shared
    Q = K per head. Unknown kwargs raise a TypeError naming them, as timm's own `Attention` does. See the module docstring for the design choices.

    Public-code options (github.com/fudan-zvg/SOFT; docs/soft.md has the table). `official=True` turns
    every one on; each can also be set alone (None: follow `official`), so they can be ablated:
    `landmark_norm` (LayerNorm(head_dim) + GELU on the landmarks after the sampler, applied at the
    public code's scale q/d^¼ and mapped back, so the kernel is the public one), `value_conv` (k of a
    per-head depthwise k×k conv of V on the grid, added to each head's output; 0 = off; official 3,
    the backbones pass 9/5/3 by stage), `newton_rule` ('ours' | 'soft' | 'softpp', see
    `newton_pinv`; official: 'soft' for SOFT, 'softpp' for SOFT++), `newton_backward`
    ('closed_form' | 'unrolled'; official: closed form for SOFT, unrolled for SOFT++),
    `sampler_init` ('avgpool' | 'kaiming': nn.Conv2d's default init, the public code's), `landmark_border`
    ('replicate' | 'drop': a grid k does not divide, padded or cut to whole windows as the public conv; conv
    sampler only).
    """

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.,
                 norm_layer=None, *, num_landmarks: int = 49, sampler: str = 'conv', newton_iter: int = 20,
                 ridge: float = 0.0, num_prefix_tokens: Optional[int] = None, sampling_ratio: Optional[int] = None,
                 grid_size: Optional[Tuple[int, int]] = None, normalize: bool = False,
                 attn_head_dim: Optional[int] = None, seed: int = 0, fold_projections: Optional[bool] = None,
                 official: bool = False, landmark_norm: Optional[bool] = None, value_conv: Optional[int] = None,
                 newton_rule: Optional[str] = None, newton_backward: Optional[str] = None,
                 sampler_init: Optional[str] = None, landmark_border: Optional[str] = None, device=None, dtype=None):
        super().__init__(dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop,
                         norm_layer, attn_head_dim=attn_head_dim, shared_qk=True, device=device, dtype=dtype)
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        positive_int('newton_iter', newton_iter)        # True would have run one step
        positive_int('num_landmarks', num_landmarks)
        count('seed', seed)            # 2.5 failed at the first eval forward (manual_seed)
        # NaN / inf / negative: a NaN or indefinite A + ridge·I, silently; None or a string failed in the comparison
        if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not 0 <= ridge < float('inf'):
            raise ValueError(f"ridge={ridge!r} must be a finite number >= 0 (added as ridge·I to A before inverting)")
        if grid_size is not None:        # (4,), (2.5, 4), (-4, -4) failed at the first forward, naming nothing
            grid_size = image_size('grid_size', grid_size)
        if sampling_ratio is not None:
            positive_int('sampling_ratio', sampling_ratio)
        if num_prefix_tokens is not None:
            count('num_prefix_tokens', num_prefix_tokens)
        # public-code options: None follows `official` (each its own argument, so each can be ablated)
        landmark_norm = official if landmark_norm is None else landmark_norm
        value_conv = (3 if official else 0) if value_conv is None else value_conv
        newton_rule = newton_rule or (('softpp' if normalize else 'soft') if official else 'ours')
        newton_backward = newton_backward or ('unrolled' if official and normalize else 'closed_form')
        sampler_init = sampler_init or ('kaiming' if official else 'avgpool')
        landmark_border = landmark_border or ('drop' if official else 'replicate')
        if not isinstance(value_conv, int) or isinstance(value_conv, bool) or value_conv < 0 or \
                (value_conv and value_conv % 2 == 0):
            raise ValueError(f"value_conv must be 0 (off) or an odd kernel size >= 1, got {value_conv!r}")
        check_rule(newton_rule, newton_backward)
        self.official = official
        self.newton_rule = newton_rule
        self.newton_backward = newton_backward
        self.num_landmarks = num_landmarks
        self.sampler = sampler
        self.newton_iter = newton_iter
        self.ridge = ridge
        self.num_prefix_tokens = num_prefix_tokens
        self.sampling_ratio = sampling_ratio
        self.normalize = normalize
        self.seed = seed
        self.fold_projections = fold_projections
        self.grid_size = tuple(grid_size) if grid_size is not None else None
        self.scale = 1.0 / (2.0 * math.sqrt(self.head_dim))       # 1/(2√d) of Eq. 5, per head
        self._eval_indices = {}
        self.conv = None
        if sampler == 'conv':
            k = sampling_ratio
            if k is None and grid_size is not None:
                self._check_landmarks(grid_size[0] * grid_size[1], tuple(grid_size))
                k = sampling_ratio_for(grid_size[0], grid_size[1], num_landmarks)
            # one head_dim→head_dim conv shared by every head (as SOFT's public code), not a C×C conv:
            # C²k² weights per block would add 3.6M parameters to SOFT-Tiny that the paper does not have
            if landmark_border == 'drop' and k is not None and grid_size is not None and min(grid_size) < k:
                # known now: refused at construction (a model built for this grid could be converted, saved and
                # exported, and failed only at its first forward)
                raise ValueError(f"landmark_border='drop' needs a token grid of at least k×k = {k}×{k}, got "
                                 f"{grid_size[0]}×{grid_size[1]} (a larger img_size, or landmark_border='replicate', "
                                 "which pads the border windows)")
            self.conv = ConvLandmarkSampler(self.head_dim, k, device=device, dtype=dtype, init=sampler_init,
                                            border=landmark_border)
        elif landmark_border != ('drop' if official else 'replicate'):
            raise ValueError(f"landmark_border={landmark_border!r} applies to sampler='conv', got sampler={sampler!r}")
        # public code: LayerNorm(head_dim) + GELU after the sampler (shared by the heads)
        self.landmark_norm = (nn.Sequential(nn.LayerNorm(self.head_dim, device=device, dtype=dtype), nn.GELU())
                              if landmark_norm else None)
        # public code: depthwise conv of V per head (groups = heads, one k×k kernel per head, no bias)
        self.value_conv = (nn.Conv2d(num_heads, num_heads, value_conv, padding=value_conv // 2, groups=num_heads,
                                     bias=False, device=device, dtype=dtype) if value_conv else None)

    def _check_landmarks(self, n: int, grid: Optional[Tuple[int, int]]) -> None:
        if self.num_landmarks > n:
            where = f" ({grid[0]}×{grid[1]} grid)" if grid else ""
            raise ValueError(f"num_landmarks={self.num_landmarks} exceeds the number of tokens n={n}{where}; "
                             "pass a smaller num_landmarks")

    def resolve_grid(self, num_tokens: int, grid_size: Optional[Tuple[int, int]] = None):
        """-> (num_prefix, (H, W) or None). H·W grid tokens follow the prefix tokens."""
        grid_size = _grid_pair(grid_size) if grid_size is not None else self.grid_size
        if grid_size is not None:
            h, w = grid_size
            prefix = num_tokens - h * w
            if prefix < 0 or (self.num_prefix_tokens is not None and prefix != self.num_prefix_tokens):
                raise ValueError(f"grid_size={tuple(grid_size)} does not fit N={num_tokens} tokens with "
                                 f"num_prefix_tokens={self.num_prefix_tokens}")
            return prefix, (h, w)
        candidates = [self.num_prefix_tokens] if self.num_prefix_tokens is not None else [0, 1]
        for prefix in candidates:
            side = math.isqrt(max(num_tokens - prefix, 0))
            if side > 0 and side * side == num_tokens - prefix:
                return prefix, (side, side)
        if self.sampler == 'random':                               # needs no grid
            return candidates[0], None
        raise ValueError(f"cannot infer the token grid: N={num_tokens} minus {candidates} prefix token(s) is not "
                         f"a perfect square; pass grid_size=(H, W) to forward (the first N − H·W tokens are "
                         f"prefix tokens), or num_prefix_tokens / grid_size when the layer is built (a timm ViT "
                         f"with register tokens: attn_kwargs num_prefix_tokens=1 + reg_tokens)")

    def check_num_tokens(self, num_tokens: int) -> None:
        """The grid must be inferable from N (or given), and where the landmark count is num_landmarks itself
        (random sampler; conv / avgpool without a sampling ratio) it must not exceed the grid's tokens."""
        prefix, grid = self.resolve_grid(num_tokens)
        k = self.sampling_ratio
        if self.conv is not None and self.conv.kernel_size is not None:
            k = self.conv.kernel_size
        if self.sampler == 'random' or k is None:
            self._check_landmarks(num_tokens - prefix, grid)
        if k is None and grid is not None:
            k = sampling_ratio_for(grid[0], grid[1], self.num_landmarks)
        if self.sampler == 'conv' and self.conv.border == 'drop' and grid is not None and min(grid) < k:
            raise ValueError(f"landmark_border='drop' needs a token grid of at least k×k = {k}×{k}, got "
                             f"{grid[0]}×{grid[1]}; use landmark_border='replicate' or a smaller sampling_ratio")

    def check_token_layout(self, num_prefix_tokens: int, grid_size: Tuple[int, int]) -> None:
        """Refuse, when a model of a fixed input size is built, a layout this layer would read otherwise: without
        grid_size / num_prefix_tokens it infers a square grid from N, which fits a non-square grid with the wrong
        prefix (1 cls + 14×16 patches = 225 tokens read as a 15×15 grid without a prefix), silently. The random
        sampler reads no grid, only the prefix (unless its V conv needs the grid)."""
        h, w = grid_size
        prefix, grid = self.resolve_grid(num_prefix_tokens + h * w)
        reads_grid = self.sampler != 'random' or self.value_conv is not None
        if prefix != num_prefix_tokens or (reads_grid and grid != (h, w)):
            seen = f"a {grid[0]}×{grid[1]} grid" if grid is not None else "no grid"
            raise ValueError(f"the model's tokens are {num_prefix_tokens} prefix token(s) and a {h}×{w} grid, which "
                             f"this layer would read as {prefix} prefix token(s) and {seen}; pass attn_kwargs "
                             f"grid_size=({h}, {w}), num_prefix_tokens={num_prefix_tokens}")

    def _random_indices(self, n: int, m: int, device) -> torch.Tensor:
        if self.training:
            return torch.randperm(n, device=device)[:m]
        idx = self._eval_indices.get((n, m))
        if idx is None:
            # exported or traced: the seeded subset as a constant, not a randperm op drawn per call (TorchScript's
            # tracer hands n over as a 0-dim tensor; a token count torch.export leaves free, a SymInt, has no one
            # subset: drawn in the graph, as before)
            constant = not isinstance(n, torch.SymInt)
            with graph_constant() if constant else nullcontext():
                gen = torch.Generator().manual_seed(self.seed)
                idx = torch.randperm(int(n) if constant else n, generator=gen)[:m].sort().values
            if not recording_graph():          # an exported program cannot write module attributes (export warns)
                self._eval_indices[(n, m)] = idx
        return idx.to(device)

    def landmarks(self, q: torch.Tensor, grid_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """Bottleneck tokens Q̃ [B, h, p + m, d]: the p prefix tokens, then m sampled grid tokens."""
        prefix, grid = self.resolve_grid(q.shape[-2], grid_size)
        head, spatial = q[..., :prefix, :], q[..., prefix:, :]
        n = spatial.shape[-2]
        if self.sampler == 'random':
            self._check_landmarks(n, grid)
            sampled = spatial[..., self._random_indices(n, self.num_landmarks, q.device), :]
            return self._normalize_landmarks(torch.cat([head, sampled], dim=-2))
        h, w = grid
        k = self.sampling_ratio
        if self.conv is not None and self.conv.kernel_size is not None:
            k = self.conv.kernel_size
        if k is None:
            self._check_landmarks(n, grid)
            k = sampling_ratio_for(h, w, self.num_landmarks)
        if self.sampler == 'conv':
            if self.conv.kernel_size is None:
                self.conv.initialize_parameters(spatial, (h, w), k)
            sampled = self.conv(spatial, (h, w))                  # heads share the sampler
        else:
            planes = rearrange(spatial, 'b h (y x) d -> (b h) d y x', y=h, x=w)
            pooled = F.avg_pool2d(planes, k, stride=k, ceil_mode=True)
            sampled = rearrange(pooled, '(b h) d y x -> b h (y x) d', h=self.num_heads)
        return self._normalize_landmarks(torch.cat([head, sampled], dim=-2))

    def _normalize_landmarks(self, landmarks: torch.Tensor) -> torch.Tensor:
        """Public code: GELU(LN(·)) of the landmarks of q/d^¼ (its kernel is exp(−‖q/d^¼ − l‖²/2)); scaled
        back by d^¼ so our exp(−‖q − l‖²/2√d) gives the same kernel. Prefix landmarks (cls) included."""
        if self.landmark_norm is None:
            return landmarks
        c = self.head_dim ** 0.25
        return c * self.landmark_norm(landmarks / c)

    def value_conv_term(self, v: torch.Tensor, grid_size: Optional[Tuple[int, int]]) -> torch.Tensor:
        """Per-head depthwise conv of V [B, h, n, d] over the H×W grid (public code), 0 on prefix tokens."""
        if grid_size is None:
            raise ValueError("value_conv needs the token grid: pass grid_size=(H, W) (the random sampler "
                             "cannot infer it)")
        h, w = grid_size
        prefix = v.shape[-2] - h * w
        planes = rearrange(v[..., prefix:, :], 'b h (y x) d -> (b d) h y x', y=h, x=w)
        out = rearrange(self.value_conv(planes), '(b d) h y x -> b h (y x) d', d=v.shape[-1])   # d: B may be 0
        return F.pad(out, (0, 0, prefix, 0)) if prefix else out

    def folding_pays(self, num_landmarks: int) -> bool:
        """Whether `soft_attention_projected` needs fewer multiply-adds than the textbook order here.

        Per token, folded: h·m·(C_in + C_out) (P x and the [n, h·m] output product); textbook:
        inner·(C_in + C_out) (V and proj) + 2·h·m·d (P V and Pᵀ z), inner = h·d. Folding wins when h·m
        is small against the width: SOFT-Tiny stage 1 (h = 2, m = 49, C = 64) yes, stages 2–4 no.
        """
        if not isinstance(self.norm, nn.Identity):
            return False                                           # scale_norm sits between merge and proj
        if not (isinstance(self.qkv, nn.Linear) and isinstance(self.proj, nn.Linear)):
            return False              # folding reads W_v, W_proj: not after `factorize` (no `.weight`, see _project_q)
        if self.value_conv is not None:
            return False                                           # the V conv needs V itself
        if self.fold_projections is not None:
            return self.fold_projections
        hm, inner = self.num_heads * num_landmarks, self.num_heads * self.head_dim
        widths = self.qkv.in_features + self.proj.out_features
        return hm * widths < inner * widths + 2 * hm * self.head_dim

    def _project_q(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(q [B, h, n, d] after q_norm, the V rows' output [B, n, h·d] or None). Dense: Q's rows of the weight
        alone (V is computed later, or folded away); structured (after `factorize`: a StructuredLinear has no
        `.weight`, so slicing it failed): the module on x, which keeps its cheaper product, split into Q and V."""
        inner = self.num_heads * self.head_dim
        if isinstance(self.qkv, nn.Linear):
            b_q = None if self.qkv.bias is None else self.qkv.bias[:inner]
            q, v = F.linear(x, self.qkv.weight[:inner], b_q), None
        else:
            qv = self.qkv(x)
            q, v = qv[..., :inner], qv[..., inner:]
        return self.q_norm(rearrange(q, 'b n (h d) -> b h n d', h=self.num_heads)), v

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                grid_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        check_no_mask(type(self).__name__, attn_mask, is_causal)
        dropout = self.attn_drop if self.training and self.attn_drop.p > 0 else None
        inner = self.num_heads * self.head_dim
        q, v_rows = self._project_q(x)
        landmarks = self.landmarks(q, grid_size)
        options = dict(normalize=self.normalize, newton_iter=self.newton_iter, ridge=self.ridge, scale=self.scale,
                       dropout=dropout, newton_rule=self.newton_rule, newton_backward=self.newton_backward)
        if self.folding_pays(landmarks.shape[-2]):                  # dense qkv and proj only
            b_v = None if self.qkv.bias is None else self.qkv.bias[inner:]
            out = soft_attention_projected(x, q, landmarks, self.qkv.weight[inner:], b_v, self.proj.weight,
                                           self.proj.bias, **options)
            return self.proj_drop(out)
        if v_rows is None:
            b_v = None if self.qkv.bias is None else self.qkv.bias[inner:]
            v_rows = F.linear(x, self.qkv.weight[inner:], b_v)
        v = rearrange(v_rows, 'b n (h d) -> b h n d', h=self.num_heads)
        out = soft_attention(q, v, landmarks, **options)
        if self.value_conv is not None:
            out = out + self.value_conv_term(v, self.resolve_grid(x.shape[1], grid_size)[1]).to(out.dtype)
        return self.merge(out)                                     # project, attend, merge, project

    def landmark_kernel(self, x: torch.Tensor, grid_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """A = exp(Q̃ ⊖ Q̃) [B, h, m, m] for the layer input x (for analysis: its conditioning)."""
        q, _ = self._project_q(x)
        landmarks = _upcast(self.landmarks(q, grid_size))
        return gaussian_kernel(landmarks, landmarks, self.scale)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_landmarks={self.num_landmarks}, sampler={self.sampler!r}, "
                f"newton_iter={self.newton_iter}, ridge={self.ridge}, normalize={self.normalize}, "
                f"newton_rule={self.newton_rule!r}, newton_backward={self.newton_backward!r}")


@register_attention('softpp')
class SoftPlusPlusAttention(SoftAttention):
    """SOFT++ (Eq. 17): SoftAttention with the symmetric normalisation D^-½ A† D^-½ on by default."""

    def __init__(self, dim: int, num_heads: int = 8, *args, normalize: bool = True, **kwargs):
        super().__init__(dim, num_heads, *args, normalize=normalize, **kwargs)
