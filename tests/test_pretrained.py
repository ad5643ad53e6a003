"""Weights in through timm's own paths (issue 32): `pretrained=True` with a file or a local-dir folder, the family
filters, timm's validate.py data config, and the smaller items (Wide-ResNet NCHW, token-id models, version, licence)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

import structformer
from structformer import list_structformer_models
from structformer.models import list_structformer_language_models
from structformer.models.base import takes_token_ids
from structformer.weights import WeightsMismatch

ROOT = Path(__file__).resolve().parents[1]
# one small model per family, with a cheap size to adapt to
FAMILIES = {'crate_digits': {}, 'soft_digits': {}, 'sparsifiner_digits': {'keep_ratio': 1.0}, 'mixer_digits': {},
            'wrn_10_2_digits': {}}


def _saved(tmp_path, name, **kwargs):
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs).eval()
    path = tmp_path / f'{name}.safetensors'
    save_file(model.state_dict(), str(path))
    return model, path


@pytest.mark.parametrize('name', FAMILIES)
def test_pretrained_file_loads_exactly(tmp_path, name):
    model, path = _saved(tmp_path, name, **FAMILIES[name])
    torch.manual_seed(1)                                     # another initialisation: only the file can make them equal
    loaded = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **FAMILIES[name])
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.pretrained_adaptations == []


@pytest.mark.parametrize('name', FAMILIES)
def test_more_input_channels_see_a_gray_image_as_the_original_did(tmp_path, name):
    """timm's adapt_input_conv repeats the 1-channel filter over 3 channels scaled by 1/3 (CRATE: on its (p1 p2 c)
    patch layout, its input LayerNorm repeated): a gray image repeated over 3 channels gives the original logits."""
    model, path = _saved(tmp_path, name, **FAMILIES[name])
    rgb = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), in_chans=3,
                            **FAMILIES[name]).eval()
    assert any('input channels 1 -> 3' in line for line in rgb.pretrained_adaptations), rgb.pretrained_adaptations
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(rgb(x.repeat(1, 3, 1, 1)), model(x), rtol=1e-4, atol=1e-5)   # float32 sums of 3


@pytest.mark.parametrize('name', FAMILIES)
def test_classes_and_image_size_adapt_and_the_rest_is_the_file(tmp_path, name):
    model, path = _saved(tmp_path, name, **FAMILIES[name])
    other = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), num_classes=3,
                              **({} if name.startswith(('wrn', 'mixer')) else {'img_size': 16}), **FAMILIES[name])
    done = other.pretrained_adaptations
    assert any(line.startswith('head.weight [10, ') and 'freshly initialised' in line for line in done), done
    if name.startswith(('crate', 'sparsifiner')):
        assert any(line.startswith('pos_embed: grid 4x4 -> 8x8') for line in done), done
    if name.startswith('sparsifiner'):                    # one W_down column per token: another count starts afresh
        assert any('basis.w_down: 17 token columns, the model has 65' in line for line in done), done
    ours, theirs = other.state_dict(), model.state_dict()
    adapted = {line.split(' ')[0].rstrip(':') for line in done}
    same = [k for k in theirs if k not in adapted and k in ours and ours[k].shape == theirs[k].shape]
    assert same and all(torch.equal(ours[k], theirs[k]) for k in same)


def test_a_mixer_at_another_size_is_refused_by_name(tmp_path):
    """The token-mixing MLP is as wide as the token count: nothing adapts it, so it is named, not dropped."""
    _, path = _saved(tmp_path, 'mixer_digits')
    with pytest.raises(WeightsMismatch, match=r'of another shape \(e\.g\. blocks\.0\.mlp_tokens'):
        timm.create_model('mixer_digits', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), img_size=16)


def test_soft_stage_positions_are_resampled_per_stage(tmp_path):
    model, path = _saved(tmp_path, 'soft_tiny_official_224', img_size=64)
    bigger = timm.create_model('soft_tiny_official_224', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                               img_size=96)
    lines = bigger.pretrained_adaptations
    assert [line.split(':')[0] for line in lines if 'grid' in line] == [f'pos_embeds.{i}' for i in range(4)]
    assert 'pos_embeds.3: grid 2x2 -> 3x3' in ' '.join(lines)        # stage 4: its cls position kept aside
    torch.testing.assert_close(bigger.pos_embeds[3][:, :1], model.pos_embeds[3][:, :1], rtol=0, atol=0)


def test_local_dir_in_timm_hub_layout_loads_through_the_filter(tmp_path):
    """timm's own writer (`save_for_hf`: config.json + model.safetensors, what `export --format hf` writes) read
    back by `timm.create_model('local-dir:...', pretrained=True)`."""
    from timm.models import save_for_hf
    model = timm.create_model('crate_digits', depth=2).eval()
    save_for_hf(model, str(tmp_path / 'hub'), safe_serialization=True)
    loaded = timm.create_model(f'local-dir:{tmp_path / "hub"}', pretrained=True).eval()
    assert len(loaded.blocks) == 2
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_without_weights_the_error_is_one_line_naming_what_to_pass(tmp_path):
    with pytest.raises(ValueError) as info:
        timm.create_model('crate_tiny_patch16_224', pretrained=True)
    message = str(info.value)
    assert '\n' not in message
    for words in ('pretrained_cfg_overlay=dict(file=', 'local-dir:', '--pretrained-path'):
        assert words in message
    with pytest.raises(FileNotFoundError, match='missing.safetensors: does not exist'):
        timm.create_model('crate_digits', pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(tmp_path / 'missing.safetensors')))


def test_weights_of_another_family_are_refused_by_name(tmp_path):
    _, path = _saved(tmp_path, 'soft_digits')
    with pytest.raises(WeightsMismatch, match=r'do not fit model crate_digits: \d+ missing \(.*\); \d+ unexpected'):
        timm.create_model('crate_digits', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))


# ------------------------------------------------------------------ timm's validate.py at the pretrained size

IMAGE_224 = [n for n in list_structformer_models() if timm.get_pretrained_cfg(n).input_size[-1] == 224]


def test_no_config_keeps_a_test_size_other_than_its_input_size():
    """validate.py evaluates at `test_input_size` when the config has one (use_test_size); ours set 32 / 64 px."""
    from timm.data import resolve_data_config
    assert len(IMAGE_224) >= 20
    for name in list_structformer_models():
        cfg = timm.get_pretrained_cfg(name)
        assert cfg.test_input_size is None, name
        resolved = resolve_data_config({}, pretrained_cfg=cfg.to_dict(), use_test_size=True)
        assert resolved['input_size'] == cfg.input_size, name
    for name in IMAGE_224:
        resolved = resolve_data_config({}, pretrained_cfg=timm.get_pretrained_cfg(name).to_dict(), use_test_size=True)
        assert resolved['input_size'] == (3, 224, 224), name


@pytest.mark.parametrize('name', ['crate_tiny_patch16_224', 'soft_tiny_224', 'sparsifiner_deit_tiny_patch16_224'])
def test_validate_py_steps_run_the_model_at_224(name):
    """What timm's validate.py does with a model: resolve_data_config(model=..., use_test_size=True),
    create_transform(**config), a forward of the transformed image. Before, CRATE-T crashed (built for 224,
    fed 32 px) and SOFT-T ran at 64 px."""
    from PIL import Image
    from timm.data import create_transform, resolve_data_config
    model = timm.create_model(name).eval()
    config = resolve_data_config({}, model=model, use_test_size=True)
    image = Image.new('RGB', (300, 260), (120, 30, 200))
    x = create_transform(**config)(image).unsqueeze(0)
    assert x.shape == (1, 3, 224, 224)
    with torch.no_grad():
        assert model(x).shape == (1, 1000)


# ------------------------------------------------------------------ smaller items

def test_wide_resnet_features_are_nchw_as_timm_cnns():
    model = timm.create_model('wrn_10_2_digits').eval()
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        features = model.forward_features(x)
        assert features.shape == (2, model.num_features, 2, 2)
        torch.testing.assert_close(model.forward_head(features), model(x))
        torch.testing.assert_close(model.forward_head(features, pre_logits=True), features.mean((2, 3)))
        final, maps = model.forward_intermediates(x)
        torch.testing.assert_close(final, features)


def test_token_id_models_say_so_in_their_config_and_image_models_do_not():
    language = list_structformer_language_models()
    assert language and all(takes_token_ids(name) for name in language)
    assert not any(takes_token_ids(name) for name in list_structformer_models())
    assert takes_token_ids(timm.create_model('gpt2_byte_tiny').pretrained_cfg)


def test_version_licence_and_typing_marker():
    out = subprocess.run([sys.executable, '-m', 'structformer', '--version'], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == f'structformer {structformer.__version__}'
    pyproject = (ROOT / 'pyproject.toml').read_text()
    assert re.search(r'^license = "Apache-2\.0"$', pyproject, re.M)
    assert re.search(r'^version = "(.*)"$', pyproject, re.M)[1] == structformer.__version__
    assert 'Apache License' in (ROOT / 'LICENSE').read_text() and 'Version 2.0, January 2004' in (ROOT / 'LICENSE').read_text()
    assert (ROOT / 'structformer' / 'py.typed').is_file() and '"py.typed"' in pyproject


# ------------------------------------------------------------------ training from weights

def test_train_pretrained_path_prints_what_it_adapted(tmp_path, capsys):
    from structformer.cli import main
    _, path = _saved(tmp_path, 'crate_digits', num_classes=5)
    assert main(['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '1', '--limit-train-batches', '1',
                 '--pretrained-path', str(path), '--output', str(tmp_path / 'run'), '--no-progress']) == 0
    out = capsys.readouterr().out
    assert f'--pretrained-path {path}: weights loaded' in out
    assert 'adapted head.weight [5, 64] -> [10, 64]: freshly initialised' in out


def test_teacher_weights_file_builds_the_dense_counterpart_and_starts_the_student(tmp_path, capsys):
    """Sparsifiner distils from a pretrained DeiT: --teacher FILE is read into the student's dense counterpart
    (vit_digits for sparsifiner_digits), and the student starts from its weights."""
    from safetensors.torch import load_file

    from structformer.cli import main
    teacher, path = _saved(tmp_path, 'vit_digits')
    assert main(['train', '--model', 'sparsifiner_digits', '--data', 'digits', '--epochs', '2', '--limit-train-batches',
                 '1', '--teacher', str(path), '--output', str(tmp_path / 'run'), '--no-progress']) == 0
    start = load_file(str(tmp_path / 'run' / 'checkpoints' / 'epoch_0000' / 'model.safetensors'))
    for key, value in teacher.state_dict().items():
        assert torch.equal(start[key], value), key


def test_a_file_with_the_models_class_count_keeps_its_head(tmp_path):
    """timm's loader drops the classifier when the model's class count differs from the config's; the config
    describes the weights, so the filter takes the count from the file: a 5-class file into a 5-class model
    keeps its head although crate_digits' registry config says 10."""
    model, path = _saved(tmp_path, 'crate_digits', num_classes=5)
    loaded = timm.create_model('crate_digits', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                               num_classes=5)
    assert torch.equal(loaded.head.weight, model.head.weight) and loaded.pretrained_adaptations == []


def test_public_checkpoint_given_straight_to_pretrained_is_converted(tmp_path):
    """An official CRATE checkpoint as `file=` (or --pretrained-path): converted by convert's key map first."""
    from test_convert import _as_loaded, _fill, crate_official_forward, crate_official_shapes
    state = _fill(crate_official_shapes(1, 2, 64, 4, 4, 16, 16, 10))
    torch.save({'state_dict': state}, tmp_path / 'official.pth')
    model = timm.create_model('crate_digits', pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / 'official.pth'))).double().eval()
    assert model.pretrained_adaptations == ['converted from the crate-official layout']
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), crate_official_forward(_as_loaded(state), x, 2, 4, 4), rtol=1e-10,
                                   atol=1e-10)


def test_a_weights_folder_given_as_file_names_local_dir(tmp_path):
    """A convert / save_weights_folder folder given as `pretrained_cfg_overlay=dict(file=FOLDER)` reached timm's
    loader, which raised a FileNotFoundError with no message at all; it is named, with the two ways to load it."""
    from structformer.weights import save_weights_folder
    folder = tmp_path / 'crate_w'
    save_weights_folder(timm.create_model('crate_digits', depth=1), folder, model_kwargs={'depth': 1})
    with pytest.raises(IsADirectoryError) as info:
        timm.create_model('crate_digits', depth=1, pretrained=True, pretrained_cfg_overlay=dict(file=str(folder)))
    assert str(info.value) == (f"crate_digits: pretrained weights {folder}: is a folder; load it with "
                               f"timm.create_model('local-dir:{folder}', pretrained=True), or give its weights file "
                               f"as file= ({folder / 'model.safetensors'})")
    loaded = timm.create_model(f'local-dir:{folder}', pretrained=True)                   # the way named works
    assert loaded.pretrained_cfg['architecture'] == 'crate_digits'
