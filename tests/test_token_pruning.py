"""EViT token pruning combined with Sparsifiner: keep 1 is the unpruned model, the kept tokens are the most
cls-attended, the fused token is their cls-attention-weighted mean, a Sparsifiner layer after pruning uses
the W columns of its tokens and ⌈keep · n'⌉ keys per query, and the transform is recorded and rebuilds."""
import math
import warnings

import pytest
import timm
import torch

from structformer.functional.sparsifiner import budget
from structformer.layers import SparsifinerAttention
from structformer.layers.attention.softmax import softmax_attention_reference
from structformer.models.factory import build_model, rebuild
from structformer.models.sparsifiner import sparsify
from structformer.models.token_pruning import TokenPruningBlock, prune_tokens, tokens_per_block

D = torch.float64


def _digits(seed=0):
    torch.manual_seed(seed)
    model = timm.create_model('sparsifiner_digits').double().eval()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        model(torch.zeros(1, 1, 8, 8, dtype=D))            # shapes W_down, W_up (n = 17)
    return model, torch.randn(3, 1, 8, 8, dtype=D)


def _vit(seed=0):
    torch.manual_seed(seed)
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, depth=4, num_classes=10)
    return model.double().eval(), torch.randn(3, 3, 16, 16, dtype=D)


def _record(model, what):
    """Inputs of each block (`what`='block') or of each block's MLP ('mlp'), in order."""
    seen, hooks = [], []
    for block in model.blocks:
        target = block if what == 'block' else block.norm2
        hooks.append(target.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone())))
    return seen, hooks


@pytest.mark.parametrize('make', [_digits, _vit])
def test_keep_rate_one_is_the_unpruned_model(make):
    model, x = make()
    keys = list(model.state_dict())
    with torch.no_grad():
        before = model(x)
        prune_tokens(model, keep_rate=1.0, layers=[1, 2])
        after = model(x)
    assert list(model.state_dict()) == keys
    assert isinstance(model.blocks[1], TokenPruningBlock) and not isinstance(model.blocks[0], TokenPruningBlock)
    # another code path (the pruning block gathers every token back in order): equal within float32 rounding, not
    # bitwise; a token out of place would move the logits by far more
    torch.testing.assert_close(after, before)
    assert torch.equal(model.token_pruning.positions, torch.arange(17).expand(3, -1))


def test_no_layers_is_a_no_op():
    model, x = _vit()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(x)
        assert prune_tokens(model, keep_rate=1.0, layers=()) is model
        torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    assert not hasattr(model, 'token_pruning') and not any(isinstance(b, TokenPruningBlock) for b in model.blocks)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _expected_counts(n_patches, prefix, layers, keep, depth, fuse=True):
    counts, n = [n_patches + prefix], n_patches
    for i in range(depth):
        if i in layers:
            kept = math.ceil(keep * n)
            n = kept + (1 if fuse and kept < n else 0)
        counts.append(n + prefix)
    return counts


@pytest.mark.parametrize('keep,layers,fuse', [(0.5, [1, 2], True), (0.7, [0, 2, 3], True), (0.3, [1], False)])
def test_token_counts_follow_keep_rate(keep, layers, fuse):
    model, x = _vit()
    prune_tokens(model, keep_rate=keep, layers=layers, fuse=fuse)
    seen, hooks = _record(model, 'block')
    with torch.no_grad():
        model(x)
    expected = _expected_counts(16, 1, layers, keep, 4, fuse)
    assert [t.shape[1] for t in seen] == expected[:-1]
    assert model.token_pruning.positions.shape == (3, expected[-1])
    assert tokens_per_block(model) == expected
    assert tokens_per_block(_vit()[0]) == [17] * 5


def _slow_evit(block, x, keep):
    """EViT written out per sample: the cls row of softmax(QKᵀ/√d) averaged over heads, the top ⌈keep · N⌉
    patches by a Python sort, the dropped ones averaged with their cls attention as weights."""
    attn = block.attn
    h = block.norm1(x)
    b, n, c = h.shape
    qkv = attn.qkv(h).reshape(b, n, 3, attn.num_heads, c // attn.num_heads).permute(2, 0, 3, 1, 4)
    q, k = qkv[0], qkv[1]
    probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(c // attn.num_heads), dim=-1)
    cls = probs[:, :, 0, :].mean(1)
    y = x + block.ls1(attn(h))
    out, weights = [], []
    for i in range(b):
        order = sorted(range(1, n), key=lambda j: -cls[i, j].item())
        kept = sorted(order[:math.ceil(keep * (n - 1))])
        dropped = sorted(set(range(1, n)) - set(kept))
        total = sum(cls[i, j] for j in dropped)
        fused = sum(cls[i, j] / total * y[i, j] for j in dropped)
        out.append(torch.stack([y[i, 0]] + [y[i, j] for j in kept] + [fused]))
        weights.append({j: (cls[i, j] / total).item() for j in dropped})
    return torch.stack(out), weights


def test_kept_tokens_are_the_most_cls_attended_and_the_fused_token_their_weighted_mean():
    model, x = _vit()
    prune_tokens(model, keep_rate=0.5, layers=[1])
    blocks, mlps = _record(model, 'block'), _record(model, 'mlp')
    with torch.no_grad():
        model(x)
        expected, weights = _slow_evit(model.blocks[1], blocks[0][1], 0.5)
    torch.testing.assert_close(mlps[0][1], expected)
    positions, sources = model.token_pruning.positions, model.token_pruning.sources
    for i in range(3):
        kept = positions[i, 1:-1].tolist()
        assert positions[i, -1] == -1 and positions[i, 0] == 0 and len(kept) == 8
        assert set(kept).isdisjoint(weights[i]) and set(kept) | set(weights[i]) == set(range(1, 17))
        for row, p in enumerate(positions[i, :-1].tolist()):
            assert torch.equal(sources[i, row], torch.nn.functional.one_hot(torch.tensor(p), 17).to(D))
        fused = torch.zeros(17, dtype=D)
        for j, w in weights[i].items():
            fused[j] = w
        torch.testing.assert_close(sources[i, -1], fused)


def test_positions_gather_the_unpruned_tokens_when_nothing_else_changes():
    """A distillation loss reads `positions`: with the pruning in the last block, the kept tokens are the
    unpruned model's tokens at those positions (before that block's MLP)."""
    model, x = _vit()
    prune_tokens(model, keep_rate=0.4, layers=[3])
    mlps, _ = _record(model, 'mlp')
    with torch.no_grad():
        model(x)
    unpruned, _ = _vit()
    ref, _ = _record(unpruned, 'mlp')
    with torch.no_grad():
        unpruned(x)
    pos = model.token_pruning.positions[:, :-1]
    torch.testing.assert_close(mlps[3][:, :-1], ref[3].gather(1, pos.unsqueeze(-1).expand(-1, -1, ref[3].shape[-1])))


def _slow_sparsifiner(layer, x, sources):
    """Eq. 1–6 per sample with W_down, W_up columns assembled one token at a time from `sources`."""
    q, k, v = layer.project(x)
    outs = []
    for b in range(x.shape[0]):
        cols = [sum(sources[b, i, m] * torch.stack([layer.basis.w_down[:, m], layer.basis.w_up[:, m]])
                    for m in range(sources.shape[-1]) if sources[b, i, m] != 0) for i in range(x.shape[1])]
        w_down, w_up = torch.stack([c[0] for c in cols], -1), torch.stack([c[1] for c in cols], -1)
        w_up = w_up.abs() if layer.up_basis == 'abs' else w_up                  # the public code's |W_up| (default)
        qb, kb, vb = q[b], k[b], v[b]                                          # [H, n', d]
        a_down = torch.softmax(qb @ (w_down @ kb).transpose(-2, -1) / math.sqrt(qb.shape[-1]), dim=-1)
        scores = (a_down * (a_down > layer.tau)) @ (w_up * (w_up.abs() >= layer.up_threshold))
        keys = math.ceil(layer.keep_ratio * x.shape[1])
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask.scatter_(-1, scores.topk(keys, dim=-1).indices, True)
        mask[:, 0, :] = True
        outs.append(softmax_attention_reference(qb, kb, vb, attn_mask=mask))
    return layer.merge(torch.stack(outs)), keys


@pytest.mark.parametrize('impl', ['masked', 'gather'])
def test_sparsifiner_after_pruning_uses_its_tokens_columns_and_the_reduced_budget(impl):
    torch.manual_seed(3)
    layer = SparsifinerAttention(32, 4, keep_ratio=0.3, seq_len=12, n_down=6, impl=impl, keep_scores=True).double()
    x = torch.randn(2, 7, 32, dtype=D)
    sources = torch.zeros(2, 7, 12, dtype=D)
    for b, kept in enumerate([[0, 2, 3, 7, 9, 11], [0, 1, 4, 5, 6, 10]]):
        sources[b, range(6), kept] = 1
        rest = sorted(set(range(1, 12)) - set(kept))
        w = torch.rand(len(rest), dtype=D)
        sources[b, 6, rest] = w / w.sum()
    out = layer(x, token_sources=sources)
    expected, keys = _slow_sparsifiner(layer, x, sources)
    torch.testing.assert_close(out, expected)
    assert keys == budget(7, 0.3) == 3
    if layer.last_mask is not None:
        assert (layer.last_mask[..., 1:, :].sum(-1) == keys).all() and layer.last_mask[..., 0, :].all()
    with pytest.raises(ValueError, match='token_sources come from n=11'):
        layer(x, token_sources=sources[..., :11])


def _pruned_sources():
    """token_sources of 7 tokens pruned from 12: six kept ones (one-hot rows) and a fused token (a weighted mean)."""
    sources = torch.zeros(2, 7, 12, dtype=D)
    for b, kept in enumerate([[0, 2, 3, 7, 9, 11], [0, 1, 4, 5, 6, 10]]):
        sources[b, range(6), kept] = 1
        rest = sorted(set(range(1, 12)) - set(kept))
        w = torch.rand(len(rest), dtype=D, generator=torch.Generator().manual_seed(b))
        sources[b, 6, rest] = w / w.sum()
    return sources


@pytest.mark.parametrize('impl', ['gather', 'kernel'])
def test_block_connectivity_after_pruning_equals_the_masked_block_path(impl):
    """A pruned sequence with block connectivity takes its own branch of the tile paths (the predictor on the
    tokens' W columns, `_block_tiles` with token_sources, never the kernel's predictor): the same output and
    input, qkv and proj gradients as impl='masked' on the same weights, float64, 7 tokens in tiles of 2 (a partial
    last tile). Softmax and sums over <= 7 keys in another order: 1e-12."""
    from structformer.functional import tile_kernel
    if impl == 'kernel' and tile_kernel.unavailable_reason():
        pytest.skip(f'no tile kernel here: {tile_kernel.unavailable_reason()}')
    torch.manual_seed(3)
    options = dict(keep_ratio=0.4, seq_len=12, n_down=6, connectivity='block', block_size=2)
    layers = {name: SparsifinerAttention(32, 4, impl=name, **options).double() for name in ('masked', impl)}
    layers[impl].load_state_dict(layers['masked'].state_dict())
    x, sources = torch.randn(2, 7, 32, dtype=D), _pruned_sources()
    results = {}
    for name, layer in layers.items():
        xs = x.clone().requires_grad_()
        out = layer(xs, token_sources=sources)
        results[name] = (out.detach(), *torch.autograd.grad(out.square().sum(),
                                                             [xs, layer.qkv.weight, layer.proj.weight]))
    for a, b in zip(results[impl], results['masked']):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_sparsifiner_model_prunes_with_the_reduced_budget_and_gradients_flow():
    model, x = _digits()
    prune_tokens(model, keep_rate=0.5, layers=[1, 2])
    for block in model.blocks:
        block.attn.keep_scores, block.attn.impl = True, 'masked'
    model.train()
    logits = model(x)
    expected = [17, 17, 10, 7]
    for block, n in zip(model.blocks, expected):
        mask = block.attn.last_mask
        assert mask.shape[-1] == n and (mask[..., 1:, :].sum(-1) == budget(n, 0.25)).all()
    assert tokens_per_block(model) == expected + [7]
    logits.square().sum().backward(retain_graph=True)
    for name, p in model.named_parameters():
        if '.basis.' not in name:                           # the predictors learn from distillation only
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad()
    sum(b.attn.last_scores.square().mean() for b in model.blocks).backward()
    for block in model.blocks[2:]:                       # after pruning: through the gathered columns
        assert block.attn.basis.w_down.grad.abs().sum() > 0 and block.attn.basis.w_up.grad.abs().sum() > 0


def test_gradient_checkpointing_recomputes_the_same_tokens():
    grads = []
    for checkpointing in (False, True):
        model, x = _vit()
        sparsify(model, keep_ratio=0.5, impl='masked')
        prune_tokens(model, keep_rate=0.5, layers=[1, 2])
        model.set_grad_checkpointing(checkpointing)
        model.train()
        model(x).square().sum().backward()
        grads.append([p.grad.clone() for n, p in model.named_parameters() if '.basis.' not in n])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_transform_is_recorded_and_rebuilds():
    spec = ('prune_tokens', {'keep_rate': 0.5, 'layers': [1, 2]})
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        model, recipe = build_model('sparsifiner_digits', transforms=[spec])
        plain, _ = build_model('sparsifiner_digits')
        again = rebuild(recipe)
    assert recipe.transforms[0]['name'] == 'prune_tokens' and recipe.transforms[0]['kwargs'] == spec[1]
    assert list(model.state_dict()) == list(plain.state_dict()) == list(again.state_dict())
    assert model.blocks[3].attn.basis.w_down.shape == (8, 17)       # the unpruned n, whatever the pruning
    again.load_state_dict(model.state_dict())
    x = torch.randn(2, 1, 8, 8)
    model.eval(), again.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))
    assert [b.keep_rate for b in again.blocks[1:]] == [0.5, 0.5, None]


@pytest.mark.parametrize('kwargs,match', [
    (dict(keep_rate=0), r'keep_rate must be in \(0, 1\]'), (dict(keep_rate=1.5), 'keep_rate'),
    (dict(keep_rate=True), 'keep_rate'), (dict(layers=[4]), r'layers must be block indices in \[0, 3\]'),
    (dict(layers=[-1]), 'layers'), (dict(fuse='false'), 'fuse must be True or False'), (dict(layers='12'), 'layers'), (dict(layers=[1, 1]), 'layers has repeated'),
])
def test_bad_arguments_are_named(kwargs, match):
    model, _ = _vit()
    with pytest.raises(ValueError, match=match):
        prune_tokens(model, **dict(dict(keep_rate=0.5, layers=[1]), **kwargs))


def test_refusals_name_the_problem():
    model, _ = _vit()
    sparsify(model, keep_ratio=0.5, dense_cls_row=False)
    with pytest.raises(ValueError, match='dense_cls_row=True'):
        prune_tokens(model, layers=[1])
    model, _ = _vit()
    prune_tokens(model, layers=[1])
    with pytest.raises(ValueError, match='already token-pruned'):
        prune_tokens(model, layers=[2])
    torch.manual_seed(0)
    no_cls = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, depth=2, class_token=False,
                               global_pool='avg')
    with pytest.raises(ValueError, match='no cls token'):
        prune_tokens(no_cls, layers=[1])


def test_forward_intermediates_refuses_a_grid_the_pruned_tokens_do_not_fill():
    """timm's NCHW reshape does not check the token count: after pruning, a block's 8 kept + 1 fused tokens of width
    192 came back as a [B, 108, 4, 4] map. Now NCHW is refused for such blocks, naming them; blocks before the first
    pruning one, NLC, and copies of the model (EMA's deepcopy) behave as before."""
    import copy
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, depth=4, num_classes=10).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        dense = model.forward_intermediates(x, intermediates_only=True)
        prune_tokens(model, keep_rate=0.5, layers=[1, 2])
        with pytest.raises(ValueError, match=r"output_fmt='NCHW' needs the 4x4 patch grid, .*block\(s\) \[1, 2, 3\]"):
            model.forward_intermediates(x)
        first, = model.forward_intermediates(x, indices=[0], intermediates_only=True)
        torch.testing.assert_close(first, dense[0])
        nlc = model.forward_intermediates(x, output_fmt='NLC', intermediates_only=True)
        assert [t.shape[1] for t in nlc] == [16, 9, 6, 6] and all(t.shape[2] == 192 for t in nlc)
        twin = copy.deepcopy(model)
        assert twin.forward_intermediates.args[0] is twin
        with pytest.raises(ValueError, match='patch grid'):
            twin.forward_intermediates(x, indices=[-1])
        torch.testing.assert_close(twin.forward_intermediates(x, indices=[0], intermediates_only=True)[0], first)
    unpruned = prune_tokens(timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, depth=2).eval(),
                            keep_rate=1.0, layers=[1])                 # keeps every token: still a grid
    assert unpruned.forward_intermediates(x, intermediates_only=True)[-1].shape == (2, 192, 4, 4)


def test_prune_intermediate_layers_moves_the_bookkeeping_to_the_new_last_block():
    """timm's prune_intermediate_layers cuts `blocks`; `positions` / `sources` kept reading the entry of the old
    last block: after a forward of the shorter model they were the full model's (a stale forward's) tokens."""
    import copy
    model, x = _vit()
    prune_tokens(model, keep_rate=0.5, layers=[1, 2])
    with torch.no_grad():
        model(x)
        leaving_block_1 = model.token_pruning.entering[2]
        assert model.token_pruning.positions.shape == (3, 7)          # cls + 16 -> 8 + 1 -> 5 + 1
        cut = copy.deepcopy(model)
        assert cut.prune_intermediate_layers([1]) == [1] and len(cut.blocks) == 2
        cut(x)
    assert cut.token_pruning.depth == 2 and cut.token_pruning.positions.shape == (3, 10)
    torch.testing.assert_close(cut.token_pruning.positions, leaving_block_1[0], rtol=0, atol=0)
    torch.testing.assert_close(cut.token_pruning.sources, leaving_block_1[1])
    assert model.token_pruning.depth == 4                             # the copy's cut leaves the model whole
    before_pruning = copy.deepcopy(model)
    before_pruning.prune_intermediate_layers([0])                     # only block 0 (no pruning block) is left
    with torch.no_grad():
        before_pruning(x)
    assert before_pruning.token_pruning.positions is None


def test_an_attention_after_pruning_that_needs_the_full_token_count_is_refused_when_applied():
    """Linformer's E, F are built for the model's 17 tokens; after pruning at block 1 block 3 gets 10: refused by
    prune_tokens, naming the block and the layer, before the model changes (the first forward used to fail inside
    the layer). A Linformer before the pruning block is fine."""
    from structformer.models.attention_swap import swap_attention
    model, x = _vit()
    swap_attention(model.blocks[3], 'linformer', seq_len=17, num_landmarks=4)
    with pytest.raises(ValueError, match=r"^prune_tokens: blocks\[3\]\.attn \(LinformerAttention\) gets 10 tokens "
                                         r"after pruning at blocks \[1\] \(of 17\): .*seq_len=17"):
        prune_tokens(model, keep_rate=0.5, layers=[1])
    assert not any(isinstance(block, TokenPruningBlock) for block in model.blocks)
    model, x = _vit()
    swap_attention(model.blocks[0], 'linformer', seq_len=17, num_landmarks=4)
    assert tokens_per_block(prune_tokens(model, keep_rate=0.5, layers=[1])) == [17, 17, 10, 10, 10]
    assert model(x).shape == (3, 10)
