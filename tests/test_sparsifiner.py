"""Sparsifiner attention (Eq. 1–6): its execution paths agree, it keeps exactly B keys per query, keep 1 is
dense attention, `sparsify` keeps a ViT's function, and the mask is detached from the attention path."""
import re
import warnings

import pytest
import timm
import torch
from timm.layers import Attention as TimmAttention

from structformer.functional.sparsifiner import (block_mask_from_scores, budget, flex_attention_path, gathered_attention,
                                                 mask_from_indices, masked_attention, topk_indices)
from structformer.functional.sparsifiner_flex import flex_attention_available
from structformer.layers import SparsifinerAttention
from structformer.layers.attention.softmax import softmax_attention_reference
from structformer.models.attention_swap import swap_attention
from structformer.models.sparsifiner import sparsify

D = torch.float64


def _qkv(b=2, h=3, n=17, d=8, dtype=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, dtype=dtype, generator=g, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize('n,keep,expected', [(17, 0.25, 5), (197, 0.25, 50), (50, 1.0, 50), (10, 0.01, 1), (8, 0.5, 4)])
def test_budget_is_ceil_keep_times_n(n, keep, expected):
    assert budget(n, keep) == expected


@pytest.mark.parametrize('keep', [0, -0.1, 1.5, True])
def test_bad_keep_ratio_is_refused(keep):
    with pytest.raises(ValueError, match=r'keep_ratio must be in \(0, 1\]'):
        SparsifinerAttention(32, 4, keep_ratio=keep)


@pytest.mark.parametrize('option, bad', [('predictor_dim', 0), ('predictor_dim', -1), ('predictor_dim', 2.5),
                                         ('predictor_dim', True), ('tau', None), ('tau', '0.1'),
                                         ('up_threshold', None), ('up_threshold', '0.01'), ('up_threshold', True)])
def test_bad_predictor_options_are_named(option, bad):
    """predictor_dim=0 built q/k maps to zero channels (every score 0, silently), -1 failed in torch.empty
    ("negative dimension"), 2.5 / True in nn.Linear's size check; tau / up_threshold that are not numbers failed with
    "'<=' not supported between instances of 'int' and 'NoneType'", naming neither."""
    with pytest.raises(ValueError, match=rf'^{option}={re.escape(repr(bad))} '):
        SparsifinerAttention(32, 4, **{option: bad})


@pytest.mark.parametrize('options', [dict(), dict(impl='gather'), dict(predictor_dim=4),
                                     dict(connectivity='block', block_size=4), dict(keep_scores=True)])
def test_an_empty_batch_is_attended(options):
    """A batch of 0 images (as nn.Linear and SDPA take): the predictor's W_down K reshape(B, -1, H, d) of 0 elements
    raised "cannot reshape tensor of 0 elements ... ambiguous"."""
    layer = SparsifinerAttention(16, 2, seq_len=9, **options)
    x = torch.randn(0, 9, 16, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, 9, 16) and x.grad.shape == x.shape


@pytest.mark.parametrize('connectivity', ['token', 'block'])
def test_a_layer_that_kept_its_scores_can_be_copied(connectivity):
    """With keep_scores (the attention-distillation phases), `last_scores` holds the predictor's graph for the loss.
    copy.deepcopy of the layer, or of a model holding it (timm's ModelEmaV3, weight averaging), then failed: "Only
    Tensors created explicitly by the user (graph leaves) support the deepcopy protocol". A copy has run no forward:
    it carries no scores, and the original keeps its own."""
    import copy
    import io
    torch.manual_seed(0)
    layer = SparsifinerAttention(16, 2, seq_len=9, keep_scores=True, connectivity=connectivity, block_size=4)
    x = torch.randn(2, 9, 16)
    layer(x)
    assert layer.last_scores is not None and layer.last_scores.requires_grad
    twin = copy.deepcopy(layer)
    assert twin.last_scores is None and layer.last_scores is not None
    torch.testing.assert_close(twin(x), layer(x), rtol=0, atol=0)         # the same ops on the same weights
    torch.save(layer, io.BytesIO())


@pytest.mark.parametrize('b, h, n, keys, dense_rows', [(2, 3, 17, 5, 0), (2, 3, 17, 5, 1), (1, 1, 5, 1, 0),
                                                       (1, 2, 6, 6, 2), (1, 1, 1, 1, 1)])
def test_masked_and_gathered_paths_agree_with_gradients(b, h, n, keys, dense_rows):
    """Token connectivity, gathered keys against the masked n×n softmax: outputs and q, k, v gradients in float64,
    also at batch 1, one key per query, every key, two dense rows and one token. Softmax and sums over <= n keys in
    another order: ~1e-15, so 1e-12 (the default float64 tolerance, 1e-7, would pass a wrong term of that size)."""
    q, k, v = _qkv(b, h, n)
    scores = torch.randn(b, h, n, n, dtype=D)
    idx = topk_indices(scores, keys)
    mask = mask_from_indices(idx, n, dense_rows)
    grad = torch.randn(b, h, n, 8, dtype=D)
    outs, grads = [], []
    for path in (lambda: masked_attention(q, k, v, mask), lambda: gathered_attention(q, k, v, idx, dense_rows=dense_rows)):
        out = path()
        outs.append(out.detach())
        grads.append(torch.autograd.grad(out, (q, k, v), grad))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_exactly_budget_keys_per_query_row():
    scores = torch.randn(2, 3, 17, 17)
    keys = budget(17, 0.25)
    mask = mask_from_indices(topk_indices(scores, keys), 17, dense_rows=1)
    counts = mask.sum(-1)
    assert (counts[..., 0] == 17).all() and (counts[..., 1:] == keys).all()
    # the kept keys are the highest-scoring ones
    kept_min = scores.masked_fill(~mask, float('inf'))[..., 1:, :].amin(-1)
    dropped_max = scores.masked_fill(mask, float('-inf'))[..., 1:, :].amax(-1)
    assert (kept_min >= dropped_max).all()


def test_flex_attention_path_agrees_on_forward():
    q, k, v = (t.detach().float() for t in _qkv())
    mask = mask_from_indices(topk_indices(torch.randn(2, 3, 17, 17), 5), 17, 1)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try:
            out = flex_attention_path(q, k, v, mask, block_size=16)
        except (RuntimeError, NotImplementedError) as e:       # a torch build without CPU FlexAttention
            pytest.skip(f"FlexAttention does not run here: {e}")
    torch.testing.assert_close(out, masked_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_block_variant_is_whole_tiles_and_equals_its_masked_reference():
    scores = torch.randn(1, 2, 20, 20)
    mask = block_mask_from_scores(scores, block_size=4, keep_ratio=0.4)
    tiles = mask.reshape(1, 2, 5, 4, 5, 4)
    assert (tiles.all(dim=(-3, -1)) | ~tiles.any(dim=(-3, -1))).all()           # each tile all in or all out
    assert (tiles.any(dim=(-3, -1)).sum(-1) == budget(5, 0.4)).all()            # ⌈0.4 · 5⌉ key blocks per query block
    torch.manual_seed(0)
    layer = SparsifinerAttention(32, 2, keep_ratio=0.4, connectivity='block', block_size=4, impl='masked',
                                 seq_len=20, keep_scores=True).double().eval()
    x = torch.randn(2, 20, 32, dtype=D)
    out = layer(x)
    q, k, v = layer.project(x)
    expected = block_mask_from_scores(layer.predict(q, k), 4, 0.4)
    expected[..., 0, :] = True
    assert torch.equal(layer.last_mask, expected)
    torch.testing.assert_close(out, layer.merge(masked_attention(q, k, v, expected)))


def _twin(keep=1.0, **options):
    torch.manual_seed(1)
    dense = TimmAttention(32, num_heads=4, qkv_bias=True).double()
    sparse = SparsifinerAttention(32, 4, qkv_bias=True, keep_ratio=keep, seq_len=12, **options).double()
    sparse.load_state_dict(dense.state_dict(), strict=False)
    return dense, sparse


@pytest.mark.parametrize('impl', ['masked', 'gather', 'auto'])
def test_keep_ratio_one_is_dense_attention_outputs_and_gradients(impl):
    dense, sparse = _twin(impl=impl)
    x = torch.randn(3, 12, 32, dtype=D, requires_grad=True)
    grad = torch.randn(3, 12, 32, dtype=D)
    a = dense(x)
    ga = torch.autograd.grad(a, [x, dense.qkv.weight, dense.proj.weight], grad)
    b = sparse(x)
    gb = torch.autograd.grad(b, [x, sparse.qkv.weight, sparse.proj.weight], grad)
    torch.testing.assert_close(b, a)
    for u, w in zip(ga, gb):
        torch.testing.assert_close(w, u)


def test_sparse_attention_is_softmax_over_the_kept_keys():
    _, sparse = _twin(keep=0.25, impl='gather', keep_scores=True)
    sparse.eval()
    x = torch.randn(2, 12, 32, dtype=D)
    out = sparse(x)
    q, k, v = sparse.project(x)
    mask = sparse.last_mask if sparse.last_mask is not None else mask_from_indices(
        topk_indices(sparse.predict(q, k), budget(12, 0.25)), 12, 1)
    torch.testing.assert_close(out, sparse.merge(softmax_attention_reference(q, k, v, attn_mask=mask)))


def test_mask_is_detached_and_scores_carry_the_predictor_gradient():
    # the sparse path's thresholded scores (the trunc-normal(0.02) init puts every coefficient below τ at this size,
    # the stall of issue 34: tests/test_sparsifiner_stage1.py)
    _, sparse = _twin(keep=0.25, keep_scores=True, predictor_dim=4, basis_init='scaled')
    x = torch.randn(2, 12, 32, dtype=D)
    sparse(x).sum().backward(retain_graph=True)          # the scores share q, k with the attention
    predictor = [sparse.basis.w_down, sparse.basis.w_up, sparse.predictor_q.weight, sparse.predictor_k.weight]
    assert all(p.grad is None for p in predictor)                      # nothing flows through the mask
    assert sparse.qkv.weight.grad is not None
    sparse.last_scores.square().mean().backward()                      # the distillation target does train them
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in predictor)


def test_sparsify_keeps_the_logits_at_keep_one_and_reports_nothing_to_convert():
    torch.manual_seed(2)
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, num_classes=5).double().eval()
    x = torch.randn(2, 3, 16, 16, dtype=D)
    with torch.no_grad():
        before = model(x)
        sparsify(model, keep_ratio=1.0)
        after = model(x)
    assert all(isinstance(b.attn, SparsifinerAttention) for b in model.blocks)
    assert model.blocks[0].attn.basis.seq_len == 17
    torch.testing.assert_close(after, before)
    with pytest.raises(ValueError, match='no timm Attention'):
        sparsify(torch.nn.Linear(3, 3))


def test_a_vit_without_class_token_gets_no_dense_first_row():
    """Without a class token (timm's class_token=False, global average pooling) token 0 is a patch: the dense
    'cls' row made it attend to every key (density above the budget) and left it out of the distillation loss."""
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, class_token=False,
                              global_pool='avg', embed_dim=32, num_heads=2, depth=1)
    sparsify(model, keep_ratio=0.25).eval()
    layer = model.blocks[0].attn
    assert not layer.dense_cls_row
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert float(layer.last_density) == pytest.approx(budget(16, 0.25) / 16)
    registered = timm.create_model('sparsifiner_digits', class_token=False, global_pool='avg')
    assert not any(m.dense_cls_row for m in registered.modules() if isinstance(m, SparsifinerAttention))
    assert timm.create_model('sparsifiner_digits').blocks[0].attn.dense_cls_row
    dense = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, class_token=False, global_pool='avg')
    with pytest.raises(ValueError, match='dense_cls_row=True, but the model has no class token'):
        sparsify(dense, dense_cls_row=True)


def test_sparsify_keeps_an_eval_model_in_eval_mode():
    """The new layers are fresh modules (training mode); with attention dropout an eval model that kept them
    in training mode would drop attention weights at inference and differ from the dense model at keep 1."""
    torch.manual_seed(3)
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, num_classes=5,
                              attn_drop_rate=0.5).double().eval()
    x = torch.randn(2, 3, 16, 16, dtype=D)
    with torch.no_grad():
        before = model(x)
        sparsify(model, keep_ratio=1.0)
        after = model(x)
    assert not any(m.training for m in model.modules())
    torch.testing.assert_close(after, before)
    model.train()
    assert all(b.attn.training for b in model.blocks)


@pytest.mark.parametrize('attn', ['soft', 'softpp', 'mssa'])
def test_swap_attention_refuses_shared_qk_layers_and_leaves_the_model(attn):
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, embed_dim=16, num_heads=2, depth=2)
    with pytest.raises(ValueError, match=f"attn='{attn}' has .* cannot take the \\[48, 16\\] q/k/v weights"):
        swap_attention(model, attn)
    assert all(type(b.attn) is TimmAttention for b in model.blocks)


def test_wrong_token_count_and_options_are_named():
    layer = SparsifinerAttention(32, 4, seq_len=12)
    with pytest.raises(ValueError, match='built for seq_len=12 tokens, got n=9'):
        layer(torch.randn(1, 9, 32))
    with pytest.raises(ValueError, match='impl='):
        SparsifinerAttention(32, 4, impl='sparse')
    with pytest.raises(ValueError, match=r'^tau=1.5 must be a number in \[0, 1\)'):
        SparsifinerAttention(32, 4, tau=1.5)
    for bad in (-1e-3, float('nan'), float('inf')):             # NaN zeroed every W_up entry, silently
        with pytest.raises(ValueError, match=r'^up_threshold=\S+ must be a finite number >= 0'):
            SparsifinerAttention(32, 4, up_threshold=bad)
    with pytest.raises(ValueError, match=r'^tau=nan must be a number in \[0, 1\)'):
        SparsifinerAttention(32, 4, tau=float('nan'))
    with pytest.raises(ValueError, match=r'^seq_len=0 must be None or a positive integer \(tokens per image\)$'):
        SparsifinerAttention(32, 4, seq_len=0)


def test_registered_models_train_a_step_with_the_predictor_trainable_by_distillation():
    model = timm.create_model('sparsifiner_digits')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        model(torch.randn(2, 1, 8, 8))                   # shapes W_down, W_up (n = 17)
    attn = model.blocks[0].attn
    assert attn.basis.w_down.shape == (8, 17) and attn.budget(17) == 5


def test_auto_picks_masked_on_cpu_and_explicit_paths_are_kept():
    q = torch.zeros(1, 4, 600, 8)
    layer = SparsifinerAttention(32, 4, keep_ratio=0.25)
    for mode in (layer.train, layer.eval):
        mode()
        assert layer._resolve_impl(q, 0.0) == 'masked'
    explicit = SparsifinerAttention(32, 4, keep_ratio=0.25, impl='gather').eval()
    assert explicit._resolve_impl(q, 0.0) == 'gather'


def test_keys_per_query_fixes_the_budget_and_refuses_more_than_n():
    from structformer.layers.attention.sparsifiner import SparsifinerAttention
    torch.manual_seed(0)
    layer = SparsifinerAttention(32, 4, keys_per_query=6, seq_len=17, n_down=4, impl='masked', keep_scores=True)
    layer(torch.randn(2, 17, 32))
    assert (layer.last_mask[..., 1:, :].sum(-1) == 6).all()          # the cls row stays dense
    with pytest.raises(ValueError, match=r'keys_per_query=18 is larger than the seq_len=17 tokens; accepted 1\.\.17'):
        SparsifinerAttention(32, 4, keys_per_query=18, seq_len=17)
    lazy = SparsifinerAttention(32, 4, keys_per_query=9, n_down=4)
    with pytest.raises(ValueError, match=r'keys_per_query=9 is larger than the n=5 tokens'), warnings.catch_warnings():
        warnings.simplefilter('ignore')                    # W_down, W_up created at the first forward
        lazy(torch.randn(1, 5, 32))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf'^keys_per_query={bad!r} must be a positive integer \(the budget B\)$'):
            SparsifinerAttention(32, 4, keys_per_query=bad)


@pytest.mark.parametrize('n', [20, 19])                       # 19: a partial last tile
def test_block_connectivity_tile_gather_equals_the_masked_block_path(n):
    """impl='gather' with block connectivity (the CPU default without keep_scores: no n×n tensor) picks the
    tiles the masked block path picks and computes the same outputs and gradients."""
    torch.manual_seed(0)
    options = dict(keep_ratio=0.4, connectivity='block', block_size=4, seq_len=n, n_down=6)
    masked = SparsifinerAttention(32, 2, impl='masked', keep_scores=True, **options).double()
    gathered = SparsifinerAttention(32, 2, impl='gather', keep_scores=True, **options).double()
    gathered.load_state_dict(masked.state_dict())
    # 'auto' gathers under attention dropout; otherwise on a CPU it takes the tile kernel (test_sparsifiner_kernel.py)
    assert SparsifinerAttention(32, 2, **options)._resolve_impl(torch.zeros(1, requires_grad=True), 0.1) == 'gather'
    x = torch.randn(3, n, 32, dtype=D, requires_grad=True)
    out_m = masked(x)
    grad_m = torch.autograd.grad(out_m.square().sum(), [x, masked.qkv.weight])
    out_g = gathered(x)
    grad_g = torch.autograd.grad(out_g.square().sum(), [x, gathered.qkv.weight])
    assert torch.equal(gathered.last_mask, masked.last_mask)
    # float64, softmax and sums over <= n keys in another order: ~1e-15 of each tensor's largest entry, so 1e-12 (the
    # default float64 tolerance, 1e-7, would pass a wrong term of that size)
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item())  # noqa: E731
    close(gathered.last_scores, masked.last_scores)
    close(out_g, out_m)
    for a, b in zip(grad_g, grad_m):
        close(a, b)


def test_registered_models_have_every_parameter_at_construction():
    """timm.create_model gives W_down, W_up their shape at once (n = patches + cls at the model's img_size),
    so an optimiser built right away trains the predictor; only a dynamic image size leaves them lazy."""
    from torch.nn.parameter import UninitializedParameter
    with warnings.catch_warnings():
        warnings.simplefilter('error')                        # no lazy-parameter warning, now or at forward
        model = timm.create_model('sparsifiner_digits')
        bigger = timm.create_model('sparsifiner_digits', img_size=16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 1, 8, 8)).sum().backward()
    assert not any(isinstance(p, UninitializedParameter) for p in model.parameters())
    assert model.blocks[0].attn.basis.w_down.shape == (8, 17)      # 4×4 patches + cls
    assert bigger.blocks[0].attn.basis.w_up.shape == (8, 65)       # 8×8 patches + cls
    optimised = {id(p) for group in optimizer.param_groups for p in group['params']}
    assert id(model.blocks[0].attn.basis.w_down) in optimised
    dynamic = timm.create_model('sparsifiner_digits', dynamic_img_size=True)
    assert isinstance(dynamic.blocks[0].attn.basis.w_down, UninitializedParameter)
    converted = sparsify(timm.create_model('vit_digits', dynamic_img_size=True))      # sparsify sees it too
    assert isinstance(converted.blocks[0].attn.basis.w_up, UninitializedParameter)


def test_a_linformer_attn_layer_is_shaped_when_the_model_is_built():
    """timm.create_model('vit_digits', attn_layer=Linformer without seq_len) knows its 17 tokens (4x4 patches + cls):
    E, F are shaped then, so parameter counts, an optimiser and load_state_dict work before any forward (they stayed
    lazy until the first one), drawn as the dry forward of `materialize_lazy` drew them (same seed, same weights, the
    global RNG left where it was); a dynamic image size keeps them lazy."""
    from torch.nn.parameter import UninitializedParameter

    from timm.models.vision_transformer import VisionTransformer

    from structformer.layers.attention.linformer import LinformerAttention
    from structformer.layers.attention.registry import with_defaults
    from structformer.models.sparsifiner import _DIGITS
    from structformer.models.transforms import TransformContext, materialize_lazy
    layer = with_defaults(LinformerAttention, num_landmarks=8)
    with warnings.catch_warnings():
        warnings.simplefilter('error')                        # no lazy-parameter warning, now or at forward
        torch.manual_seed(0)
        model = timm.create_model('vit_digits', attn_layer=layer)
        after_build = torch.random.get_rng_state()
        count = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        timm.create_model('vit_digits', attn_layer=layer).load_state_dict(model.state_dict())
        model(torch.randn(2, 1, 8, 8)).sum().backward()
    assert model.blocks[0].attn.seq_proj.e.shape == model.blocks[-1].attn.seq_proj.f.shape == (8, 17)
    assert count == sum(p.numel() for p in model.parameters())
    optimised = {id(p) for group in optimizer.param_groups for p in group['params']}
    assert id(model.blocks[0].attn.seq_proj.e) in optimised
    # the weights a lazy build and its dry forward draw from the same seed
    dynamic = timm.create_model('vit_digits', attn_layer=layer, dynamic_img_size=True)
    assert isinstance(dynamic.blocks[0].attn.seq_proj.e, UninitializedParameter)
    with pytest.raises(ValueError, match='LinformerAttention has parameters per token position'):
        timm.create_model('vit_digits', attn_layer=layer, patch_drop_rate=0.25)    # its training forward failed
    torch.manual_seed(0)              # timm's own class of the same shape stays lazy: shaped by the dry forward
    lazy = VisionTransformer(**_DIGITS, attn_layer=layer)
    torch.testing.assert_close(torch.random.get_rng_state(), after_build, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        materialize_lazy(lazy, TransformContext(input_size=(1, 8, 8)))
    assert list(model.state_dict()) == list(lazy.state_dict())
    for built, drawn in zip(model.state_dict().values(), lazy.state_dict().values()):
        torch.testing.assert_close(built, drawn, rtol=0, atol=0)
    assert sparsify(timm.create_model('vit_digits')).blocks[0].attn.basis.w_up.shape == (32, 17)


# ---- FlexAttention (functional/sparsifiner_flex.py): what can be checked without a GPU ----------------------

def test_token_block_mask_visits_the_tiles_create_block_mask_visits():
    from structformer.functional.sparsifiner_flex import token_block_mask, token_block_mask_reference
    n, bs = 37, 16                                        # 37 = 2·16 + 5: the last tiles cross the sequence end
    mask = torch.rand(2, 3, n, n) < 0.3
    mask[..., :16, :16] = True                            # a full interior tile
    mask[..., 16:32, :16] = False                         # an empty one
    ours, reference = token_block_mask(mask, bs), token_block_mask_reference(mask, bs)
    assert torch.equal(ours.to_dense(), reference.to_dense())
    full = lambda m: m.full_kv_num_blocks[..., :2]        # noqa: E731  (query tiles inside the sequence)
    assert torch.equal(full(ours), full(reference)) and full(ours).sum() > 0


@pytest.mark.parametrize('dense_rows', [0, 1])
def test_block_flex_attention_equals_gathered_tiles_on_forward(dense_rows):
    from structformer.functional.sparsifiner import block_gathered_attention
    from structformer.functional.sparsifiner_flex import block_flex_attention
    q, k, v = (t.detach() for t in _qkv(n=37))
    indices = torch.rand(2, 3, 3, 3).topk(2, dim=-1).indices
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')                   # eager FlexAttention's notice
        got = block_flex_attention(q, k, v, indices, 16, dense_rows=dense_rows)
    torch.testing.assert_close(got, block_gathered_attention(q, k, v, indices, 16, dense_rows=dense_rows))


def test_flex_kernel_tiles_follow_the_mask_tiles():
    from structformer.functional.sparsifiner_flex import kernel_options
    assert kernel_options(128, True) is None and kernel_options(256, True) is None and kernel_options(64, False) is None
    options = kernel_options(64, True)
    assert options['BLOCK_M'] == options['BLOCK_N'] == 64
    assert options['BLOCK_N1'] % options['BLOCK_M1'] == 0 and options['BLOCK_M2'] % options['BLOCK_N2'] == 0
    assert all(64 % options[key] == 0 for key in ('BLOCK_M1', 'BLOCK_N1', 'BLOCK_M2', 'BLOCK_N2'))
    with pytest.raises(ValueError, match='block_size=48'):
        kernel_options(48, True)


def test_flex_refuses_attention_dropout():
    with pytest.raises(ValueError, match=r"impl='flex'.*attn_drop=0\.1"):
        SparsifinerAttention(32, 4, impl='flex', attn_drop=0.1)
    layer = SparsifinerAttention(32, 4, impl='flex', seq_len=9).train()
    layer.attn_drop.p = 0.1
    with pytest.raises(ValueError, match=r"impl='flex' has no attention dropout"):
        layer(torch.randn(2, 9, 32))


@pytest.mark.skipif(not flex_attention_available(), reason='this torch has no FlexAttention')
@pytest.mark.parametrize('connectivity', ['token', 'block'])
def test_flex_refuses_to_train_on_a_cpu_by_its_argument(connectivity):
    """torch's FlexAttention has no CPU backward; the layer says so by impl='flex' before any work (torch's own
    NotImplementedError came from inside its kernel). Without a gradient it still runs on a CPU."""
    layer = SparsifinerAttention(32, 4, impl='flex', seq_len=9, connectivity=connectivity, block_size=4)
    x = torch.randn(2, 9, 32)
    with pytest.raises(ValueError, match=r"impl='flex' cannot train on a CPU.*'masked'"):
        layer(x)
    with torch.no_grad():
        assert layer(x).shape == (2, 9, 32)


def test_auto_on_cuda_follows_the_gpu_measurements():
    cuda_like = type('CudaLike', (), {'is_cuda': True})()
    token = SparsifinerAttention(32, 4, attn_drop=0.1).train()
    assert token._resolve_impl(cuda_like, 0.0) == 'flex' and token._resolve_impl(cuda_like, 0.1) == 'masked'
    assert token.eval()._resolve_impl(cuda_like, 0.0) == 'masked'
    block = SparsifinerAttention(32, 4, connectivity='block')
    assert block._resolve_impl(cuda_like, 0.0) == 'gather' and block.eval()._resolve_impl(cuda_like, 0.0) == 'gather'
    block.keep_scores = True                              # the n×n scores are wanted: the masked block path
    assert block._resolve_impl(cuda_like, 0.0) == 'masked'


def test_auto_on_cuda_without_flex_attention_trains_on_the_masked_path(monkeypatch):
    import structformer.layers.attention.sparsifiner as module
    monkeypatch.setattr(module, 'flex_attention_available', lambda: False)      # torch 2.4: no FlexAttention
    cuda_like = type('CudaLike', (), {'is_cuda': True})()
    assert SparsifinerAttention(32, 4).train()._resolve_impl(cuda_like, 0.0) == 'masked'


def test_flex_attention_availability_traces_as_a_constant():
    """`_resolve_impl` asks `flex_attention_available()` inside compiled layers; as an lru_cache-wrapped function
    dynamo warned that it ignores the cache and traces the function (seen on an H200). A constant traces silently."""
    import warnings

    from structformer.functional.sparsifiner_flex import flex_attention_available
    torch._dynamo.reset()

    def step(x):
        return x + 1 if flex_attention_available() else x - 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        out = torch.compile(step, backend='eager', fullgraph=True)(torch.zeros(2))
    assert torch.equal(out, step(torch.zeros(2)))
    assert not [w for w in caught if 'lru_cache' in str(w.message)], [str(w.message) for w in caught]
    torch._dynamo.reset()


def test_converting_twice_is_refused_by_saying_so():
    """A second `sparsify` / `swap_attention` to the same class (or `sparsify` on a registered Sparsifiner model)
    was refused with "has no timm Attention module to replace", as if the model had no attention."""
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, embed_dim=16, num_heads=2, depth=2)
    sparsify(model, keep_ratio=0.5)
    with pytest.raises(ValueError, match=r'^sparsify: every attention of VisionTransformer is already '
                                         r'SparsifinerAttention \(2 layer'):
        sparsify(model, keep_ratio=0.25)
    with pytest.raises(ValueError, match='is already SparsifinerAttention'):
        sparsify(timm.create_model('sparsifiner_digits', depth=1))
    swap_attention(model, 'linformer', num_landmarks=4)                 # another class still converts
    with pytest.raises(ValueError, match=r'^swap_attention: every attention .* already LinformerAttention'):
        swap_attention(model, 'linformer', num_landmarks=8)


def test_sparsify_takes_a_factorised_model():
    """`factorize` then `sparsify` (low-rank projections, sparse attention): the swap read `qkv.weight`, which a
    FactorizedLinear has not (AttributeError). The factorised projection moves across; at keep 1 the logits stay."""
    from structformer.models.factorize import factorize
    torch.manual_seed(4)
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, embed_dim=16, num_heads=2, depth=2,
                              num_classes=5).double().eval()
    factorize(model, rank=0.5, verbose=False)
    x = torch.randn(2, 3, 16, 16, dtype=D)
    with torch.no_grad():
        before = model(x)
        sparsify(model, keep_ratio=1.0)
        after = model(x)
    assert isinstance(model.blocks[0].attn, SparsifinerAttention) and not hasattr(model.blocks[0].attn.qkv, 'weight')
    assert model.blocks[0].attn.basis.w_down.dtype == D
    torch.testing.assert_close(after, before)


def test_patch_dropout_is_refused_where_attention_has_per_token_parameters():
    """timm's patch_drop_rate drops patch tokens in training; Sparsifiner's W_down / W_up and Linformer's E / F are
    built for the fixed token count, so the first training step failed with "built for seq_len=17 tokens, got n=9",
    not naming the cause. Now building or converting such a model names patch_drop_rate; other layers still take it."""
    from structformer.models.factory import build_model
    with pytest.raises(ValueError, match='patch_drop_rate=0.5'):
        timm.create_model('sparsifiner_digits', depth=1, patch_drop_rate=0.5)
    vit = dict(img_size=16, patch_size=4, embed_dim=16, num_heads=2, depth=1, patch_drop_rate=0.5)
    with pytest.raises(ValueError, match="^sparsify: attn='sparsifiner' has parameters per token position"):
        sparsify(timm.create_model('vit_tiny_patch16_224', **vit))
    with pytest.raises(ValueError, match='LinformerAttention has parameters per token position'):
        build_model('vit_tiny_patch16_224', dict(vit, attn_layer='linformer', attn_kwargs={'num_landmarks': 4}))
    model = swap_attention(timm.create_model('vit_tiny_patch16_224', **vit), 'nystrom', num_landmarks=4).train()
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 1000)


def test_set_input_size_refuses_a_token_count_the_predictors_do_not_fit():
    """timm's `set_input_size` resampled the position embeddings and left W_down / W_up at 17 columns: the next
    forward failed with "built for seq_len=17 tokens, got n=65". It is refused before anything changes; a size with
    the same token count (patch size scaled along) is still taken."""
    model = timm.create_model('sparsifiner_digits', depth=1).eval()
    pos = model.pos_embed.detach().clone()
    with pytest.raises(ValueError, match=r'set_input_size: .* shaped for 17 tokens .* gives 65'):
        model.set_input_size(img_size=16)
    assert torch.equal(model.pos_embed, pos) and model.patch_embed.img_size == (8, 8)
    model.set_input_size(img_size=16, patch_size=4)
    assert model(torch.randn(1, 1, 16, 16)).shape == (1, 10)


@pytest.mark.parametrize('feature_cls', ['getter', 'hook', 'fx'])
def test_predictors_are_shaped_inside_every_feature_wrapper(feature_cls):
    """The predictors were shaped after `create_model` returned, through the wrapper's `.model`: timm's 'hook' and
    'fx' extractors have none, so W_down / W_up stayed lazy (not in `parameters()`, a warning at the first forward).
    Shaped at construction now, with the values a plain model of the same seed gets."""
    from torch.nn.parameter import UninitializedParameter
    torch.manual_seed(5)
    plain = timm.create_model('sparsifiner_digits', depth=2)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        torch.manual_seed(5)
        features = timm.create_model('sparsifiner_digits', depth=2, features_only=True, out_indices=(0, 1),
                                     feature_cls=feature_cls).eval()
        assert not any(isinstance(p, UninitializedParameter) for p in features.parameters())
        with torch.no_grad():
            assert len(features(torch.randn(2, 1, 8, 8))) == 2
    w_down = [p for n, p in features.named_parameters() if n.endswith('blocks.1.attn.basis.w_down')]
    torch.testing.assert_close(w_down[0], plain.blocks[1].attn.basis.w_down)


@pytest.mark.parametrize('up_basis', ['signed', 'abs'])
def test_predictor_scores_are_eq1_to_eq3_written_out(up_basis):
    """The layer's connectivity scores against Eq. 1–3 written out here in float64 (not through the layer's own
    helpers): A_down = softmax(Q (W_down K)ᵀ / √d), Ã_down = A_down ⊙ 1[A_down > τ], S = Ã_down (W ⊙ 1[|W| ≥ t])
    with W = W_up ('signed', the paper) or |W_up| ('abs', the public code). The data holds coefficients between τ/2
    and τ and negative basis entries above t in magnitude, so a threshold at another τ, a basis thresholded by its
    sign or a logit scale of 1/d instead of 1/√d changes S."""
    n, d, heads, tau, t = 17, 8, 2, 0.05, 1e-2
    layer = SparsifinerAttention(d * heads, heads, n_down=8, tau=tau, up_threshold=t, seq_len=n, up_basis=up_basis,
                                 basis_init='scaled').double().eval()
    q, k, _ = _qkv(b=2, h=heads, n=n, d=d)
    w_down, w_up = layer.basis.w_down.detach(), layer.basis.w_up.detach()
    a_down = torch.softmax(q @ (w_down @ k).transpose(-2, -1) / d ** 0.5, dim=-1)
    basis = w_up if up_basis == 'signed' else w_up.abs()
    expected = (a_down * (a_down > tau)) @ (basis * (basis.abs() >= t))
    assert ((a_down > tau / 2) & (a_down <= tau)).any() and ((w_up < -t).any())
    torch.testing.assert_close(layer.predict(q, k), expected, rtol=1e-12, atol=1e-14)


def test_low_rank_attention_defaults_to_the_inverse_square_root_of_the_head_width():
    """Eq. 1's scale when none is given: 1/√d of the keys' width (d = 8 here), as `masked_attention`'s."""
    from structformer.functional.sparsifiner import low_rank_attention
    q, k, _ = _qkv(d=8)
    w_down = torch.randn(4, k.shape[-2], dtype=D, generator=torch.Generator().manual_seed(3))
    expected = torch.softmax(q @ (w_down @ k).transpose(-2, -1) / 8 ** 0.5, dim=-1)
    torch.testing.assert_close(low_rank_attention(q, k, w_down), expected, rtol=1e-12, atol=1e-14)
