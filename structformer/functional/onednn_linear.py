"""`F.linear` (y = x Wᵀ + b) on oneDNN's inner-product kernels, with the backward written out.

Why: torch's CPU matmul calls MKL's sgemm. On an AVX2 AMD EPYC, oneDNN's JIT kernels ran the
products of a factorised layer 14–16 % faster where the left operand is a plain row-major matrix (x Wᵀ
and g W at [4096, 4096] × [4096, 256] and alike) and the bias-fused forward 7 % faster; with a
transposed left operand (∂W = gᵀ x) they were 2× slower, so that product stays on `torch.mm`
(docs/lowrank.md, "Kernels"). On an AVX-512 AMD EPYC oneDNN's kernels ran a dense 1024 -> 4096 layer's
training step 1.5× faster than MKL's (MKL takes its AVX2 code on AMD CPUs; oneDNN's JIT uses AVX-512); on an
Intel Xeon MKL's were the faster. So which kernels run is the machine's choice (`functional.autotune`, choice
'linear_kernel': both timed once per shape class, fast path on first use, cached; STRUCTFORMER_CHOICE_LINEAR_KERNEL
overrides). The op is `torch.ops.mkldnn._linear_pointwise`, the one inductor emits for
linear layers on CPU; it has no autograd formula, hence the Function below:

    forward   y  = x Wᵀ + b       oneDNN, bias fused
    backward  ∂x = g W            oneDNN (W passed as the view (Wᵀ)ᵀ, no copy)
              ∂W = gᵀ x           torch.mm (as (xᵀ g)ᵀ for a transposed-view weight)
              ∂b = Σ_tokens g

`linear` may take this path for float32 CPU tensors outside autocast, compilation and graph recording (export,
tracing: `tracing.py`), on x86-64 when torch has the op and the product has at least `MIN_MULTIPLY_ADDS`
multiply-adds, where the machine chose it for the shape class (rows class, in, out, weight layout); where
nothing may be timed it is the default there, as before. Everything else (other dtypes, devices, autocast,
`torch.compile`, small products, `torch_kernels()`, the choice 'torch') runs `F.linear`, the reference the tests
compare against (outputs and gradients in float32; `gradcheck` of the Function in float64, where its
products run on torch's kernels).
"""
import contextlib
import platform

import torch
import torch.nn.functional as F

from . import autotune
from .flop_formulas import register_flop_formulas
from .tracing import recording_graph

__all__ = ['linear', 'onednn_available', 'torch_kernels']

_enabled = True

# Below this many multiply-adds per product, torch's kernels. A oneDNN call (with this Function around it) cost
# about 50 µs more than F.linear here, which decides small products (a FactorizedLinear 64 -> 256 at rank 16 on
# 64 tokens trained at 0.55x torch's speed on oneDNN); a rank-0.25 ViT-S block stack on 8 x 197 tokens (products
# of 0.6e8-2.3e8) trained at the same speed on either (1.93x vs 2.00x dense, 20 paired rounds); a 1024 -> 4096
# layer at rank 256 on 4096 tokens (products of 1.1e9-4.3e9) 8-11 % faster on oneDNN.
# That is the default where nothing is timed; where the machine times the two (`autotune`), products from
# MIN_TIMED_MULTIPLY_ADDS up are its choice too (on an AVX-512 AMD EPYC oneDNN's kernels ran CRATE-T's 3152 x 384 x
# 384 products 1.4-1.7x faster than MKL's, a training step's worth below the old floor at batch 8).
MIN_MULTIPLY_ADDS = 2 ** 28
MIN_TIMED_MULTIPLY_ADDS = 2 ** 22


def _has_op() -> bool:
    # x86-64 only: the only CPUs it was measured on; on ARM torch's BLAS is left alone
    if platform.machine().lower() not in ('x86_64', 'amd64'):
        return False
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, '_linear_pointwise')
    except (AttributeError, RuntimeError):
        return False


_HAS_OP = _has_op()


def _linear_pointwise_flops(x_shape, w_shape, *args, **kwargs) -> int:
    """2 · tokens · in · out, as FlopCounterMode counts F.linear's addmm (the bias add is not counted)."""
    tokens = 1
    for size in x_shape[:-1]:
        tokens *= size
    return 2 * tokens * w_shape[1] * w_shape[0]


if _HAS_OP:    # without this FlopCounterMode would see no work in a FactorizedLinear (model_flops, benches)
    register_flop_formulas(((torch.ops.mkldnn._linear_pointwise, _linear_pointwise_flops),))


def onednn_available() -> bool:
    """Whether `linear` can use oneDNN here (torch built with it and the op present) and is allowed to."""
    return _HAS_OP and _enabled


@contextlib.contextmanager
def torch_kernels():
    """Within this block `linear` runs `F.linear` (torch's own kernels), e.g. to compare the two paths."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


def _product(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x Wᵀ (+ b): oneDNN for float32, torch's kernels otherwise (float64 in gradcheck)."""
    if x.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class _OneDnnLinear(torch.autograd.Function):
    """F.linear's forward and backward with the products of `_product` (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (a gradient penalty, a Hessian-vector product, timm's AdaHessian): the same three
            # products in torch's own ops, which autograd differentiates again (oneDNN's op has no derivative)
            return _differentiable_backward(ctx, grad_out, x, weight)
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(g, weight.t()).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            rows = x.reshape(-1, x.shape[-1])
            # a transposed view (FactorizedLinear's Vᵀ) gets its gradient in its base's layout: (xᵀ g)ᵀ, so
            # the parameter's gradient needs no copy, and that product ran faster here than gᵀ x
            grad_w = (rows.t() @ g).t() if _is_transposed(weight) else g.t() @ rows
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


def _differentiable_backward(ctx, grad_out, x, weight):
    """F.linear's gradients written in differentiable torch ops, for a backward that builds a graph."""
    g = grad_out.reshape(-1, grad_out.shape[-1])
    grad_x = (g @ weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
    grad_w = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
    grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


def _is_transposed(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) != 1


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    if not onednn_available() or torch.compiler.is_compiling() or torch.is_autocast_enabled('cpu') or recording_graph():
        return False
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if not all(t.device.type == 'cpu' and t.dtype == torch.float32 for t in tensors) or weight.dim() != 2:
        return False
    return x.numel() * weight.shape[0] >= min(MIN_MULTIPLY_ADDS, MIN_TIMED_MULTIPLY_ADDS)   # tokens · in · out


def _default_kernel(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Where nothing is timed: oneDNN from MIN_MULTIPLY_ADDS multiply-adds (the AVX2 AMD EPYC's rule), else torch."""
    return 'onednn' if x.numel() * weight.shape[0] >= MIN_MULTIPLY_ADDS else 'torch'


# the stand-in products of a timing: at most this many multiply-adds each (rows cut down to fit), a few ms
TIMING_MULTIPLY_ADDS = 2 ** 27


def _training(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def linear_shape_class(x: torch.Tensor, weight: torch.Tensor, bias) -> tuple:
    """(rows class: the power of two at or below the row count, in, out, weight layout, bias, train / infer):
    what the two kernels' speeds depend on."""
    rows = max(1, x.numel() // max(x.shape[-1], 1))
    return (autotune.power_class(rows), weight.shape[1], weight.shape[0],
            'transposed' if _is_transposed(weight) else 'rows', 'bias' if bias is not None else 'nobias',
            'train' if _training(x, weight) else 'infer')


def linear_candidates(x: torch.Tensor, weight: torch.Tensor, bias) -> dict:
    """Both kernels on stand-ins of the same in / out, weight layout and bias, with the rows cut to about
    `TIMING_MULTIPLY_ADDS` (at least 64, at most x's), drawn from a private generator: forward + backward
    (input, weight and bias gradients) where a backward will follow, else the forward."""
    out_features, in_features = weight.shape
    rows = max(1, x.numel() // max(in_features, 1))
    rows = max(min(rows, 64), min(rows, TIMING_MULTIPLY_ADDS // max(in_features * out_features, 1)))
    training = _training(x, weight)
    generator = torch.Generator().manual_seed(0)
    shape = (in_features, out_features) if _is_transposed(weight) else (out_features, in_features)
    xs, base, grad = (torch.randn(*size, generator=generator)
                      for size in ((rows, in_features), shape, (rows, out_features)))
    bs = torch.randn(out_features, generator=generator) if bias is not None else None
    for t in (xs, base, bs):
        if training and t is not None:
            t.requires_grad_()

    def run(product):
        def call():
            w = base.t() if _is_transposed(weight) else base
            if training:
                with torch.enable_grad():
                    product(xs, w).backward(grad)
            else:
                product(xs, w)
        return call
    return {'onednn': run(lambda a, w: _OneDnnLinear.apply(a, w, bs)), 'torch': run(lambda a, w: _torch_linear(a, w, bs))}


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    if bias is None and _is_transposed(weight):
        # x (Wᵀ)ᵀ as a product with the base: autograd then gives the base its gradient in its own layout
        # (through F.linear it arrives transposed and AccumulateGrad copies it)
        return torch.matmul(x, weight.t())
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """y = x Wᵀ + b, as `F.linear` (any leading dims of x; weight [out, in], possibly a strided view):
    on oneDNN for float32 CPU tensors where this machine chose it (`_OneDnnLinear`), `F.linear` otherwise."""
    if _eligible(x, weight, bias) and autotune.decide(
            'linear_kernel', linear_shape_class(x, weight, bias), _default_kernel(x, weight),
            lambda: linear_candidates(x, weight, bias)) == 'onednn':
        return _OneDnnLinear.apply(x, weight, bias)
    return _torch_linear(x, weight, bias)
