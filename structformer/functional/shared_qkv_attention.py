"""Self-attention with one projection for queries, keys and values: CRATE's SSA operator (Eq. 11).

    O = softmax(s · W Wᵀ) W,    W = U_kᵀZ per head (rows: tokens),  s = the softmax scale.

Generic attention treats Q, K and V as three inputs: its backward computes dQ, dK and dV with four
N×N×p products (plus a fifth to recompute the scores) and autograd sums the three into dW. With
Q = K = V = W the gradient has a shorter form. Writing P = softmax(S), S = s·W Wᵀ, and G = dO:

    dP = G Wᵀ,    dS = P ⊙ (dP − rowsum(dP ⊙ P)),    dW = Pᵀ G + s (dS + dSᵀ) W,

and rowsum(dP ⊙ P) = rowsum(G ⊙ O) (an N×p product instead of N×N). That is three N×N×p products
in the backward instead of five. The price is keeping P (N×N per head) for the backward, which a
flash kernel does not, and N×N elementwise passes (softmax, dS, the transposed sum dS + dSᵀ) that a
fused kernel keeps in cache. Run over all heads at once those passes stream [batch·heads, N, N]
tensors through memory, and from N ≈ 128 on they cost more than the two saved products. So on a CPU
both passes run in chunks of (image, head) pairs small enough that a chunk's N×N weights stay in a
core's cache (`heads_per_chunk`); the products of a chunk are still batched, and a chunk of MSSA's
[images, N, heads·p] activations is packed for them while it is in cache, never the whole tensor.
Timed on a 2-core CPU (docs/benchmarks.md) it beats SDPA's fused kernel up to N ≈ 150 at every head
width and up to N ≈ 290 at widths 32–64 (CRATE-T: N = 197). `structformer.layers.attention.mssa.MSSA`
picks it or SDPA (`ssa_impl`).
"""
from typing import Tuple

import torch

from .flop_formulas import register_flop_formulas
from .precision import autocast_dtype

# One chunk's N×N weights take about this many bytes per thread: a chunk's scores, dP and dS then stay in
# a core's L2 cache (1–2 MiB on current x86 servers) between the products and the elementwise passes
# that read them, instead of making every pass stream [batch·heads, N, N] tensors through memory.
CHUNK_BYTES_PER_THREAD = 1 << 20


def shared_qkv_attention_reference(w: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale · W Wᵀ) W over the last two dims, differentiated by autograd: the oracle."""
    return torch.softmax(scale * w @ w.transpose(-2, -1), dim=-1) @ w


def heads_per_chunk(pairs: int, tokens: int, element_size: int, threads: int, device_type: str) -> int:
    """How many of the `pairs` (image, head) pairs one chunk holds: all of them off the CPU (one batched
    product each), else as many as keep each thread's share of the chunk's N×N weights within
    `CHUNK_BYTES_PER_THREAD`, at least one."""
    if device_type != 'cpu':
        return pairs
    return max(1, min(pairs, threads * CHUNK_BYTES_PER_THREAD // (tokens * tokens * element_size)))


@torch.compiler.assume_constant_result
def _threads() -> int:
    """torch's intra-op thread count, read as a constant under torch.compile (it only sets the chunk
    size, i.e. speed, never the result)."""
    return torch.get_num_threads()


def _compute_dtype(w: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run the products in: the custom ops below are opaque to autocast (it passes them
    through untouched), so `shared_qkv_attention` casts their input first."""
    return autocast_dtype(w.device.type, w.dtype)


def pieces(t: torch.Tensor, per_chunk: int):
    """An [images, heads, ...] tensor as views covering every (image, head) pair once, in chunks of at
    most `per_chunk` pairs (at least one): whole images (one split) when a chunk holds at least one
    image's heads, else head ranges of one image. A chunk of a contiguous tensor is contiguous."""
    images, heads = t.shape[:2]
    if per_chunk >= heads:
        return t.split(per_chunk // heads)
    return [t[i:i + 1, h:h + per_chunk] for i in range(images) for h in range(0, heads, per_chunk)]


def _batch(t: torch.Tensor) -> torch.Tensor:
    """A contiguous [images, heads, A, B] chunk as the [pairs, A, B] batch of the products (a view)."""
    return t.view(-1, *t.shape[-2:])


# The forward and backward are custom ops (opaque to torch.compile, which runs them as they are: traced,
# their chunk loop of out= writes would be functionalised into whole-tensor copies) with the backward
# registered as the forward's autograd formula.

@torch.library.custom_op('structformer::shared_qkv_attention_forward', mutates_args=())
def _forward(w: torch.Tensor, scale: float, per_chunk: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
    """(O in w's memory layout, P [images, heads, N, N], W and O packed contiguous for the backward)
    for w [images, heads, N, p]. A strided w's chunks are packed just before their products read them
    (while in cache); for a contiguous w the packed pair is empty (the backward reads w and O)."""
    images, heads, n, _ = w.shape
    strided = not w.is_contiguous()
    w_packed = torch.empty(w.shape, dtype=w.dtype, device=w.device) if strided else w.new_empty(0)
    out_packed = torch.empty_like(w_packed)
    out = torch.empty_like(w)                                         # w's layout (strides preserved)
    probs = w.new_empty(images, heads, n, n)
    parts = [pieces(t, per_chunk) for t in (w, out, probs) + ((w_packed, out_packed) if strided else (w, out))]
    for w_src, o_dst, p_c, w_c, o_c in zip(*parts):
        if strided:
            w_c.copy_(w_src)
        p_c, w_c = _batch(p_c), _batch(w_c)
        torch.baddbmm(p_c, w_c, w_c.transpose(1, 2), beta=0, alpha=scale, out=p_c)     # S = s·W Wᵀ
        torch.softmax(p_c, dim=-1, out=p_c)                                           # P
        torch.bmm(p_c, w_c, out=_batch(o_c))                                          # O = P W
        if strided:
            o_dst.copy_(o_c)
    return out, probs, w_packed, out_packed


@_forward.register_fake
def _(w, scale, per_chunk):
    packed = torch.empty(w.shape if not w.is_contiguous() else (0,), dtype=w.dtype, device=w.device)
    return torch.empty_like(w), w.new_empty(*w.shape[:-1], w.shape[-2]), packed, torch.empty_like(packed)


@torch.library.custom_op('structformer::shared_qkv_attention_backward', mutates_args=())
def _backward(grad_out: torch.Tensor, w: torch.Tensor, probs: torch.Tensor, out: torch.Tensor, scale: float,
              per_chunk: int) -> torch.Tensor:
    """dW (in grad_out's memory layout) from G = grad_out, chunk by chunk (see the module docstring);
    w and out contiguous."""
    grad_w = torch.empty_like(grad_out)
    for g_c, dw_c, w_c, o_c, p_c in zip(*(pieces(t, per_chunk) for t in (grad_out, grad_w, w, out, probs))):
        w_c, o_c, p_c = _batch(w_c), _batch(o_c), _batch(p_c)
        g_c = _batch(g_c.contiguous())
        row = torch.linalg.vecdot(g_c, o_c).unsqueeze(-1)              # rowsum(dP ⊙ P) = rowsum(G ⊙ O)
        # dS = P ⊙ (G Wᵀ − row): the row subtracted as the product's β-term, then one in-place pass
        d_scores = torch.baddbmm(row.expand(-1, -1, row.shape[1]), g_c, w_c.transpose(1, 2), beta=-1)
        d_scores.mul_(p_c)
        # W is both query and key: their gradients s·dS W and s·dSᵀ W share one product
        d_sym = d_scores + d_scores.transpose(1, 2)
        into = _batch(dw_c) if dw_c.is_contiguous() else None        # else a buffer copied into place
        grad_c = torch.bmm(p_c.transpose(1, 2), g_c, out=into).baddbmm_(d_sym, w_c, alpha=scale)
        if into is None:
            dw_c.copy_(grad_c.view(dw_c.shape))
    return grad_w


@_backward.register_fake
def _(grad_out, w, probs, out, scale, per_chunk):
    return torch.empty_like(grad_out)


# FlopCounterMode cannot look inside a custom op: without these, CRATE's attention counted 0 in a training step
def _forward_flops(w_shape, *args, **kwargs) -> int:
    images, heads, n, p = w_shape
    return 2 * 2 * images * heads * n * n * p                   # S = s·W Wᵀ, O = P W


def _backward_flops(grad_shape, *args, **kwargs) -> int:
    images, heads, n, p = grad_shape
    return 3 * 2 * images * heads * n * n * p                   # G Wᵀ, Pᵀ G, (dS + dSᵀ) W


register_flop_formulas(((torch.ops.structformer.shared_qkv_attention_forward, _forward_flops),
                        (torch.ops.structformer.shared_qkv_attention_backward, _backward_flops)))


def _setup_context(ctx, inputs, output):
    w, scale, per_chunk = inputs
    out, probs, w_packed, out_packed = output
    packed = w_packed.numel() > 0
    ctx.save_for_backward(w_packed if packed else w, probs, out_packed if packed else out)
    ctx.scale, ctx.per_chunk = scale, per_chunk
    ctx.set_materialize_grads(False)       # P and the packed copies are outputs only for the backward


def _autograd_backward(ctx, grad_out, *unused):
    if grad_out is None:
        return None, None, None
    w, probs, out = ctx.saved_tensors
    return _backward(grad_out, w, probs, out, ctx.scale, ctx.per_chunk), None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def shared_qkv_attention(w: torch.Tensor, scale: float, chunk: int = 0) -> torch.Tensor:
    """softmax(scale · W Wᵀ) W for w of shape [..., N, p], with the shared-projection backward above.
    The output has w's memory layout. `chunk`: (image, head) pairs per pass (a multiple of the heads,
    the second-to-last batch dimension, or a part of them); 0 (default) picks `heads_per_chunk`.
    Dtype policy: under autocast, w is cast to the autocast dtype here and both custom ops (forward and backward)
    run in it, returning that dtype, as SDPA would; measured under CPU bf16 autocast the output is off a float64
    reference by ~0.8·2⁻⁸ and dW by ~1.7·2⁻⁸ (SDPA's: ~1.3·2⁻⁸), at N = 17 to 197 alike."""
    if w.dim() < 3:
        raise ValueError(f"shared_qkv_attention: w must be [..., N, p] with a batch dimension, got {tuple(w.shape)}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"shared_qkv_attention: chunk must be an integer >= 0 (0 = chosen per device), got {chunk!r}")
    shape = w.shape
    w4 = (w.unsqueeze(0) if w.dim() == 3 else w.flatten(0, -4)).to(_compute_dtype(w))   # [images, heads, N, p]
    if chunk == 0:
        chunk = heads_per_chunk(w4.shape[0] * w4.shape[1], shape[-2], w4.element_size(), _threads(), w.device.type)
    out = _forward(w4, float(scale), chunk)[0]
    return out.view(shape)
