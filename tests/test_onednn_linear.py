"""`functional.onednn_linear.linear`: F.linear on oneDNN's kernels with a hand-written backward. Checked against
F.linear (outputs and every gradient, float32), by gradcheck in float64, and for when it must not be taken."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from structformer.functional import onednn_linear
from structformer.functional.onednn_linear import _OneDnnLinear, linear, torch_kernels
from structformer.layers.linear import FactorizedLinear

needs_onednn = pytest.mark.skipif(not onednn_linear.onednn_available(), reason='torch built without oneDNN')


@pytest.fixture
def every_size(monkeypatch):
    """Small test shapes take the oneDNN path too."""
    monkeypatch.setattr(onednn_linear, 'MIN_MULTIPLY_ADDS', 0)


def _took_onednn(out: torch.Tensor) -> bool:
    return out.grad_fn is not None and '_OneDnnLinear' in out.grad_fn.name()


def _run(fn, x, w, b, upstream):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    b = b.detach().requires_grad_() if b is not None else None
    out = fn(x, w, b)
    out.backward(upstream)
    return out, [t.grad for t in (x, w, b) if t is not None]


@needs_onednn
@pytest.mark.parametrize('shape', [(37, 24), (3, 11, 24)])
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('transposed_weight', [False, True])
def test_onednn_linear_equals_f_linear_with_gradients(every_size, shape, bias, transposed_weight):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    w = torch.randn(24, 40).t() if transposed_weight else torch.randn(40, 24)    # [out=40, in=24]
    b = torch.randn(40) if bias else None
    upstream = torch.randn(*shape[:-1], 40)
    out, grads = _run(linear, x, w, b, upstream)
    assert _took_onednn(out)
    ref_out, ref_grads = _run(F.linear, x, w, b, upstream)
    # float32 sums of ≤ 40 unit-scale products in another order: ~1e-6 relative
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize('on_onednn', [True, False])
def test_transposed_weight_gets_its_gradient_in_its_base_layout(monkeypatch, on_onednn):
    """FactorizedLinear passes Vᵀ: on either path the gradient that reaches V has V's own row-major layout
    (no AccumulateGrad copy) and equals xᵀ g."""
    if on_onednn:
        monkeypatch.setattr(onednn_linear, 'MIN_MULTIPLY_ADDS', 0)
    v = torch.randn(24, 8, requires_grad=True)
    x, upstream = torch.randn(16, 24), torch.randn(16, 8)
    out = linear(x, v.t())
    assert _took_onednn(out) == on_onednn
    out.backward(upstream)
    assert v.grad.is_contiguous() and v.grad.shape == v.shape
    torch.testing.assert_close(v.grad, x.t() @ upstream, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('bias', [True, False])
def test_function_gradcheck_float64(bias):
    """float64 runs the Function's products on torch's kernels: this checks its backward formulas."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True) if bias else None
    assert torch.autograd.gradcheck(lambda x, w: _OneDnnLinear.apply(x, w, b), (x, w))
    wt = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)          # a transposed-view weight
    assert torch.autograd.gradcheck(lambda x, wt: _OneDnnLinear.apply(x, wt.t(), b), (x, wt))


@needs_onednn
def test_stride_zero_upstream_gradient(every_size):
    x = torch.randn(9, 6, requires_grad=True)
    w = torch.randn(5, 6, requires_grad=True)
    linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(9, 5) @ w.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, torch.ones(9, 5).t() @ x.detach(), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_when_the_path_is_not_taken(monkeypatch):
    x, w = torch.randn(4, 6, requires_grad=True), torch.randn(5, 6, requires_grad=True)
    assert not _took_onednn(linear(x, w))                                   # 120 multiply-adds: below the floor
    monkeypatch.setattr(onednn_linear, 'MIN_MULTIPLY_ADDS', 0)
    assert _took_onednn(linear(x, w))
    assert not _took_onednn(linear(x.double(), w.double()))                 # float64: torch's kernels
    with torch_kernels():
        assert not _took_onednn(linear(x, w))
    assert _took_onednn(linear(x, w))                                       # the switch is restored
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = linear(x, w)
    assert out.dtype == torch.bfloat16 and not _took_onednn(out)            # autocast keeps F.linear's casting


@needs_onednn
def test_compiled_module_matches_eager(every_size):
    torch.manual_seed(0)
    layer = FactorizedLinear(12, 20, rank=4)
    x = torch.randn(6, 12)
    with torch_kernels():
        want = layer(x)
    got = torch.compile(layer, backend='eager')(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_factorized_linear_on_onednn_equals_its_torch_path(every_size):
    torch.manual_seed(0)
    layer = FactorizedLinear(24, 40, rank=6)
    x = torch.randn(3, 7, 24)
    upstream = torch.randn(3, 7, 40)

    def grads(use_onednn):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        if use_onednn:
            out = layer(xi)
            assert _took_onednn(out)
        else:
            with torch_kernels():
                out = layer(xi)
        out.backward(upstream)
        return [out, xi.grad, layer.U.grad, layer.V.grad, layer.bias.grad]

    for got, want in zip(grads(True), grads(False)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_flop_counter_sees_the_onednn_products(every_size):
    """Forward 2 products, backward 2 products of ∂x plus 2 of ∂W (torch.mm): 3 × 2·T·r(m + n) FLOPs."""
    layer = FactorizedLinear(16, 64, rank=4)
    x = torch.randn(3, 32, 16, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        layer(x).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * (3 * 32) * 4 * (16 + 64)


def _rounding_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|fl(a b) − a b| ≤ γ_K |a| |b| entry-wise for any summation order in float32, γ_K ≈ K·eps (K the inner
    length; Higham, Accuracy and Stability, §3.5), plus one rounding of the result itself."""
    eps = torch.finfo(torch.float32).eps
    exact = a.double() @ b.double()
    return (a.shape[-1] + 1) * eps * (a.double().abs() @ b.double().abs()) + eps * exact.abs()


_LAYOUTS_X = {
    'one-row': lambda: torch.randn(1, 24),
    'batch-1x1': lambda: torch.randn(1, 1, 24),
    'transposed': lambda: torch.randn(24, 37).t(),
    'permuted-3d': lambda: torch.randn(11, 3, 24).transpose(0, 1),
    'strided-channels': lambda: torch.randn(37, 48)[:, ::2],
    'expanded': lambda: torch.randn(1, 24).expand(5, 24),
}
_LAYOUTS_W = {
    'rows': lambda: torch.randn(40, 24),
    'transposed': lambda: torch.randn(24, 40).t(),
    'strided': lambda: torch.randn(40, 48)[:, 1::2],
}


@needs_onednn
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('w_layout', list(_LAYOUTS_W))
@pytest.mark.parametrize('x_layout', list(_LAYOUTS_X))
def test_onednn_linear_on_every_input_layout_is_within_float32_rounding(every_size, x_layout, w_layout, bias):
    """One row, a 1×1 batch, and x / W views that are not row-major (transposed, permuted, strided, expanded rows
    sharing memory): the Function's output and x, W, b gradients against the float64 product, each entry within
    the float32 rounding bound of its own product (so the tolerance follows from the dtype and the inner length,
    and a wrong layout, off by O(1), cannot pass). The tests above take contiguous x of 37 and 33 rows only."""
    torch.manual_seed(0)
    x, w = _LAYOUTS_X[x_layout](), _LAYOUTS_W[w_layout]()
    b = torch.randn(40) if bias else None
    upstream = torch.randn(*x.shape[:-1], 40)
    out, grads = _run(linear, x, w, b, upstream)
    assert _took_onednn(out)
    rows, g = x.reshape(-1, 24), upstream.reshape(-1, 40)
    exact = rows.double() @ w.double().t() + (b.double() if bias else 0)
    bound = _rounding_bound(rows, w.t()) + (2 * torch.finfo(torch.float32).eps * b.double().abs() if bias else 0)
    assert ((out.reshape(-1, 40).double() - exact).abs() <= bound).all()
    checks = [(grads[0].reshape(-1, 24), g, w), (grads[1], g.t(), rows)]
    if bias:
        checks.append((grads[2][None], torch.ones(1, g.shape[0]), g))
    for got, left, right in checks:
        assert ((got.double() - left.double() @ right.double()).abs() <= _rounding_bound(left, right)).all()
    assert grads[1].shape == w.shape and grads[0].shape == x.shape
