"""Coding rates of CRATE (Yu et al., 2023, §2.1–2.3).

Tokens are rows here: a sample is `Z` of shape [N, d] (the paper writes Z ∈ R^{d×N}).
Every function accepts a leading batch dimension and returns one value per sample.
"""
import torch


def _half_logdet_identity_plus(gram: torch.Tensor, scale: float) -> torch.Tensor:
    """½ logdet(I + scale · gram) for a batch of PSD matrices, via Cholesky (stable, PSD input)."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    chol = torch.linalg.cholesky(eye + scale * gram)
    return torch.log(torch.diagonal(chol, dim1=-2, dim2=-1)).sum(-1)


def _small_gram(z: torch.Tensor) -> torch.Tensor:
    # logdet(I + c ZᵀZ) = logdet(I + c ZZᵀ) (Sylvester): use whichever Gram matrix is smaller.
    n, d = z.shape[-2:]
    return z.transpose(-2, -1) @ z if d <= n else z @ z.transpose(-2, -1)


def coding_rate(z: torch.Tensor, eps: float = 0.5) -> torch.Tensor:
    """R(Z) of CRATE Eq. 7: ½ logdet(I + d/(N ε²) ZᵀZ), for z of shape [..., N, d]."""
    n, d = z.shape[-2:]
    return _half_logdet_identity_plus(_small_gram(z), d / (n * eps ** 2))


def split_heads(u: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[d, K·p] basis matrix -> [K, d, p] stack of U_k."""
    d, kp = u.shape
    if kp % num_heads:
        raise ValueError(f"num_heads={num_heads} does not divide the basis width {kp}")
    return u.reshape(d, num_heads, kp // num_heads).permute(1, 0, 2)


def coding_rate_per_head(z: torch.Tensor, u_heads: torch.Tensor, eps: float = 0.5) -> torch.Tensor:
    """Per-head terms of CRATE Eq. 8: ½ logdet(I + p/(N ε²) (U_kᵀZ)ᵀ(U_kᵀZ)) -> [..., K]."""
    n = z.shape[-2]
    p = u_heads.shape[-1]
    projected = torch.einsum('...nd,kdp->...knp', z, u_heads)   # rows of (U_kᵀZ)ᵀ
    return _half_logdet_identity_plus(_small_gram(projected), p / (n * eps ** 2))


def compression_rate(z: torch.Tensor, u_heads: torch.Tensor, eps: float = 0.5) -> torch.Tensor:
    """R_c(Z; U_[K]) of CRATE Eq. 8 (sum over heads) for z [..., N, d] and u_heads [K, d, p]."""
    return coding_rate_per_head(z, u_heads, eps).sum(-1)


def compression_rate_grad(z: torch.Tensor, u_heads: torch.Tensor, eps: float = 0.5) -> torch.Tensor:
    """Closed-form ∇_Z R_c of CRATE Eq. 9, in row layout.

    Column form: p/(Nε²) Σ_k U_k U_kᵀ Z (I + p/(Nε²)(U_kᵀZ)ᵀ(U_kᵀZ))⁻¹.
    Rows (X = Zᵀ, P_k = X U_k ∈ R^{N×p}): c Σ_k (I_N + c P_k P_kᵀ)⁻¹ P_k U_kᵀ.
    """
    n = z.shape[-2]
    p = u_heads.shape[-1]
    c = p / (n * eps ** 2)
    projected = torch.einsum('...nd,kdp->...knp', z, u_heads)
    eye = torch.eye(n, dtype=z.dtype, device=z.device)
    gram = eye + c * projected @ projected.transpose(-2, -1)
    solved = torch.linalg.solve(gram, projected)                 # (I + c P Pᵀ)⁻¹ P
    return c * torch.einsum('...knp,kdp->...nd', solved, u_heads)


def sparsity(z: torch.Tensor, tol: float = 0.0) -> torch.Tensor:
    """‖Z‖₀ / (d·N) per sample (fraction of entries with |z| > tol), as in CRATE §3.1."""
    return (z.abs() > tol).float().mean(dim=(-2, -1))
