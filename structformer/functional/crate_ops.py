"""Slow, obvious references for the CRATE operators, written straight from the equations.

The layers in `structformer.layers` have fused fast paths; tests compare them with these.
Dtype policy: plain torch ops, so under autocast each product runs in the autocast dtype and everything else
follows torch's type promotion (e.g. `ista_reference`'s skip add x + η(·) returns float32 for a float32 x); the
layers state and enforce their own output dtype (docs/precision.md).
Row layout: x is [B, N, d]; `qkv_weight` is the [K·p, d] weight of the shared projection,
so U_k = qkv_weight[k·p:(k+1)·p]ᵀ ∈ R^{d×p}.
"""
import torch
import torch.nn.functional as F


def ssa_per_head_reference(x, qkv_weight, num_heads, scale):
    """SSA(Z|U_k) of CRATE Eq. 11 for each head k, one head at a time:
    (U_kᵀZ) softmax(scale · (U_kᵀZ)ᵀ(U_kᵀZ)), returned in rows as [B, N, K·p] (heads concatenated)."""
    p = qkv_weight.shape[0] // num_heads
    outs = []
    for k in range(num_heads):
        u_k = qkv_weight[k * p:(k + 1) * p].t()                # [d, p]
        proj = x @ u_k                                          # rows of U_kᵀZ: [B, N, p]
        weights = torch.softmax(scale * proj @ proj.transpose(-2, -1), dim=-1)
        outs.append(weights @ proj)
    return torch.cat(outs, dim=-1)


def mssa_reference(x, qkv_weight, num_heads, scale, out_weight=None, out_bias=None, tied_scale=None):
    """MSSA: Eq. 115 (separate trainable output map W, as implemented) when `out_weight` is given,
    or Eq. 12 (output tied to U: p/(Nε²)[U_1…U_K]) when `tied_scale` = p/(Nε²) is given."""
    heads = ssa_per_head_reference(x, qkv_weight, num_heads, scale)
    if out_weight is not None:
        return F.linear(heads, out_weight, out_bias)
    return tied_scale * heads @ qkv_weight                    # rows of [U_1…U_K] · SSA stack


def ista_reference(x, dictionary, eta, lambd):
    """One ISTA step of CRATE Eq. 17, Z⁺ = ReLU(Z + η Dᵀ(Z − D Z) − ηλ), three products as written.

    Column form D Z is F.linear(x, D) in rows; Dᵀ(·) is F.linear(·, Dᵀ)."""
    dz = F.linear(x, dictionary)
    residual = x - dz
    return F.relu(x + eta * F.linear(residual, dictionary.t()) - eta * lambd)


def mm_sparsify_reference(x, dictionary, lambd, alpha):
    """Proximal majorisation-minimisation step of CRATE Eq. 92 (App. A), no skip connection:
    Z⁺ = ReLU((1 + 4/(9(1+α))) DᵀZ − 4λ/(9α)), α = d/(Nε²)."""
    gain = 1.0 + 4.0 / (9.0 * (1.0 + alpha))
    return F.relu(gain * F.linear(x, dictionary.t()) - 4.0 * lambd / (9.0 * alpha))
