"""Mixer-family models: timm parity, the paper's block equations, RP permutations, reload, SW-MLP masks."""
import json
import subprocess
import sys

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.mlp_mixer import MlpMixer

from structformer.cli import main
from structformer.layers.linear import MaskedLinear, PKLinear
from structformer.models.mixer import SparseMixer, SWMLP

D = torch.float64


def test_mixer_equals_timm_mlp_mixer_with_copied_weights():
    """Our MLP-Mixer (PK layers, J_c token mixing) is timm's MlpMixer: same state-dict names, same outputs."""
    torch.manual_seed(0)
    reference = MlpMixer(img_size=32, patch_size=4, num_classes=10, embed_dim=24, num_blocks=2).double().eval()
    ours = SparseMixer(img_size=32, patch_size=4, num_classes=10, embed_dim=24, depth=2,
                       token_mlp_dim=12, channel_mlp_dim=96, norm_eps=1e-6).double().eval()
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in reference.state_dict().items()}   # non-zero head too
    reference.load_state_dict(state)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith(('perm_in', 'perm_out')) for k in missing)
    x = torch.randn(3, 3, 32, 32, dtype=D)
    torch.testing.assert_close(ours(x), reference(x))


def _s_mixer_block_by_the_equations(block, X):
    """Eq. S.7–S.8 written out: U = X + φ(W LN(X)), Y = U + φ(LN(U) Vᵀ), with W, V the PK layers' weights."""
    W, bW = block.mlp_tokens.fc1.weight, _bias(block.mlp_tokens.fc1)
    V, bV = block.mlp_channels.fc1.weight, _bias(block.mlp_channels.fc1)
    U = X + F.gelu(W @ block.norm1(X) + bW[:, None])
    return U + F.gelu(block.norm2(U) @ V.t() + bV)


def _bias(layer):
    """The layer's bias, or zeros where it has none (the S-Mixer's default: Eq. S.7–S.8 have no bias)."""
    return layer.bias if layer.bias is not None else torch.zeros(layer.weight.shape[0], dtype=layer.weight.dtype)


@pytest.mark.parametrize('mixing_bias', [None, True])
def test_s_mixer_block_follows_equations_s7_s8(mixing_bias):
    torch.manual_seed(1)
    model = SparseMixer(img_size=8, patch_size=2, in_chans=1, embed_dim=6, depth=1, mlp_ratio=None,
                        mixing_bias=mixing_bias).double()
    block = model.blocks[0]
    if mixing_bias:
        with torch.no_grad():                      # non-zero, so that the equations' bias terms are exercised
            block.mlp_tokens.fc1.bias.normal_()
            block.mlp_channels.fc1.bias.normal_()
    X = torch.randn(2, 16, 6, dtype=D)
    torch.testing.assert_close(block(X), _s_mixer_block_by_the_equations(block, X))


def test_first_block_maps_s0_to_s_with_the_skip_layer():
    """S ≠ S₀: U = LN(W̃X) + φ(W LN(X)) (Eq. S.14–S.15), W ∈ R^{S×S₀}."""
    torch.manual_seed(2)
    model = SparseMixer(img_size=8, patch_size=2, in_chans=1, embed_dim=6, depth=2, num_tokens=10).double()
    block = model.blocks[0]
    assert block.skip is not None and model.blocks[1].skip is None
    X = torch.randn(2, 16, 6, dtype=D)
    assert block.mlp_tokens.fc1.bias is None and block.mlp_channels.fc1.bias is None      # S.7–S.8: no bias
    W, bW = block.mlp_tokens.fc1.weight, _bias(block.mlp_tokens.fc1)
    U = block.skip_norm(block.skip.weight @ X) + F.gelu(W @ block.norm1(X) + bW[:, None])
    V, bV = block.mlp_channels.fc1.weight, _bias(block.mlp_channels.fc1)
    torch.testing.assert_close(block(X), U + F.gelu(block.norm2(U) @ V.t() + bV))
    assert model(torch.randn(2, 1, 8, 8, dtype=D)).shape == (2, 10)
    assert model.forward_features(torch.randn(2, 1, 8, 8, dtype=D)).shape == (2, 10, 6)
    with pytest.raises(ValueError, match="output_fmt='NCHW' needs num_tokens"):
        model.forward_intermediates(torch.randn(2, 1, 8, 8, dtype=D))
    assert model.forward_intermediates(torch.randn(2, 1, 8, 8, dtype=D), output_fmt='NLC')[1][0].shape == (2, 10, 6)


def test_rp_mixer_permutations_are_fresh_per_layer_frozen_and_only_in_token_mixing():
    model = timm.create_model('rp_mixer_digits')
    token_perms = [b.mlp_tokens.fc1.perm_in for b in model.blocks] + [b.mlp_tokens.fc2.perm_out for b in model.blocks]
    assert len({tuple(p.tolist()) for p in token_perms}) == len(token_perms)        # all different
    assert all(b.mlp_channels.fc1.perm_in_kind == 'identity' for b in model.blocks)
    names = {n for n, _ in model.named_parameters()}
    assert not any('perm' in n for n in names)                                      # buffers, never trained
    assert all(b.mlp_tokens.fc1.perm_in.dtype == torch.int64 for b in model.blocks)
    channels_too = timm.create_model('rp_mixer_digits', rp_channels=True)
    assert channels_too.blocks[0].mlp_channels.fc1.perm_in_kind == 'random'
    # same weights, other structure: RP is not the Mixer
    plain = timm.create_model('mixer_digits')
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if 'perm' not in k}, strict=False)
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        for m in (model, plain):
            m.head.weight.normal_()
        plain.head.weight.copy_(model.head.weight)
        assert not torch.allclose(model(x), plain(x))


def test_rp_mixer_run_reloads_to_identical_outputs_in_a_fresh_process(tmp_path):
    out = tmp_path / 'rp'
    assert main(['train', '--model', 'rp_mixer_digits', '--model-kwargs', 'perm_seed=3', '--data', 'digits',
                 '--epochs', '1', '--limit-train-batches', '2', '--output', str(out), '--no-progress']) == 0
    code = ("import sys, torch, json; from structformer.train import load_model; "
            "model, _ = load_model(sys.argv[1]); model.eval(); torch.manual_seed(0); "
            "x = torch.rand(4, 1, 8, 8); print(json.dumps(model(x).tolist()))")
    fresh = subprocess.run([sys.executable, '-c', code, str(out)], capture_output=True, text=True, check=True)
    from structformer.train import load_model
    model, _ = load_model(out)
    model.eval()
    torch.manual_seed(0)
    x = torch.rand(4, 1, 8, 8)
    with torch.no_grad():
        here = model(x)
    # the same weights and permutations in another process: equal within float32 rounding (its kernel choices could
    # differ, so not bitwise); a permutation drawn again would change the logits entirely
    torch.testing.assert_close(torch.tensor(json.loads(fresh.stdout)), here, rtol=1e-5, atol=1e-6)
    assert model.blocks[0].mlp_tokens.fc1.perm_in.tolist() != list(range(32 * 16))
    # both processes rebuild with perm_seed=3, so the above would pass with shuffles drawn again from the seed: the
    # weights file itself carries them, and they win over another model's seeded ones
    from structformer.train.checkpoint import load_checkpoint
    weights, _, _ = load_checkpoint(out)
    saved = {k: v for k, v in weights.items() if k.endswith(('perm_in', 'perm_out'))}
    assert len(saved) == 8 and all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    other = timm.create_model('rp_mixer_digits', perm_seed=0)
    assert not torch.equal(other.blocks[0].mlp_tokens.fc1.perm_in, saved['blocks.0.mlp_tokens.fc1.perm_in'])
    other.load_state_dict(weights)
    other.eval()
    with torch.no_grad():
        torch.testing.assert_close(other(x), here)


def test_sw_mlp_masked_weights_stay_zero_through_training(tmp_path):
    out = tmp_path / 'sw'
    assert main(['train', '--model', 'swmlp_digits', '--data', 'digits', '--epochs', '1', '--limit-train-batches', '3',
                 '--weight-decay', '0.5', '--decay-everything', '--output', str(out), '--no-progress']) == 0
    from structformer.train import load_model
    model, _ = load_model(out)
    layers = [m for m in model.modules() if isinstance(m, MaskedLinear)]
    assert layers
    fresh = timm.create_model('swmlp_digits')
    for layer, initial in zip(layers, [m for m in fresh.modules() if isinstance(m, MaskedLinear)]):
        assert torch.equal(layer.mask, initial.mask)
        assert (layer.weight[~layer.mask] == 0).all()
        assert not torch.equal(layer.weight[layer.mask], initial.weight[initial.mask])


def test_sw_mlp_width_and_density():
    model = SWMLP(img_size=8, patch_size=2, in_chans=1, embed_dim=8, depth=2, density=0.25, mlp_ratio=2.0)
    assert model.width == 128 and model.blocks[0].fc1.out_features == 256
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize('kwargs,match', [
    (dict(permutation='shuffle'), "permutation='shuffle': accepted 'mixer'"),
    (dict(global_pool='token'), "a Mixer: its head pools by the token mean .*no cls token"),
    (dict(global_pool='max'), "no max pooling; accepted 'avg' or ''"),
    (dict(num_tokens=0), 'num_tokens must be >= 1'),
])
def test_mixer_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseMixer(img_size=8, patch_size=2, in_chans=1, **kwargs)


def test_reset_classifier_refuses_a_cls_pool():
    model = timm.create_model('mixer_digits')
    with pytest.raises(ValueError, match="no cls token"):
        model.reset_classifier(5, 'token')
    model.reset_classifier(5, 'avg')
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 5)


def test_sw_mlp_refuses_a_pool_by_saying_it_pools_nothing():
    """SW-MLP's head reads the whole flat vector: a refused pool says that, not the Mixers' 'no cls token'."""
    model = timm.create_model('swmlp_digits')
    for pool in ('token', 'max'):
        with pytest.raises(ValueError, match="SWMLP: its head classifies the whole flat vector"):
            model.reset_classifier(5, pool)
    with pytest.raises(ValueError, match="SW-MLP: its head classifies the whole flat vector"):
        SWMLP(img_size=8, patch_size=2, in_chans=1, embed_dim=8, depth=1, global_pool='max')


def test_wrong_image_names_the_expected_shape():
    model = timm.create_model('mixer_digits')
    with pytest.raises(ValueError, match=r'expects images \[B, 1, 8, 8\]'):
        model(torch.randn(2, 1, 16, 16))
    with pytest.raises(ValueError, match=r'density must be in \(0, 1\]'):
        timm.create_model('swmlp_digits', density=1.5)


def test_pk_layers_carry_the_mixer():
    model = timm.create_model('mixer_digits')
    assert isinstance(model.blocks[0].mlp_tokens.fc1, PKLinear)
    assert model.blocks[0].mlp_tokens.fc1.perm_in_kind == 'transpose'


def test_features_only_of_a_mixer_with_another_token_count_gives_its_tokens():
    """S ≠ S₀ has no patch grid: timm's feature getter asked for NCHW, which forward_intermediates refuses, so
    `features_only=True` failed for every such Mixer; it now hands back the token tables [B, S, C]."""
    torch.manual_seed(0)
    model = timm.create_model('mixer_digits', num_tokens=8).eval()
    features = timm.create_model('mixer_digits', num_tokens=8, features_only=True, out_indices=(0, -1)).eval()
    features.model.load_state_dict({k: v for k, v in model.state_dict().items() if k in features.model.state_dict()})
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        got = features(x)
        want = model.forward_intermediates(x, indices=(0, -1), output_fmt='NLC', intermediates_only=True)
    assert [tuple(g.shape) for g in got] == [(2, 8, 32)] * 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    grid = timm.create_model('mixer_digits', features_only=True, out_indices=(-1,)).eval()   # S = S₀: maps, as before
    assert grid(x)[0].shape == (2, 32, 4, 4)


def test_sw_mlp_hook_features_are_the_tables_feature_info_describes():
    """timm's hook feature extractor (`feature_cls='hook'`) took SW-MLP's block outputs as flat [B, m] vectors while
    feature_info said C channels; the blocks now carry the [B, S₀, C] table (as the Mixers' hooks give [B, S, C]).
    The model's function is unchanged: the same weights through the flat-vector equations (Eq. S.16-S.17) give
    the same logits, and the hook features equal forward_intermediates' tables."""
    torch.manual_seed(0)
    model = timm.create_model('swmlp_digits', mlp_ratio=2.0).double().eval()
    with torch.no_grad():
        model.head.weight.normal_()
    x = torch.randn(3, 1, 8, 8, dtype=D)
    flat = model.stem(x).flatten(1)                                      # the paper's m-vector, block by block
    for block in model.blocks:
        flat = flat + block.act(block.fc2(block.act(block.fc1(block.norm(flat)))))
    torch.testing.assert_close(model(x), model.head(model.norm(flat)))
    hooks = timm.create_model('swmlp_digits', mlp_ratio=2.0, features_only=True, feature_cls='hook',
                              out_indices=(0, 1)).double().eval()
    missing, _ = hooks.load_state_dict({f'body.{k}': v for k, v in model.state_dict().items()}, strict=False)
    assert not missing
    got = hooks(x)
    channels = hooks.feature_info.channels()
    assert [tuple(t.shape) for t in got] == [(3, 16, c) for c in channels] == [(3, 16, 8)] * 2
    tables = model.forward_intermediates(x, indices=(0, 1), output_fmt='NLC', intermediates_only=True)
    for a, b in zip(got, tables):
        torch.testing.assert_close(a, b)
    normed = model.forward_intermediates(x, indices=(1,), norm=True, output_fmt='NLC', intermediates_only=True)[0]
    torch.testing.assert_close(normed.flatten(1), model.forward_features(x))


def test_sw_mlp_masks_are_todays_draws_and_are_not_drawn_on_meta():
    """A mask is Bernoulli(p) from its seed alone (a reference draw here, so a change to the draw fails); built on
    the meta device it is not drawn (it cost ~1 s per swmlp_cifar in `structformer models`), yet the count of the
    weights it keeps is the real one."""
    from structformer.models.inventory import effective_parameter_count
    model = timm.create_model('swmlp_digits', mask_seed=3, mlp_ratio=2.0)
    for i, block in enumerate(model.blocks):
        for layer, seed in ((block.fc1, 3000 + 10 * i), (block.fc2, 3000 + 10 * i + 1)):
            drawn = torch.rand(layer.out_features, layer.in_features,
                               generator=torch.Generator().manual_seed(seed)) < layer.density
            assert torch.equal(layer.mask, drawn)
            assert torch.equal(layer.weight == 0, ~drawn) and layer.kept_weights() == int(drawn.sum())
    with torch.device('meta'):
        meta = timm.create_model('swmlp_digits', mask_seed=3, mlp_ratio=2.0)
    assert all(b.fc1.mask.is_meta and b.fc2.mask.is_meta for b in meta.blocks)
    assert effective_parameter_count(meta) == effective_parameter_count(model) < sum(p.numel() for p in
                                                                                      model.parameters())


def test_single_layer_blocks_survive_timm_create_model():
    """timm.create_model drops every None kwarg, so `mlp_ratio=None` (S-Mixer / Eq. S.16 blocks) silently kept a
    registered model's γ: the swmlp_cifar10 recipe (mlp_ratio: null) trained 8 two-layer γ = 2 blocks (4× the weights,
    2× its Ω = 2^18) and compare's digits "S-Mixer" was mixer_digits' MLP-Mixer. mlp_ratio=0 says it through timm;
    build_model refuses KEY=None by name."""
    from structformer.models.factory import build_model
    from structformer.models.inventory import effective_parameter_count
    from structformer.train.recipes import load_recipe
    with torch.device('meta'):
        assert timm.create_model('swmlp_cifar', embed_dim=8, depth=1).blocks[0].fc2 is not None      # its γ = 2
        sw = timm.create_model('swmlp_cifar', embed_dim=8, depth=1, mlp_ratio=0).blocks[0]
        mixer = timm.create_model('mixer_digits', mlp_ratio=0).blocks[0]
    assert sw.fc2 is None and sw.fc1.out_features == sw.fc1.in_features == 64 * 8
    assert mixer.mlp_tokens.fc2 is None and mixer.mlp_channels.fc2 is None and mixer.mlp_tokens.fc1.bias is None
    with pytest.raises(ValueError, match=r'--model-kwargs mlp_ratio=None: timm.create_model drops a None'):
        build_model('mixer_digits', {'mlp_ratio': None})
    # the recipe: 8 one-layer blocks of width m = 1600 whose masks keep p m^2 = 2^18 each (S.43), within 5 sigma
    values = load_recipe('swmlp_cifar10')[0]
    with torch.device('meta'):
        model = timm.create_model(values['model'], **values['model_kwargs'])
    assert len(model.blocks) == 8 and all(b.fc2 is None and b.fc1.weight.shape == (1600, 1600) for b in model.blocks)
    kept = sum(b.fc1.kept_weights() for b in model.blocks)
    p = values['model_kwargs']['density']
    assert abs(kept - 8 * 2 ** 18) < 5 * (8 * 1600 ** 2 * p * (1 - p)) ** 0.5
    assert effective_parameter_count(model) > kept


def test_compare_s_mixer_row_is_an_s_mixer():
    """compare's "S-Mixer" row on digits is mixer_digits made single-layer by its kind_kwargs (it said mlp_ratio=None,
    which timm dropped: the row trained the γ = 2 MLP-Mixer)."""
    from structformer.compare.catalogue import BY_KEY
    entry = BY_KEY['smixer']
    assert {'digits', 'mnist'} <= set(entry.models)
    for kind, name in entry.models.items():
        with torch.device('meta'):
            model = timm.create_model(name, **entry.kind_kwargs.get(kind, {}))
        assert all(b.mlp_tokens.fc2 is None and b.mlp_channels.fc2 is None for b in model.blocks), kind
