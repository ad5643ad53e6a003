"""Unknown options fail loudly: every layer raises a TypeError naming a keyword it does not take (as
timm's own `Attention` does), a model's `attn_kwargs` typo names the key and the closest accepted one,
and the CLI turns it into one line with exit status 2."""
import inspect

import pytest
import timm
import torch

from structformer.cli import main
from structformer.layers.attention import ATTENTION_LAYERS, SoftAttention, SoftPlusPlusAttention
from structformer.layers.attention.registry import (accepted_options, resolve_layer_kwargs, select_options,
                                                    with_defaults)
from structformer.layers.mlp import ISTA

# timm's VisionTransformer Block passes these to attn_layer / mlp_layer (timm/models/vision_transformer.py)
TIMM_ATTN_KWARGS = {'dim', 'num_heads', 'qkv_bias', 'qk_norm', 'scale_norm', 'proj_bias', 'attn_drop', 'proj_drop',
                    'norm_layer', 'device', 'dtype'}
TIMM_MLP_KWARGS = {'in_features', 'hidden_features', 'act_layer', 'norm_layer', 'bias', 'drop', 'device', 'dtype'}
ATTENTION_NAMES = sorted(ATTENTION_LAYERS)


@pytest.mark.parametrize('name', ATTENTION_NAMES)
def test_attention_rejects_unknown_keyword(name):
    cls = ATTENTION_LAYERS[name]
    with pytest.raises(TypeError, match='no_such_option'):
        cls(64, num_heads=2, no_such_option=1)


@pytest.mark.parametrize('name', ATTENTION_NAMES)
def test_attention_accepts_what_timm_blocks_pass(name):
    assert TIMM_ATTN_KWARGS <= accepted_options(ATTENTION_LAYERS[name])
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD
                   for p in inspect.signature(ATTENTION_LAYERS[name].forward).parameters.values())


def test_mlp_layers_reject_unknown_keyword_and_accept_timm_kwargs():
    with pytest.raises(TypeError, match='no_such_option'):
        ISTA(64, no_such_option=1)
    assert TIMM_MLP_KWARGS <= accepted_options(ISTA)


def test_soft_attention_landmark_typo_raises():
    """The issue's case: `num_landmark` used to be swallowed and 49 landmarks kept."""
    with pytest.raises(TypeError, match='num_landmark'):
        SoftAttention(64, num_landmark=4)
    with pytest.raises(TypeError, match='num_landmark'):
        SoftPlusPlusAttention(64, num_landmark=4)         # forwards **kwargs to SoftAttention
    assert SoftAttention(64, num_landmarks=4).num_landmarks == 4


def test_accepted_options_follow_kwargs_up_the_mro():
    assert 'num_landmarks' in accepted_options(SoftPlusPlusAttention)
    assert 'normalize' in accepted_options(SoftPlusPlusAttention)
    assert accepted_options(with_defaults(SoftAttention, num_landmarks=4)) == accepted_options(SoftAttention)


def test_select_options_passes_each_class_its_own():
    shared = {'num_landmarks': 4, 'seq_len': 17, 'grid_size': (4, 4), 'num_features': 8}
    assert select_options(ATTENTION_LAYERS['softmax'], shared) == {}
    assert select_options(ATTENTION_LAYERS['linformer'], shared) == {'num_landmarks': 4, 'seq_len': 17}
    assert select_options(ATTENTION_LAYERS['performer'], shared) == {'num_features': 8}
    assert select_options(SoftAttention, shared) == {'num_landmarks': 4, 'grid_size': (4, 4)}


def test_with_defaults_and_attn_kwargs_reject_typos():
    with pytest.raises(TypeError, match=r"num_landmark\b.*did you mean: num_landmark -> num_landmarks"):
        with_defaults(SoftAttention, num_landmark=4)
    with pytest.raises(TypeError, match='num_landmark'):
        resolve_layer_kwargs({'attn_layer': 'soft', 'attn_kwargs': {'num_landmark': 4}})


def test_models_with_preset_attention_pickle_whole():
    """timm keeps the attn_layer class in `model._model_args`; a preset made at run time used to make
    `torch.save(model)` fail for every sparsifiner_* model and every `attn_layer='<name>'` ViT."""
    import io

    from structformer.models.factory import build_model
    soft_vit = build_model('vit_tiny_patch16_224', {'img_size': 8, 'patch_size': 2, 'in_chans': 1, 'depth': 2,
                                                   'attn_layer': 'soft', 'attn_kwargs': {'num_landmarks': 4}})[0]
    for model in (timm.create_model('sparsifiner_digits', depth=2), soft_vit):
        model.eval()
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        x = torch.randn(2, 1, 8, 8)
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)     # the same code path and weights
        assert type(loaded.blocks[0].attn).__module__ != 'structformer.layers.attention.registry'   # a plain class
    preset = loaded._model_args['attn_layer']                        # the soft ViT's, rebuilt from (class, defaults)
    assert preset.preset_base is SoftAttention and preset.preset_defaults == {'num_landmarks': 4}
    assert issubclass(preset, SoftAttention) and type(loaded.blocks[0].attn) is SoftAttention


@pytest.mark.parametrize('name', ['soft_digits', 'softpp_digits'])
def test_model_attn_kwargs_typo_names_the_key(name):
    with pytest.raises(TypeError, match=r"Attention got unknown option\(s\) num_landmark .*num_landmarks"):
        timm.create_model(name, attn_kwargs={'num_landmark': 4})


def test_model_attn_kwargs_the_chosen_class_ignores_are_refused():
    """Options a stage passes to every attention go through each class's accepted set, but a user option
    the chosen attention does not take (softmax has no landmarks) is an error, not silently dropped."""
    model = timm.create_model('soft_digits', attn='softmax').eval()   # stage facts (landmarks, grid) filtered
    assert model(torch.randn(1, 1, 8, 8)).shape == (1, 10)
    with pytest.raises(TypeError, match='num_landmarks'):
        timm.create_model('soft_digits', attn='softmax', attn_kwargs={'num_landmarks': 4})


def test_model_attn_kwargs_are_applied():
    model = timm.create_model('soft_digits', attn_kwargs={'newton_iter': 3})
    assert all(b.attn.newton_iter == 3 for s in model.stages for b in s.blocks)


@pytest.mark.filterwarnings('ignore:SOFT conv sampler')
@pytest.mark.parametrize('name', ['soft', 'nystrom', 'softmax'])
def test_timm_vision_transformer_takes_our_attention(name):
    kwargs = {'soft': {'num_landmarks': 4}, 'nystrom': {'num_landmarks': 4}, 'softmax': {}}[name]
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=8, depth=2, num_classes=3,
                              **resolve_layer_kwargs({'attn_layer': name, 'attn_kwargs': kwargs}))
    assert isinstance(model.blocks[0].attn, ATTENTION_LAYERS[name])
    out = model(torch.randn(2, 3, 16, 16))
    assert out.shape == (2, 3) and torch.isfinite(out).all()


def test_timm_vision_transformer_takes_mssa_and_ista():
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=8, depth=2, num_classes=3,
                              attn_layer=ATTENTION_LAYERS['mssa'], mlp_layer=ISTA)
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 3)


def test_cli_attn_kwargs_typo_is_one_line(tmp_path, capsys):
    out = tmp_path / 'run'
    try:
        code = main(['train', '--model', 'soft_digits', '--data', 'digits', '--model-kwargs',
                     "attn_kwargs={'num_landmark': 4}", '--epochs', '1', '--output', str(out)])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and 'Traceback' not in captured.err, captured.err
    assert lines[0].startswith('structformer train: error:')
    assert 'num_landmark' in lines[0] and 'num_landmarks' in lines[0]
    assert not out.exists()
