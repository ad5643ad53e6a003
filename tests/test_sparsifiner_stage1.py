"""Stage 1 learns at DeiT size (issue 34, item 3), and the public code's choices are options (item 2).

With the paper's n_down = 32 and τ = 0.05 applied while the predictor learns, a near-uniform row of A_down (1/32 per
coefficient) is all below τ: its scores are zero, so is its gradient, and the top-k is a tie. The public code learns
the predictor with the thresholds off (and the student attending densely); that is the default `stage1='dense'`."""
import pytest
import torch
import torch.nn.functional as F
from timm import create_model

import structformer.models  # noqa: F401  (registers the models)
from structformer.layers.attention.sparsifiner import SparsifinerAttention


def _stalled_rows(**options) -> float:
    """The share of predictor query rows (the dense cls row left out) whose distillation gradient is exactly zero,
    over the 12 layers of a randomly initialised sparsifiner_deit_small_patch16_224 on two random images, each
    layer in the stage-1 state the distillation puts it in (`learning_predictor`, training mode)."""
    torch.manual_seed(0)
    model = create_model('sparsifiner_deit_small_patch16_224', **options)
    layers = [m for m in model.modules() if isinstance(m, SparsifinerAttention)]
    inputs = {}
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, args, out, i=i: inputs.__setitem__(i, args[0].detach()))
        layer.learning_predictor, layer.keep_scores = True, True
    model.train()
    with torch.no_grad():
        model(torch.randn(2, 3, 224, 224))
    zero = total = 0
    for i, layer in enumerate(layers):
        q, k, _ = layer.project(inputs[i])
        q, k = q.detach().requires_grad_(), k.detach()
        target = torch.softmax((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1).detach()
        scores = layer.predict(q, k)
        (grad,) = torch.autograd.grad(F.mse_loss(scores[..., 1:, :], target[..., 1:, :], reduction='sum'), q)
        rows = grad[..., 1:, :]
        zero += int((rows == 0).all(-1).sum())
        total += rows[..., 0].numel()
    return zero / total


def test_stage1_gives_almost_every_predictor_row_a_gradient_at_deit_small():
    assert _stalled_rows() < 0.01


def test_stage1_with_the_thresholds_on_stalls_at_deit_small():
    """What the default avoids (the measurement can see a stall): the sparse path's thresholds in stage 1 leave most
    rows without gradient, with the public init and with ours before issue 34."""
    assert _stalled_rows(stage1='sparse') > 0.5
    assert _stalled_rows(stage1='sparse', basis_init='scaled') > 0.5


def test_dense_stage1_attends_densely_and_keeps_unthresholded_signed_scores():
    torch.manual_seed(1)
    layer = SparsifinerAttention(32, 2, seq_len=9, keep_ratio=0.25, keep_scores=True, basis_init='scaled')
    dense = SparsifinerAttention(32, 2, seq_len=9, keep_ratio=1.0)
    dense.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 32)
    layer.train()
    layer.learning_predictor = True
    dense.eval()
    torch.testing.assert_close(layer(x), dense(x))
    q, k, _ = layer.project(x)
    a_down = torch.softmax((q @ (layer.basis.w_down @ k).transpose(-2, -1)) * 16 ** -0.5, dim=-1)
    torch.testing.assert_close(layer.last_scores, a_down @ layer.basis.w_up)       # no τ, no t, W_up signed
    assert float(layer.last_density) == 1.0
    layer.eval()                                    # inference: the sparse path, |W_up| and the thresholds
    layer(x)
    w_up = layer.basis.w_up.abs()
    want = (a_down * (a_down > layer.tau)) @ (w_up * (w_up >= layer.up_threshold))
    torch.testing.assert_close(layer.last_scores, want)
    layer.train()
    layer.stage1 = 'sparse'                         # ours before: the sparse path while the predictor learns
    layer(x)
    torch.testing.assert_close(layer.last_scores, want)


def test_public_code_options_and_their_alternatives():
    torch.manual_seed(2)
    public = SparsifinerAttention(64, 2, seq_len=10, predictor_dim=16)
    assert public.up_basis == 'abs' and public.stage1 == 'dense' and public.predictor_q.bias is not None
    assert 0.015 < float(public.basis.w_up.detach().std()) < 0.025                    # trunc-normal, std 0.02
    ours = SparsifinerAttention(64, 2, seq_len=10, predictor_dim=16, up_basis='signed', predictor_bias=False,
                                basis_init='scaled', stage1='sparse')
    assert ours.predictor_q.bias is None and float(ours.basis.w_up.detach().std()) > 0.1      # N(0, 1/n_down)
    x = torch.randn(1, 10, 64)
    q, k, _ = public.project(x)
    with torch.no_grad():
        public.predictor_q.bias.fill_(1.0)
        qr, _ = public._predictor_inputs(q, k)
    torch.testing.assert_close(qr, q @ public.predictor_q.weight.t() + 1.0)
    for bad, match in (({'up_basis': 'x'}, 'up_basis'), ({'stage1': 'x'}, 'stage1'), ({'basis_init': 'x'}, 'basis_init')):
        with pytest.raises(ValueError, match=match):
            SparsifinerAttention(64, 2, seq_len=10, **bad)


def test_distiller_sets_the_stage1_state_for_the_attention_loss_alone():
    from types import SimpleNamespace

    from structformer.train.distill import Distiller
    model = create_model('sparsifiner_digits')
    teacher = create_model('vit_digits')
    distiller = Distiller(model, teacher)
    layers = list(distiller.sparse_layers.values())
    distiller.start_phase(SimpleNamespace(losses={'distill_attn': 1.0}))
    assert all(layer.learning_predictor and layer.keep_scores for layer in layers)
    distiller.start_phase(SimpleNamespace(losses={'ce': 1.0, 'distill_attn': 0.5}))
    assert all(layer.keep_scores and not layer.learning_predictor for layer in layers)
    distiller.start_phase(SimpleNamespace(losses={'ce': 1.0, 'distill_token': 0.5}))
    assert not any(layer.learning_predictor or layer.keep_scores for layer in layers)
    distiller.start_phase(SimpleNamespace(losses={'distill_attn': 1.0}))
    distiller.stop()
    assert not any(layer.learning_predictor for layer in layers)
