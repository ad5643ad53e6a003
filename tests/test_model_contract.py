"""The timm model contract, for every model structformer registers."""
import functools
import json
import math

import pytest
import timm
import torch

from structformer import list_structformer_models
from structformer.layers import ISTA, MSSA
from structformer.models.sparsifiner import predictor_parameter_names

MODELS = list_structformer_models()


def _cheap_side(name):
    """A small input side for the contract tests, so 24-layer / 87M-parameter models stay cheap on CPU: the
    224-px models at 32 px (SOFT's four stages on grids 8², 4², 2², 1²: the smallest side at which every stage
    still sees a token; the attention's numerics are tested at full grids in test_soft*.py), SW-MLP on CIFAR at
    16 px (its m = 3072 at 32 px is 113M weights), WRN-28-10 at 16 px (its three groups on 16², 8², 4² maps; at 32
    px its forward and backward alone took 2.2 s); None: the model's own size. (Not the pretrained config's
    `test_input_size`: timm's validate.py evaluates at that size.)"""
    if name.endswith('_224'):
        return 32
    return 16 if name in ('swmlp_cifar', 'wrn_28_10') else None


def _small_kwargs(name):
    side = _cheap_side(name)
    return {'img_size': side} if side else {}


def _small_size(name):
    c, h, w = timm.get_pretrained_cfg(name).input_size
    side = _cheap_side(name)
    return (c, side, side) if side else (c, h, w)


@functools.lru_cache(maxsize=1)
def _initial_state(name):
    """A freshly initialised model's weights at its small size, kept while that model's tests run (the `model_name`
    fixture groups them): drawing the initial values was most of these tests' time (timm's trunc_normal_ after
    nn.Linear's own uniform_: 1.5 s for SOFT-Huge's 87M weights, four times over)."""
    return timm.create_model(name, **_small_kwargs(name)).state_dict()


def _with_initial_weights(model, name):
    """`model` (built on the meta device) given copies of `_initial_state(name)`'s tensors for its own keys: copies,
    as a forward in training mode updates BatchNorm's statistics in place."""
    state = _initial_state(name)
    model.load_state_dict({k: state[k].clone() for k in model.state_dict()}, assign=True)
    return model


def _small(name):
    """A model at a small input size (`_cheap_side`), with the initial weights its tests share."""
    with torch.device('meta'):
        model = timm.create_model(name, **_small_kwargs(name))
    return _with_initial_weights(model, name), _small_size(name)


@pytest.fixture(scope='module', params=MODELS)
def model_name(request):
    """Each registered model; module-scoped, so pytest runs one model's tests together and `_initial_state` draws
    its weights once per test process."""
    return request.param


def _structure(name):
    """The model at its small size on the meta device: its parameter names, shapes and feature_info without the
    cost of initialising them (the contract tests were a sixth of the suite's time, 70 % of it the SOFT models)."""
    with torch.device('meta'):
        return timm.create_model(name, **_small_kwargs(name))


def test_model_contract(model_name):
    name = model_name
    model, (c, h, w) = _small(name)
    x = torch.randn(2, c, h, w)
    out = model(x)
    assert out.shape == (2, model.num_classes)
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    # Sparsifiner's predictors learn only from attention distillation: its mask is detached (Eq. 3–4)
    distilled = predictor_parameter_names(model)
    missing = [n for n, p in model.named_parameters() if p.grad is None and n not in distilled]
    assert not missing, f"parameters without gradient: {missing[:5]}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

    with torch.no_grad():
        feats = model.forward_features(x)
        # token models end in their width; convolutional nets return NCHW maps, as timm's CNNs do
        width = feats.shape[1] if name.startswith('wrn_') else feats.shape[-1]
        assert feats.shape[0] == 2 and width == model.num_features
        pre = model.forward_head(feats, pre_logits=True)
        assert pre.shape == (2, model.num_features)
        model.reset_classifier(0)
        assert model(x).shape == (2, model.num_features)
        model.reset_classifier(7)
        assert model(x).shape == (2, 7)
        assert model.get_classifier() is model.head
    names = dict(model.named_parameters())
    embeddings = {n for n in names if n.split('.')[-1] in ('pos_embed', 'cls_token') or n.startswith('pos_embeds.')}
    # what timm's param groups would not exempt by shape (embeddings) must be listed; nothing unknown is
    assert embeddings <= model.no_weight_decay() <= set(names)


def test_forward_intermediates_follow_timm(model_name):
    """timm's feature interface: one intermediate per feature_info entry, of its width and reduction;
    the final output is forward_features'; index selection, NLC, stop_early and features_only agree."""
    name = model_name
    model, (c, h, w) = _small(name)
    model.eval()
    x = torch.randn(2, c, h, w)
    info = model.feature_info
    with torch.no_grad():
        final, maps = model.forward_intermediates(x)
        torch.testing.assert_close(final, model.forward_features(x))
        assert len(maps) == len(info)
        for fmap, entry in zip(maps, info):
            assert fmap.shape == (2, entry['num_chs'], math.ceil(h / entry['reduction']),
                                  math.ceil(w / entry['reduction'])), (fmap.shape, entry)
        last_two = model.forward_intermediates(x, indices=[-2, -1], intermediates_only=True, stop_early=True)
        assert len(last_two) == 2
        torch.testing.assert_close(last_two[0], maps[-2])
        torch.testing.assert_close(last_two[1], maps[-1])
        # stopped after the first block / stage, with the final output too (WRN's final BN-ReLU, 4x wider than
        # the first group, failed on it)
        early_final, early = model.forward_intermediates(x, indices=[0], stop_early=True)
        assert early_final.shape[0] == 2 and torch.isfinite(early_final).all()
        torch.testing.assert_close(early[0], maps[0])
        nlc = model.forward_intermediates(x, indices=1, output_fmt='NLC', intermediates_only=True)[0]
        torch.testing.assert_close(nlc, maps[-1].flatten(2).transpose(1, 2))
        with pytest.raises(ValueError, match='output_fmt'):
            model.forward_intermediates(x, output_fmt='NHWC')

        with torch.device('meta'):
            features = timm.create_model(name, features_only=True, out_indices=(0, -1), **_small_kwargs(name))
        kept = features.model.state_dict()                 # pruned: later blocks / stages and the head are gone
        assert set(kept) < set(model.state_dict())
        _with_initial_weights(features.model, name)        # the weights `model` has
        features.eval()
        got = features(x)
        assert features.feature_info.channels() == [info[0]['num_chs'], info[-1]['num_chs']]
        torch.testing.assert_close(got[0], maps[0])
        torch.testing.assert_close(got[1], maps[-1])


def test_features_only_with_default_out_indices(model_name):
    """`features_only=True` alone (timm's default out_indices: the last 3 blocks, SOFT's last 4 stages) builds
    and runs for every model, a variant shallower than that included; the predictors of a Sparsifiner
    model are shaped at construction inside timm's wrapper too (no lazy-parameter warning)."""
    name = model_name
    import warnings
    size, kwargs = _small_size(name), _small_kwargs(name)
    info = _structure(name).feature_info
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with torch.device('meta'):
            features = timm.create_model(name, features_only=True, **kwargs)
        _with_initial_weights(features.model, name)
        features.eval()
        with torch.no_grad():
            maps = features(torch.randn(1, *size))
    last = 4 if name.startswith('soft') else 3
    assert len(maps) == min(last, len(info))
    assert features.feature_info.channels() == [e['num_chs'] for e in info][-len(maps):]


def test_features_only_of_a_variant_made_shallow():
    features = timm.create_model('crate_digits', depth=2, features_only=True)      # default asks for 3
    assert len(features(torch.randn(1, 1, 8, 8))) == 2


@pytest.mark.parametrize('name', ['crate_digits', 'soft_digits', 'wrn_10_2_digits', 'swmlp_digits'])
def test_grad_checkpointing_gives_the_same_gradients(name, monkeypatch):
    import structformer.models.base as base
    torch.manual_seed(0)
    model = timm.create_model(name).eval()
    x = torch.randn(3, 1, 8, 8)
    model(x).square().sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    calls = []
    monkeypatch.setattr(base, 'checkpoint', lambda *a, **k: calls.append(1) or torch.utils.checkpoint.checkpoint(*a, **k))
    model.set_grad_checkpointing(True)
    model(x).square().sum().backward()
    assert calls, 'set_grad_checkpointing(True) checkpointed nothing'        # WRN ignored the flag before
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[n], msg=n)


def test_grad_checkpointing_leaves_a_training_step_unchanged_batchnorm_included():
    """A training step with checkpointing changes the model as one without: same gradients and the same
    BatchNorm running statistics (the recomputation updated WRN's a second time, and counted the batch twice)."""
    import copy
    torch.manual_seed(0)
    plain = timm.create_model('wrn_10_2_digits').double().train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.set_grad_checkpointing(True)
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    for model in (plain, checkpointed):
        model(x).square().sum().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    buffers = dict(checkpointed.named_buffers())
    assert any('running_var' in n for n in buffers)
    for name, value in plain.named_buffers():
        torch.testing.assert_close(buffers[name], value, msg=name)


@pytest.mark.parametrize('name', MODELS)
def test_group_matcher_gives_one_group_per_block_for_layer_decay(name):
    """timm's `group_parameters` (layer-wise lr decay): embeddings first, one group per block in order, the head
    last. Without `group_matcher`, timm falls back to chunks of parameters that split blocks."""
    import re

    import timm.optim
    from timm.models import group_parameters
    model = _structure(name)                   # names and groups only: the optimiser allocates no state yet
    groups = group_parameters(model, model.group_matcher())
    group_of = {n: i for i, names in groups.items() for n in names}
    assert set(group_of) == {n for n, _ in model.named_parameters()}
    embeddings = [n for n in group_of if re.match(r'(stem|patch_embed|tok_embed|cls_token|pos_embed)', n)]
    assert embeddings and all(group_of[n] == 0 for n in embeddings), embeddings
    assert all(group_of[n] == max(groups) for n in group_of if n.startswith('head.'))
    block = lambda n: re.match(r'(blocks\.\d+|stages\.\d+\.blocks\.\d+|stages\.\d+\.\d+)\.', n)
    by_block = {}
    for n, i in group_of.items():
        if block(n):
            by_block.setdefault(block(n).group(1), set()).add(i)
    assert by_block and all(len(ids) == 1 for ids in by_block.values()), by_block     # a block is never split
    order = [min(ids) for _, ids in sorted(by_block.items(), key=lambda kv: [int(t) for t in re.findall(r'\d+', kv[0])])]
    assert order == sorted(order) and len(set(order)) == len(order)
    optimizer = timm.optim.create_optimizer_v2(model, 'adamw', lr=1e-3, layer_decay=0.75)
    assert len({g['lr_scale'] for g in optimizer.param_groups}) == len(groups)


@pytest.mark.parametrize('name', ['crate_digits', 'swmlp_digits', 'wrn_10_2_digits', 'mixer_digits', 'soft_digits'])
def test_drop_path_rate_is_stochastic_depth_growing_over_the_blocks(name):
    """timm's `drop_path_rate` (train.py --drop-path): 0 at the first block, the rate at the last, off in eval."""
    from timm.layers import DropPath
    torch.manual_seed(0)
    model = timm.create_model(name, drop_path_rate=0.5)
    rates = [m.drop_prob for m in model.modules() if isinstance(m, DropPath)]
    assert rates and max(rates) == pytest.approx(0.5) and rates == sorted(rates)
    plain = timm.create_model(name)
    plain.load_state_dict(model.state_dict())
    x = torch.randn(4, 1, 8, 8)
    model.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))
        model.train()                                      # features: some heads are zero-initialised
        assert not torch.allclose(model.forward_features(x), model.forward_features(x))
    if name in ('crate_digits', 'swmlp_digits', 'wrn_10_2_digits'):         # ours; the others build timm's blocks
        with pytest.raises(ValueError, match='drop_path_rate'):
            timm.create_model(name, drop_path_rate=1.5)


# the registered layouts test_compile.py does not compile (it traces every *_digits model): one model of each, at
# the small size, the deep ones cut to a few blocks (tracing time grows with the blocks; a graph break is a property
# of a block's code). Before: the first six registered models, all CRATE, 60 s for one layout.
EAGER_COMPILED = {'crate_tiny_patch16_224': {'depth': 2}, 'soft_tiny_official_224': {'depths': (1, 1, 1, 1)},
                  'sparse_mixer_b16_224': {'depth': 2}, 'rp_mixer_b16_224': {'depth': 2}, 'swmlp_cifar': {},
                  'wrn_16_4': {}}


@pytest.mark.parametrize('name', EAGER_COMPILED)
def test_torch_compile_eager_runs(name):
    model = timm.create_model(name, **_small_kwargs(name), **EAGER_COMPILED[name])
    c, h, w = _small_size(name)
    model.eval()
    x = torch.randn(1, c, h, w)
    compiled = torch.compile(model, backend='eager')
    torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize('name,expected', [('crate_tiny_patch16_224', 6.09e6), ('crate_small_patch16_224', 13.12e6),
                                           ('crate_base_patch16_224', 22.80e6), ('crate_large_patch16_224', 77.64e6)])
def test_crate_parameter_counts_match_table1(name, expected):
    with torch.device('meta'):
        model = timm.create_model(name)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - expected) / expected < 0.005, count


def test_crate_wrong_input_gives_clear_error():
    model = timm.create_model('crate_digits')
    with pytest.raises(ValueError, match='in_chans=1'):
        model(torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match='img_size'):
        model(torch.randn(1, 1, 16, 16))


# one model of each size-dependence the families have (the 224-px ones at their cheap side): digits / MNIST / CIFAR
# models and the Tiny 224s of each SOFT variant (its public-code layout and Linformer baseline are size-bound)
SIZE_PROBES = [n for n in MODELS if not n.endswith('_224') and n != 'swmlp_cifar'] + [
    'crate_tiny_patch16_224', 'soft_tiny_224', 'soft_tiny_linformer_224', 'soft_tiny_official_224',
    'sparsifiner_deit_tiny_patch16_224']


@pytest.mark.parametrize('name', SIZE_PROBES)
def test_a_model_built_for_one_input_size_says_so_to_timm(name):
    """timm's `fixed_input_size`: a model that refuses images of another size than it was built for says True
    (as timm's MLP-Mixer does), so that timm's scripts (`resolve_input_data_config`, validate.py --img-size) refuse
    the size, or build the model for it, before the first batch, instead of resizing the images to a size the model
    then refuses mid-run; a model that takes any size says False. Built at its cheap size, fed twice that side."""
    from timm.data import resolve_input_data_config
    from timm.models import get_model_input_config
    model, (c, h, w) = _small(name)
    try:
        with torch.no_grad():
            model.eval()(torch.randn(1, c, 2 * h, 2 * w))
        takes_another_size = True
    except (ValueError, RuntimeError, AssertionError):
        takes_another_size = False
    assert get_model_input_config(model)['fixed_input_size'] == (not takes_another_size)
    if not takes_another_size:
        with pytest.raises(ValueError, match='requires'):
            resolve_input_data_config(model, {'img_size': 2 * h})
        built = timm.create_model(name, img_size=2 * h).eval()          # what the request must build instead
        with torch.no_grad():
            assert built(torch.randn(1, c, 2 * h, 2 * w)).shape == (1, built.num_classes)


@pytest.mark.parametrize('name, kwargs, fixed', [
    ('soft_digits', {'pos_embed': True}, True),                      # the public code's positions, by option
    ('soft_digits', {'attn': 'linformer'}, True),                    # Linformer's E, F per token, by option
    ('soft_tiny_official_224', {'pos_embed': False, 'img_size': 32}, False)])                # takes any size
def test_soft_says_whether_it_is_size_bound_by_what_it_was_built_with(name, kwargs, fixed, tmp_path):
    """SOFT's fixed_input_size followed the registered name ('official' or 'linformer' in it): soft_digits built
    with pos_embed=True or attn='linformer' said False (timm's resolve_input_data_config then took another size, and
    the forward failed inside the stage: 'The size of tensor a (256) must match ... (64)'), an official layout
    without positions said True. The built model's trait says it, the forward refuses another size in one line,
    and an export's config.json (timm's save_config_for_hf reads the trait) carries it."""
    from timm.data import resolve_input_data_config
    from timm.models import get_model_input_config
    from timm.models._hub import save_config_for_hf
    model = timm.create_model(name, **kwargs).eval()
    c, side = model.in_chans, kwargs.get('img_size', 8)
    assert get_model_input_config(model)['fixed_input_size'] is fixed
    with torch.no_grad():
        if fixed:
            with pytest.raises(ValueError, match=rf'SoftNet expects images \[B, {c}, {side}, {side}\]'):
                model(torch.randn(1, c, 2 * side, 2 * side))
            with pytest.raises(ValueError, match='requires'):
                resolve_input_data_config(model, {'img_size': 2 * side})
        else:
            assert model(torch.randn(1, c, 2 * side, 2 * side)).shape == (1, model.num_classes)
    save_config_for_hf(model, str(tmp_path / 'config.json'))
    assert json.loads((tmp_path / 'config.json').read_text())['pretrained_cfg']['fixed_input_size'] is fixed


def test_pretrained_request_is_refused_without_download():
    with pytest.raises(ValueError, match='no pretrained weights'):
        timm.create_model('crate_digits', pretrained=True)


def test_mssa_and_ista_drop_into_timm_vision_transformer():
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=10,
                              attn_layer=MSSA, mlp_layer=ISTA)
    assert isinstance(model.blocks[0].attn, MSSA) and isinstance(model.blocks[0].mlp, ISTA)
    out = model(torch.randn(2, 3, 32, 32))
    out.sum().backward()
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    assert model.blocks[0].mlp.weight.grad is not None


def test_crate_variants_build_and_differ():
    base = timm.create_model('crate_digits')
    tied = timm.create_model('crate_digits', tied_output=True)
    mm = timm.create_model('crate_digits', sparse_step='mm')
    assert tied.blocks[0].attn.proj is None and base.blocks[0].attn.proj is not None
    assert mm.blocks[0].mlp.step == 'mm'
    x = torch.randn(2, 1, 8, 8)
    for m in (tied, mm):
        assert torch.isfinite(m(x)).all()


@pytest.mark.parametrize('name', ['wrn_10_2_digits', 'soft_digits'])
def test_pruning_the_last_stage_drops_the_final_norm_of_its_width(name):
    """timm's default prune_norm=False kept a final norm sized for the last stage: the next forward failed."""
    model = timm.create_model(name).eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        before = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
        model.prune_intermediate_layers([0, 1])
        after = model.forward_intermediates(x, indices=[0, 1], norm=True, intermediates_only=True)
        out = model.forward_features(x)
        width = out.shape[1] if name.startswith('wrn_') else out.shape[-1]      # NCHW from the CNN
        assert width == model.num_features == model.feature_info[1]['num_chs']
    assert isinstance(model.norm, torch.nn.Identity)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match='prune_head=False'):
        timm.create_model(name).prune_intermediate_layers([0], prune_head=False)


def test_pruning_a_constant_width_model_keeps_its_norm_and_width():
    model = timm.create_model('swmlp_digits').eval()                    # feature maps of embed_dim channels
    width = model.num_features                                          # its flat vector is wider
    model.prune_intermediate_layers([0])
    assert model.num_features == width and not isinstance(model.norm, torch.nn.Identity)
    with torch.no_grad():
        assert model.forward_features(torch.randn(2, 1, 8, 8)).shape[-1] == width


def test_wrn_global_pool_empty_returns_the_unpooled_map():
    """As timm's ResNets: global_pool='' leaves the map [B, C, H, W] (the head, if any, at every position)."""
    model = timm.create_model('wrn_10_2_digits', num_classes=0, global_pool='').eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        fmap = model(x)
        assert fmap.shape == (2, 128, 2, 2)
        torch.testing.assert_close(fmap, model.forward_features(x))          # NCHW, as timm's CNNs
        model.reset_classifier(5, 'avg')
        assert model(x).shape == (2, 5)
        model.reset_classifier(5, '')
        assert model(x).shape == (2, 5, 2, 2)


@pytest.mark.parametrize('name, modules', [('crate_digits', 'blocks'), ('soft_digits', 'stages')])
def test_prune_intermediate_layers_keeps_what_the_features_need(name, modules):
    """timm's pruning: modules after the last index taken go, the head goes, the kept features are unchanged."""
    model = timm.create_model(name).eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        before = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
        taken = model.prune_intermediate_layers([0, 1], prune_norm=True)
        after = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    assert taken == [0, 1] and len(getattr(model, modules)) == 2
    assert model.num_classes == 0 and isinstance(model.head, torch.nn.Identity) and isinstance(model.norm, torch.nn.Identity)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize('name', ['soft_digits', 'wrn_10_2_digits'])
def test_hook_feature_extractor_hooks_modules_that_run(name):
    """timm's `feature_cls='hook'` hooks `feature_info[i]['module']`. SOFT and WRN named their stages, which their
    forward never calls (it runs a stage's parts through run_block), so the extractor returned an empty list. It now
    hooks each stage's last block: WRN's stage maps, SOFT's stage tokens (stage 4 with its cls token first)."""
    torch.manual_seed(0)
    model = timm.create_model(name).eval()
    features = timm.create_model(name, features_only=True, feature_cls='hook').eval()
    features.load_state_dict({f'body.{k}': v for k, v in model.state_dict().items()
                              if f'body.{k}' in features.state_dict()})
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        got = features(x)
        want = model.forward_intermediates(x, output_fmt='NCHW' if name.startswith('wrn') else 'NLC',
                                           intermediates_only=True)
    assert len(got) == len(want) == len(model.feature_info)
    for g, w in zip(got, want):
        torch.testing.assert_close(g[:, -w.shape[1]:] if g.dim() == 3 else g, w)


@pytest.mark.parametrize('name', ['crate_digits', 'mixer_digits', 'swmlp_digits', 'soft_digits', 'sparsifiner_digits',
                                  'wrn_10_2_digits', 'gpt2_byte_tiny'])
def test_create_model_takes_timm_device_and_dtype(name):
    """timm.create_model passes `device` / `dtype` to the model (timm's own ViT and ResNet build there); every
    family of ours raised TypeError on them. The model built in float64 is the float32 one, converted (same seed)."""
    torch.manual_seed(0)
    ref = timm.create_model(name).eval()
    torch.manual_seed(0)
    model = timm.create_model(name, dtype=torch.float64).eval()
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(t.dtype == torch.float64 for t in tensors if t.is_floating_point())
    size = model.pretrained_cfg['input_size']
    if hasattr(model, 'vocab_size'):
        x = torch.randint(0, 256, (2, 8))
        x64 = x
    else:
        x = torch.randn(2, *size)
        x64 = x.double()
    with torch.no_grad():
        torch.testing.assert_close(model(x64), ref(x).double(), rtol=1e-4, atol=1e-5)
    meta = timm.create_model(name, device='meta', dtype=torch.bfloat16)
    assert all(t.device.type == 'meta' for t in meta.parameters())
    assert all(t.dtype == torch.bfloat16 for t in meta.parameters())
    assert '_model_args' not in vars(meta) or not {'device', 'dtype'} & set(meta._model_args)
    features = timm.create_model(name, features_only=True, device='meta')
    assert all(t.device.type == 'meta' for t in features.parameters())


@pytest.mark.parametrize('name', ['smixer_cifar', 'rp_smixer_cifar', 'mixer_cifar', 'rp_mixer_cifar'])
def test_cifar_mixers_built_at_another_size_mix_their_own_patches(name):
    """The CIFAR Mixers' S = S₀ = 64 holds at 32 px; built at another img_size (timm's scripts pass --img-size) they
    kept S = 64, so a skip layer remapped the new patch count to 64 tokens, which have no grid: forward_intermediates
    refused its default NCHW. At 32 px the model is the one with S = 64 given explicitly."""
    torch.manual_seed(0)
    default = timm.create_model(name)
    torch.manual_seed(0)
    explicit = timm.create_model(name, num_tokens=64)
    shapes = [{k: v.shape for k, v in m.state_dict().items()} for m in (default, explicit)]
    assert shapes[0] == shapes[1]
    model = timm.create_model(name, img_size=(16, 32)).eval()
    assert model.num_tokens == model.patch_tokens == 32
    maps = model.forward_intermediates(torch.randn(1, 3, 16, 32), intermediates_only=True)
    assert maps[-1].shape == (1, model.embed_dim, 4, 8)


@pytest.mark.parametrize('name', ['crate_digits', 'wrn_10_2_digits'])
def test_pretrained_in_chans_change_says_what_was_done(name, tmp_path, caplog):
    """pretrained=True with another in_chans: our filter adapts the first layer (timm's adapt_input_conv) and says so;
    timm's loader then found the adapted weights fitting and warned 'Loading unchanged', the opposite of what
    happened."""
    import logging
    from safetensors.torch import save_file
    from timm.models._manipulate import adapt_input_conv
    source = timm.create_model(name)
    path = tmp_path / 'w.safetensors'
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    with caplog.at_level(logging.INFO):
        model = timm.create_model(name, pretrained=True, in_chans=3, pretrained_cfg_overlay=dict(file=str(path)))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert any('input channels 1 -> 3' in r.getMessage() for r in caplog.records)
    if name.startswith('wrn'):
        torch.testing.assert_close(model.stem.weight, adapt_input_conv(3, source.stem.weight.detach(), base_chans=1))


class _CpuTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (dtype, shape) of every tensor an aten op makes on the CPU while active."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == 'cpu':
                self.made.append((t.dtype, tuple(t.shape)))
        return out


# the largest variant of each family (77M-113M weights): on 'meta' none of them may be made on the CPU first
@pytest.mark.parametrize('name', ['crate_large_patch16_224', 'soft_huge_official_224', 'softpp_huge_official_224',
                                  'sparsifiner_deit_small_patch16_224', 'sparse_mixer_b16_224', 'rp_mixer_b16_224',
                                  'swmlp_cifar', 'wrn_28_10', 'gpt2_byte_small'])
def test_create_model_on_meta_makes_no_weight_on_the_cpu(name):
    """timm.create_model(name, device='meta') builds on the meta device, as timm's own models do: no weight or buffer
    of the model is ever made on the CPU (ours were built on the CPU, all 87M weights of SOFT-Huge filled there by
    their initialisers, then moved). The low-rank transform then factorises the meta model without the CPU too."""
    from structformer import factorize
    made = _CpuTensors()
    with made:
        model = timm.create_model(name, device='meta', dtype=torch.bfloat16)
        if name == 'wrn_28_10':
            model = factorize(model, 0.25)
    tensors = dict(model.named_parameters(), **dict(model.named_buffers()))
    assert {t.device.type for t in tensors.values()} == {'meta'}
    shapes = {tuple(t.shape) for t in tensors.values() if t.is_floating_point() and t.numel() > 1}
    on_cpu = sorted({shape for dtype, shape in made.made if dtype.is_floating_point and shape in shapes})
    assert not on_cpu, f"{name}: weights of shapes {on_cpu[:4]} were made on the CPU"
