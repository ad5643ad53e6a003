"""Sparsifiner MHSA FLOPs: the analytic count (sparse_flops.py) against FlopCounterMode on the executed paths."""
import warnings

import pytest
import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

import structformer  # noqa: F401  (registers the models)
from structformer.bench.sparse_flops import (counting_context, dense_mhsa_flops, layer_mhsa_flops, model_mhsa_flops,
                                             sparsifiner_mhsa_flops)
from structformer.layers.attention.sparsifiner import SparsifinerAttention


def _counted(layer, n, dim):
    with torch.no_grad(), counting_context(), FlopCounterMode(display=False) as counter:
        layer(torch.randn(1, n, dim))
    return counter.get_total_flops()


@pytest.mark.parametrize('n, keep, heads, head_dim, dense_cls_row, predictor_dim', [
    (17, 0.25, 2, 8, True, None), (33, 0.1, 3, 4, False, None), (50, 0.5, 1, 16, True, 4), (9, 1.0, 2, 8, False, None)])
def test_analytic_count_equals_flop_counter_on_the_gather_path(n, keep, heads, head_dim, dense_cls_row, predictor_dim):
    dim = heads * head_dim + 3                    # attn_head_dim decoupled from dim: every term has its own size
    layer = SparsifinerAttention(dim, heads, attn_head_dim=head_dim, seq_len=n, keep_ratio=keep, n_down=5,
                                 predictor_dim=predictor_dim, dense_cls_row=dense_cls_row, impl='gather').eval()
    expected = layer_mhsa_flops(layer, n)
    assert _counted(layer, n, dim) == expected['sparse']
    layer.impl = 'masked'                         # n² logits: the executed count, not the sparse one
    assert _counted(layer, n, dim) == expected['executed_masked']
    assert (expected['executed_masked'] > expected['sparse']) == (keep < 1.0)


def test_keep_one_without_predictor_is_the_dense_count():
    n, dim, heads, head_dim = 20, 24, 3, 8
    counts = sparsifiner_mhsa_flops(n, dim, heads, head_dim, keep_ratio=1.0, dense_cls_row=False)
    assert counts['attention_sparse'] == counts['attention_masked'] == 4 * heads * head_dim * n * n
    assert counts['sparse'] - counts['predictor'] == counts['dense'] == dense_mhsa_flops(n, dim, heads, head_dim)
    assert counts['predictor'] == 2 * heads * 32 * n * head_dim * 2 + 2 * heads * n * 32 * n


def test_model_counts_sparse_mhsa_and_dense_twin():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')           # W_down, W_up created at the first forward
        gather = model_mhsa_flops(timm.create_model('sparsifiner_digits', impl='gather'))
        masked = model_mhsa_flops(timm.create_model('sparsifiner_digits', impl='masked'))
        dense = model_mhsa_flops(timm.create_model('vit_digits'))
    assert gather['tokens'] == 17 and gather['layers'] == 4
    assert gather['mhsa'] == gather['mhsa_executed'] and gather['total'] == gather['total_executed']
    assert masked['mhsa'] == gather['mhsa'] < masked['mhsa_executed']            # masked executes n² logits
    assert masked['total'] == gather['total']
    assert dense['mhsa'] == dense['mhsa_executed'] == dense['dense_mhsa'] == gather['dense_mhsa']
    assert dense['total'] == gather['dense_total']


def test_token_pruned_model_counts_each_layer_on_the_tokens_it_sees():
    """EViT keep 0.7 at blocks 1, 2 of a 16-patch model: the attention of blocks 0..3 sees 17, 17, 14, 12 tokens
    (13 = 12 kept + 1 fused patches, then 10 + 1), and both the sparse and the dense-twin counts follow them."""
    from structformer.models.token_pruning import prune_tokens
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')           # W_down, W_up created at the first forward
        sparse = timm.create_model('sparsifiner_digits', impl='gather').eval()
        sparse(torch.zeros(1, 1, 8, 8))
        counts = model_mhsa_flops(prune_tokens(sparse, keep_rate=0.7, layers=(1, 2)))
        dense = model_mhsa_flops(prune_tokens(timm.create_model('vit_digits'), keep_rate=0.7, layers=(1, 2)))
    seen = [17, 17, 14, 12]
    layers = [block.attn for block in sparse.blocks]
    assert counts['mhsa'] == sum(layer_mhsa_flops(layer, n)['sparse'] for layer, n in zip(layers, seen))
    twin = sum(dense_mhsa_flops(n, layer.qkv.in_features, layer.num_heads, layer.head_dim)
               for layer, n in zip(layers, seen))
    assert counts['dense_mhsa'] == twin == dense['dense_mhsa']
    assert dense['mhsa'] == dense['mhsa_executed'] == dense['dense_mhsa']          # measured = analytic dense
