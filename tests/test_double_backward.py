"""Second derivatives (docs/design.md, "Second derivatives"): a gradient penalty, a Hessian-vector product or timm's
AdaHessian differentiates a backward again. The fast paths with a hand-written backward (oneDNN's GEMMs, SOFT's
Eq. 12 backward of A†, the Sparsifiner tile kernel) give the second derivative of their plain-torch reference
(float64 where the path takes it); CRATE's shared-QKV op, which has none, refuses with an error, never a wrong value,
and `autotune.twice_differentiable()` takes SDPA's math kernel instead. Before, `once_differentiable` dropped the
dependence on the saved tensors silently whenever the incoming gradient did not itself require grad."""
import math

import pytest
import torch
import torch.nn.functional as F

from structformer.functional import autotune, tile_kernel
from structformer.functional.crate_ops import mssa_reference
from structformer.functional.newton_pinv import newton_pinv
from structformer.functional.onednn_linear import _OneDnnLinear, onednn_available
from structformer.functional.sparsifiner import block_indices_to_mask, masked_attention
from structformer.layers import MSSA, SoftAttention
from structformer.train import TrainConfig, train

F64 = torch.float64


def _penalty_gradients(fn, inputs, weights):
    """∂/∂inputs of ‖∂L/∂inputs[0]‖², L = Σ weights · tanh(fn(*inputs)): the gradient of a gradient penalty.
    tanh makes the second derivative depend on every input, and the fixed `weights` are an incoming gradient that
    does not require grad (where `once_differentiable` used to drop terms)."""
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    first, = torch.autograd.grad((weights * torch.tanh(fn(*inputs))).sum(), inputs[0], create_graph=True)
    return torch.autograd.grad(first.square().sum(), inputs)


def _draw(*shapes, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype) for shape in shapes]


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear op")
def test_onednn_linear_second_derivative_is_f_linears():
    """float32 (the path's dtype): against F.linear's, within float32 rounding of the products."""
    x, w, b, c = _draw((64, 32), (16, 32), (16,), (64, 16), dtype=torch.float32)
    got = _penalty_gradients(lambda x, w, b: _OneDnnLinear.apply(x, w, b), (x, w, b), c)
    want = _penalty_gradients(F.linear, (x, w, b), c)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * r.abs().max().item())


@pytest.mark.parametrize('rule', ['ours', 'softpp'])
def test_newton_pinv_closed_form_second_derivative_is_the_pinvs(rule):
    """Well conditioned SPD A, converged iterations: Eq. 12 differentiated again equals the second derivative of
    torch.linalg.pinv (and of the unrolled iteration). Not the public SOFT rule: its iterate is still 3e-4 off the
    pseudo-inverse here after 60 steps, so neither reference is its function."""
    b, c = _draw((3, 5, 5), (3, 5, 5))
    a = b @ b.transpose(-1, -2) + 5 * torch.eye(5, dtype=F64)
    got = _penalty_gradients(lambda a: newton_pinv(a, 60, rule=rule), (a,), c)
    want = _penalty_gradients(torch.linalg.pinv, (a,), c)
    torch.testing.assert_close(got[0], want[0], rtol=1e-8, atol=1e-12)
    unrolled = _penalty_gradients(lambda a: newton_pinv(a, 60, rule=rule, backward='unrolled'), (a,), c)
    torch.testing.assert_close(got[0], unrolled[0], rtol=1e-8, atol=1e-12)


def test_soft_layer_closed_form_and_unrolled_second_derivatives_agree():
    """The whole SOFT layer at float64: Eq. 12's second derivative (it lost the terms through A† before: 6 % of the
    largest entry here) equals the one through the unrolled Newton steps, converged."""
    x, = _draw((2, 16, 16))
    grads = {}
    for backward in ('closed_form', 'unrolled'):
        torch.manual_seed(0)
        layer = SoftAttention(16, num_heads=2, num_landmarks=4, sampler='avgpool', newton_iter=40,
                              newton_backward=backward).to(F64)
        grads[backward] = _penalty_gradients(layer, (x,), torch.ones(()))[0]
    scale = grads['unrolled'].abs().max().item()
    torch.testing.assert_close(grads['closed_form'], grads['unrolled'], rtol=1e-7, atol=1e-9 * scale)


@pytest.mark.skipif(tile_kernel.unavailable_reason() is not None, reason='the tile kernel does not exist here')
@pytest.mark.parametrize('dense_rows', [0, 1])
def test_tile_kernel_second_derivative_is_the_masked_attentions(dense_rows):
    """n = 20 in tiles of 8 (a partial last tile), 2 of 3 key tiles kept, float64: against the masked n×n
    softmax on the same tiles, differentiated twice by autograd."""
    q, k, v, c = _draw(*[(1, 2, 20, 4)] * 4)
    g = torch.Generator().manual_seed(1)
    indices = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(2 * 3)]).reshape(1, 2, 3, 2)
    mask = block_indices_to_mask(indices, 20, 8, dense_rows)
    got = _penalty_gradients(lambda q, k, v: tile_kernel.block_tile_attention(q, k, v, indices, 8,
                                                                              dense_rows=dense_rows), (q, k, v), c)
    want = _penalty_gradients(lambda q, k, v: masked_attention(q, k, v, mask), (q, k, v), c)
    for a, r in zip(got, want):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-12)


def test_shared_qkv_refuses_a_second_derivative_and_twice_differentiable_takes_sdpa(monkeypatch):
    """300 tokens, where CRATE's shared-QKV backward runs: a second derivative through it stops with torch's error;
    inside `twice_differentiable()` the layer takes SDPA (math kernel) and equals CRATE Eq. 115 written out."""
    monkeypatch.setenv('STRUCTFORMER_CHOICE_SSA_IMPL', '')
    torch.manual_seed(0)
    layer = MSSA(16, num_heads=2, ssa_impl='shared').train().to(F64)
    x, c = _draw((2, 300, 16), (2, 300, 16))
    with pytest.raises(RuntimeError, match='autograd'):
        _penalty_gradients(layer, (x,), c)
    layer.ssa_impl = 'auto'
    autotune.forget()
    with autotune.twice_differentiable():
        got = _penalty_gradients(layer, (x,), c)[0]
    assert any(d['name'] == 'ssa_impl' and d['source'] == 'twice-differentiable' and d['choice'] == 'sdpa'
               for d in autotune.report()['decisions'])
    want = _penalty_gradients(lambda x: mssa_reference(x, layer.qkv.weight, 2, layer.scale, layer.proj.weight,
                                                       layer.proj.bias), (x,), c)[0]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_an_explicit_choice_wins_inside_twice_differentiable(monkeypatch):
    monkeypatch.setenv('STRUCTFORMER_CHOICE_SSA_IMPL', 'shared')
    with autotune.twice_differentiable():
        assert autotune.decide('ssa_impl', (300, 8, 'float64'), 'sdpa', dict) == 'shared'
    monkeypatch.setenv('STRUCTFORMER_CHOICE_SSA_IMPL', '')
    with autotune.twice_differentiable():
        assert autotune.decide('ssa_impl', (300, 8, 'float64'), 'shared', dict) == 'sdpa'


@pytest.mark.parametrize('model', ['crate_digits', 'soft_digits'])
def test_train_with_timms_second_order_optimiser(model, tmp_path):
    """`--opt adahessian` (timm's AdaHessian differentiates the gradients again in its step): the backward keeps
    its graph (it ended in 'element 0 of tensors does not require grad'), and the Hessian estimate is non-zero."""
    from timm.optim import Adahessian
    seen = []
    original = Adahessian.set_hessian

    def spy(self):
        original(self)
        seen.extend(float(p.hess.abs().sum()) for p in self.get_params())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Adahessian, 'set_hessian', spy)
        result = train(TrainConfig(model=model, data='digits', epochs=1, limit_train_batches=2, batch_size=16,
                                   opt='adahessian', lr=0.01, output=str(tmp_path / 'run')), progress=False)
    assert result.history and all(math.isfinite(value) for value in result.final.values()
                                  if isinstance(value, float))
    assert len(seen) > 0 and sum(seen) > 0


def test_hand_written_backwards_pass_gradgradcheck_in_float64():
    """The create_graph branch of each custom autograd Function, numerically, in float64: the tests above compare
    one direction of the second derivative (a gradient penalty's) with the reference's; gradgradcheck checks the
    whole double-backward Jacobian against finite differences. _OneDnnLinear with a row-major and a transposed
    weight, with and without bias (its float64 products are torch's: the backward formula is what is checked);
    Eq. 12's backward of A† (converged, well conditioned; gradcheck's float64 tolerances); the tile kernel's on a
    partial last tile with the cls row dense."""
    x, w, b, a_base = _draw((3, 4), (5, 4), (5,), (2, 4, 4), seed=4)
    for weight in (w, w.t().contiguous().t()):
        for bias in (b, None):
            inputs = (x.clone().requires_grad_(), weight.detach().clone().requires_grad_())
            assert torch.autograd.gradgradcheck(lambda x, w: _OneDnnLinear.apply(x, w, bias), inputs)
    a = (a_base @ a_base.transpose(-1, -2) / 4 + torch.eye(4, dtype=F64)).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda m: newton_pinv(m, num_iter=60), (a,), eps=1e-6, atol=1e-8, rtol=1e-6)
    if tile_kernel.unavailable_reason() is None:
        q, k, v = (t.requires_grad_() for t in _draw(*[(1, 2, 7, 3)] * 3, seed=5))
        indices = torch.tensor([[[[1], [0]], [[0], [1]]]])              # 2 query tiles of 4 (the last partial), 1 kept
        assert torch.autograd.gradgradcheck(
            lambda q, k, v: tile_kernel.block_tile_attention(q, k, v, indices, 4, dense_rows=1), (q, k, v))
