"""CRATE operators against references written from the paper's equations (float64)."""
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from structformer.functional import (coding_rate, compression_rate, compression_rate_grad, ista_reference,
                                     mm_sparsify_reference, mssa_reference, split_heads, ssa_per_head_reference)
from structformer.layers import ISTA, MSSA


@pytest.fixture(autouse=True)
def _float64():
    """Compare in float64 inside this module only (a module-level default would leak into other tests)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _column_logdet_rate(zc, scale):
    """½ logdet(I + scale · Z Zᵀ) with Z ∈ R^{d×N} in the paper's column layout, by slogdet."""
    d = zc.shape[0]
    return 0.5 * torch.linalg.slogdet(torch.eye(d) + scale * zc @ zc.T)[1]


@pytest.mark.parametrize('n,d', [(7, 12), (20, 6)])
def test_coding_rate_eq7_matches_direct_logdet(n, d):
    z = torch.randn(n, d)
    eps = 0.7
    expected = _column_logdet_rate(z.T, d / (n * eps ** 2))
    torch.testing.assert_close(coding_rate(z, eps), expected, rtol=1e-12, atol=0)   # Cholesky vs LU of one SPD matrix


@pytest.mark.parametrize('n, p', [(9, 2), (3, 5), (1, 4)])     # p <= N, p > N (the N×N Gram), one token
def test_compression_rate_eq8_matches_per_head_sum(n, p):
    d, k, eps = 8, 3, 0.5
    z, u = torch.randn(n, d), torch.randn(k, d, p)
    expected = sum(_column_logdet_rate(u[i].T @ z.T, p / (n * eps ** 2)) for i in range(k))
    torch.testing.assert_close(compression_rate(z, u, eps), expected, rtol=1e-12, atol=0)   # float64 logdets


@pytest.mark.parametrize('n, p', [(11, 2), (3, 5)])
def test_eq9_gradient_equals_autograd_of_eq8(n, p):
    d, k, eps = 8, 4, 0.5
    z = torch.randn(3, n, d, requires_grad=True)
    u = torch.randn(k, d, p)
    compression_rate(z, u, eps).sum().backward()
    # float64, well-conditioned I + c·Gram (eigenvalues >= 1): 1e-10 of the largest entry
    torch.testing.assert_close(compression_rate_grad(z.detach(), u, eps), z.grad, rtol=1e-10,
                               atol=1e-10 * z.grad.abs().max().item())


def test_split_heads_matches_qkv_rows():
    w = torch.randn(12, 5)                    # [K·p, d], K=3, p=4
    u = split_heads(w.T, 3)
    torch.testing.assert_close(u[1], w[4:8].T)


def _naive_ssa_column_form(x, w, num_heads, scale):
    """Eq. 11 literally, in the paper's column layout, sample by sample: (U_kᵀZ) softmax((U_kᵀZ)ᵀ(U_kᵀZ))."""
    p = w.shape[0] // num_heads
    out = []
    for sample in x:
        zc = sample.T                                         # d × N
        heads = []
        for k in range(num_heads):
            proj = w[k * p:(k + 1) * p] @ zc                  # U_kᵀ Z: p × N
            attn = torch.softmax(scale * proj.T @ proj, dim=0)   # column-stochastic N × N
            heads.append(proj @ attn)
        out.append(torch.cat(heads, 0).T)
    return torch.stack(out)


def test_ssa_reference_is_eq11():
    x, w = torch.randn(2, 6, 8), torch.randn(8, 8)
    # (U_kᵀZ)·softmax: the Gram matrix is symmetric, so row- and column-softmax are transposes
    torch.testing.assert_close(ssa_per_head_reference(x, w, 2, 0.5), _naive_ssa_column_form(x, w, 2, 0.5))


@pytest.mark.parametrize('tied', [False, True])
def test_mssa_layer_equals_naive_per_head(tied):
    layer = MSSA(12, num_heads=3, attn_head_dim=5, tied_output=tied, eps=0.8)
    x = torch.randn(2, 7, 12, requires_grad=True)
    out = layer(x)
    if tied:
        ref = mssa_reference(x, layer.qkv.weight, 3, 5 ** -0.5, tied_scale=5 / (7 * 0.8 ** 2))
    else:
        ref = mssa_reference(x, layer.qkv.weight, 3, 5 ** -0.5, layer.proj.weight, layer.proj.bias)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x] + list(layer.parameters()), g)
    ref_grads = torch.autograd.grad(ref, [x] + list(layer.parameters()), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_ista_reference_is_eq17_in_column_form():
    x, dmat = torch.randn(2, 5, 6), torch.randn(6, 6)
    eta, lambd = 0.1, 0.2
    cols = [F.relu(s.T + eta * dmat.T @ (s.T - dmat @ s.T) - eta * lambd).T for s in x]
    torch.testing.assert_close(ista_reference(x, dmat, eta, lambd), torch.stack(cols))


def test_ista_is_a_proximal_gradient_step():
    """Eq. 17 = prox of ηλ‖·‖₁ (+ non-negativity) after a gradient step on ½‖Z_½ − D Z‖² at Z = Z_½."""
    x, dmat = torch.randn(4, 6), torch.randn(6, 6)
    eta, lambd = 0.05, 0.3
    z = x.clone().requires_grad_(True)
    (0.5 * ((x - z @ dmat.T) ** 2).sum()).backward()
    expected = F.relu(x - eta * z.grad - eta * lambd)
    torch.testing.assert_close(ista_reference(x, dmat, eta, lambd), expected)


@pytest.mark.parametrize('eta,lambd', [(0.1, 0.1), (0.5, 0.02)])
def test_fused_ista_equals_reference(eta, lambd):
    fused = ISTA(10, eta=eta, lambd=lambd)
    ref = ISTA(10, eta=eta, lambd=lambd, fused=False)
    ref.load_state_dict(fused.state_dict())
    x = torch.randn(3, 7, 10, requires_grad=True)
    a, b = fused(x), ref(x)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, ista_reference(x, fused.weight, eta, lambd))   # the fused layer vs Eq. 17 itself
    g = torch.randn_like(a)
    for ga, gb in zip(torch.autograd.grad(a, [x, fused.weight], g), torch.autograd.grad(b, [x, ref.weight], g)):
        torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize('rows', [(1, 4), (2, 5), (1, 10), (1, 11), (3, 7)])
def test_fused_ista_takes_the_cheaper_product_for_the_rows_and_equals_the_reference(rows, monkeypatch):
    """R = B·N rows at most d = 10: the three products of Eq. 17 (the d³ effective matrix would cost more); more:
    the fused product. Both give the reference's output and gradients."""
    fused = ISTA(10, eta=0.2, lambd=0.05)
    formed = []
    original = ISTA.effective_matrix
    monkeypatch.setattr(ISTA, 'effective_matrix', lambda self: formed.append(1) or original(self))
    x = torch.randn(*rows, 10, requires_grad=True)
    out = fused(x)
    assert bool(formed) == (rows[0] * rows[1] > 10)
    expected = ista_reference(x, fused.weight, 0.2, 0.05)
    torch.testing.assert_close(out, expected)
    g = torch.randn_like(out)
    for ga, gb in zip(torch.autograd.grad(out, [x, fused.weight], g),
                      torch.autograd.grad(expected, [x, fused.weight], g)):
        torch.testing.assert_close(ga, gb)


def test_an_exported_ista_keeps_one_path_for_every_batch():
    """Exported with a free batch (1 image of 4 tokens is 4 rows < d, 8 images are 32 > d): no branch on the rows
    constrains the range, and each batch size gives the reference's output."""
    layer = ISTA(10, eta=0.2, lambd=0.05)
    batch = torch.export.Dim('batch', min=1, max=64)
    program = torch.export.export(layer, (torch.randn(2, 4, 10),), dynamic_shapes=({0: batch},))
    for b in (1, 8):
        x = torch.randn(b, 4, 10)
        torch.testing.assert_close(program.module()(x), ista_reference(x, layer.weight, 0.2, 0.05))


def test_mm_step_is_eq92():
    layer = ISTA(6, lambd=0.3, step='mm', eps=0.5)
    x = torch.randn(2, 5, 6)
    alpha = 6 / (5 * 0.5 ** 2)
    cols = [F.relu((1 + 4 / (9 * (1 + alpha))) * layer.weight.T @ s.T - 4 * 0.3 / (9 * alpha)).T for s in x]
    torch.testing.assert_close(layer(x), torch.stack(cols))
    torch.testing.assert_close(mm_sparsify_reference(x, layer.weight, 0.3, alpha), torch.stack(cols))


def test_bad_sizes_and_eps_are_named_at_construction():
    for bad in (0, -3):
        with pytest.raises(ValueError, match=rf'^in_features={bad} must be a positive integer \(the width d of D\)$'):
            ISTA(bad)
    with pytest.raises(ValueError, match='eps must be a finite number > 0'):
        ISTA(4, step='mm', eps=0)                      # α = d/(Nε²) would divide by zero at the first forward
    # a string failed inside a comparison (TypeError); an infinite η gave NaN codes, an infinite λ all-zero ones
    for name, value in (('eta', 0), ('eta', 'abc'), ('lambd', -1), ('lambd', None), ('eta', math.inf),
                        ('lambd', math.inf), ('eps', math.nan)):
        with pytest.raises(ValueError, match=f"{name} must be a finite number"):
            ISTA(4, **{name: value})
    with pytest.raises(ValueError, match=r'^eps=0.0 must be a finite number > 0'):
        MSSA(8, 2, tied_output=True, eps=0.0)
    # an infinite ε made the tied output p/(N·∞²)·(...) = 0 for every input, silently; None and a string failed
    # inside a comparison ("'>' not supported between instances of 'NoneType' and 'int'"), True was ε = 1
    for value in (math.inf, math.nan, None, '1.0', True):
        with pytest.raises(ValueError, match=rf'^eps={re.escape(repr(value))} must be a finite number > 0'):
            MSSA(8, 2, tied_output=True, eps=value)


def test_ista_output_is_sparse_and_nonnegative():
    layer = ISTA(16, lambd=5.0)
    out = layer(torch.randn(4, 8, 16))
    assert (out >= 0).all() and (out == 0).float().mean() > 0.3


@pytest.mark.parametrize('kwargs', [dict(step='fista'), dict(eta=0.0), dict(out_features=3)])
def test_ista_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        ISTA(8, **kwargs)


def test_the_ista_paths_script_times_both_paths(capsys):
    """tools/ista_paths.py (the numbers docs/crate.md quotes) runs each case both ways and reports the ratio."""
    import importlib.util
    from pathlib import Path

    import timm

    import structformer  # noqa: F401  (registers the models)
    spec = importlib.util.spec_from_file_location('ista_paths', Path(__file__).resolve().parents[1] / 'tools' / 'ista_paths.py')
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as bad:
        script.main(['--rounds', '0'])
    assert bad.value.code == 2 and '--rounds' in capsys.readouterr().err
    formed = []
    model = script._always_fused(timm.create_model('crate_digits'))
    original = ISTA.effective_matrix
    for module in model.modules():
        if isinstance(module, ISTA):
            module.effective_matrix = lambda module=module: formed.append(1) or original(module)
    with torch.no_grad():
        model(torch.randn(1, *model.pretrained_cfg['input_size']))
    assert formed                                       # forced onto the fused path at one image


@pytest.mark.parametrize('eps', [0, 0.0, -0.5, float('inf'), float('nan')])
def test_rates_refuse_an_eps_outside_the_positive_reals(eps):
    """coding_rate(eps=0) raised ZeroDivisionError (d/(N·0²)); a negative ε was taken as |ε| (only ε² enters) and
    ε = inf gave a rate of 0. Every rate now says which argument and what it accepts."""
    from structformer.functional.coding_rate import official_rate_bounds, official_rate_per_head
    z, u = torch.randn(5, 4, dtype=torch.float64), torch.randn(2, 4, 2, dtype=torch.float64)
    calls = [lambda: coding_rate(z, eps), lambda: compression_rate(z, u, eps), lambda: compression_rate_grad(z, u, eps),
             lambda: official_rate_per_head(z, u, eps), lambda: official_rate_bounds(2, 5, 2, eps)]
    for call in calls:
        with pytest.raises(ValueError, match=r'eps must be a finite number > 0 .*; got '):
            call()
    assert float(coding_rate(z, np.float32(0.5))) == pytest.approx(float(coding_rate(z, 0.5)))


def test_sparsity_is_the_fraction_of_non_zero_codes():
    """‖Z‖₀ / (d·N) per sample (CRATE §3.1, what `analyze` plots after every ISTA): exact zeros (ReLU's) do not
    count, and with `tol` only |z| > tol does."""
    from structformer.functional import sparsity
    z = torch.zeros(2, 4, 5)
    z[0, :2, :] = 1.0                                  # 10 of 20 non-zero
    z[1, 0, 0], z[1, 1, 1], z[1, 2, 2] = -3.0, 0.05, 0.2   # 3 of 20 non-zero, 2 above 0.1
    assert sparsity(z).tolist() == pytest.approx([0.5, 0.15], abs=1e-7)        # a float32 mean of 20 entries
    assert sparsity(z, tol=0.1).tolist() == pytest.approx([0.5, 0.1], abs=1e-7)


def test_a_meta_built_ista_is_initialised_by_to_empty_and_reset_parameters():
    """torch's deferred initialisation (build on the meta device, `to_empty`, `reset_parameters()` on every module)
    draws the dictionary D as the constructor does (kaiming-uniform); ISTA had no reset_parameters, so D kept
    `to_empty`'s uninitialised memory."""
    torch.manual_seed(0)
    reference = ISTA(8)
    from deferred_init import deferred_init
    layer = deferred_init(lambda **dd: ISTA(8, **dd), seed=0)
    assert torch.equal(layer.weight, reference.weight)        # the same draw, one op


def test_repr_says_the_configuration():
    """print(model) showed `ISTA((drop): Dropout(p=0.0))` and MSSA's projections only: neither the ISTA step, η, λ
    nor MSSA's heads, head width, tied output or SSA implementation."""
    assert repr(ISTA(8, eta=0.5, lambd=0.2, step='mm', eps=2.0)).startswith(
        "ISTA(\n  in_features=8, step='mm', eta=0.5, lambd=0.2, eps=2.0, fused=True\n")
    assert repr(MSSA(8, 2, tied_output=True, eps=0.5, ssa_impl='sdpa')).startswith(
        "MSSA(\n  num_heads=2, head_dim=4, tied_output=True, eps=0.5, project_out=False, ssa_impl='sdpa'")
    assert "num_heads=2, head_dim=4, tied_output=False, project_out=True, ssa_impl='auto'" in repr(MSSA(8, 2))
