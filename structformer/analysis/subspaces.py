"""Learned subspaces of CRATE: coherence (Yu et al., 2023, Fig. 7) and recovery of known subspaces.

Coherence: |[U_1 … U_K]ᵀ[U_1 … U_K]| with unit-norm columns; orthogonal heads give a block-diagonal
heat map, identical heads all-ones blocks.

Recovery (synthetic mixture-of-subspaces data, §2.2): the true bases B_j live in the D-dim token
(patch) space, the learned U_k in the d-dim feature space. We carry B_j across with the LINEAR PART
of the patch embedding (Alg. 1: LN(D) → Linear(D, d) → LN(d)):
    M = diag(γ_out) C_d · W · diag(γ_in) C_D,    C_n = I − 11ᵀ/n (LayerNorm's centring),
dropping what is not linear in the token: the 1/σ of each LayerNorm (a positive per-token scalar,
which keeps a token inside its span), the biases β and b and the position embedding (offsets).
So span(M B_j) is where the embedded tokens of subspace j lie up to a per-token scale and a
common offset (the position embedding is such an offset: removed). Layer 1's MSSA then sees
LN1(z), so its heads are compared with span(diag(γ₁) C_d M B_j), the norm's γ included. Only layer 1
is compared: later layers see tokens already mixed by attention and ISTA, where the data's
subspaces have no closed-form image. The paper does not claim that supervised training recovers the
data's subspaces (it claims incoherent U and compression), so this is a control, not a test of CRATE.

Energy (layer 1, measured on data): for every patch token of a known subspace j, the share of
Σ_k ‖U_kᵀ LN1(z)‖² that falls in head k (z = patch embedding, no cls, no positions), averaged into a
heads × subspaces matrix; contrast = mean over the Hungarian-matched (head, subspace) pairs minus the
uniform 1/K, against a baseline that permutes the tokens' subspace labels. Attention (layer 1, as
the model runs, positions included): per head, the share of each patch token's attention over patch
tokens that lands on tokens of its own subspace, against the share of such tokens (uniform attention).

Precision: float64 throughout; the functions that run the model do so with autocast off (`full_precision`).
"""
from typing import Dict, Optional

import numpy as np
import torch
from scipy.linalg import subspace_angles
from scipy.optimize import linear_sum_assignment
from torch import nn

from ..functional.precision import full_precision
from ..layers.linear.base import StructuredLinear, linear_weight
from .whitebox import _eval_no_grad, _to_model, layer_bases

__all__ = ['subspace_energy', 'subspace_coherence', 'coherence_summary', 'principal_angles', 'embedding_linear_map',
           'map_true_bases', 'match_subspaces', 'random_bases', 'subspace_recovery']


def subspace_coherence(u_heads: torch.Tensor) -> torch.Tensor:
    """|UᵀU| for U = [U_1 … U_K] ([K, d, p] in) with column-normalised U -> [Kp, Kp] (Fig. 7)."""
    if u_heads.ndim != 3:
        raise ValueError(f"u_heads must be [K, d, p]; got {list(u_heads.shape)}")
    k, d, p = u_heads.shape
    u = u_heads.detach().double().permute(1, 0, 2).reshape(d, k * p)        # [d, Kp], heads side by side
    u = u / u.norm(dim=0, keepdim=True).clamp_min(1e-12)                     # zero columns stay zero
    return (u.T @ u).abs()


def coherence_summary(coherence: torch.Tensor, num_heads: int) -> Dict[str, float]:
    """Mean and max |cos| between columns of DIFFERENT heads (off the K diagonal p×p blocks)."""
    kp = coherence.shape[0]
    head = torch.arange(kp) // (kp // num_heads)
    between = coherence[head[:, None] != head[None, :]]
    if between.numel() == 0:                                                 # a single head
        return {'mean_between_heads': 0.0, 'max_between_heads': 0.0}
    return {'mean_between_heads': float(between.mean()), 'max_between_heads': float(between.max())}


def principal_angles(a, b) -> np.ndarray:
    """Principal angles in DEGREES, smallest first, between the column spaces of a [n, p] and b [n, q]
    (min(rank a, rank b) angles; scipy.linalg.subspace_angles does the work)."""
    a = a.detach().double().cpu().numpy() if torch.is_tensor(a) else np.asarray(a, dtype=float)
    b = b.detach().double().cpu().numpy() if torch.is_tensor(b) else np.asarray(b, dtype=float)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"principal_angles needs two matrices with the same number of rows; "
                         f"got {a.shape} and {b.shape}")
    return np.sort(np.degrees(subspace_angles(a, b)))


def _ln_linear(norm: nn.Module, n: int) -> torch.Tensor:
    """diag(γ)·(I − 11ᵀ/n): the linear part of a LayerNorm over n features (1/σ dropped)."""
    if not isinstance(norm, nn.LayerNorm):
        raise ValueError(f"expected a LayerNorm in the CRATE patch embedding; got {type(norm).__name__}")
    gamma = norm.weight.detach().double() if norm.weight is not None else torch.ones(n, dtype=torch.float64)
    centre = torch.eye(n, dtype=torch.float64) - 1.0 / n
    return gamma[:, None] * centre


def embedding_linear_map(model: nn.Module) -> torch.Tensor:
    """M = diag(γ_out)C_d · W · diag(γ_in)C_D ([d, D]): the patch embedding without its offsets."""
    pe = getattr(model, 'patch_embed', None)
    proj = getattr(pe, 'proj', None)
    if not isinstance(proj, (nn.Linear, StructuredLinear)) or not hasattr(pe, 'norm_in') or not hasattr(pe, 'norm_out'):
        raise ValueError("subspace recovery needs CRATE's patch embedding (patch_embed.norm_in, .proj "
                         "as a Linear, .norm_out)")
    w = linear_weight(proj).detach().double().cpu()
    d, big_d = w.shape
    return _ln_linear(pe.norm_out, d).to(w) @ w @ _ln_linear(pe.norm_in, big_d).to(w)


def map_true_bases(model: nn.Module, true_bases: torch.Tensor, layer_norm: Optional[nn.Module] = None) -> torch.Tensor:
    """[K, D, p] true bases in token space -> [K, d, p] orthonormal bases of span(M B_j), or of
    span(diag(γ) C_d M B_j) when `layer_norm` (layer 1's norm1) is given."""
    m = embedding_linear_map(model)
    if layer_norm is not None:
        m = _ln_linear(layer_norm, m.shape[0]).to(m) @ m
    if true_bases.ndim != 3 or true_bases.shape[1] != m.shape[1]:
        raise ValueError(f"true_bases must be [K, D, p] with D = {m.shape[1]} (the model's patch dimension "
                         f"in_chans·patch_size²); got {list(true_bases.shape)}")
    mapped = torch.einsum('ed,kdp->kep', m, true_bases.detach().double().cpu())
    q, _ = torch.linalg.qr(mapped)
    return q


def random_bases(num: int, dim: int, width: int, seed: int = 0) -> torch.Tensor:
    """[num, dim, width] random orthonormal bases (QR of Gaussians, fixed seed)."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(num, dim, width, generator=gen, dtype=torch.float64))
    return q


def match_subspaces(learned: torch.Tensor, true: torch.Tensor) -> Dict:
    """Pair heads with true subspaces minimising the summed mean principal angle (Hungarian,
    linear_sum_assignment); with unequal counts the surplus stays unmatched."""
    angles = [[principal_angles(learned[i], true[j]) for j in range(len(true))] for i in range(len(learned))]
    cost = np.array([[a.mean() for a in row] for row in angles])
    rows, cols = linear_sum_assignment(cost)
    pairs = [{'head': int(i), 'true': int(j), 'angles_deg': [float(x) for x in angles[i][j]],
              'mean_deg': float(cost[i, j])} for i, j in zip(rows, cols)]
    return {'pairs': pairs, 'mean_deg': float(np.mean([p['mean_deg'] for p in pairs]))}


@full_precision
def subspace_recovery(model: nn.Module, true_bases: torch.Tensor, seed: int = 0) -> Dict:
    """Layer 1: heads matched to the mapped true subspaces (LN1's γ included), principal angles in
    degrees, and the same for random orthonormal bases of the learned shape (what "no recovery" looks like)."""
    mapped = map_true_bases(model, true_bases, model.blocks[0].norm1)
    bases = layer_bases(model)
    layers = [0]
    out = []
    for i in layers:
        u = bases[i].double().cpu()
        out.append({'layer': i + 1, 'learned': match_subspaces(u, mapped),
                    'random': match_subspaces(random_bases(*u.shape, seed=seed + i), mapped)})
    return {'num_true': int(true_bases.shape[0]), 'true_dim': int(true_bases.shape[2]),
            'mapping': 'the linear part of the patch embedding and of layer 1\'s LN1 (LayerNorm centring and γ, '
                       'projection weight; per-token 1/σ, biases and positions dropped), compared as spans',
            'layers': out}


def _hungarian_mean(matrix: torch.Tensor) -> float:
    rows, cols = linear_sum_assignment(-matrix.numpy())
    return float(matrix[rows, cols].mean())


@full_precision
def subspace_energy(model: nn.Module, images: torch.Tensor, token_subspaces: torch.Tensor, num_subspaces: int,
                    permutations: int = 200, seed: int = 0) -> Dict:
    """Layer 1, on data: the heads × subspaces energy-share matrix with a label-permutation baseline, and
    the share of each head's attention that stays within a token's own subspace (see the module notes).

    `token_subspaces` [B, N] gives the subspace of every patch token of `images` [B, C, H, W]."""
    blk = model.blocks[0]
    u = blk.attn.subspace_bases().detach().double()                      # [K, d, p]
    num_heads = u.shape[0]
    labels = token_subspaces.reshape(-1).long()
    images = _to_model(images, model)          # a float64 (or bf16) model takes the float32 images a caller has
    with _eval_no_grad(model):              # eval for the forward; each module's own mode back after
        z = model.patch_embed(images)                                # no cls, no positions
        y = blk.norm1(z).double().reshape(-1, z.shape[-1])
        energy = torch.einsum('td,kdp->tkp', y, u).pow(2).sum(-1)    # [tokens, K]
        share = energy / energy.sum(-1, keepdim=True).clamp_min(1e-300)
        x = model._embed(images)                                      # layer 1's input as the model runs
        w = torch.einsum('bnd,kdp->bknp', blk.norm1(x).double(), u)
        prefix = int(getattr(model, 'num_prefix_tokens', 1))
        attn = torch.softmax(w @ w.transpose(-1, -2) * blk.attn.scale, dim=-1)[:, :, prefix:, prefix:]
    if len(labels) != len(share):
        raise ValueError(f"token_subspaces has {len(labels)} labels for {len(share)} patch tokens")

    def matrix(lab):
        counts = torch.bincount(lab, minlength=num_subspaces).clamp_min(1).double()
        sums = torch.zeros(num_subspaces, num_heads, dtype=torch.float64).index_add_(0, lab, share)
        return (sums / counts[:, None]).T                                 # [K heads, J subspaces]

    mat = matrix(labels)
    gen = torch.Generator().manual_seed(seed)
    baseline = torch.tensor([_hungarian_mean(matrix(labels[torch.randperm(len(labels), generator=gen)]))
                             for _ in range(permutations)])
    matched = _hungarian_mean(mat)
    attn = attn / attn.sum(-1, keepdim=True)                              # over patch tokens only
    lab = token_subspaces.long()
    same = (lab[:, :, None] == lab[:, None, :]).double()                 # [B, N, N]
    within = (attn * same[:, None]).sum(-1).mean(dim=(0, 2))             # per head
    chance = same.mean(-1).mean()
    return {'matrix': mat.tolist(), 'uniform': 1.0 / num_heads, 'matched_share': matched,
            'permutation_matched_share': {'mean': float(baseline.mean()), 'p95': float(baseline.quantile(0.95)),
                                          'count': permutations},
            'p_value': float(((baseline >= matched).sum() + 1) / (permutations + 1)),
            'attention_within_subspace': {'per_head': within.tolist(), 'mean': float(within.mean()),
                                          'chance': float(chance)}}
