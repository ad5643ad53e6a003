"""CRATE options that only one variant reads (App. B.4): a value the built model would never use is refused by
name, as timm refuses an unknown keyword, instead of being silently ignored."""
import pytest
import timm
import torch

import structformer.models  # noqa: F401  (registers the models)


@pytest.mark.parametrize('kwargs, match', [
    (dict(eps=0.5), r"eps=0.5 is the ε of the tied MSSA .* has neither"),                 # default MSSA and ISTA
    (dict(sparse_step='mm', eta=0.5), r"eta=0.5 is the ISTA step size .* has none"),     # Eq. 92 has no η
])
def test_an_option_the_variant_does_not_read_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        timm.create_model('crate_synthetic', **kwargs)


@pytest.mark.parametrize('kwargs', [dict(eps=0.5, tied_output=True), dict(eps=0.5, sparse_step='mm'),
                                    dict(eta=0.5), dict(sparse_step='mm', lambd=0.2)])
def test_the_variants_that_read_them_take_them(kwargs):
    model = timm.create_model('crate_synthetic', **kwargs)
    block = model.blocks[0]
    if 'eps' in kwargs:
        used = block.attn.eps if kwargs.get('tied_output') else block.mlp.eps
        assert used == 0.5
    assert block.mlp.eta == kwargs.get('eta', 0.1) and block.mlp.lambd == kwargs.get('lambd', 0.1)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 4)


@pytest.mark.parametrize('size', ['tiny', 'small', 'base', 'large'])
def test_imagenet_configs_evaluate_as_the_public_code(size):
    """timm's eval transform from the model's config is the public main.py's: Resize(256), CenterCrop(224), bilinear
    (ImageNet mean / std); it was timm's generic 0.9 bicubic, so converted official weights scored off their numbers."""
    from timm.data import create_transform, resolve_model_data_config
    with torch.device('meta'):
        model = timm.create_model(f'crate_{size}_patch16_224')
    config = resolve_model_data_config(model)
    assert (config['crop_pct'], config['interpolation']) == (0.875, 'bilinear')
    assert config['mean'] == (0.485, 0.456, 0.406) and config['std'] == (0.229, 0.224, 0.225)
    resize = create_transform(**config).transforms[0]
    assert resize.size == 256 and resize.interpolation.value == 'bilinear'


def test_one_head_as_wide_as_the_model_has_no_output_map():
    """Alg. 3 / the public code: project_out = not (heads == 1 and dim_head == dim), so such a CRATE's MSSA returns
    SSA(Z|U) itself (an official checkpoint of it has no to_out); it carried an extra d×d + d Linear."""
    from structformer.functional import ssa_per_head_reference
    model = timm.create_model('crate_synthetic', num_heads=1, dim_head=16).double().eval()   # d = 16
    attn = model.blocks[0].attn
    assert attn.proj is None and not any('attn.proj' in k for k in model.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(attn(x), ssa_per_head_reference(x, attn.qkv.weight, 1, 16 ** -0.5))
    assert timm.create_model('crate_synthetic', num_heads=1, dim_head=8).blocks[0].attn.proj is not None
    assert timm.create_model('crate_synthetic').blocks[0].attn.proj is not None            # K = 4 heads of p = 4
