"""timm's input-size contract: whether a model takes only the image size it was built with (timm's
`fixed_input_size`: the model trait that `timm.data.resolve_input_data_config` and `save_for_hf` read, and the
registry's pretrained_cfg field) is said truthfully, so timm's tools hand the model images it accepts."""
import json

import pytest
import timm
import torch
from timm.data import resolve_data_config, resolve_input_data_config
from timm.models import get_model_input_config

from structformer import list_structformer_models


@pytest.mark.parametrize('name', list_structformer_models())
def test_registry_config_says_what_the_model_declares(name):
    with torch.device('meta'):
        model = timm.create_model(name)
    assert get_model_input_config(model)['fixed_input_size'] == timm.get_pretrained_cfg(name).fixed_input_size


@pytest.mark.parametrize('name, kwargs, fixed', [
    ('crate_digits', {'img_size': 16}, True), ('mixer_digits', {'img_size': 16}, True),
    ('swmlp_digits', {'img_size': 16}, True), ('vit_digits', {'img_size': 16}, True),
    ('soft_tiny_official_224', {'img_size': 64}, True),          # position embeddings
    ('soft_tiny_linformer_mnist', {}, True),                      # Linformer's E, F: one column per token
    ('soft_digits', {'img_size': 16}, False), ('soft_digits', {'pos_embed': True}, True),
    ('wrn_10_2_digits', {}, False)])
def test_fixed_input_size_is_what_the_model_does(name, kwargs, fixed):
    """The size timm's resolver picks is one the model takes (a CRATE / Mixer / official SOFT built at another
    img_size said 'flexible', so it was handed the registry's 8 px or 224 px and refused them); a fixed model
    refuses another size in one line naming img_size (official SOFT failed deep in a tensor add), a flexible one
    runs it."""
    model = timm.create_model(name, **kwargs).eval()
    assert get_model_input_config(model)['fixed_input_size'] is fixed
    c, h, w = resolve_input_data_config(model)['input_size']
    with torch.no_grad():
        assert model(torch.randn(1, c, h, w)).shape == (1, model.num_classes)
        other = torch.randn(1, c, 2 * h, 2 * w)
        if fixed:
            with pytest.raises((ValueError, AssertionError), match=r'img_size|Input height'):   # timm's ViT asserts
                model(other)
        else:
            assert model(other).shape == (1, model.num_classes)


def test_timm_export_of_a_resized_model_records_its_size(tmp_path):
    """timm's save_for_hf (push_to_hf_hub) writes the size the model takes, and a `local-dir:` reload's data config
    gives it (before: the registry's 8 px, which the 16 px model refuses)."""
    from timm.models._hub import save_for_hf
    model = timm.create_model('crate_digits', img_size=16)
    save_for_hf(model, tmp_path, safe_serialization=True)
    assert json.loads((tmp_path / 'config.json').read_text())['pretrained_cfg']['input_size'] == [1, 16, 16]
    loaded = timm.create_model(f'local-dir:{tmp_path}', pretrained=True).eval()
    size = resolve_data_config({}, model=loaded)['input_size']
    assert tuple(size) == (1, 16, 16)
    with torch.no_grad():
        loaded(torch.randn(1, *size))


@pytest.mark.parametrize('name, kwargs', [
    ('crate_digits', {'in_chans': 3}), ('soft_digits', {'in_chans': 3}), ('swmlp_digits', {'in_chans': 3}),
    ('crate_cifar', {'in_chans': 1}), ('crate_digits', {'img_size': 16})])
def test_timm_scripts_data_config_fits_the_built_model(name, kwargs):
    """timm's train.py / validate.py / inference.py build with in_chans=3 unless told (img_size= when given), then
    take the input size from `resolve_data_config(args, model=model)` and read images as 'RGB' for 3 channels, else
    'L' (inference.py: always RGB). The resolved size is the built model's (before: the registry's 1 x 8 x 8, so a
    crate_digits built for RGB got grey images, and a 3-value mean broadcast a grey image to 3 channels)."""
    from PIL import Image
    from timm.data import create_transform
    model = timm.create_model(name, num_classes=3, **kwargs).eval()
    config = resolve_data_config({'in_chans': None, 'input_size': None, 'img_size': None}, model=model)
    c, h, w = config['input_size']
    assert c == kwargs.get('in_chans', c) and (h, w) == (kwargs.get('img_size', h),) * 2
    transform = create_transform(**config, is_training=False)
    image = Image.new('RGB' if c == 3 else 'L', (32, 32), 128)
    batch = transform(image).unsqueeze(0)
    assert batch.shape == (1, c, h, w)
    with torch.no_grad():
        assert model(batch).shape == (1, 3)
