"""FX tracing of every family (issue 32.5): timm's `features_only=True, feature_cls='fx'` and its (torchvision's)
`create_feature_extractor` trace our models, the traced graph computes what the eager model computes, and the
input check survives tracing. Before: every family failed on a Python shape check in `forward` (and on einops
inside the layers)."""
import pytest
import timm
import torch
from timm.layers import create_feature_extractor, get_graph_node_names

import structformer  # noqa: F401
from structformer.models.factorize import factorize

# family -> (model, the module whose output is taken as a feature)
CASES = {
    'crate': ('crate_digits', 'blocks.1'),
    'soft': ('soft_digits', 'stages.1.blocks.0'),
    'sparsifiner': ('sparsifiner_digits', 'blocks.1'),
    'mixer': ('mixer_digits', 'blocks.1'),
    'swmlp': ('swmlp_digits', 'blocks.0'),
    'lowrank': ('vit_digits', 'blocks.1'),
    'wrn-lowrank': ('wrn_10_2_digits', 'stages.1.0'),
}


def _build(family):
    name, _ = CASES[family]
    torch.manual_seed(0)
    model = timm.create_model(name)
    if family == 'lowrank':
        factorize(model, rank=0.5, include='transformer')
    elif family == 'wrn-lowrank':
        factorize(model, rank=0.5)
    with torch.no_grad():                                # a zero-initialised head would hide a wrong graph
        for p in model.parameters():
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def _images(model, batch=3):
    return torch.randn(batch, *model.pretrained_cfg['input_size'], generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize('family', list(CASES))
def test_feature_extractor_matches_eager(family):
    model = _build(family)
    _, feature = CASES[family]
    x = _images(model)
    seen = {}
    module = model.get_submodule(feature)
    handle = module.register_forward_hook(lambda m, i, o: seen.__setitem__('feature', o))
    with torch.no_grad():
        logits = model(x)
    handle.remove()
    nodes = get_graph_node_names(model)[1]
    extractor = create_feature_extractor(model, {feature: 'feature', nodes[-1]: 'logits'})
    with torch.no_grad():
        out = extractor(x)
    torch.testing.assert_close(out['logits'], logits, rtol=0, atol=0)        # the same ops in the same order
    torch.testing.assert_close(out['feature'], seen['feature'], rtol=0, atol=0)


@pytest.mark.parametrize('family', ['crate', 'soft', 'sparsifiner', 'mixer'])
def test_timm_features_only_fx(family):
    name, _ = CASES[family]
    torch.manual_seed(0)
    features = timm.create_model(name, features_only=True, feature_cls='fx').eval()
    x = _images(features)
    with torch.no_grad():
        maps = features(x)
    info = features.feature_info
    assert len(maps) == len(info.out_indices)
    assert [m.shape[0] for m in maps] == [3] * len(maps)
    assert [m.shape[-1] for m in maps] == info.channels()           # tokens [B, N, C]: the module outputs
    # the same graph runs at another batch size (no shape was frozen into it)
    with torch.no_grad():
        assert [m.shape[0] for m in features(_images(features, 2))] == [2] * len(maps)


@pytest.mark.parametrize('family', ['crate', 'soft', 'mixer', 'wrn-lowrank'])
def test_traced_graph_keeps_the_input_check(family):
    model = _build(family)
    traced = create_feature_extractor(model, [get_graph_node_names(model)[1][-1]])
    c, h, w = model.pretrained_cfg['input_size']
    with pytest.raises(ValueError, match='expects images'):
        traced(torch.randn(2, c + 1, h, w))


def test_language_model_traces_and_keeps_its_input_check():
    """The GPT (the low-rank LM family) failed FX tracing (`features_only=True, feature_cls='fx'`: TraceError on
    its token-id checks, then on its attention unpacking x.shape). Its checks are an FX leaf now and its attention a
    traced leaf; the traced hidden states are the eager ones, at any length up to the context."""
    torch.manual_seed(0)
    model = timm.create_model('gpt2_byte_tiny', embed_dim=32, depth=2, num_heads=2).eval()
    features = timm.create_model('gpt2_byte_tiny', embed_dim=32, depth=2, num_heads=2, features_only=True,
                                 feature_cls='fx').eval()
    features.load_state_dict({f'graph_module.{k}': v for k, v in model.state_dict().items()
                              if f'graph_module.{k}' in features.state_dict()})
    for length in (8, 20):
        x = torch.randint(0, 256, (2, length))
        with torch.no_grad():
            got, want = features(x), model.forward_intermediates(x, intermediates_only=True)
        assert len(got) == 2
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
    with pytest.raises(ValueError, match='longer than the context img_size=128'):
        features(torch.randint(0, 256, (1, 129)))
