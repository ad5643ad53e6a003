"""Sparsifiner's GPU path: compiled FlexAttention (token and block connectivity) against the masked reference,
outputs and gradients, float32 and bfloat16; the layer's `auto` choice on CUDA; one compilation per shape.

Skipped without CUDA (CI has none); run on a lent GPU. Errors are relative norms ‖got − ref‖ / ‖ref‖ against
a float64 reference on the same device: float32 kernels land far under 1e-4 here, bfloat16 operands (8 bits
of mantissa, rounding ≈ 4e-3 per operand) under 2e-2."""
import pytest
import torch

from structformer.functional.sparsifiner import (block_gathered_attention, block_indices_to_mask, budget,
                                                 mask_from_indices, masked_attention, topk_indices)
from structformer.functional.sparsifiner_flex import (block_flex_attention, flex_attention_path, token_block_mask,
                                                      token_block_mask_reference)
from structformer.layers import SparsifinerAttention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: the shapes of earlier tests must not count towards a recompile limit."""
    torch._dynamo.reset()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    assert torch.isfinite(got).all()
    return float((got - want).norm() / want.norm())


def _qkv(n, dtype, b=2, h=6, d=64, seed=0):
    g = torch.Generator(device='cuda').manual_seed(seed)
    return [torch.randn(b, h, n, d, device='cuda', generator=g).to(dtype).requires_grad_() for _ in range(3)]


def _check_against(reference_fn, fn, q, k, v, dtype):
    """fn(q, k, v) against reference_fn on float64 copies: outputs and the gradients of a random cotangent."""
    grad = torch.randn_like(q, dtype=torch.float64)
    out = fn(q, k, v)
    got_grads = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_fn(*ref_inputs)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad)
    assert _relative(out, ref) < TOLERANCE[dtype]
    for got, want in zip(got_grads, ref_grads):
        assert _relative(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('n, keep', [(197, 0.25), (577, 0.1), (64, 0.5)])
def test_compiled_flex_token_path_matches_masked_attention(n, keep, dtype):
    q, k, v = _qkv(n, dtype)
    scores = torch.randn(q.shape[0], q.shape[1], n, n, device='cuda')
    mask = mask_from_indices(topk_indices(scores, budget(n, keep)), n, dense_rows=1)
    _check_against(lambda *t: masked_attention(*t, mask), lambda *t: flex_attention_path(*t, mask), q, k, v, dtype)


# torch 2.11's inductor finds no valid bfloat16 backward kernel for 64-token tiles (NoValidChoicesError, seen on
# an H100 with the kernel options of `kernel_options` and without them); their forward is checked on its own below
BF16_SMALL_TILES = pytest.mark.xfail(raises=Exception, strict=False,
                                     reason='torch 2.11: no bfloat16 backward kernel for 64-token tiles')
BLOCK_CASES = [(577, 64, 1, torch.float32), (197, 64, 0, torch.float32), (256, 128, 1, torch.float32),
               (256, 128, 1, torch.bfloat16),
               pytest.param(577, 64, 1, torch.bfloat16, marks=BF16_SMALL_TILES),
               pytest.param(197, 64, 0, torch.bfloat16, marks=BF16_SMALL_TILES)]


def _block_case(n, block_size, dense_rows, dtype):
    q, k, v = _qkv(n, dtype, seed=1)
    tiles = -(-n // block_size)
    block_indices = torch.rand(q.shape[0], q.shape[1], tiles, tiles, device='cuda').topk(
        budget(tiles, 0.25), dim=-1).indices
    mask = block_indices_to_mask(block_indices, n, block_size, dense_rows)
    flex = lambda *t: block_flex_attention(*t, block_indices, block_size, dense_rows=dense_rows)    # noqa: E731
    gathered = lambda *t: block_gathered_attention(*t, block_indices, block_size, dense_rows=dense_rows)  # noqa: E731
    return (q, k, v), mask, flex, gathered


@pytest.mark.parametrize('n, block_size, dense_rows, dtype', BLOCK_CASES)
def test_compiled_block_flex_matches_gathered_tiles_and_the_masked_reference(n, block_size, dense_rows, dtype):
    (q, k, v), mask, flex, gathered = _block_case(n, block_size, dense_rows, dtype)
    _check_against(lambda *t: masked_attention(*t, mask), flex, q, k, v, dtype)
    _check_against(gathered, flex, q, k, v, dtype)


@pytest.mark.parametrize('n, dense_rows', [(577, 1), (197, 0)])
def test_compiled_block_flex_forward_in_bfloat16_with_64_token_tiles(n, dense_rows):
    (q, k, v), mask, flex, _ = _block_case(n, 64, dense_rows, torch.bfloat16)
    with torch.no_grad():
        got = flex(q, k, v)
    assert _relative(got, masked_attention(*(t.detach().double() for t in (q, k, v)), mask)) < TOLERANCE[torch.bfloat16]


def test_tile_lists_equal_create_block_mask_on_the_gpu():
    n, bs = 300, 128
    mask = torch.rand(2, 3, n, n, device='cuda') < 0.1
    mask[..., :128, :128] = True                                 # a full interior tile
    ours, reference = token_block_mask(mask, bs), token_block_mask_reference(mask, bs)
    assert torch.equal(ours.to_dense(), reference.to_dense())    # the same tiles visited
    interior = slice(0, n // bs)                                 # tiles that do not cross the sequence end
    full_ours = _full_map(ours)[..., interior, interior]
    full_reference = _full_map(reference)[..., interior, interior]
    assert full_ours.any() and torch.equal(full_ours, full_reference)


def _full_map(block_mask) -> torch.Tensor:
    counts, indices = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    tiles = indices.shape[-1]
    rank = torch.arange(tiles, device=indices.device)
    chosen = torch.zeros(*indices.shape[:-1], tiles, dtype=torch.bool, device=indices.device)
    return chosen.scatter_(-1, indices.long(), rank < counts.unsqueeze(-1))


def _layer_pair(connectivity: str, dtype, n=197):
    torch.manual_seed(0)
    flex = SparsifinerAttention(384, 6, qkv_bias=True, seq_len=n, connectivity=connectivity,
                                impl='flex').cuda().to(dtype)
    masked = SparsifinerAttention(384, 6, qkv_bias=True, seq_len=n, connectivity=connectivity,
                                  impl='masked').cuda().to(dtype)
    masked.load_state_dict(flex.state_dict())
    return flex, masked


@pytest.mark.parametrize('connectivity', ['token', 'block'])
def test_layer_on_cuda_trains_through_flex_and_equals_the_masked_path(connectivity):
    flex, masked = _layer_pair(connectivity, torch.float32)
    x = torch.randn(4, 197, 384, device='cuda')
    grad = torch.randn_like(x)
    outs, grads = [], []
    for layer in (flex, masked):
        out = layer(x)
        outs.append(out)
        grads.append(torch.autograd.grad(out, [layer.qkv.weight, layer.proj.weight], grad))
    assert _relative(outs[0], outs[1]) < 1e-4
    for got, want in zip(*grads):
        assert _relative(got, want) < 1e-4


def test_auto_trains_with_attention_dropout_on_the_masked_path():
    layer = SparsifinerAttention(64, 2, seq_len=17, attn_drop=0.1).cuda().train()
    assert layer._resolve_impl(torch.empty(1, device='cuda'), 0.1) == 'masked'
    layer(torch.randn(2, 17, 64, device='cuda')).sum().backward()


@pytest.mark.parametrize('connectivity', ['token', 'block'])
def test_flex_compiles_once_and_once_more_for_any_other_batch(connectivity):
    """The same shape never recompiles; a second batch size compiles one shape-generic kernel, and a third
    reuses it (no eager fallback after dynamo's recompile limit)."""
    import warnings

    from torch._dynamo.utils import counters
    counters.clear()
    flex, _ = _layer_pair(connectivity, torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(3):
            flex(torch.randn(4, 197, 384, device='cuda')).sum().backward()
        assert counters['stats']['unique_graphs'] == 1, dict(counters['stats'])
        for batch in (3, 5, 2):
            flex(torch.randn(batch, 197, 384, device='cuda')).sum().backward()
    assert counters['stats']['unique_graphs'] == 2, dict(counters['stats'])
    eager = [w for w in caught if 'without torch.compile' in str(w.message)]    # flex's eager-fallback notice
    assert not eager, eager[0].message


def test_block_sizes_flex_cannot_tile_are_refused_by_name():
    with pytest.raises(ValueError, match='block_size=48'):
        flex, _ = _layer_pair('block', torch.float32)
        flex.block_size = 48
        flex(torch.randn(1, 197, 384, device='cuda'))
