"""The dtype policy of every custom op and numerically delicate step under autocast (docs/precision.md).

Everything here runs under CPU bfloat16 autocast (`torch.autocast('cpu', dtype=torch.bfloat16)`), with float32
weights, and checks for each op: forward and backward run; the output dtype is the one its policy states; the
values and the gradients agree with a reference computed without autocast.

How the tolerances are chosen (none was adjusted to make a test pass):
* Errors are norm-wise, rel(a, b) = ‖a − b‖_F / ‖b‖_F, against a float32 or float64 reference as each test says.
* U = 2⁻⁸ is bfloat16's unit roundoff: rounding a number to bf16 (8 significant bits, round to nearest) changes it
  by at most U relatively (`torch.finfo(torch.bfloat16).eps` is 2⁻⁷ = 2U, the spacing just above 1).
* CPU bf16 products accumulate in float32 (as CUDA tensor cores do), so a product's error is that of rounding its
  operands and its result, whatever its length K: for sums of random-sign terms the error and the value both grow
  like √K, so the relative error does not. (The rule of thumb "a few × U·√K for a K-term sum" is the bound for
  accumulation in bf16, which neither backend does.) Each test therefore counts S, the bf16 roundings a result
  goes through (operand casts and product outputs, weights included), and allows S·U: the worst case when
  the errors add up with no cancellation, where independent roundings give about √S·U.
* Where a step has a known amplification (logits of size |ℓ| turn a relative error U into an absolute error |ℓ|·U
  of the softmax's exponent) it is counted as extra roundings and said so.
* Gradients count the backward's roundings the same way (the incoming gradient's cast, each bf16 product of the
  backward, the bf16 activations the backward reads).
* float32 islands must show no bf16 error at all: they are compared with the same computation without autocast
  (exactly equal: the same float32 ops run), or with a float64 reference at float32 precision.
"""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from structformer.functional import onednn_linear, tile_kernel
from structformer.functional import sparsifiner as sparsifiner_functional
from structformer.functional.coding_rate import (coding_rate, compression_rate, compression_rate_grad,
                                                 official_rate_per_head, paper_rate_per_head)
from structformer.functional.gaussian_kernel import gaussian_kernel, gaussian_kernel_reference
from structformer.functional.newton_pinv import newton_pinv
from structformer.functional.shared_qkv_attention import shared_qkv_attention, shared_qkv_attention_reference
from structformer.functional.sparsifiner import (block_indices_to_mask, mask_from_indices, masked_attention,
                                                 predicted_tiles, topk_indices)
from structformer.layers.attention.mssa import MSSA
from structformer.layers.attention.nystrom import NystromAttention
from structformer.layers.attention.performer import PerformerAttention
from structformer.layers.attention.soft import SoftAttention, SoftPlusPlusAttention, soft_attention, soft_attention_projected
from structformer.layers.attention.sparsifiner import SparsifinerAttention
from structformer.layers.linear import (FactorizedConv2d, FactorizedLinear, KroneckerLinear, MaskedLinear,
                                        MonarchLinear, PKLinear)
from structformer.layers.mlp.ista import ISTA

BF16 = torch.bfloat16
U = 2.0 ** -8                     # bf16 unit roundoff
U32 = 2.0 ** -24                  # float32 unit roundoff


def autocast():
    return torch.autocast('cpu', dtype=BF16)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def grads(module: torch.nn.Module):
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def run(module, x, amp: bool):
    """Forward and backward of module(x) with a fixed random upstream gradient; (output, parameter grads)."""
    module.zero_grad()
    if amp:
        with autocast():
            out = module(x)
    else:
        out = module(x)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.backward(upstream.to(out.dtype))
    return out, grads(module)


def assert_grads_close(got, want, tol):
    assert got.keys() == want.keys() and got
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        assert got[name].dtype == want[name].dtype == torch.float32, name    # float32 weights keep float32 grads
        assert rel(got[name], want[name]) <= tol, (name, rel(got[name], want[name]), tol)


def assert_autocast_close(layer, x, rounds: int, grad_rounds: int):
    """layer(x) under autocast returns bf16 within rounds·U of the float32 layer, its weight gradients within
    grad_rounds·U of the float32 ones."""
    want, want_grads = run(layer, x, amp=False)
    got, got_grads = run(layer, x, amp=True)
    assert got.dtype == BF16 and want.dtype == torch.float32
    assert rel(got, want) <= rounds * U
    assert_grads_close(got_grads, want_grads, grad_rounds * U)


def run_reference(layer, forward, x):
    """`run` in float32 of forward(x), a reference computed with `layer`'s own parameters but taking a choice (a
    mask, the ReLU's gates) from elsewhere; the gradients are named as the layer's."""
    class Reference(torch.nn.Module):
        def forward(self, x):
            return forward(x)
    reference = Reference()
    reference.layer = layer
    out, want_grads = run(reference, x, amp=False)
    return out, {name.removeprefix('layer.'): g for name, g in want_grads.items()}


class OpLog(TorchDispatchMode):
    """Every op the dispatcher runs (after autocast's casts): (op, dtypes, shapes) of its tensor arguments."""

    PRODUCTS = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.bmm.default: (0, 1),
                torch.ops.aten.baddbmm.default: (1, 2), torch.ops.aten.addmm.default: (1, 2)}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.calls.append((func, [t.dtype for t in tensors], [tuple(t.shape) for t in tensors], args))
        return func(*args, **kwargs)

    def products(self):
        """(dtype, shapes of the two factors, multiply-adds) of every matrix product."""
        out = []
        for func, _, _, args in self.calls:
            if func in self.PRODUCTS:
                i, j = self.PRODUCTS[func]
                a, b = args[i], args[j]
                out.append((a.dtype, (tuple(a.shape), tuple(b.shape)), a.numel() * b.shape[-1]))
        return out

    def ran(self, name: str):
        """dtypes of the calls of the op named `name` (e.g. 'structformer.block_tile_attention.default')."""
        return [dtypes for func, dtypes, _, _ in self.calls if str(func) == name]


# ---------------------------------------------------------------- 1. SOFT: kernel and pseudo-inverse in float32

def test_gaussian_kernel_is_a_float32_island():
    """Policy: float32 under autocast. With float32 inputs the result and the gradients are exactly those
    without autocast (the same float32 ops run); with bf16 inputs it is float32 and matches float64 on the
    same (bf16-valued) inputs at float32 precision, which a bf16 expansion would miss by far."""
    q, k = torch.randn(2, 12, 16, requires_grad=True), torch.randn(2, 7, 16, requires_grad=True)
    want = gaussian_kernel(q, k)
    want_grads = torch.autograd.grad(want.sum(), (q, k))
    with autocast():
        got = gaussian_kernel(q, k)
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    for g, w in zip(torch.autograd.grad(got.sum(), (q, k)), want_grads):
        assert torch.equal(g, w)

    qb, kb = q.detach().bfloat16().requires_grad_(), k.detach().bfloat16().requires_grad_()
    with autocast():
        got = gaussian_kernel(qb, kb)
    got_grads = torch.autograd.grad(got.sum(), (qb, kb))
    assert got.dtype == torch.float32 and all(g.dtype == BF16 and torch.isfinite(g).all() for g in got_grads)
    q64, k64 = qb.detach().double().requires_grad_(), kb.detach().double().requires_grad_()
    ref = gaussian_kernel_reference(q64, k64)
    ref_grads = torch.autograd.grad(ref.sum(), (q64, k64))
    # float32 expansion ‖q‖² + ‖k‖² − 2qk: each of the three d-term sums is off by ≤ d·U32 of its size, so the
    # exponent by ≤ 3·d·U32·scale·(‖q‖² + ‖k‖²); the kernel's relative error is that absolute exponent error
    scale = 1 / (2 * math.sqrt(16))
    sizes = q64.detach().square().sum(-1).amax() + k64.detach().square().sum(-1).amax()
    bound = float(3 * 16 * U32 * scale * sizes)
    assert rel(got, ref) <= bound
    # the gradients are the kernel times exponent derivatives: the same bound, bf16-rounded on the way out (1 U)
    for g, r in zip(got_grads, ref_grads):
        assert rel(g, r) <= bound + U
    # the bound can tell: the same expansion with its products in bf16 is off by far more
    with autocast():
        bf16_exponent = q64.detach().float().square().sum(-1, keepdim=True) + \
            k64.detach().float().square().sum(-1).unsqueeze(-2) - 2 * (qb @ kb.transpose(-2, -1)).float()
    assert rel(torch.exp(-scale * bf16_exponent.clamp_min(0)), ref) > 10 * bound


def test_newton_pinv_and_its_custom_op_are_float32_islands():
    """Policy: float32 under autocast, for `newton_pinv` (autocast off inside) and for the opaque op
    `structformer::newton_schulz` called directly (its registered autocast rule casts the input to float32)."""
    base = torch.randn(3, 6, 6, dtype=torch.float64)
    a = (base @ base.transpose(-2, -1) / 6 + torch.eye(6, dtype=torch.float64)).float().requires_grad_()
    want = newton_pinv(a, num_iter=30)
    (want_grad,) = torch.autograd.grad(want.sum(), a)
    with autocast():
        got = newton_pinv(a, num_iter=30)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    (got_grad,) = torch.autograd.grad(got.sum(), a)
    assert torch.equal(got_grad, want_grad)

    # the op itself: float32 in, float32 out, the same values as outside autocast; a bf16 input runs in float32
    flat = a.detach()
    want_op = torch.ops.structformer.newton_schulz(flat, 30)
    with autocast():
        got_op = torch.ops.structformer.newton_schulz(flat, 30)
        got_op_bf16 = torch.ops.structformer.newton_schulz(flat.bfloat16(), 30)
    assert got_op.dtype == torch.float32 and torch.equal(got_op, want_op)
    assert got_op_bf16.dtype == torch.float32
    assert torch.equal(got_op_bf16, torch.ops.structformer.newton_schulz(flat.bfloat16().float(), 30))


def _soft_inputs(spread: float = 1.0, seed: int = 0):
    """q, v [2, 2, 36, 8] and avgpool landmarks [2, 2, 4, 8] (6×6 grid, 3×3 windows): n = 36 is no other size."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, 36, 8, generator=gen) * spread
    v = torch.randn(2, 2, 36, 8, generator=gen)
    landmarks = F.avg_pool2d(q.reshape(4, 6, 6, 8).permute(0, 3, 1, 2), 3).flatten(2).transpose(1, 2).reshape(2, 2, 4, 8)
    return q, v, landmarks


@pytest.mark.parametrize('fold', [False, True])
def test_soft_float32_islands_are_exactly_the_kernel_and_the_m_sized_products(fold):
    """Narrowness: of the products that touch the n = 36 tokens, only the kernel exponent's (forward: m·n·d per
    head; backward: its two gradient products) runs in float32; P V and Pᵀz (folded: P x and the output product)
    run in bf16. Every product that does not touch n (A, Newton–Schulz, A† P V, the per-head weights) is float32."""
    n, m, d = 36, 4, 8
    q, v, landmarks = _soft_inputs()
    q.requires_grad_(), landmarks.requires_grad_()                      # both kernel operands get gradients
    x = torch.randn(2, n, 16, requires_grad=True)
    w_v, w_o = torch.randn(16, 16) / 4, torch.randn(16, 16) / 4
    log = OpLog()
    with log:
        with autocast():
            if fold:
                out = soft_attention_projected(x, q, landmarks, w_v, torch.zeros(16), w_o, torch.zeros(16), scale=0.2)
            else:
                out = soft_attention(q, v.requires_grad_(), landmarks, scale=0.2)
        forward = log.products()
        out.float().sum().backward()
    backward = log.products()[len(forward):]
    assert out.dtype == BF16
    kernel = 2 * 2 * m * n * d                                           # the exponent's qkᵀ, all (image, head) pairs

    def touches_n(shapes):
        return any(n in shape for shape in shapes)

    fp32_n = sum(madds for dtype, shapes, madds in forward if touches_n(shapes) and dtype == torch.float32)
    bf16_n = [dtype for dtype, shapes, _ in forward if touches_n(shapes) and dtype != torch.float32]
    assert fp32_n == kernel                                              # the kernel exponent, nothing else
    assert bf16_n == [BF16, BF16]                                        # P V, Pᵀz  (folded: P x, the output)
    assert all(dtype == torch.float32 for dtype, shapes, _ in forward if not touches_n(shapes))
    assert sum(madds for dtype, shapes, madds in backward if touches_n(shapes) and dtype == torch.float32) == 2 * kernel
    assert all(dtype == BF16 for dtype, shapes, _ in backward if touches_n(shapes) and dtype != torch.float32)


@pytest.mark.parametrize('spread', [3.0, 1.0, 0.3, 0.1])
def test_soft_attention_error_does_not_grow_with_the_conditioning_of_A(spread):
    """The reason for the islands: landmarks squeezed together (smaller spread) make A = exp(Q̃ ⊖ Q̃) ill
    conditioned (cond ≈ 1, 60, 1e4, 1e6 here), and A† then has large entries of both signs. With A† and the
    m-sized products in float32 the bf16 error stays that of the n-sized products at every conditioning.
    Reference: float64 on the same (bf16-valued) inputs. Roundings: P and v cast to bf16 (2), P V's result (3),
    z cast to bf16 (4), the output (5): 5U. (A† in bf16 instead measured 1e-2 at cond 60 and 6e-2 at 1e6.)"""
    q, v, landmarks = (t.bfloat16() for t in _soft_inputs(spread, seed=1))
    scale = 1 / (2 * math.sqrt(8))
    ref = soft_attention(q.double(), v.double(), landmarks.double(), scale=scale)
    with autocast():
        got = soft_attention(q, v, landmarks, scale=scale)
    assert got.dtype == BF16
    assert rel(got, ref) <= 5 * U


SOFT_LAYERS = [(SoftAttention, dict(fold_projections=False)), (SoftAttention, dict(fold_projections=True)),
               (SoftPlusPlusAttention, dict(fold_projections=False)), (SoftAttention, dict(official=True))]


@pytest.mark.parametrize('cls,kwargs', SOFT_LAYERS)
def test_soft_layer_under_autocast(cls, kwargs):
    """The layer returns the autocast dtype; output and weight gradients against the float32 layer.
    Forward roundings (S = 12): x and the qkv weight (2), q and v (3), the sampler's weight and landmarks (5), the
    kernel's exponent from bf16 q and landmarks (≈ 2·scale·‖q‖·‖q − q̃‖·U ≤ 1U here: 6), P (7), P V (8), z (9),
    Pᵀz (10), the proj weight and output (12). Gradients: the upstream cast, the bf16 products of the backward
    (proj: 2, Pᵀz: 2, P V: 2, the q/v projection and sampler: 3) and the bf16 activations they read (x, P, z, v:
    4): S = 14."""
    layer = cls(16, num_heads=2, qkv_bias=True, sampling_ratio=2, grid_size=(4, 4), **kwargs)
    assert_autocast_close(layer, torch.randn(2, 17, 16), 12, 14)


@pytest.mark.parametrize('fold', [False, True])
def test_soft_layer_shapes_on_the_meta_device(fold):
    """`train --dry-run` builds the model on the meta device, and a SOFT sampler given no grid (a timm ViT with
    attn_layer=soft) is shaped by one forward there: autocast knows no 'meta' device, so the float32 islands and
    `autocast_dtype` leave it alone instead of raising (torch's 'unknown device type for autocast')."""
    from structformer.functional.precision import autocast_dtype, float32_island
    assert autocast_dtype('meta', torch.float64) is torch.float64
    shaped = SoftAttention(16, num_heads=2, sampling_ratio=2, fold_projections=fold)
    shaped(torch.zeros(1, 17, 16))                     # the CPU's shapes, to compare with
    with torch.device('meta'):
        layer = SoftAttention(16, num_heads=2, sampling_ratio=2, fold_projections=fold)
        with float32_island('meta'):
            out = layer(torch.zeros(1, 17, 16))
    assert out.shape == (1, 17, 16) and out.device.type == 'meta'
    assert [(n, p.shape, p.device.type) for n, p in layer.named_parameters()] == \
        [(n, p.shape, 'meta') for n, p in shaped.named_parameters()]


@pytest.mark.parametrize('build, shape', [
    (lambda: ISTA(8), (2, 12, 8)),                                                  # the fused effective matrix
    (lambda: NystromAttention(8, num_heads=2, num_landmarks=3), (2, 7, 8)),
    (lambda: PerformerAttention(8, num_heads=2), (2, 7, 8)),
    (lambda: SparsifinerAttention(8, num_heads=2, seq_len=7, predictor_dim=4), (2, 7, 8)),
])
def test_layers_that_turn_autocast_off_run_on_the_meta_device(build, shape):
    """Every layer whose forward turns autocast off for a float32 step runs on the meta device, as `train --dry-run`
    and the parameter counts build models there (a lazy layer is shaped by one forward there). Each called
    `torch.autocast(device_type=x.device.type, enabled=False)` directly, which on 'meta' raised torch's bare
    "RuntimeError: unsupported scalarType": `train --dry-run --model vit_tiny_patch16_224 --model-kwargs
    attn_layer=sparsifiner attn_kwargs="{'predictor_dim': 32}"` ended in that traceback."""
    torch.manual_seed(0)
    shapes = build()(torch.randn(*shape)).shape
    with torch.device('meta'):
        out = build()(torch.randn(*shape))
    assert out.device.type == 'meta' and out.shape == shapes


@pytest.mark.parametrize('build', [lambda: MonarchLinear(8, 4, nblocks=2), lambda: FactorizedLinear(8, 4, rank=2),
                                   lambda: FactorizedConv2d(2, 4, 3, rank=2)])
def test_to_dense_runs_on_the_meta_device(build):
    """`to_dense()` (the weight a structured layer applies, read by analysis and weight-tying code) turns autocast off
    the same way: on the meta device it raised "unsupported scalarType" instead of giving the weight's shape."""
    shape = build().to_dense().shape
    with torch.device('meta'):
        dense = build().to_dense()
    assert dense.device.type == 'meta' and dense.shape == shape


# ---------------------------------------------------------------- 2. CRATE: shared-QKV SSA and ISTA in bf16

def test_shared_qkv_attention_runs_in_the_autocast_dtype():
    """Policy: the wrapper casts w to the autocast dtype, both custom ops run in it (as SDPA would).
    Forward roundings: w (1), the scores (2), their magnitude |ℓ| ≤ 3 here turning U into up to 3U of the
    softmax's exponent (5), P (6), P W (7): 7U. dW: the upstream cast, dP = G Wᵀ, the row sums, dS (with the
    cancellation dP − rowsum, counted as 2), Pᵀ G, dS W, plus the bf16 P, W and O it reads: 10U."""
    w = torch.randn(2, 3, 17, 8, requires_grad=True)
    scale = 8 ** -0.5
    w64 = w.detach().double().requires_grad_()
    ref = shared_qkv_attention_reference(w64, scale)
    upstream = torch.randn(ref.shape, dtype=torch.float64)
    (ref_grad,) = torch.autograd.grad(ref, w64, upstream)
    with autocast():
        out = shared_qkv_attention(w, scale)
    (grad,) = torch.autograd.grad(out, w, upstream.to(out.dtype))
    assert out.dtype == BF16
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all()
    assert rel(out, ref) <= 7 * U
    assert rel(grad, ref_grad) <= 10 * U


@pytest.mark.parametrize('ssa_impl', ['shared', 'sdpa'])
@pytest.mark.parametrize('tied_output', [False, True])
def test_mssa_under_autocast(ssa_impl, tied_output):
    """MSSA returns the autocast dtype on either SSA path. Forward: the SSA's 7 roundings above plus x and the qkv
    weight (9), the output weight and product (11): 11U; gradients: SSA's 10 plus the projections' backward
    products and the bf16 x and weights they read (4): 14U."""
    layer = MSSA(16, num_heads=2, ssa_impl=ssa_impl, tied_output=tied_output)
    assert_autocast_close(layer, torch.randn(2, 9, 16), 11, 14)


def _ista_pre_activation(layer: ISTA, x: torch.Tensor) -> torch.Tensor:
    """The argument of the step's ReLU (Eq. 17 fused or term by term, or Eq. 92), as the layer computes it."""
    d = layer.weight
    if layer.step == 'mm':
        alpha = layer.dim / (x.shape[-2] * layer.eps ** 2)
        return (1 + 4 / (9 * (1 + alpha))) * F.linear(x, d.t()) - 4 * layer.lambd / (9 * alpha)
    if layer.fused:
        return x @ layer.effective_matrix() - layer.eta * layer.lambd
    return x + layer.eta * F.linear(x - F.linear(x, d), d.t()) - layer.eta * layer.lambd


@pytest.mark.parametrize('kwargs,rounds', [(dict(), 3), (dict(fused=False), 6), (dict(step='mm'), 5)])
def test_ista_under_autocast(kwargs, rounds):
    """Policy: bf16 products, the autocast dtype out, on every step. Forward roundings S: fused, x, the effective
    matrix I + η(D − DᵀD) (formed in float32) and the product: 3; reference, x, D, D x, the residual's cast,
    Dᵀ(·), the final cast: 6; mm, x, D, the product, the gain and the shift in bf16: 5. The output: S·U (the ReLU is
    1-Lipschitz). The ReLU's gates: the pre-activation's rounding error is at most S·U of its spread σ (its sums
    cancel, so the error is a share of σ, not of its value), so a share ≤ 2φ(0)·S·U = 0.8·S·U of the gates can
    open or close. Each such flip moves a whole entry of the gradient (with ~600 entries one flip costs ~10U
    norm-wise), so the gradient is compared with the float32 one taken through the bf16 run's own gates: twice
    the forward's count (the upstream cast and one bf16 backward product per forward product, reading bf16
    operands)."""
    layer = ISTA(32, **kwargs)
    x = torch.randn(2, 9, 32)
    want, _ = run(layer, x, amp=False)
    got, got_grads = run(layer, x, amp=True)
    assert got.dtype == BF16
    assert rel(got, want) <= rounds * U
    gates = got > 0
    assert (gates != (want > 0)).float().mean() <= 0.8 * rounds * U
    _, want_grads = run_reference(layer, lambda x: torch.where(gates, _ista_pre_activation(layer, x), 0.0), x)
    assert_grads_close(got_grads, want_grads, 2 * rounds * U)


# ---------------------------------------------------------------- 3. Sparsifiner: float32 predictor, bf16 attention

def _sparsifiner(**kwargs):
    torch.manual_seed(3)
    # the 'scaled' basis init: the public code's trunc-normal(0.02) puts every Eq. 2 coefficient below τ before
    # training, and all-zero scores would test nothing about their precision
    return SparsifinerAttention(32, num_heads=2, qkv_bias=True, **{'basis_init': 'scaled', **kwargs})


@pytest.mark.parametrize('predictor_dim', [None, 8])
def test_sparsifiner_predictor_scores_and_top_k_are_float32(predictor_dim):
    """The scores under autocast are float32 and match float64 on the same (bf16) q, k at float32 precision: the
    predictor's three products (q (W_down K)ᵀ, the n_down-term Ã_down W_up, with the reduction to predictor_dim
    before them) each sum ≤ 32 terms, so each is off by ≤ 32·U32 of its size, and the softmax between them adds
    nothing larger: 3·32·U32 ≈ 6e-6. bf16 scores would be off by ≥ U = 4e-3. The kept keys are the top keys of the
    float64 scores (up to ties within that bound). The scores' gradient (the distillation loss's) is finite."""
    layer = _sparsifiner(seq_len=17, predictor_dim=predictor_dim)
    x = torch.randn(2, 17, 32)
    with autocast():
        q, k, _ = layer.project(x)
        scores = layer.predict(q, k)
        indices = topk_indices(scores, layer.budget(17))
    assert q.dtype == BF16 and scores.dtype == torch.float32
    ref = layer.predict(q.double(), k.double())
    bound = 3 * 32 * U32
    assert rel(scores, ref) <= bound
    kth = ref.topk(layer.budget(17), dim=-1).values[..., -1:]
    assert bool((ref.gather(-1, indices) >= kth - bound * ref.abs().amax()).all())
    scores.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.basis.parameters())


@pytest.mark.parametrize('impl', ['masked', 'gather'])
def test_sparsifiner_token_attention_under_autocast(impl):
    """The attention runs in the autocast dtype (bf16 out) on the float32 predictor's mask. Reference: the float32
    layer's masked attention on that same mask (the mask itself is the predictor's choice, tested above).
    Forward roundings: x and the qkv weight (2), q, k, v (3), the logits (4) with |ℓ| ≤ 3 (6), the softmax's output
    (7), attn·V (8), proj weight and output (10): 10U. Gradients: the upstream cast, the backward's bf16 products
    (proj: 2, attn·V: 2, the logits: 2, qkv: 1) and the bf16 activations they read (x, q, k, v, attn): 13U."""
    layer = _sparsifiner(seq_len=17, impl=impl, keep_scores=True)
    x = torch.randn(2, 17, 32)
    got, got_grads = run(layer, x, amp=True)
    assert got.dtype == BF16 and layer.last_scores.dtype == torch.float32
    # the layer's own mask (the gathered path keeps indices, not a mask: rebuilt from its scores as it picks them)
    mask = mask_from_indices(topk_indices(layer.last_scores, layer.budget(17)), 17, dense_rows=1)
    if layer.last_mask is not None:
        assert torch.equal(mask, layer.last_mask)
    want, want_grads = run_reference(layer, lambda x: layer.merge(masked_attention(*layer.project(x), mask)), x)
    assert rel(got, want) <= 10 * U
    assert_grads_close(got_grads, want_grads, 13 * U)


def test_sparsifiner_block_auto_takes_the_gathered_path_under_autocast(monkeypatch):
    """Policy: under CPU autocast impl='auto' with block connectivity runs the gathered tiles in bf16 (the attention
    in the autocast dtype), not the float32-only tile kernel; its tiles come from the float32 predictor."""
    layer = _sparsifiner(seq_len=65, connectivity='block', block_size=16)
    taken, tiles = [], []
    real_gather, real_top = sparsifiner_functional.block_gathered_attention, sparsifiner_functional.top_tiles
    monkeypatch.setattr(sparsifiner_functional, 'block_gathered_attention',
                        lambda q, *a, **kw: taken.append(q.dtype) or real_gather(q, *a, **kw))
    monkeypatch.setattr(sparsifiner_functional, 'top_tiles', lambda s, *a: tiles.append(s.dtype) or real_top(s, *a))
    x = torch.randn(2, 65, 32)
    log = OpLog()
    with log:
        got, got_grads = run(layer, x, amp=True)
    assert taken == [BF16] and tiles == [torch.float32]
    assert not log.ran('structformer.block_tile_attention.default')
    assert got.dtype == BF16 and all(torch.isfinite(g).all() for g in got_grads.values())


def test_sparsifiner_tile_kernel_runs_in_float32_under_autocast():
    """impl='kernel' under autocast: the kernel's ops themselves (predictor, attention and its backward) run on
    float32 tensors (cast in), the layer returns bf16 (cast out). Reference: the float32 layer's masked attention
    on the same tiles (recomputed here by the same float32 predictor from the same bf16 q, k). Roundings: x and the
    qkv weight (2), q, k, v (3), the kernel's output cast (4), proj weight and output (6), and the logits' size
    |ℓ| ≤ 3 on the bf16-rounded q, k (8): 8U. Gradients: the upstream cast, proj's two bf16 backward products, the
    cast of the kernel's float32 gradients, qkv's backward product and the bf16 x and weights read (4): 9U."""
    reason = tile_kernel.unavailable_reason()              # builds the kernel on first use (~20 s), once per machine
    if reason is not None:
        pytest.skip(f'the CPU tile kernel is unavailable: {reason}')
    layer = _sparsifiner(seq_len=65, connectivity='block', block_size=16, impl='kernel')
    x = torch.randn(2, 65, 32)
    log = OpLog()
    with log:
        got, got_grads = run(layer, x, amp=True)
    assert got.dtype == BF16
    for op in ('block_connectivity', 'block_tile_attention', 'block_tile_attention_backward'):
        calls = log.ran(f'structformer.{op}.default')
        assert calls and all(dt == torch.float32 for dtypes in calls for dt in dtypes if dt.is_floating_point), op
    with autocast():
        q, k, _ = layer.project(x)
        w_down, w_up = layer.basis(k)
        chosen = predicted_tiles(q, k, w_down, layer._scoring_basis(w_up), layer.tau, layer.up_threshold,
                                 layer.keep_ratio, 16, kernel=True)              # |W_up| by default (up_basis)
    mask = block_indices_to_mask(chosen, 65, 16, dense_rows=1)
    want, want_grads = run_reference(layer, lambda x: layer.merge(masked_attention(*layer.project(x), mask)), x)
    assert rel(got, want) <= 8 * U
    assert_grads_close({n: g for n, g in got_grads.items() if not n.startswith('basis')}, want_grads, 9 * U)


# ---------------------------------------------------------------- 4. structured linear layers

LINEARS = {
    # name: (layer, input width, bf16 roundings of the output: S)
    # one product: x, W, the product, the bias add: 4.  two products: x, both factors, both products, bias: 6.
    'monarch': (lambda: MonarchLinear(64, 64, nblocks=4), 64, 6),
    'kronecker': (lambda: KroneckerLinear((8, 8), (4, 8)), 64, 6),
    'masked': (lambda: MaskedLinear(64, 32, density=0.5), 64, 4),
    'pk_random': (lambda: PKLinear(8, 8, 4, perm_in='random', perm_out='random'), 64, 4),
    'pk_transpose': (lambda: PKLinear(8, 8, 8, perm_in='transpose', perm_out='transpose'), 64, 4),
    'factorized': (lambda: FactorizedLinear(64, 48, rank=8), 64, 6),
}


@pytest.mark.parametrize('name', sorted(LINEARS))
def test_structured_linear_under_autocast(name):
    """Policy: as nn.Linear, the autocast dtype out (bias included), products in bf16; `to_dense()` stays the
    float32 weight. Tolerance S·U with S counted in LINEARS; gradients the same S (the upstream cast and one bf16
    backward product per forward product, reading bf16 operands: as many roundings as the forward)."""
    make, width, rounds = LINEARS[name]
    torch.manual_seed(0)
    layer = make()
    assert_autocast_close(layer, torch.randn(3, 5, width), rounds, rounds)
    with autocast():
        dense = layer.to_dense()
    assert dense.dtype == torch.float32 and torch.equal(dense, layer.to_dense())


def test_factorized_conv_under_autocast():
    """Both convolutions in bf16 (x, V, the first conv, U, the second with its bias: S = 6, as a two-product
    linear); `to_dense()` stays float32."""
    layer = FactorizedConv2d(3, 8, 3, rank=2, padding=1)
    assert_autocast_close(layer, torch.randn(2, 3, 8, 8), 6, 6)
    with autocast():
        assert layer.to_dense().dtype == torch.float32


# ---------------------------------------------------------------- 5. FactorizedLinear's oneDNN path

@pytest.mark.skipif(not onednn_linear.onednn_available(), reason='oneDNN linear op not available on this build')
def test_factorized_linear_leaves_onednn_under_autocast(monkeypatch):
    """Policy: the oneDNN path is float32-only, so under autocast FactorizedLinear takes F.linear / matmul (which
    autocast casts). With the size floor at 0, oneDNN is taken outside autocast and not inside; the values agree
    as any two-product linear's (S = 6, see LINEARS)."""
    monkeypatch.setattr(onednn_linear, 'MIN_MULTIPLY_ADDS', 0)
    layer = FactorizedLinear(64, 48, rank=8)
    x = torch.randn(3, 5, 64)
    want = layer(x)
    assert '_OneDnnLinear' in want.grad_fn.name()
    with autocast():
        got = layer(x)
    assert got.dtype == BF16 and '_OneDnnLinear' not in got.grad_fn.name()
    node, names = got.grad_fn, []
    while node is not None:                          # no oneDNN node anywhere in the autocast graph
        names.append(node.name())
        node = node.next_functions[0][0] if node.next_functions else None
    assert not any('OneDnn' in n for n in names)
    assert rel(got, want) <= 6 * U


# ---------------------------------------------------------------- 6. coding rates and analysis ignore autocast

def _same_to_float32(inside, outside):
    """float32 precision: the same float32 ops run inside and outside (autocast is off inside), so any
    difference could only be reduction order: allow one float32 ulp per ~16 operations."""
    torch.testing.assert_close(inside, outside, rtol=16 * U32, atol=0)


def test_coding_rates_are_the_same_inside_autocast():
    z = torch.randn(2, 16, 64)
    u = torch.randn(4, 64, 16) / 8
    functions = {'coding_rate': lambda z: coding_rate(z), 'compression_rate': lambda z: compression_rate(z, u),
                 'official': lambda z: official_rate_per_head(z, u), 'paper': lambda z: paper_rate_per_head(z, u),
                 'grad': lambda z: compression_rate_grad(z, u)}
    for name, f in functions.items():
        outside = f(z)
        with autocast():
            inside = f(z)
            from_bf16 = f(z.bfloat16())
        assert inside.dtype == torch.float32, name
        _same_to_float32(inside, outside)
        assert from_bf16.dtype == torch.float32, name          # a bf16 input is upcast, not computed in bf16
        _same_to_float32(from_bf16, f(z.bfloat16().float()))


def test_whitebox_measurements_are_the_same_inside_autocast():
    import timm

    from structformer.analysis import measure_layers
    torch.manual_seed(0)
    model = timm.create_model('crate_synthetic').eval()
    images = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    outside = measure_layers(model, images)
    with autocast():
        inside = measure_layers(model, images)
    for metric, values in outside['samples'].items():
        _same_to_float32(inside['samples'][metric], values)


def test_sparsifiner_analysis_is_the_same_inside_autocast():
    import timm

    from structformer.analysis.sparsifiner import measure_sparsifiner
    torch.manual_seed(0)
    model = timm.create_model('sparsifiner_digits').eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='.*created at the first forward')
        model(torch.zeros(1, 1, 8, 8))
    images = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    outside = measure_sparsifiner(model, images)
    with autocast():
        inside = measure_sparsifiner(model, images)
    for got, want in zip(inside['layers'], outside['layers']):
        for key in ('mask_density', 'attention_recall', 'a_down_sparsity'):
            _same_to_float32(torch.tensor(got[key]), torch.tensor(want[key]))
