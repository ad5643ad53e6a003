"""R_c estimators of the white-box analysis (issue 10): scale invariance, planted subspaces, and the official
CRATE estimator written out from its definition."""
import math

import pytest
import torch
from torch import nn

from structformer.analysis.whitebox import ESTIMATORS, default_eps, rate
from structformer.functional.coding_rate import (official_rate_bounds, official_rate_per_head, orthonormal_bases,
                                                 paper_rate_per_head)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _tokens_bases(b=3, n=20, d=12, k=3, p=4, seed=0):
    g = _gen(seed)
    return (torch.randn(b, n, d, generator=g, dtype=torch.float64),
            torch.randn(k, d, p, generator=g, dtype=torch.float64))


def _layer_norm(d, seed=1):
    norm = nn.LayerNorm(d).double()
    with torch.no_grad():                       # a trained-looking γ, β: the estimators must not need γ = 1
        norm.weight.copy_(1 + 0.3 * torch.randn(d, generator=_gen(seed), dtype=torch.float64))
        norm.bias.copy_(0.1 * torch.randn(d, generator=_gen(seed + 1), dtype=torch.float64))
    return norm


@pytest.mark.parametrize('estimator', ESTIMATORS)
def test_invariant_to_scaling_tokens_and_bases(estimator):
    z, u = _tokens_bases()
    norm = _layer_norm(z.shape[-1])
    base = rate(z, u, estimator, norm=norm)
    scaled = rate(10 * z, 10 * u, estimator, norm=norm)
    # LayerNorm's ε (1e-5 against a variance of ~1 and ~100) is the only scale-dependent piece
    torch.testing.assert_close(scaled, base, rtol=1e-5, atol=0)
    # and the raw Eq. 8 value on unnormalised tokens and U is NOT invariant: what the estimators fix
    from structformer.functional.coding_rate import compression_rate
    assert not torch.allclose(compression_rate(10 * z, 10 * u), compression_rate(z, u), rtol=1e-2)


def test_official_invariant_without_layernorm_per_token():
    z, u = _tokens_bases()
    scales = torch.rand(z.shape[:-1], generator=_gen(5), dtype=torch.float64)[..., None] * 100 + 0.01
    torch.testing.assert_close(official_rate_per_head(z * scales, 3 * u), official_rate_per_head(z, u),
                               rtol=1e-10, atol=0)


def test_paper_invariant_to_the_scale_and_basis_of_each_head():
    z, u = _tokens_bases()
    mix = torch.randn(u.shape[0], u.shape[2], u.shape[2], generator=_gen(3), dtype=torch.float64)
    torch.testing.assert_close(paper_rate_per_head(z, u @ mix), paper_rate_per_head(z, u), rtol=1e-9, atol=0)
    q = orthonormal_bases(u)
    torch.testing.assert_close(q.transpose(-1, -2) @ q, torch.eye(u.shape[-1], dtype=torch.float64).expand_as(
        q.transpose(-1, -2) @ q), rtol=0, atol=1e-12)


def test_official_formula_written_out():
    """The public code's CodingRate: X (b, h, m, d) -> X / ‖X‖ over d; W = Xᵀ; scalar = p / (m · eps) with
    eps = 0.01 (ε² = 0.01); logdet(I_m + scalar WᵀW); summed over heads, halved."""
    z, u = _tokens_bases(b=2, n=7, d=10, k=2, p=3)
    x = torch.einsum('bnd,kdp->bknp', z, u)                         # qkv output, 'b n (h d) -> b h n d'
    x = x / torch.norm(x, dim=-1, keepdim=True)
    w = x.transpose(-1, -2)                                          # (b, h, p, m)
    p, m = w.shape[-2:]
    product = w.transpose(-1, -2) @ w                                 # (b, h, m, m)
    logdet2 = torch.logdet(torch.eye(m, dtype=torch.float64) + p / (m * 0.01) * product)
    want = logdet2.sum(-1) / 2.0                                     # per sample; the code then averages
    got = rate(z, u, 'official')                                     # no norm: tokens as given
    assert default_eps('official') == 0.1
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)
    # one term by hand, with a 1-token, 1-dim head: ½ log(1 + p/(N ε²)) = ½ log(1 + 1/0.01)
    one = official_rate_per_head(torch.tensor([[3.0]], dtype=torch.float64), torch.ones(1, 1, 1, dtype=torch.float64))
    assert float(one) == pytest.approx(0.5 * math.log(101.0))


def _planted(num_tokens, d, p, spread, seed):
    """Tokens in one p-dim subspace (spread = 1: isotropic inside it; small: nearly one direction) plus
    isotropic tokens in R^d, and the subspace's basis as a head."""
    g = _gen(seed)
    basis = torch.linalg.qr(torch.randn(d, p, generator=g, dtype=torch.float64)).Q
    coeff = torch.randn(1, num_tokens, p, generator=g, dtype=torch.float64)
    coeff[..., 1:] *= spread
    inside = coeff @ basis.T + 0.01 * torch.randn(1, num_tokens, d, generator=g, dtype=torch.float64)
    isotropic = torch.randn(1, num_tokens, d, generator=g, dtype=torch.float64)
    return inside, isotropic, basis[None]


@pytest.mark.parametrize('estimator', ESTIMATORS)
def test_compressed_tokens_give_lower_rate_than_isotropic(estimator):
    d, p = 16, 4
    heads = []
    for j in range(4):                                                # K = 4 heads, a random one among them
        _, _, b = _planted(32, d, p, 1.0, seed=10 + j)
        heads.append(b[0])
    u = torch.stack(heads)
    g = _gen(99)
    # compressed: every token a multiple of one direction of each head's subspace, plus noise
    direction = torch.stack([h[:, 0] for h in heads])                 # [K, d]
    coeff = torch.randn(1, 32, 4, generator=g, dtype=torch.float64)
    compressed = coeff @ direction + 0.05 * torch.randn(1, 32, d, generator=g, dtype=torch.float64)
    isotropic = torch.randn(1, 32, d, generator=g, dtype=torch.float64)
    low, high = rate(compressed, u, estimator), rate(isotropic, u, estimator)
    assert float(low) < float(high) - 1.0
    # a lower spread inside the subspace gives a lower rate against that subspace, monotonically
    values = []
    for spread in (1.0, 0.3, 0.05):
        inside, _, b = _planted(32, d, p, spread, seed=4)
        values.append(float(rate(inside, b, estimator)))
    assert values[0] > values[1] > values[2]


def test_official_bounds_are_attained():
    k, n, p = 2, 12, 3
    lo, hi = official_rate_bounds(k, n, p)
    parallel = torch.ones(1, n, p, dtype=torch.float64)
    eye = torch.eye(p, dtype=torch.float64).expand(k, p, p)
    assert float(rate(parallel, eye, 'official')) == pytest.approx(lo)
    spread = torch.eye(p, dtype=torch.float64).repeat(n // p, 1)[None]     # N/p tokens on each axis
    assert float(rate(spread, eye, 'official')) == pytest.approx(hi)
    z, u = _tokens_bases(b=4, n=n, d=p, k=k, p=p)
    values = rate(z, u, 'official')
    assert torch.all(values >= lo - 1e-9) and torch.all(values <= hi + 1e-9)


def test_bad_estimator_and_shapes():
    z, u = _tokens_bases()
    with pytest.raises(ValueError, match="estimator must be one of official, paper; got 'raw'"):
        rate(z, u, 'raw')
    with pytest.raises(ValueError, match=r'u_heads must be \[K, d, p\] with d = 12'):
        official_rate_per_head(z, u[:, :5])


@pytest.mark.parametrize('dtype', [torch.float64, torch.bfloat16])
def test_measure_layers_and_heat_maps_take_a_model_of_any_float_dtype(dtype):
    """A float64 or bf16 CRATE is measured like its float32 twin (the first raised 'mixed dtype' in LN1's
    re-application, both in the heat map's numpy conversion, and took only images of the model's dtype): float64 to 1e-6 of R_c (only LN1's rounding
    differs), bf16 within its own activations' rounding."""
    import timm

    import structformer.models  # noqa: F401  (registers the models)
    from structformer.analysis.whitebox import measure_layers, token_heatmaps
    torch.manual_seed(0)
    reference = timm.create_model('crate_synthetic').eval()
    images = torch.randn(3, 1, 16, 16)
    twin = timm.create_model('crate_synthetic').eval()
    twin.load_state_dict(reference.state_dict())
    twin.to(dtype)
    measured, expected = measure_layers(twin, images), measure_layers(reference, images)     # float32 images in
    tolerance = 1e-6 if dtype == torch.float64 else 0.05
    for got, want in zip(measured['layers'], expected['layers']):
        assert got['R_c']['mean'] == pytest.approx(want['R_c']['mean'], rel=tolerance)
    maps = token_heatmaps(twin, images[0], layers=[0, 4])
    assert maps[4].dtype == ('float64' if dtype == torch.float64 else 'float32') and maps[4].shape == (17, 16)
