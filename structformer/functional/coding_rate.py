"""Coding rates of CRATE (Yu et al., 2023, §2.1–2.3).

Tokens are rows here: a sample is `Z` of shape [N, d] (the paper writes Z ∈ R^{d×N}).
Every function accepts a leading batch dimension and returns one value per sample.

Dtype policy: every rate (and ∇R_c, the orthonormal bases) computes in float32 (float64 for float64 input) with
autocast off, whatever context it is called in (`computes_in_float32`), because a logdet through a Cholesky of a
bf16 Gram matrix is meaningless (before this guard, `compression_rate` of 16 tokens under CPU bf16 autocast
raised 'not positive-definite', and `coding_rate` silently factorised a bf16-rounded Gram matrix).
"""
import torch

from .precision import computes_in_float32


def _checked_eps(eps: float) -> float:
    """ε of the rates' d/(N ε²): a finite number > 0 (0 divided by zero: ZeroDivisionError; a negative ε was taken
    as |ε|, since only ε² enters)."""
    import math
    import numbers
    if isinstance(eps, torch.Tensor):
        return eps                                        # traced / batched ε: the caller's to check
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite number > 0 (the coding rate's precision ε); got {eps!r}")
    return eps


def _half_logdet_identity_plus(gram: torch.Tensor, scale: float) -> torch.Tensor:
    """½ logdet(I + scale · gram) for a batch of PSD matrices, via Cholesky (stable, PSD input)."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    chol = torch.linalg.cholesky(eye + scale * gram)
    return torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)


def _small_gram(z: torch.Tensor) -> torch.Tensor:
    # logdet(I + c ZᵀZ) = logdet(I + c ZZᵀ) (Sylvester): use whichever Gram matrix is smaller.
    n, d = z.shape[-2:]
    return z.transpose(-2, -1) @ z if d <= n else z @ z.transpose(-2, -1)


@computes_in_float32
def coding_rate(z: torch.Tensor, eps: float = 0.5) -> torch.Tensor:
    """R(Z) of CRATE Eq. 7: ½ logdet(I + d/(N ε²) ZᵀZ), for z of shape [..., N, d]."""
    n, d = z.shape[-2:]
    return _half_logdet_identity_plus(_small_gram(z), d / (n * _checked_eps(eps) ** 2))


def split_heads(u: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[d, K·p] basis matrix -> [K, d, p] stack of U_k."""
    d, kp = u.shape
    if kp % num_heads:
        raise ValueError(f"num_heads={num_heads} does not divide the basis width {kp}")
    return u.reshape(d, num_heads, kp // num_heads).permute(1, 0, 2)


@computes_in_float32
def coding_rate_per_head(z: torch.Tensor, u_heads: torch.Tensor, eps: float = 0.5) -> torch.Tensor:
    """Per-head terms of CRATE Eq. 8: ½ logdet(I + p/(N ε²) (U_kᵀZ)ᵀ(U_kᵀZ)) -> [..., K]."""
    n = z.shape[-2]
    p = u_heads.shape[-1]
    projected = torch.einsum('...nd,kdp->...knp', z, u_heads)   # rows of (U_kᵀZ)ᵀ
    return _half_logdet_identity_plus(_small_gram(projected), p / (n * _checked_eps(eps) ** 2))


@computes_in_float32
def compression_rate(z: torch.Tensor, u_heads: torch.Tensor, eps: float = 0.5) -> torch.Tensor:
    """R_c(Z; U_[K]) of CRATE Eq. 8 (sum over heads) for z [..., N, d] and u_heads [K, d, p]."""
    return coding_rate_per_head(z, u_heads, eps).sum(-1)


@computes_in_float32
def compression_rate_grad(z: torch.Tensor, u_heads: torch.Tensor, eps: float = 0.5) -> torch.Tensor:
    """Closed-form ∇_Z R_c of CRATE Eq. 9, in row layout.

    Column form: p/(Nε²) Σ_k U_k U_kᵀ Z (I + p/(Nε²)(U_kᵀZ)ᵀ(U_kᵀZ))⁻¹.
    Rows (X = Zᵀ, P_k = X U_k ∈ R^{N×p}): c Σ_k (I_N + c P_k P_kᵀ)⁻¹ P_k U_kᵀ.
    """
    n = z.shape[-2]
    p = u_heads.shape[-1]
    c = p / (n * _checked_eps(eps) ** 2)
    projected = torch.einsum('...nd,kdp->...knp', z, u_heads)
    eye = torch.eye(n, dtype=z.dtype, device=z.device)
    gram = eye + c * projected @ projected.transpose(-2, -1)
    solved = torch.linalg.solve(gram, projected)                 # (I + c P Pᵀ)⁻¹ P
    return c * torch.einsum('...knp,kdp->...nd', solved, u_heads)


def sparsity(z: torch.Tensor, tol: float = 0.0) -> torch.Tensor:
    """‖Z‖₀ / (d·N) per sample (fraction of entries with |z| > tol), as in CRATE §3.1."""
    return (z.abs() > tol).float().mean(dim=(-2, -1))


# --- estimators of R_c for measuring a network (the analysis, not the layers) -------------------------------

OFFICIAL_EPS = 0.1
"""ε of the official estimator: its code passes `eps=0.01` and uses it as ε² (p/(N·0.01)), i.e. ε = 0.1."""


def _project(z: torch.Tensor, u_heads: torch.Tensor) -> torch.Tensor:
    """U_kᵀ z for every head: z [..., N, d], u_heads [K, d, p] -> [..., K, N, p]."""
    if u_heads.ndim != 3 or u_heads.shape[1] != z.shape[-1]:
        raise ValueError(f"u_heads must be [K, d, p] with d = {z.shape[-1]} (the tokens' width); "
                         f"got {list(u_heads.shape)}")
    return torch.einsum('...nd,kdp->...knp', z, u_heads)


@computes_in_float32
def official_rate_per_head(z: torch.Tensor, u_heads: torch.Tensor, eps: float = OFFICIAL_EPS) -> torch.Tensor:
    """Per-head terms of the estimator in CRATE's public code (`vis_utils/coding_rate.py`), [..., K].

    Each projected token w_i = U_kᵀ z_i is scaled to unit norm within the head, then
    ½ logdet(I_N + p/(N ε²) W Wᵀ) with W = [ŵ_1 … ŵ_N]ᵀ ∈ R^{N×p}. Invariant to scaling tokens or U_k
    (each token separately, even). Each term lies in [½ log(1 + p/ε²), ½ r log(1 + p/(r ε²))], r = min(p, N):
    the trace of WWᵀ is N, the upper end when it spreads evenly over r directions, the lower when all
    tokens are parallel. A zero projection (a token orthogonal to the head) counts as a zero token.
    """
    w = _project(z, u_heads)
    norms = w.norm(dim=-1, keepdim=True)
    w = w / torch.where(norms > 0, norms, torch.ones_like(norms))
    n, p = w.shape[-2:]
    return _half_logdet_identity_plus(_small_gram(w), p / (n * _checked_eps(eps) ** 2))


def official_rate_bounds(num_heads: int, num_tokens: int, dim_head: int, eps: float = OFFICIAL_EPS):
    """(min, max) of the official R_c summed over K heads (see `official_rate_per_head`)."""
    import math
    r, eps = min(dim_head, num_tokens), _checked_eps(eps)
    low = 0.5 * math.log1p(dim_head / eps ** 2)
    high = 0.5 * r * math.log1p(dim_head / (r * eps ** 2))
    return num_heads * low, num_heads * high


@computes_in_float32
def orthonormal_bases(u_heads: torch.Tensor) -> torch.Tensor:
    """Q_k with orthonormal columns spanning each U_k ([K, d, p], reduced QR; p <= d)."""
    if u_heads.shape[-1] > u_heads.shape[-2]:
        raise ValueError(f"orthonormalising needs p <= d; got U of shape {list(u_heads.shape)}")
    return torch.linalg.qr(u_heads, mode='reduced').Q


@computes_in_float32
def paper_rate_per_head(z: torch.Tensor, u_heads: torch.Tensor, eps: float = 0.5) -> torch.Tensor:
    """Per-head terms of Eq. 8 as written, with U_k orthonormalised first (the paper assumes orthonormal
    bases): ½ logdet(I + p/(N ε²) (Q_kᵀZ)ᵀ(Q_kᵀZ)) -> [..., K]. Invariant to the scale of U_k; the
    caller makes it invariant to the tokens' scale by passing LayerNormed tokens (as MSSA sees them)."""
    return coding_rate_per_head(z, orthonormal_bases(u_heads), eps)
