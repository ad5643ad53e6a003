"""Sparsifiner's attention (Eq. 4–6) through torch's FlexAttention: the GPU execution path.

FlexAttention runs a fused attention kernel over a `BlockMask`: per query tile, the key tiles that are
*partial* (some entries kept: the kernel evaluates `mask_mod` inside them) and those that are *full* (every
entry kept: no mask work). Tiles in neither list are skipped, which is where a sparse mask saves time.

- `token_block_mask(mask, block_size)`: the BlockMask of a token mask M [B, H, n, m] (Eq. 3), its tile lists
  read off M with two reductions. `create_block_mask` (torch's general constructor, which evaluates
  `mask_mod` at every (query, key) pair) is the obvious reference; a test checks both give the same lists.
- `tile_block_mask(block_indices, n, block_size, dense_rows)`: the BlockMask of the block connectivity
  (ours): the chosen key tiles of each query tile are full tiles, so no n×n tensor is formed at all; the
  dense cls row turns query tile 0's other tiles into partial ones.
- `flex_attention_path` / `block_flex_attention`: attention on those masks. On CUDA `flex_attention` is
  compiled (eager FlexAttention materialises the n×n scores, which is what the path exists to avoid); on a
  CPU it runs eagerly and is there to be tested against `masked_attention`.

FlexAttention has no attention dropout: the layer refuses impl='flex' with attn_drop > 0, and 'auto'
falls back to the masked path when dropout is active.
"""
import importlib.util
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F


def _find_flex_attention() -> bool:
    try:
        return importlib.util.find_spec('torch.nn.attention.flex_attention') is not None
    except ImportError:                         # no torch.nn.attention at all (older torch)
        return False


# decided once at import, a plain constant: `flex_attention_available` is called inside layers that torch.compile
# traces, and dynamo does not honour an lru_cache there (it warned on an H200: it traces the wrapped function)
_FLEX_ATTENTION = _find_flex_attention()


def flex_attention_available() -> bool:
    """FlexAttention arrived in torch 2.5; the package accepts torch >= 2.4."""
    return _FLEX_ATTENTION


@lru_cache(maxsize=None)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention
    # dynamo's default dynamic=None: a second shape (another batch size) compiles one shape-generic kernel
    # instead of a kernel per shape, which would stop compiling after dynamo's recompile limit and run eagerly
    return torch.compile(flex_attention)


def kernel_options(block_size: int, on_cuda: bool) -> Optional[dict]:
    """FlexAttention's kernel tiles for a BlockMask of `block_size`: the compiled kernels' default tiles are
    up to 128 wide and must divide the mask's tiles (torch before 2.14 does not shrink them itself), so a
    mask of 32- or 64-token tiles runs with tiles of its size (backward: BLOCK_N1 % BLOCK_M1 = BLOCK_M2 %
    BLOCK_N2 = 0). None (the defaults) for multiples of 128 and off CUDA. Known gap: torch 2.11's inductor
    builds no bfloat16 *backward* kernel for 64-token tiles with these or its own tiles (seen on an H100; 4 warps
    and 2 stages did not help, and made the float32 forward at least 3× slower); float32 trains, bfloat16 runs forward."""
    if not on_cuda or block_size % 128 == 0:
        return None
    if block_size < 32 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size}: FlexAttention on CUDA takes a multiple of 128 or a power of "
                         "two >= 32")
    half = block_size // 2
    return {'BLOCK_M': block_size, 'BLOCK_N': block_size, 'BLOCK_M1': half, 'BLOCK_N1': block_size,
            'BLOCK_M2': block_size, 'BLOCK_N2': half}


def run_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask,
                       scale: Optional[float] = None, compiled: Optional[bool] = None) -> torch.Tensor:
    """flex_attention(q, k, v, block_mask), compiled on CUDA unless `compiled` says otherwise."""
    from torch.nn.attention.flex_attention import flex_attention
    compiled = q.is_cuda if compiled is None else compiled
    options = kernel_options(block_mask.BLOCK_SIZE[0], q.is_cuda and compiled)
    if compiled and not torch.compiler.is_compiling():          # inside a compiled model dynamo traces it anyway
        return _compiled_flex_attention()(q, k, v, block_mask=block_mask, scale=scale, kernel_options=options)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, kernel_options=options)


def _tile_lists(partial: torch.Tensor, full: torch.Tensor):
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) from bool tile maps [B, H, qt, kt]:
    each row's chosen tiles first (stable order), the counts as int32, as `BlockMask.from_kv_blocks` takes them."""
    def lists(chosen):
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)
        return chosen.sum(-1, dtype=torch.int32), order.to(torch.int32)
    return (*lists(partial), *lists(full))


def _block_mask(lists, block_size: int, mask_mod, seq_lengths, backward: bool):
    """`BlockMask.from_kv_blocks`, without the query-side lists (a transpose that cost 85 % of building the mask
    on a CPU) when no backward will need them and this torch can leave them out."""
    from torch.nn.attention.flex_attention import BlockMask
    skip = {} if backward or not _can_skip_q_blocks() else {'compute_q_blocks': False}
    return BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=seq_lengths, **skip)


@lru_cache(maxsize=None)
def _can_skip_q_blocks() -> bool:
    import inspect

    from torch.nn.attention.flex_attention import BlockMask
    return 'compute_q_blocks' in inspect.signature(BlockMask.from_kv_blocks).parameters


def _needs_backward(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def token_block_mask(mask: torch.Tensor, block_size: int = 128, backward: bool = True):
    """The BlockMask of a token mask [B, H, n, m]: a tile is full when every real entry is kept, partial when
    some are, skipped when none are. The last tiles' padding counts as 'not kept' for 'partial' and is ignored
    for 'full' (FlexAttention masks positions past n and m itself). `backward=False` leaves out the lists only
    the backward reads."""
    b, h, n, m = mask.shape
    pad = (0, (-m) % block_size, 0, (-n) % block_size)
    shape = (b, h, -(-n // block_size), block_size, -(-m // block_size), block_size)
    padded = F.pad(mask, pad, value=False)
    any_kept = padded.reshape(shape).any(dim=5).any(dim=3)
    all_kept = F.pad(mask, pad, value=True).reshape(shape).all(dim=5).all(dim=3)

    def mask_mod(batch, head, q_idx, kv_idx):          # padded, so the kernel's padded indices stay in bounds
        return padded[batch, head, q_idx, kv_idx]

    return _block_mask(_tile_lists(any_kept & ~all_kept, all_kept), block_size, mask_mod, (n, m), backward)


def token_block_mask_reference(mask: torch.Tensor, block_size: int = 128):
    """The same BlockMask by torch's general constructor, which evaluates the mask at every (query, key)."""
    from torch.nn.attention.flex_attention import create_block_mask
    b, h, n, m = mask.shape

    def mask_mod(batch, head, q_idx, kv_idx):
        return mask[batch, head, q_idx, kv_idx]

    return create_block_mask(mask_mod, b, h, n, m, device=mask.device, BLOCK_SIZE=block_size)


def flex_attention_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: Optional[float] = None, block_size: int = 128,
                        compiled: Optional[bool] = None) -> torch.Tensor:
    """Eq. 4–6 through FlexAttention on the token mask M [B, H, n, m] (kept tiles only)."""
    block_mask = token_block_mask(mask, block_size, backward=_needs_backward(q, k, v))
    return run_flex_attention(q, k, v, block_mask, scale, compiled)


def tile_block_mask(block_indices: torch.Tensor, num_tokens: int, block_size: int, dense_rows: int = 0,
                    backward: bool = True):
    """The BlockMask of the block connectivity: query tile I keeps key tiles `block_indices[..., I, :]` whole.
    With `dense_rows`, the first queries attend to every key, so query tile 0's other key tiles are partial
    tiles whose `mask_mod` keeps those rows only."""
    b, h, tiles, _ = block_indices.shape
    chosen = torch.zeros(b, h, tiles, tiles, dtype=torch.bool, device=block_indices.device)
    chosen.scatter_(-1, block_indices, True)
    partial = torch.zeros_like(chosen)
    if dense_rows:
        partial[..., 0, :] = ~chosen[..., 0, :]

    def mask_mod(batch, head, q_idx, kv_idx):
        return (q_idx < dense_rows) | chosen[batch, head, q_idx // block_size, kv_idx // block_size]

    return _block_mask(_tile_lists(partial, chosen), block_size, mask_mod, (num_tokens, num_tokens), backward)


def block_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
                         block_size: int, dense_rows: int = 0, scale: Optional[float] = None,
                         compiled: Optional[bool] = None) -> torch.Tensor:
    """Eq. 4–6 on the block connectivity through FlexAttention: the kept tiles run as full tiles, no n×n tensor.
    The same function as `block_gathered_attention` (tested against it)."""
    block_mask = tile_block_mask(block_indices, q.shape[-2], block_size, dense_rows, _needs_backward(q, k, v))
    return run_flex_attention(q, k, v, block_mask, scale, compiled)
