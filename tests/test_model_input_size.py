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
