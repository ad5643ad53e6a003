"""CRATE's SSA operator with the shared-projection backward (structformer.functional.shared_qkv_attention)
against the autograd reference and SDPA: outputs, gradients, gradcheck."""
import pytest
import torch
import torch.nn.functional as F

from structformer.functional.shared_qkv_attention import shared_qkv_attention, shared_qkv_attention_reference


@pytest.mark.parametrize('scale', [0.5, 4.0])        # 4.0: peaked softmax rows
def test_gradcheck_float64(scale):
    torch.manual_seed(0)
    w = torch.randn(2, 3, 7, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: shared_qkv_attention(t, scale), (w,))


def _value_and_grad(fn, w, probe):
    w = w.detach().clone().requires_grad_()
    out = fn(w)
    (grad,) = torch.autograd.grad((out * probe).sum(), w)
    return out.detach(), grad


def test_matches_reference_and_sdpa_in_float64():
    torch.manual_seed(1)
    w, probe = torch.randn(2, 6, 50, 64, dtype=torch.float64), torch.randn(2, 6, 50, 64, dtype=torch.float64)
    scale = 64 ** -0.5
    ours = _value_and_grad(lambda t: shared_qkv_attention(t, scale), w, probe)
    for oracle in (lambda t: shared_qkv_attention_reference(t, scale),
                   lambda t: F.scaled_dot_product_attention(t, t, t, scale=scale)):
        expected = _value_and_grad(oracle, w, probe)
        for a, b in zip(ours, expected):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10 * b.abs().max().item())


def test_float32_error_is_that_of_plain_float32_attention():
    """In float32 the fused backward may round differently from autograd, but no worse: its distance to
    the float64 result stays within a small multiple of plain float32 attention's own distance."""
    torch.manual_seed(2)
    w, probe = torch.randn(4, 6, 197, 64), torch.randn(4, 6, 197, 64)
    scale = 64 ** -0.5
    truth = _value_and_grad(lambda t: shared_qkv_attention_reference(t, scale), w.double(), probe.double())
    ours = _value_and_grad(lambda t: shared_qkv_attention(t, scale), w, probe)
    plain = _value_and_grad(lambda t: shared_qkv_attention_reference(t, scale), w, probe)
    eps = torch.finfo(torch.float32).eps
    for mine, base, exact in zip(ours, plain, truth):
        floor = eps * exact.abs().max().item()                # one rounding of the largest entry
        assert (mine.double() - exact).abs().max() <= 4 * (base.double() - exact).abs().max() + floor


def test_rejects_a_tensor_without_batch_dimension():
    with pytest.raises(ValueError, match=r'w must be \[..., N, p\]'):
        shared_qkv_attention(torch.randn(5, 4), 1.0)


def test_crate_trains_the_same_through_either_ssa_implementation():
    """CRATE with ssa_impl='shared' and 'sdpa': the same function, so the same loss and gradients."""
    import timm
    torch.manual_seed(3)
    x, y = torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    grads = {}
    for impl in ('shared', 'sdpa'):
        torch.manual_seed(0)
        model = timm.create_model('crate_digits', ssa_impl=impl).double().train()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads[impl] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(grads['shared'][0], grads['sdpa'][0], rtol=1e-12, atol=0)
    for name, g in grads['shared'][1].items():
        torch.testing.assert_close(g, grads['sdpa'][1][name], rtol=1e-9, atol=1e-12, msg=name)


def test_mssa_picks_the_shared_backward_only_where_it_applies(monkeypatch):
    from structformer.layers.attention import mssa
    calls = []
    monkeypatch.setattr(mssa, 'shared_qkv_attention', lambda w, s: calls.append(1) or shared_qkv_attention(w, s))
    layer = mssa.MSSA(16, num_heads=2, ssa_impl='shared')
    x = torch.randn(2, 5, 16)
    layer(x).sum().backward()
    assert calls == [1]                                    # 'shared', with a backward to come
    with torch.no_grad():
        layer(x)
    layer(x, attn_mask=torch.ones(5, 5, dtype=torch.bool)).sum().backward()
    mssa.MSSA(16, num_heads=2, ssa_impl='sdpa')(x).sum().backward()
    assert calls == [1]                                    # no grad, a mask, or 'sdpa': SDPA
    auto = mssa.MSSA(16, num_heads=2)
    auto(x).sum().backward()
    assert calls == [1, 1]                                 # auto, CPU, 5 tokens: the shared backward
    long = torch.randn(1, mssa.SHARED_BACKWARD_MAX_TOKENS, 16)
    auto(long).sum().backward()
    assert calls == [1, 1]                                 # auto, CPU, from the cut on: SDPA
    auto(long[:, 1:]).sum().backward()
    assert calls == [1, 1, 1]
    with pytest.raises(ValueError, match="ssa_impl='flash'"):
        mssa.MSSA(16, num_heads=2, ssa_impl='flash')


# ---- chunked passes (cache-sized (image, head) chunks, MSSA's strided layout) ----

from structformer.functional import shared_qkv_attention as ssa_module  # noqa: E402


@pytest.mark.parametrize('images,heads,per_chunk', [(3, 4, 1), (3, 4, 3), (3, 4, 4), (3, 4, 8), (3, 4, 9),
                                                    (5, 6, 12), (2, 6, 100), (1, 1, 1)])
def test_chunks_cover_every_image_head_pair_once(images, heads, per_chunk):
    """`pieces`, the chunking both custom ops run: every pair once, at most `per_chunk` per chunk, and
    a contiguous tensor's chunks contiguous (the products read them as one batch by `view`)."""
    grid = torch.zeros(images, heads, 3, dtype=torch.int64)
    for piece in ssa_module.pieces(grid, per_chunk):
        assert 1 <= piece.shape[0] * piece.shape[1] <= max(per_chunk, 1)
        assert piece.is_contiguous()
        piece += 1
    assert bool((grid == 1).all())


def test_heads_per_chunk_keeps_each_threads_share_within_the_budget():
    budget = ssa_module.CHUNK_BYTES_PER_THREAD
    per_head = 197 * 197 * 4
    chunk = ssa_module.heads_per_chunk(96, 197, 4, 2, 'cpu')
    assert chunk * per_head <= 2 * budget < (chunk + 1) * per_head
    assert ssa_module.heads_per_chunk(96, 2000, 4, 1, 'cpu') == 1          # one head's weights exceed it
    assert ssa_module.heads_per_chunk(6, 17, 4, 2, 'cpu') == 6             # never more than there are
    assert ssa_module.heads_per_chunk(96, 197, 4, 2, 'cuda') == 96         # off the CPU: one batched pass


def _mssa_layout(images, tokens, heads, width, dtype=torch.float64):
    """w as MSSA makes it: a [images, heads, N, p] view of a [images, N, heads·p] projection output."""
    base = torch.randn(images, tokens, heads * width, dtype=dtype)
    return base.view(images, tokens, heads, width).transpose(1, 2)


@pytest.mark.parametrize('chunk', [0, 1, 2, 3, 4, 8, 12])
@pytest.mark.parametrize('layout', ['mssa', 'contiguous'])
def test_every_chunking_matches_the_reference_in_float64(chunk, layout):
    """Chunks of part of an image's heads (1-3), one image (4), several (8, 12), the automatic choice:
    the same output and gradient as autograd through the plain formula, and the output keeps w's
    memory layout (MSSA's [images, N, heads·p] is never transposed as a whole)."""
    torch.manual_seed(6)
    w = _mssa_layout(3, 11, 4, 5)
    if layout == 'contiguous':
        w = w.contiguous()
    probe = torch.randn(w.shape, dtype=torch.float64)
    ours = _value_and_grad(lambda t: shared_qkv_attention(t, 0.7, chunk=chunk), w, probe)
    expected = _value_and_grad(lambda t: shared_qkv_attention_reference(t, 0.7), w, probe)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    out = shared_qkv_attention(w, 0.7, chunk=chunk)
    assert out.stride() == w.stride()


@pytest.mark.parametrize('chunk', [1, 3, 8])
def test_gradcheck_chunked_on_the_mssa_layout(chunk):
    torch.manual_seed(7)
    w = _mssa_layout(2, 6, 4, 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: shared_qkv_attention(t, 0.9, chunk=chunk), (w,))


@pytest.mark.parametrize('shape', [(5, 9, 4), (2, 3, 2, 7, 4)])
def test_three_and_five_dimensional_inputs(shape):
    torch.manual_seed(8)
    w, probe = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    for chunk in (0, 1, 2):
        ours = _value_and_grad(lambda t: shared_qkv_attention(t, 0.5, chunk=chunk), w, probe)
        expected = _value_and_grad(lambda t: shared_qkv_attention_reference(t, 0.5), w, probe)
        for a, b in zip(ours, expected):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_custom_ops_pass_torch_library_opcheck():
    """Schema, fake (meta) kernels and the registered autograd formula of the two custom ops, as
    torch.compile relies on them, on both layouts."""
    torch.manual_seed(9)
    for w in (_mssa_layout(2, 5, 3, 4, torch.float32), torch.randn(2, 3, 5, 4)):
        torch.library.opcheck(ssa_module._forward, (w.requires_grad_(), 0.5, 2))


def test_rejects_a_bad_chunk():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match='chunk must be an integer >= 0'):
            shared_qkv_attention(torch.randn(2, 5, 4), 1.0, chunk=bad)


def test_auto_takes_the_shared_backward_further_for_wide_heads(monkeypatch):
    """'auto' on a CPU: below SHARED_BACKWARD_MAX_TOKENS at any head width, below
    SHARED_BACKWARD_MAX_TOKENS_WIDE at widths from SHARED_BACKWARD_WIDE_HEAD_DIM (the measured crossovers)."""
    from structformer.layers.attention import mssa
    calls = []
    monkeypatch.setattr(mssa, 'shared_qkv_attention', lambda w, s: calls.append(1) or shared_qkv_attention(w, s))
    wide, narrow = mssa.SHARED_BACKWARD_WIDE_HEAD_DIM, mssa.SHARED_BACKWARD_WIDE_HEAD_DIM // 2
    n = mssa.SHARED_BACKWARD_MAX_TOKENS + 10
    far = mssa.SHARED_BACKWARD_MAX_TOKENS_WIDE
    for width, tokens, shared in ((wide, n, True), (narrow, n, False), (wide, far, False), (wide, far - 1, True)):
        calls.clear()
        layer = mssa.MSSA(2 * width, num_heads=2)
        layer(torch.randn(1, tokens, 2 * width)).sum().backward()
        assert bool(calls) == shared, (width, tokens)


def test_an_expanded_upstream_gradient():
    """`.sum().backward()` hands the op a stride-0 gradient; every chunking still gives the reference's."""
    torch.manual_seed(10)
    base = _mssa_layout(2, 7, 4, 3)
    grads = []
    for fn in (lambda t: shared_qkv_attention(t, 0.6, chunk=1), lambda t: shared_qkv_attention(t, 0.6, chunk=8),
               lambda t: shared_qkv_attention_reference(t, 0.6)):
        w = base.detach().clone().requires_grad_()
        fn(w).sum().backward()
        grads.append(w.grad)
    for g in grads[:2]:
        torch.testing.assert_close(g, grads[2], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('chunk', [0, 2, 3, 6])
def test_matches_crate_ssa_per_head_reference_through_the_projection(chunk):
    """CRATE Eq. 11 head by head (`ssa_per_head_reference`) against the chunked op on MSSA's layout of
    the same projection: outputs and gradients for the tokens and the projection, float64."""
    from structformer.functional.crate_ops import ssa_per_head_reference
    torch.manual_seed(11)
    x = torch.randn(2, 9, 12, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(12, 12, dtype=torch.float64, requires_grad=True)        # 3 heads of width 4
    probe = torch.randn(2, 9, 12, dtype=torch.float64)

    def ours():
        w = (x @ weight.t()).view(2, 9, 3, 4).transpose(1, 2)
        return shared_qkv_attention(w, 0.5, chunk=chunk).transpose(1, 2).reshape(2, 9, 12)
    results = []
    for fn in (ours, lambda: ssa_per_head_reference(x, weight, 3, 0.5)):
        out = fn()
        results.append((out.detach(), *torch.autograd.grad((out * probe).sum(), (x, weight))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
