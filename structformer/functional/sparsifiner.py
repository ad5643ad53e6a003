"""Sparsifiner's math (Wei et al., CVPR 2023, Eq. 1–6) as pure functions on per-head tensors.

Shapes: q, k, v [B, H, n, d]; W_down, W_up [n_down, n] (one pair per layer, shared by the heads).

    A_down = softmax(Q (W_down K)ᵀ / √d)              Eq. 1   low-rank attention, [B, H, n, n_down]
    Ã_down = A_down ⊙ 1[A_down > τ]                    Eq. 2   sparse coefficients (or each row's top k: `coef_topk`)
    S      = Ã_down · (W_up ⊙ 1[|W_up| ≥ t])           Eq. 3   connectivity scores (the distillation target's shape)
    M      = 1[Top-B(S)] per query row                 Eq. 3   B = ⌈keep · n⌉ keys per query
    Ã      = softmax(QKᵀ/√d) restricted to M, X' = ÃV  Eq. 4–6

Execution paths of Eq. 4–6 that agree to rounding:
  `masked_attention`     dense logits, −∞ off the mask, softmax: the reference (n² memory);
  `gathered_attention`   each query's B keys gathered: work and memory ∝ n·B, with autograd;
  `flex_attention_path`  torch's FlexAttention on the kept tiles of M (`sparsifiner_flex.py`: the GPU path,
                         compiled there; on CPU eager it materialises the scores, so it is there to be tested).
With block connectivity, `block_gathered_attention` (gathered tiles, autograd) and the CPU tile kernel
(`tile_kernel.py`, its own backward) take the kept tiles directly.

Dtype policy (docs/precision.md): the predictor (Eq. 1–3: `down_projected_keys`, `low_rank_attention`,
`connectivity_scores`, the tile means, `predicted_tiles`, the per-sample bases) computes in float32 under any
autocast context (`computes_in_float32`: autocast off, half inputs upcast), because its scores feed a top-k and
bf16 scores (8 significant bits) tie and change which keys are kept; the attention of Eq. 4–6 runs in the
autocast dtype like any attention (the CPU tile kernel, float32-only, casts in and out: `tile_kernel.py`).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .precision import computes_in_float32
from .tracing import recording_graph
from .sparsifiner_flex import block_flex_attention, flex_attention_path  # noqa: F401  (re-exported)
from .tile_kernel import block_connectivity, block_tile_attention


def budget(num_tokens: int, keep_ratio: float) -> int:
    """B = ⌈keep_ratio · n⌉ keys per query (at least 1)."""
    if isinstance(keep_ratio, bool) or not isinstance(keep_ratio, (int, float)) or not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio!r}")
    return max(1, math.ceil(keep_ratio * num_tokens - 1e-9))


def tile_budget(num_tokens: int, block_size: int, keep_ratio: float) -> int:
    """Key tiles kept per query tile by the block connectivity: the budget counted in keys, B = ⌈keep · n⌉,
    covered by whole tiles, ⌈B / bs⌉ (at most every tile). A query tile then attends to between B − bs and
    B + bs keys whichever tiles it keeps (a partial last tile has fewer than bs keys): within one tile of B.
    Counting the partial tile as a whole tile (⌈keep · ⌈n/bs⌉⌉) made the budget depend on whether it was kept."""
    keys = budget(num_tokens, keep_ratio)
    return min(-(-num_tokens // block_size), -(-keys // block_size))


def logits_scale(k: torch.Tensor, scale: Optional[float] = None) -> float:
    """The scale of Eq. 1's logits: `scale` where given, else 1/√d of k's channels. One rule for the torch ops
    (`down_projected_keys`) and the CPU kernel, which takes it as a number (`predicted_tiles`)."""
    return k.shape[-1] ** -0.5 if scale is None else scale


@computes_in_float32
def down_projected_keys(k: torch.Tensor, w_down: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """W_down K · scale [B, H, n_down, d]: the n_down keys of Eq. 1, the scale folded into them."""
    scale = logits_scale(k, scale)
    b, h, n, d = k.shape
    # every head's W_down K in one GEMM over the token-major keys [B, n, H·d] (a view when k is the head split
    # of a projection, as in the layer): 6 heads as one [n_down, n] × [n, 384] product instead of a broadcast
    # batch of six; the scale on the n_down keys, not on the n × n_down logits
    tokens = k.transpose(1, 2).reshape(b, n, h * d)
    return (torch.matmul(w_down, tokens) * scale).reshape(b, w_down.shape[-2], h, d).transpose(1, 2)   # B may be 0


@computes_in_float32
def low_rank_attention(q: torch.Tensor, k: torch.Tensor, w_down: torch.Tensor,
                       scale: Optional[float] = None) -> torch.Tensor:
    """Eq. 1: softmax(Q (W_down K)ᵀ · scale) over the n_down down-projected keys."""
    return torch.softmax(q @ down_projected_keys(k, w_down, scale).transpose(-2, -1), dim=-1)


@computes_in_float32
def connectivity_scores(a_down: torch.Tensor, w_up: torch.Tensor, tau: float, up_threshold: float,
                        coef_topk: Optional[int] = None) -> torch.Tensor:
    """Eq. 2–3 before the top-k: Ã_down · W̃_up with coefficients ≤ τ (or outside each row's `coef_topk` largest,
    `sparse_coefficients`) and basis entries |w| < t set to zero (the products keep their gradient through the
    entries that survive)."""
    coefficients = sparse_coefficients(a_down, tau, coef_topk)
    basis = w_up * (w_up.abs() >= up_threshold)
    return coefficients @ basis


def sparse_coefficients(a_down: torch.Tensor, tau: float, coef_topk: Optional[int] = None) -> torch.Tensor:
    """Ã_down of Eq. 2: A_down's coefficients above τ, or with `coef_topk` each row's `coef_topk` largest (the
    public code's `BASIS_COEF.USE_TOPK`, top 8 in its default config; τ is then not applied). The top k are those
    at least the row's k-th largest value, so an exact tie at the k-th value keeps every tied coefficient (the
    public code's `topk` keeps k of them, whichever its kernel returns); the gradient flows through the kept ones."""
    if coef_topk is None:
        return _below_tau_zeroed(a_down, tau)
    kth = a_down.topk(min(coef_topk, a_down.shape[-1]), dim=-1).values[..., -1:]
    return a_down * (a_down >= kth).to(a_down.dtype)


def _below_tau_zeroed(a_down: torch.Tensor, tau: float) -> torch.Tensor:
    """Ã_down = A_down · 1[A_down > τ] (Eq. 2): `F.threshold` in one pass (its gradient is 1[a > τ]); while a graph is
    recorded the same product written out, which TorchScript's ONNX exporter can translate (it has no non-zero
    threshold). A_down is a softmax, so both give +0 below τ and a itself above."""
    if recording_graph():
        return a_down * (a_down > tau).to(a_down.dtype)
    return F.threshold(a_down, tau, 0.0)


def topk_indices(scores: torch.Tensor, keys: int) -> torch.Tensor:
    """The `keys` highest-scoring key indices of every query row, [B, H, n, keys] (exactly `keys` per row, in
    ascending index order), ties to the lower key index.

    Why not `topk(...).indices`: exact ties are common (a row whose Eq. 2 coefficients all fall below τ scores
    every key 0) and `topk` leaves their order to its algorithm, which differs between backends: an ONNX export
    kept other keys than torch (8e-2 apart at keep 0.25). Here only tie-free quantities decide: the value of the
    `keys`-th largest score v (the same whichever tied element topk returns), the keys scoring above v, and the
    first keys (by index) scoring exactly v to fill the budget; their indices are then the top `keys` of the
    distinct integers mask·n + (n − 1 − index). Plain TopK / CumSum / comparisons: the same keys in eager torch,
    torch.export and ONNX Runtime (no `sort(stable=True)`, which has no ONNX translation)."""
    n = scores.shape[-1]
    kth = scores.topk(keys, dim=-1).values[..., -1:]
    above = scores > kth
    tied = scores == kth
    room = keys - above.sum(-1, keepdim=True)                 # budget left for the tied keys (>= 1)
    kept = above | (tied & (tied.to(torch.int32).cumsum(-1) <= room))
    order = torch.arange(n - 1, -1, -1, device=scores.device, dtype=torch.float32)  # float32: exact for n < 2^23
    return (kept.to(torch.float32) * n + order).topk(keys, dim=-1).indices


def top_tiles(tile_scores: torch.Tensor, kept: int) -> torch.Tensor:
    """The `kept` highest-scoring key tiles of every query tile, [..., kept], ties to the lower tile index: a
    stable descending sort, so that every block path (and the CPU kernel's partial sort) keeps the same tiles
    when scores tie exactly, as they do where Eq. 2–3's thresholds zero a whole tile's scores. `topk` leaves the
    order of ties to its algorithm (all-equal rows of 5 gave tiles 2, 3, 4)."""
    return tile_scores.sort(dim=-1, descending=True, stable=True).indices[..., :kept]


def mask_from_indices(indices: torch.Tensor, num_keys: int, dense_rows: int = 0) -> torch.Tensor:
    """Bool [B, H, n, num_keys] with True at `indices`; the first `dense_rows` query rows keep every key."""
    mask = torch.zeros(*indices.shape[:-1], num_keys, dtype=torch.bool, device=indices.device)
    # out of place, from a tensor: TorchScript's tracer (the legacy ONNX exporter) has no in-place bool scatter
    mask = mask.scatter(-1, indices, torch.ones_like(indices, dtype=torch.bool))
    if dense_rows:
        mask[..., :dense_rows, :] = True
    return mask


@computes_in_float32
def block_mask_from_scores(scores: torch.Tensor, block_size: int, keep_ratio: float) -> torch.Tensor:
    """The block-level variant (ours, beyond the paper): tile scores over block_size × block_size tiles (query
    tiles averaged, key tiles by `_key_tile_pooling`: a partial last key tile shrunk to a full tile's spread, as
    `pooled_block_scores` computes them without S), keep the top `tile_budget` key tiles of every query tile,
    and expand to a token mask. Token-level top-k leaves almost no empty tile, so only this lets a blocked
    kernel skip work."""
    n, n_k = scores.shape[-2:]
    tiles = _tile_pooling(n, block_size, scores) @ scores @ _key_tile_pooling(n_k, block_size, scores).transpose(-2, -1)
    chosen = mask_from_indices(top_tiles(tiles, tile_budget(n_k, block_size, keep_ratio)), tiles.shape[-1])
    mask = chosen.repeat_interleave(block_size, dim=-2).repeat_interleave(block_size, dim=-1)
    return mask[..., :scores.shape[-2], :n_k]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Eq. 4–6 the obvious way: softmax over the kept logits only (−∞ elsewhere), then · V."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q @ k.transpose(-2, -1)) * scale
    attn = torch.softmax(logits.masked_fill(~mask, float('-inf')), dim=-1)
    if dropout_p:
        attn = F.dropout(attn, dropout_p)
    return attn @ v


def _gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [B, H, n_k, d], indices [B, H, ...] into n_k -> [B, H, ..., d]: whole rows of d values copied by
    `index_select` on the flattened rows (an element-wise `gather` measured 9× slower forward and 3× slower
    with its backward, [1, 6, 577, 64] rows). One copy of x first when x is a strided view."""
    b, h, n_k, d = x.shape
    offsets = torch.arange(b * h, device=x.device).reshape(b, h, *([1] * (indices.dim() - 2))) * n_k
    rows = (indices + offsets).reshape(-1)
    return x.reshape(b * h * n_k, d).index_select(0, rows).reshape(*indices.shape, d)


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                       scale: Optional[float] = None, dropout_p: float = 0.0, dense_rows: int = 0) -> torch.Tensor:
    """Eq. 4–6 on each query's own keys: gather K and V at `indices` ([B, H, n, K]), softmax over K
    logits. Work and memory ∝ n·K·d instead of n². The first `dense_rows` queries attend to every key."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sparse_q, sparse_idx = q[..., dense_rows:, :], indices[..., dense_rows:, :]
    k_sel, v_sel = _gather_rows(k, sparse_idx), _gather_rows(v, sparse_idx)
    attn = torch.softmax(torch.einsum('bhnd,bhnkd->bhnk', sparse_q, k_sel) * scale, dim=-1)
    if dropout_p:
        attn = F.dropout(attn, dropout_p)
    out = torch.einsum('bhnk,bhnkd->bhnd', attn, v_sel)
    if dense_rows:
        dense = F.scaled_dot_product_attention(q[..., :dense_rows, :], k, v, dropout_p=dropout_p, scale=scale)
        out = torch.cat([dense, out], dim=-2)
    return out


# ---- the block path without n×n tensors (ours): predictor on tile means, attention on gathered tiles ----

def _tile_pooling(num_tokens: int, block_size: int, like: torch.Tensor) -> torch.Tensor:
    """P [⌈n/bs⌉, n] with P[t, i] = 1/|tile t| for token i in tile t: P X is the tile means of X's rows (a
    partial last tile averaged over its real rows)."""
    tile_of = torch.arange(num_tokens, device=like.device) // block_size
    members = tile_of == torch.arange(-(-num_tokens // block_size), device=like.device).unsqueeze(-1)
    members = members.to(like.dtype)
    return members / members.sum(-1, keepdim=True)


def _key_tile_pooling(num_tokens: int, block_size: int, like: torch.Tensor) -> torch.Tensor:
    """The key-side pooling P_k [⌈n/bs⌉, n]: a full tile's row is its mean (1/bs on its tokens); a partial last
    tile of r < bs tokens is its mean shrunk toward the mean over all n keys, μ + √(r/bs)·(mean_r − μ).

    Why: the top tiles are chosen by comparing tile scores, and a tile mean's spread falls as 1/√(tile size).
    The plain mean of a one-token tile (n = 577 = 9·64 + 1) is one key's score, 8× as spread as a 64-key mean:
    it was kept by 93 % of query tiles on random inputs at keep 0.25 (under-selected elsewhere), against 23 % for
    a full tile. Shrunk by √(r/bs), its deviation from the row mean has a full tile's variance when keys' scores
    are exchangeable, so it is kept about as often as a full tile (tests/test_sparsifiner_tiles.py). The row
    mean μ is a mean over all keys, so P_k's rows still sum to 1 and the map stays linear: pooled scores are
    still two small products (`pooled_block_scores`); the CPU kernel pools W̃_up's rows by the same rule
    (`pooled_up_basis` in csrc/block_connectivity.cpp, tested against `pooled_basis`)."""
    pooling = _tile_pooling(num_tokens, block_size, like)
    partial = num_tokens % block_size
    if partial:
        shrink = math.sqrt(partial / block_size)
        pooling[-1] = shrink * pooling[-1] + (1 - shrink) / num_tokens
    return pooling


def tile_sizes(num_tokens: int, block_size: int, device=None) -> torch.Tensor:
    """Tokens in each of the ⌈n/bs⌉ tiles (int64): bs, …, bs, and the partial last tile's r."""
    sizes = torch.full((-(-num_tokens // block_size),), block_size, dtype=torch.int64, device=device)
    sizes[-1] = num_tokens - (sizes.numel() - 1) * block_size
    return sizes


def realised_density(num_tokens: int, dense_rows: int = 0, *, keys: Optional[int] = None,
                     block_indices: Optional[torch.Tensor] = None, block_size: Optional[int] = None) -> torch.Tensor:
    """The fraction of (query, key) pairs a sparse path attends to, dense rows included: what it really
    computed, beside the nominal keep ratio. Token connectivity: `keys` per sparse query. Block connectivity:
    the kept tiles' real sizes (a partial last tile counts its r keys), per query tile weighted by its queries.
    A 0-dim float tensor (no device sync)."""
    n = num_tokens
    if block_indices is None:
        return torch.tensor(((n - dense_rows) * min(keys, n) + dense_rows * n) / (n * n))
    sizes = tile_sizes(n, block_size, block_indices.device)
    kept = sizes[block_indices].sum(-1).double()                   # [B, H, query tiles] keys per query tile
    starts = torch.arange(sizes.numel(), device=sizes.device) * block_size
    dense_here = torch.minimum((dense_rows - starts).clamp(min=0), sizes)      # dense queries in each tile
    rows = (sizes - dense_here).double()                           # its sparse queries
    pairs = (kept * rows).sum(-1).mean() + dense_rows * n          # the dense rows attend to all n keys
    return (pairs / (n * n)).float()


@computes_in_float32
def pooled_basis(w_up: torch.Tensor, up_threshold: float, block_size: int) -> torch.Tensor:
    """The key-tile poolings of W̃_up = W_up ⊙ 1[|W_up| ≥ t] (Eq. 3), [..., n_down, ⌈n/bs⌉]: W̃_up P_kᵀ
    (`_key_tile_pooling`: means, a partial last tile shrunk to a full tile's spread)."""
    basis = w_up * (w_up.abs() >= up_threshold)
    return basis @ _key_tile_pooling(w_up.shape[-1], block_size, w_up).transpose(-2, -1)


@computes_in_float32
def pooled_block_scores(a_down: torch.Tensor, w_up: torch.Tensor, tau: float, up_threshold: float,
                        block_size: int, coef_topk: Optional[int] = None) -> torch.Tensor:
    """Tile scores of the connectivity scores S = Ã_down · W̃_up (Eq. 2–3) without forming S: P_q S P_kᵀ over
    query tile I × key tile J is (mean over I of Ã_down's rows) · (P_k-pooling over J of W̃_up's columns),
    exactly, by linearity. [B, H, ⌈n/bs⌉, ⌈n/bs⌉] for 2·n_down·(n/bs)² multiply-adds instead of n_down·n². Full
    tiles are means; a partial last key tile is shrunk to a full tile's spread (`_key_tile_pooling`), as in
    `block_mask_from_scores`. Two small GEMMs with the pooling matrices instead of pads and reshapes. `coef_topk`:
    `sparse_coefficients`."""
    coefficients = sparse_coefficients(a_down, tau, coef_topk)
    pool_queries = _tile_pooling(a_down.shape[-2], block_size, a_down)
    return (pool_queries @ coefficients) @ pooled_basis(w_up, up_threshold, block_size)


@computes_in_float32
def predicted_tiles(q: torch.Tensor, k: torch.Tensor, w_down: torch.Tensor, w_up: torch.Tensor, tau: float,
                    up_threshold: float, keep_ratio: float, block_size: int, kernel: bool = False,
                    coef_topk: Optional[int] = None, scale: Optional[float] = None) -> torch.Tensor:
    """The block connectivity, without gradient: Eq. 1–3 on tile scores, then the top `tile_budget` key tiles of
    each query tile, [B, H, ⌈n/bs⌉, kept]. In torch ops (`pooled_block_scores`, `top_tiles`), or with
    `kernel=True` in one pass of the CPU kernel over the n × n_down coefficients (`tile_kernel.
    block_connectivity`, inference; the same tiles, exact ties included, up to the rounding of near ties; tested).
    The kernel thresholds the coefficients at τ: with `coef_topk` (`sparse_coefficients`) the torch ops run.
    `scale`: of Eq. 1's logits (default 1/√d)."""
    with torch.no_grad():
        if kernel and coef_topk is None:
            return block_connectivity(q, k, w_down, w_up, logits_scale(k, scale), tau, up_threshold, block_size,
                                      tile_budget(k.shape[-2], block_size, keep_ratio))
        tiles = pooled_block_scores(low_rank_attention(q, k, w_down, scale), w_up, tau, up_threshold, block_size,
                                    coef_topk)
        return top_tiles(tiles, tile_budget(k.shape[-2], block_size, keep_ratio))


def block_indices_to_mask(block_indices: torch.Tensor, num_tokens: int, block_size: int,
                          dense_rows: int = 0) -> torch.Tensor:
    """Token mask [B, H, n, n] of kept key tiles `block_indices` [B, H, query tiles, kept tiles]: each token's row
    and column are its tile's (token // block_size), gathered straight to n × n (not the whole tiles' padded square,
    which a block size far above n made enormous)."""
    tiles = block_indices.shape[-2]
    chosen = mask_from_indices(block_indices, tiles)
    tile_of = torch.arange(num_tokens, device=block_indices.device) // block_size
    mask = chosen.index_select(-2, tile_of).index_select(-1, tile_of)
    if dense_rows:
        mask[..., :dense_rows, :] = True
    return mask


def _tile_keys(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, padded: bool):
    """The keys and values at token `positions` [B, H, t, S] (`_gather_rows`: runs of block_size contiguous
    rows, no padded copy of k or v), [B, H, t, S, d] each, and the mask of slots inside n ([B, H, t, S], or
    None without padding): slots past n (a partial last key tile) read the last key, to be masked out."""
    n = k.shape[-2]
    in_range = positions.clamp(max=n - 1)
    k_sel, v_sel = (_gather_rows(x, in_range) for x in (k, v))
    return k_sel, v_sel, (positions < n) if padded else None


def _tile_sdpa(q_tiles: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               padded: bool, dropout_p: float, scale: Optional[float]) -> torch.Tensor:
    """SDPA of query tiles q_tiles [B·H, t, L, d] on the keys at token `positions` [B, H, t, S] (`_tile_keys`).
    Each part gathers its own rows, so in training no gradient is accumulated through slices of a shared
    gathered tensor."""
    b, h, t, slots = positions.shape
    k_sel, v_sel, valid = _tile_keys(k, v, positions, padded)
    k_sel, v_sel = (x.reshape(b * h, t, slots, -1) for x in (k_sel, v_sel))
    valid = valid.reshape(b * h, t, 1, slots) if valid is not None else None
    return F.scaled_dot_product_attention(q_tiles, k_sel, v_sel, attn_mask=valid, dropout_p=dropout_p, scale=scale)


def _few_queries_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                           dropout_p: float, scale: Optional[float]) -> torch.Tensor:
    """softmax(q kᵀ · scale) v written out, for the few-row calls of the block path (the dense cls row, a
    partial last query tile): at one query the fused CPU kernel cost 0.16–0.29 ms against SDPA's 7 ms for all
    577 queries, about 10× these three ops."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q * scale) @ k.transpose(-2, -1)
    if mask is not None:
        logits = logits.masked_fill(~mask, float('-inf'))
    attn = torch.softmax(logits, dim=-1)
    if dropout_p:
        attn = F.dropout(attn, dropout_p)
    return attn @ v


# Gathered K and V of one chunk of heads, at most (at least one head per chunk). At n = 577, keep 0.25 (0.9 MB
# of K and V tiles per head) chunks of 2-3 heads ran the attention at 0.70-0.78x SDPA's time against 0.82-1.02x
# for all six heads at once and 0.82-0.90x for one (1 thread; 0.89-0.99x against 0.94-1.48x at 2 threads;
# 40 paired rounds, with glibc's default heap and with a warm one): the copies stay in cache and in the
# allocator's recycled memory instead of being freshly page-faulted megabytes.
GATHER_BYTES_PER_CHUNK = 3 * 2 ** 20


def block_gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
                             block_size: int, scale: Optional[float] = None, dropout_p: float = 0.0,
                             dense_rows: int = 0) -> torch.Tensor:
    """Eq. 4–6 on a block mask: each query tile attends to its kept key tiles `block_indices` [B, H, qb, kk].

    The kk·bs keys of a tile are gathered once for its bs queries (token-level gathering copies B keys per
    query), and the full query tiles are one batched SDPA call: work ∝ n·kk·bs·d. A partial last query tile
    and the first `dense_rows` queries (which attend to every key) are small written-out products
    (`_few_queries_attention`). Key positions past n (the last key tile's padding) are gathered as copies of
    the last key and masked out. Heads run in chunks whose gathered K and V fit `GATHER_BYTES_PER_CHUNK`.
    `masked_attention` on `block_indices_to_mask` is the reference (tested, outputs and gradients)."""
    b, h, _, d = q.shape
    tiles, kept = block_indices.shape[-2:]
    per_head = 2 * b * tiles * kept * block_size * d * k.element_size()
    heads = max(1, GATHER_BYTES_PER_CHUNK // per_head)
    if heads >= h:
        return _block_gathered_chunk(q, k, v, block_indices, block_size, scale, dropout_p, dense_rows)
    return torch.cat([_block_gathered_chunk(q[:, i:i + heads], k[:, i:i + heads], v[:, i:i + heads],
                                            block_indices[:, i:i + heads], block_size, scale, dropout_p, dense_rows)
                      for i in range(0, h, heads)], dim=1)


def _block_gathered_chunk(q, k, v, block_indices, block_size: int, scale: Optional[float], dropout_p: float,
                          dense_rows: int) -> torch.Tensor:
    """`block_gathered_attention` on one chunk of heads (the parts joined by one concatenation)."""
    b, h, n, d = q.shape
    full = n // block_size                                # query tiles without padding
    positions = block_indices.unsqueeze(-1) * block_size + torch.arange(block_size, device=q.device)
    positions = positions.flatten(-2)                     # [B, H, qb, kk·bs] key token of every tile slot
    padded = n % block_size != 0                          # the last key tile has slots past n to mask
    k, v = k.contiguous(), v.contiguous()                 # one copy each if strided views, not one per part
    parts = []
    if dense_rows:
        parts.append(_few_queries_attention(q[..., :dense_rows, :], k, v, None, dropout_p, scale))
    if full:
        q_full = q[..., :full * block_size, :].reshape(b * h, full, block_size, d)
        out = _tile_sdpa(q_full, k, v, positions[..., :full, :], padded, dropout_p, scale)
        parts.append(out.reshape(b, h, full * block_size, d))
    if full * block_size < n:
        k_sel, v_sel, valid = _tile_keys(k, v, positions[..., full:, :], padded)     # one tile: t = 1
        parts.append(_few_queries_attention(q[..., full * block_size:, :], k_sel.squeeze(2), v_sel.squeeze(2),
                                            valid, dropout_p, scale))
    if dense_rows:                                        # drop the sparse rows that the dense ones replace
        dense, sparse = parts[0], parts[1:]
        if sparse[0].shape[-2] > dense_rows:
            parts = [dense, sparse[0][..., dense_rows:, :], *sparse[1:]]
        else:                                             # they reach past the first sparse part
            parts = [dense, torch.cat(sparse, dim=-2)[..., dense_rows:, :]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w_down: torch.Tensor,
                           w_up: torch.Tensor, tau: float, up_threshold: float, keep_ratio: float,
                           block_size: int, dense_rows: int = 0, dropout_p: float = 0.0,
                           impl: str = 'gather', coef_topk: Optional[int] = None,
                           scale: Optional[float] = None) -> torch.Tensor:
    """Eq. 1–6 with block connectivity and no n×n tensor: low-rank attention (Eq. 1), tile-mean scores
    (Eq. 2–3, `pooled_block_scores`), the top `tile_budget` key tiles per query tile (detached, as the token
    mask is), then Eq. 4–6 on those tiles (`tile_attention`): `block_gathered_attention` (impl='gather', CPU and
    GPU), the CPU tile kernel (impl='kernel'; no dropout) or `block_flex_attention` (impl='flex', GPU;
    no dropout). q, k here are the predictor's inputs too; `coef_topk`, `scale`: the predictor's (`predicted_tiles`)."""
    block_indices = predicted_tiles(q, k, w_down, w_up, tau, up_threshold, keep_ratio, block_size, impl == 'kernel',
                                    coef_topk, scale)
    return tile_attention(q, k, v, block_indices, block_size, dense_rows, dropout_p, impl)


def tile_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor,
                   block_size: int, dense_rows: int = 0, dropout_p: float = 0.0, impl: str = 'gather') -> torch.Tensor:
    """Eq. 4–6 on the kept key tiles `block_indices`: gathered (impl='gather', `block_gathered_attention`), as
    FlexAttention's full tiles (impl='flex', `block_flex_attention`, which has no dropout), or by the CPU tile
    kernel (impl='kernel', `tile_kernel.block_tile_attention`: no dropout)."""
    if impl == 'kernel':
        if dropout_p:
            raise ValueError("impl='kernel' has no attention dropout; use dropout_p=0 or impl='gather'")
        return block_tile_attention(q, k, v, block_indices, block_size, dense_rows=dense_rows)
    if impl == 'flex':
        if dropout_p:
            raise ValueError("impl='flex' has no attention dropout; use dropout_p=0 or impl='gather'")
        return block_flex_attention(q, k, v, block_indices, block_size, dense_rows=dense_rows)
    if impl != 'gather':
        raise ValueError(f"impl={impl!r}: accepted 'gather', 'flex' or 'kernel'")
    return block_gathered_attention(q, k, v, block_indices, block_size, dropout_p=dropout_p, dense_rows=dense_rows)


def tile_shape_class(q: torch.Tensor, block_size: int, kept: int, dense_rows: int) -> tuple:
    """What the tile kernel's and the gathered tiles' speeds depend on, for `autotune` (choice
    'sparsifiner_tiles'): token class, tile size, kept tiles, heads, head width, dense rows, train / infer."""
    from . import autotune
    training = torch.is_grad_enabled() and q.requires_grad
    return (autotune.size_class(q.shape[-2]), block_size, kept, q.shape[1], q.shape[-1], dense_rows,
            'train' if training else 'infer')


def tile_candidates(q: torch.Tensor, block_size: int, kept: int, dense_rows: int) -> dict:
    """The tile kernel and the gathered tiles on one image's stand-in q, k, v (a qkv projection's head views, as
    the layer has them) and random kept tiles, forward (+ backward where q needs a gradient); inputs from a
    private generator."""
    _, heads, n, d = q.shape
    training = torch.is_grad_enabled() and q.requires_grad
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, n, 3, heads, d, generator=generator).to(q.dtype).requires_grad_(training)
    q_s, k_s, v_s = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    tiles = -(-n // block_size)
    indices = torch.rand(1, heads, tiles, tiles, generator=generator).argsort(-1)[..., :kept]

    def run(attend):
        def call():
            out = attend(q_s, k_s, v_s, indices, block_size, dense_rows=dense_rows)
            if training:
                qkv.grad = None
                out.sum().backward()
        return call
    return {'kernel': run(block_tile_attention), 'gather': run(block_gathered_attention)}


# ---- pruned sequences (EViT token pruning combined, ours): per-sample bases for the tokens left ----

@computes_in_float32
def source_columns(w: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """The W_down / W_up columns of a pruned sequence: W [n_down, n_full], `sources` [B, n, n_full] (row i:
    the convex weights of the original tokens that token i stands for) -> W·Sᵀ [B, n_down, n]. A one-hot row
    picks its token's column exactly (a gather written as a product); a fused token's row mixes columns."""
    return torch.einsum('pm,bnm->bpn', w, sources.to(w.dtype))


@computes_in_float32
def low_rank_attention_per_sample(q: torch.Tensor, k: torch.Tensor, w_down: torch.Tensor,
                                  scale: Optional[float] = None) -> torch.Tensor:
    """Eq. 1 with a per-sample W_down [B, n_down, n] (`source_columns`), shared by the heads."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k_down = torch.einsum('bpn,bhnd->bhpd', w_down, k) * scale
    return torch.softmax(q @ k_down.transpose(-2, -1), dim=-1)
