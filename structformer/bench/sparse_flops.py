"""Sparsifiner MHSA FLOPs (Wei et al., CVPR 2023): analytic per layer, and per model beside the measured total.

FLOPs with one multiply-add = 2 FLOPs, the `FlopCounterMode` convention (matmuls only: softmax, top-k,
thresholds and bias adds count 0). One layer on n tokens, width C, h heads of d, n_down = p, B keys:

  projections   qkv 2·n·C·3hd, proj 2·n·hd·C (and the optional predictor q/k reductions 2·2·h·n·d·r, d' = r)
  predictor     W_down·K 2·h·p·n·d', Q·K_downᵀ 2·h·n·p·d' (Eq. 1), Ã_down·W_up 2·h·n·p·n (Eq. 3), dense as executed
  attention     QKᵀ and ÃV at nnz(M) entries, 2·2·h·d·nnz (Eq. 4–6); token connectivity nnz = (n − c)·B + c·n
                with c = 1 dense cls row (`dense_cls_row`), else 0

'sparse (paper)' is that sum. 'executed' is what a path computes: the gather path computes exactly the sparse
count; the masked path forms all n² logits, 2·2·h·d·n², and so does the CPU-eager flex path. The dense MHSA
for comparison is the projections plus 2·2·h·d·n². `block_sparse_attention` (block connectivity without n×n
tensors) computes the predictor on tile means (2·h·p·(n/bs)² instead of 2·h·p·n²) and whole padded tiles.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

ATTENTION_KEYS = ('attn',)


def dense_mhsa_flops(n: int, dim: int, heads: int, head_dim: int) -> int:
    """Dense softmax MHSA: qkv and proj, QKᵀ and AV at n² entries."""
    inner = heads * head_dim
    return 2 * n * dim * 3 * inner + 2 * n * inner * dim + 4 * heads * head_dim * n * n


def token_nnz(n: int, keys: int, dense_rows: int) -> int:
    """nnz(M) per head of a token mask: B keys for every sparse query row, n for the dense rows."""
    return (n - dense_rows) * keys + dense_rows * n


def sparsifiner_mhsa_flops(n: int, dim: int, heads: int, head_dim: int, keep_ratio: float, n_down: int = 32,
                           predictor_dim: Optional[int] = None, dense_cls_row: bool = True,
                           nnz: Optional[int] = None) -> Dict[str, int]:
    """The count of the module docstring for one layer. `nnz` (per head) defaults to the token mask's
    (n − c)·B + c·n; pass the measured nnz of a block mask. Returns the parts, 'sparse' (the paper's count,
    = what the gather path executes), 'executed_masked' (the masked / CPU flex path) and 'dense'."""
    from ..functional.sparsifiner import budget
    inner, c = heads * head_dim, int(bool(dense_cls_row))
    d_pred = predictor_dim or head_dim
    projections = 2 * n * dim * 3 * inner + 2 * n * inner * dim
    if predictor_dim:
        projections += 2 * 2 * heads * n * head_dim * predictor_dim
    predictor = 2 * heads * n_down * n * d_pred * 2 + 2 * heads * n * n_down * n
    nnz = token_nnz(n, budget(n, keep_ratio), c) if nnz is None else nnz
    attention = 4 * heads * head_dim * nnz
    return {'projections': projections, 'predictor': predictor, 'attention_sparse': attention, 'nnz': nnz,
            'attention_masked': 4 * heads * head_dim * n * n, 'sparse': projections + predictor + attention,
            'executed_masked': projections + predictor + 4 * heads * head_dim * n * n,
            'dense': dense_mhsa_flops(n, dim, heads, head_dim)}


def layer_mhsa_flops(layer, n: int, nnz: Optional[int] = None) -> Dict[str, int]:
    """`sparsifiner_mhsa_flops` with a SparsifinerAttention layer's own hyper-parameters. A block-connectivity
    layer without a measured `nnz` is charged `tile_budget` whole tiles per query (an upper bound)."""
    from ..functional.sparsifiner import tile_budget
    dim = layer.qkv.in_features
    if nnz is None and layer.connectivity == 'block':
        per_row = min(n, tile_budget(n, layer.block_size, layer.keep_ratio) * layer.block_size)
        c = int(bool(layer.dense_cls_row))
        nnz = (n - c) * per_row + c * n
    elif nnz is None:                                   # the layer's own B (keep_ratio, or keys_per_query)
        nnz = token_nnz(n, layer.budget(n), int(bool(layer.dense_cls_row)))
    return sparsifiner_mhsa_flops(n, dim, layer.num_heads, layer.head_dim, layer.keep_ratio, layer.basis.n_down,
                                  layer.predictor_q.out_features if layer.predictor_q is not None else None,
                                  layer.dense_cls_row, nnz)


def counting_context():
    """Explicit attention while counting: SDPA through its math backend, whose matmuls FlopCounterMode sees
    (the fused CPU kernels are invisible to it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)


def _tokens(model) -> int:
    embed = model.patch_embed
    return embed.num_patches + getattr(model, 'num_prefix_tokens', 1)


def model_mhsa_flops(model, seq_len: Optional[int] = None) -> Dict[str, float]:
    """MHSA and total forward FLOPs of one image through a timm ViT (eval, no_grad, CPU), any attention.

    'mhsa': Σ over attention layers of the sparse (paper) count for Sparsifiner layers (token connectivity
    exact, block an upper bound) and of the counted FLOPs for any other attention; 'mhsa_executed': the
    counted FLOPs of the attention layers on their configured paths; 'total': the counted model total with
    'mhsa' in place of 'mhsa_executed'; 'dense_mhsa' / 'dense_total': the same network with dense MHSA.
    After EViT token pruning (`prune_tokens`) each layer is counted on the tokens its block sees
    (`tokens_per_block`); 'tokens' stays the count entering the first block."""
    import torch

    from ..layers.attention.sparsifiner import SparsifinerAttention
    from ..models.token_pruning import tokens_per_block
    from .flops import flop_counter
    n = _tokens(model)
    if seq_len is not None and seq_len != n:
        raise ValueError(f"seq_len={seq_len} but the model makes {n} tokens of an image")
    embed = model.patch_embed
    image = torch.randn(1, embed.proj.in_channels, *embed.img_size)
    attns = {name: m for name, m in model.named_modules() if name.rsplit('.', 1)[-1] in ATTENTION_KEYS}
    was_training = model.training
    model.eval()
    flags = [(m, f) for m in model.modules() for f in ('fused_attn', 'fused') if isinstance(getattr(m, f, None), bool)]
    saved = [getattr(m, f) for m, f in flags]
    for m, f in flags:
        setattr(m, f, False)
    try:
        with torch.no_grad(), counting_context(), flop_counter() as counter:
            model(image)
    finally:
        for (m, f), value in zip(flags, saved):
            setattr(m, f, value)
        model.train(was_training)
    per_module = counter.get_flop_counts()
    executed = {name: sum(per_module.get(f"{type(model).__name__}.{name}", {}).values()) for name in attns}
    mhsa, dense = 0, 0
    blocks = getattr(model, 'blocks', None)
    counts = tokens_per_block(model, n) if blocks is not None else []
    block_of = {id(getattr(block, 'attn', None)): i for i, block in enumerate(blocks)} if blocks is not None else {}
    for name, layer in attns.items():
        dim = layer.qkv.in_features if hasattr(layer, 'qkv') else model.embed_dim
        heads = layer.num_heads
        head_dim = getattr(layer, 'head_dim', dim // heads)
        seen = counts[block_of[id(layer)]] if id(layer) in block_of else n      # tokens this layer attends over
        dense += dense_mhsa_flops(seen, dim, heads, head_dim)
        mhsa += layer_mhsa_flops(layer, seen)['sparse'] if isinstance(layer, SparsifinerAttention) else executed[name]
    total = counter.get_total_flops()
    return {'tokens': n, 'layers': len(attns), 'mhsa': float(mhsa), 'mhsa_executed': float(sum(executed.values())),
            'total': float(total - sum(executed.values()) + mhsa), 'total_executed': float(total),
            'dense_mhsa': float(dense), 'dense_total': float(total - sum(executed.values()) + dense)}


def keep_ratio_flops(name: str = 'sparsifiner_deit_small_patch16_224', keeps: Iterable[float] = (0.1, 0.25, 0.5, 1.0),
                     img_size: int = 224, **model_kwargs) -> List[Dict[str, float]]:
    """Per keep ratio, the MHSA and total forward FLOPs (G) of a registered Sparsifiner model, with the
    dense network's beside them (e.g. DeiT-S at 224 px, n = 197: the paper's Table 1 axis)."""
    import timm
    import structformer  # noqa: F401  (registers the models)
    rows = []
    for keep in keeps:
        model = timm.create_model(name, img_size=img_size, keep_ratio=keep, **model_kwargs)
        out = model_mhsa_flops(model)
        rows.append({'keep': keep, 'tokens': out['tokens'], 'mhsa_gflops': out['mhsa'] / 1e9,
                     'total_gflops': out['total'] / 1e9, 'mhsa_executed_gflops': out['mhsa_executed'] / 1e9,
                     'dense_mhsa_gflops': out['dense_mhsa'] / 1e9, 'dense_total_gflops': out['dense_total'] / 1e9,
                     'mhsa_vs_dense': out['mhsa'] / out['dense_mhsa'], 'total_vs_dense': out['total'] / out['dense_total']})
    return rows
