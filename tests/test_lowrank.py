"""Low-rank layers, `factorize`, inits, regularisers and effective rank (seed 004) against their
definitions: dense references, SVD, autograd."""
import math
import re

import pytest
import timm
import torch
from torch import nn

from structformer.layers.linear.factorized import (FactorizedConv2d, FactorizedLinear, resolve_rank,
                                                   saves_parameters, spectral_factors)
from structformer.models.lowrank_spectra import effective_rank
from structformer.models.factorize import factorize, plan_factorization
from structformer.train.lowrank_decay import (factor_l2, factor_parameter_names, frobenius_decay,
                                               frobenius_decay_reference)
from structformer.models.lowrank_spectra import effective_ranks, singular_values
from structformer.models.factorize import factorized_layers
from structformer.models.factory import build_model, rebuild

F64 = dict(dtype=torch.float64)


# ------------------------------------------------------------------ ranks and inits
def test_resolve_rank_int_and_fraction():
    assert resolve_rank(5, 10, 20) == 5
    assert resolve_rank(0.1, 100, 300) == 10
    assert resolve_rank(0.62, 768, 3072) == round(0.62 * 768)
    assert resolve_rank(1e-6, 10, 20) == 1            # a fraction never rounds to rank 0
    assert (resolve_rank(0.26, 10, 20), resolve_rank(0.24, 10, 20)) == (3, 2)   # the nearest count, not truncated
    assert resolve_rank(1.0, 10, 20) == 10
    assert saves_parameters(4, 10, 10) and not saves_parameters(5, 10, 10)   # mn/(m+n) = 5


@pytest.mark.parametrize('bad', [0, -3, 11, 0.0, -0.5, 1.5, float('nan'), True, '0.3', None])
def test_bad_rank_is_a_clear_error(bad):
    with pytest.raises(ValueError, match='rank'):
        resolve_rank(bad, 10, 20)
    with pytest.raises(ValueError, match='rank'):
        FactorizedLinear(20, 10, rank=bad)


def test_unknown_init_is_a_clear_error():
    with pytest.raises(ValueError, match="init='svd'.*spectral, spectral_ones, he"):
        FactorizedLinear(8, 8, rank=2, init='svd')
    with pytest.raises(ValueError, match='init'):
        FactorizedConv2d(3, 8, 3, rank=2, init='orthogonal')


@pytest.mark.parametrize('args, name', [((0, 3, 3), 'in_channels'), ((2, -1, 3), 'out_channels'),
                                        ((2, 3, 0), 'kernel_size'), ((2, 3, (3, -1)), 'kernel_size')])
def test_conv_sizes_are_named_before_the_rank(args, name):
    with pytest.raises(ValueError, match=rf'^{name}=\S.* must be a positive integer'):   # the value as given
        FactorizedConv2d(*args, rank=1)


@pytest.mark.parametrize('shape', [(12, 7), (7, 12), (9, 9)])
def test_full_rank_spectral_init_reproduces_w(shape):
    torch.manual_seed(0)
    dense = nn.Linear(shape[1], shape[0], **F64)
    layer = FactorizedLinear.from_linear(dense, rank=min(shape), init='spectral')
    torch.testing.assert_close(layer.to_dense(), dense.weight, rtol=0, atol=1e-13)
    x = torch.randn(5, shape[1], **F64)
    torch.testing.assert_close(layer(x), dense(x), rtol=0, atol=1e-13)


def test_spectral_init_is_the_truncated_svd_with_balanced_factors():
    w = torch.randn(30, 20, **F64)
    u, v = spectral_factors(w, 6)
    U, S, Vh = torch.linalg.svd(w, full_matrices=False)
    best = U[:, :6] @ torch.diag(S[:6]) @ Vh[:6]
    torch.testing.assert_close(u @ v.T, best, rtol=0, atol=1e-12)
    # Eckart-Young: the error is the norm of the dropped singular values
    assert math.isclose(torch.linalg.norm(w - u @ v.T).item(), S[6:].norm().item(), rel_tol=1e-10)
    torch.testing.assert_close(u.T @ u, v.T @ v, rtol=0, atol=1e-12)     # both = Σ_r


def test_spectral_ones_keeps_directions_with_unit_singular_values():
    w = torch.randn(30, 20, **F64)
    u, v = spectral_factors(w, 5, ones=True)
    torch.testing.assert_close(u.T @ u, torch.eye(5, **F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.linalg.svdvals(u @ v.T)[:5], torch.ones(5, **F64), rtol=0, atol=1e-12)
    U, _, Vh = torch.linalg.svd(w, full_matrices=False)
    torch.testing.assert_close(u @ v.T, U[:, :5] @ Vh[:5], rtol=0, atol=1e-12)


def test_he_init_scales_each_factor_by_its_fan_in():
    torch.manual_seed(0)
    layer = FactorizedLinear(2000, 1000, rank=400, init='he')
    assert math.isclose(layer.V.std().item(), math.sqrt(2 / 2000), rel_tol=0.02)
    assert math.isclose(layer.U.std().item(), math.sqrt(2 / 400), rel_tol=0.02)


# ------------------------------------------------------------------ fast paths vs references
def test_factorized_linear_forward_and_gradients_match_dense_reference():
    torch.manual_seed(0)
    layer = FactorizedLinear(16, 24, rank=5, **F64)
    x = torch.randn(3, 7, 16, **F64, requires_grad=True)
    fast = layer(x)
    grads_fast = torch.autograd.grad(fast.square().sum(), [x, layer.U, layer.V, layer.bias])
    ref = layer.forward_reference(x)
    grads_ref = torch.autograd.grad(ref.square().sum(), [x, layer.U, layer.V, layer.bias])
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_fast, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('lead', [(), (1,), (2, 1, 3)], ids=['vector', 'one-row', 'batch-2x1x3'])
@pytest.mark.parametrize('bias, rank', [(False, 2), (True, 1), (True, 7)], ids=['no-bias', 'rank-1', 'full-rank'])
def test_factorized_linear_matches_dense_reference_on_edge_shapes(lead, bias, rank):
    """The test above takes one [3, 7, 16] input with a bias at rank 5: here no bias (the first product's
    transposed-weight path, then F.linear without bias), rank 1 and full rank, and a vector, one row and a 3-D
    batch. Outputs and x, U, V (and b) gradients, float64, 1e-12 of each tensor's largest entry (sums of <= 9
    products in another order)."""
    torch.manual_seed(1)
    layer = FactorizedLinear(9, 7, rank=rank, bias=bias, **F64)
    x = torch.randn(*lead, 9, **F64)
    probe = torch.randn(*lead, 7, **F64)
    params = [layer.U, layer.V] + ([layer.bias] if bias else [])
    results = []
    for forward in (layer, layer.forward_reference):
        xs = x.clone().requires_grad_()
        out = forward(xs)
        assert out.shape == (*lead, 7)
        results.append((out.detach(), *torch.autograd.grad((out * probe).sum(), [xs, *params])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item())


@pytest.mark.parametrize('kwargs', [dict(kernel_size=3, stride=1, padding=1), dict(kernel_size=3, stride=2, padding=1),
                                    dict(kernel_size=(3, 5), stride=(2, 1), padding=(0, 2), dilation=2),
                                    dict(kernel_size=1, stride=2, padding=0, bias=False)])
def test_conv_factorisation_keeps_shapes_stride_padding(kwargs):
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 10, **kwargs, **F64)
    x = torch.randn(2, 6, 13, 11, **F64, requires_grad=True)
    full = FactorizedConv2d.from_conv(conv, rank=min(10, conv.weight[0].numel()))
    assert (full.stride, full.padding, full.dilation, full.kernel_size) == (conv.stride, conv.padding, conv.dilation,
                                                                            conv.kernel_size)
    torch.testing.assert_close(full(x), conv(x), rtol=0, atol=1e-12)          # full rank: the same conv
    low = FactorizedConv2d.from_conv(conv, rank=3)
    y = low(x)
    assert y.shape == conv(x).shape
    ref = low.forward_reference(x)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    params = [x, low.U, low.V] + ([low.bias] if low.bias is not None else [])
    for a, b in zip(torch.autograd.grad(y.sum(), params), torch.autograd.grad(ref.sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ regularisers
def _factorized_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), FactorizedConv2d(8, 12, 3, rank=4, **F64),
                         nn.Flatten(), FactorizedLinear(20, 7, rank=3, **F64)).double()


def test_frobenius_decay_value_and_gradients_equal_autograd_of_the_product_norm():
    model = _factorized_model()
    params = [p for n, p in model.named_parameters() if n.endswith(('.U', '.V'))]
    fast = frobenius_decay(model)
    ref = frobenius_decay_reference(model)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=0)
    for a, b in zip(torch.autograd.grad(fast, params), torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # and against the definition written out: ½ Σ ‖U Vᵀ‖²_F from to_dense()
    direct = 0.5 * sum(m.to_dense().pow(2).sum() for m in model if hasattr(m, 'factors'))
    torch.testing.assert_close(fast, direct, rtol=1e-12, atol=0)


def test_factor_l2_and_parameter_names():
    model = _factorized_model()
    assert factor_parameter_names(model) == ['1.U', '1.V', '3.U', '3.V']
    expected = 0.5 * sum(p.pow(2).sum() for n, p in model.named_parameters() if n.endswith(('.U', '.V')))
    torch.testing.assert_close(factor_l2(model), expected, rtol=1e-12, atol=0)
    assert frobenius_decay(nn.Linear(3, 3)).item() == 0.0     # no factorised layer: no penalty


# ------------------------------------------------------------------ effective rank
def test_effective_rank_of_known_matrices():
    assert math.isclose(effective_rank(torch.eye(7)), 7.0, rel_tol=1e-12)
    q, _ = torch.linalg.qr(torch.randn(9, 9, **F64))
    assert math.isclose(effective_rank(q), 9.0, rel_tol=1e-10)
    a, b = torch.randn(8, 1, **F64), torch.randn(1, 5, **F64)
    assert math.isclose(effective_rank(a @ b), 1.0, rel_tol=1e-10)
    assert math.isclose(effective_rank(torch.diag(torch.tensor([3.0, 1.0, 1.0, 0.0]))), 5 / 3, rel_tol=1e-12)
    assert effective_rank(torch.zeros(4, 4)) == 0.0
    assert math.isclose(effective_rank(torch.tensor([4.0, 2.0, 2.0])), 2.0)   # from singular values


def test_factor_spectra_equal_svd_of_the_product():
    model = _factorized_model()
    for module in (model[1], model[3]):
        expected = torch.linalg.svdvals(module.to_dense().flatten(1).double())[:module.rank]
        torch.testing.assert_close(singular_values(module), expected, rtol=1e-10, atol=1e-12)
    ranks = effective_ranks(model)
    assert set(ranks) == {'1', '3'} and all(1 <= r <= 4 for r in ranks.values())


# ------------------------------------------------------------------ factorize()
def _small_resnet():
    """ResNet-18's layout (stem, 8 basic blocks, 3 downsample 1×1 convs: 20 convs) at 64, 64, 128, 256 channels
    instead of 64–512: which layers save at a rank fraction does not depend on the width (a downsample conv
    C -> 2C at rank 0.7C costs 2.1C² against 2C², C -> C 1.4C² against C²; a 3×3 conv saves), and a rank-20
    3×3 conv saves at 64 channels. The float64 SVDs of the full widths were 7 s of the suite."""
    torch.manual_seed(0)
    return timm.create_model('resnet18', num_classes=5, channels=(64, 64, 128, 256)).double().eval()


def test_factorize_at_full_rank_keeps_outputs_and_reports_skipped(capsys):
    model = _small_resnet()
    x = torch.randn(2, 3, 32, 32, **F64)
    before = model(x)
    plans = plan_factorization(model, rank=1.0)
    assert plans and all(p.action == 'skip' and 'no saving' in p.reason for p in plans)
    with pytest.raises(ValueError, match='none of the .* would save'):
        factorize(model, rank=1.0)
    factorize(model, rank=1.0, skip_no_saving=False)
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert convs == ['conv1']                        # the vision preset: every conv but the first
    torch.testing.assert_close(model(x), before, rtol=1e-9, atol=1e-9)
    assert 'factorize: 19 layer(s)' in capsys.readouterr().err


def test_factorize_reports_no_saving_layers_and_keeps_outputs_at_high_rank(capsys):
    """At rank 0.7 the 1×1 downsample convs (c_in·h·w small) do not save and are skipped by name; layers
    whose weights are already of low rank come out exactly."""
    model = _small_resnet()
    with torch.no_grad():                            # make every 3×3 conv exactly rank 20
        for name, m in model.named_modules():
            if isinstance(m, nn.Conv2d) and name != 'conv1' and m.kernel_size == (3, 3):
                w = m.weight.flatten(1)
                u, s, vh = torch.linalg.svd(w, full_matrices=False)
                m.weight.copy_((u[:, :20] * s[:20] @ vh[:20]).reshape(m.weight.shape))
    x = torch.randn(2, 3, 32, 32, **F64)
    before = model(x)
    factorize(model, rank=20, include=['layer*.conv*'])
    torch.testing.assert_close(model(x), before, rtol=1e-9, atol=1e-9)
    plans = {p['name']: p for p in model.lowrank_plan}
    assert plans['layer1.0.conv1']['action'] == 'factorize'
    model2 = _small_resnet()
    factorize(model2, rank=0.7)
    skipped = [p['name'] for p in model2.lowrank_plan if p['action'] == 'skip']
    assert skipped and all('downsample' in n for n in skipped)
    err = capsys.readouterr().err
    assert 'skipped' in err and 'layer2.0.downsample.0' in err and 'no saving' in err


def test_transformer_preset_takes_qkv_and_ffn_not_the_attention_output():
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, depth=2, embed_dim=32, num_heads=2)
    factorize(model, rank=0.25, verbose=False)
    names = sorted(factorized_layers(model))
    assert names == ['blocks.0.attn.qkv', 'blocks.0.mlp.fc1', 'blocks.0.mlp.fc2',
                     'blocks.1.attn.qkv', 'blocks.1.mlp.fc1', 'blocks.1.mlp.fc2']
    assert type(model.blocks[0].attn.proj) is nn.Linear and type(model.head) is nn.Linear
    model(torch.randn(2, 3, 16, 16)).sum().backward()


@pytest.mark.parametrize('model_kwargs, expected', [
    # timm's EVA with q, k, v apart and a SwiGLU FFN (EVA-02's layout): the preset left q_proj / k_proj / v_proj and
    # fc1_g / fc1_x dense, two thirds of what the paper factorises
    (dict(model_name='eva02_tiny_patch14_224', qkv_fused=False, scale_mlp=True),
     ['attn.q_proj', 'attn.k_proj', 'attn.v_proj', 'mlp.fc1_g', 'mlp.fc1_x', 'mlp.fc2']),
    # timm's ViT with fused qkv and a SwiGLU FFN
    (dict(model_name='vit_tiny_patch16_224', mlp_layer='swiglu'), ['attn.qkv', 'mlp.fc1_g', 'mlp.fc1_x', 'mlp.fc2']),
])
def test_transformer_preset_takes_every_qkv_and_ffn_spelling(model_kwargs, expected):
    """SPEC §5: Q, K, V and both FFN matrices, whatever the model calls them; never the attention output."""
    kwargs = dict(model_kwargs)
    name = kwargs.pop('model_name')
    if kwargs.get('mlp_layer') == 'swiglu':
        from timm.layers import SwiGLU
        kwargs['mlp_layer'] = SwiGLU
    model = timm.create_model(name, img_size=16, patch_size=4, depth=1, embed_dim=32, num_heads=2, num_classes=3,
                              **kwargs)
    factorize(model, rank=0.25, verbose=False)
    assert sorted(factorized_layers(model)) == sorted(f'blocks.0.{n}' for n in expected)
    assert type(model.blocks[0].attn.proj) is nn.Linear and type(model.head) is nn.Linear
    model(torch.randn(2, 3, 16, 16)).sum().backward()


@pytest.mark.parametrize('tied_output', [False, True])
def test_factorized_crate_keeps_its_subspaces_and_tied_output(tied_output):
    """MSSA reads its qkv weight as the subspace bases U_k (white-box analysis) and, tied, as the output map
    of Eq. 12: after `factorize` both must read U Vᵀ (an nn.Linear `.weight` no longer exists)."""
    model = timm.create_model('crate_digits', depth=2, tied_output=tied_output).double()
    x = torch.randn(3, 1, 8, 8, **F64)
    before, bases = model(x), [b.attn.subspace_bases() for b in model.blocks]
    factorize(model, rank=1.0, include=['blocks.*.attn.qkv'], skip_no_saving=False, verbose=False)
    assert isinstance(model.blocks[0].attn.qkv, FactorizedLinear)
    for block, dense in zip(model.blocks, bases):
        torch.testing.assert_close(block.attn.subspace_bases(), dense, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(model(x), before, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('kwargs, message', [
    (dict(rank=0), 'rank=0'), (dict(rank=-1), 'rank=-1'), (dict(rank=1.5), 'rank=1.5'),
    (dict(rank=10_000), r'rank \(layer .*\)=10000 is out of range'),
    (dict(rank=0.3, init='svd'), "init='svd'"),
    (dict(rank=0.3, include=['blocks.*.nothing']), "include pattern 'blocks.*.nothing' matches no"),
    (dict(rank=0.3, include=['layer1.*'], exclude=['layer9.*']), "exclude pattern 'layer9.*'"),
    (dict(rank=0.3, include='transformer'), "include='transformer': the preset matches no layer"),
    # `--transform factorize skip_no_saving=false` parses to the string 'false', which was truthy
    (dict(rank=0.3, skip_no_saving='false'), "skip_no_saving='false': accepted True or False"),
    (dict(rank=0.3, include=5), 'include=5: accepted a preset'), (dict(rank=0.3, exclude=5), 'exclude=5: accepted'),
])
def test_factorize_bad_input_is_a_clear_error_and_changes_nothing(kwargs, message):
    model = _small_resnet()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    types = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=message):
        factorize(model, **kwargs)
    assert [type(m) for m in model.modules()] == types
    after = model.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    assert not hasattr(model, 'lowrank_plan')


def test_factorize_is_a_recorded_transform_that_rebuilds():
    model, recipe = build_model('vit_tiny_patch16_224', {'img_size': 16, 'patch_size': 4, 'depth': 1,
                                                         'embed_dim': 32, 'num_heads': 2},
                                transforms=[{'name': 'factorize', 'kwargs': {'rank': 0.25, 'init': 'he'}}])
    assert recipe.transforms[0]['name'] == 'factorize'
    assert recipe.transforms[0]['module'] == 'structformer.models.factorize'
    again = rebuild(recipe)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert shapes == {k: v.shape for k, v in again.state_dict().items()}
    again.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match=r"--transform factorize: unknown argument\(s\) 'rnk'; accepted: rank, init, include, exclude, skip_no_saving"):
        build_model('vit_tiny_patch16_224', {'img_size': 16, 'patch_size': 4, 'depth': 1},
                    transforms=[{'name': 'factorize', 'kwargs': {'rnk': 0.25}}])


def test_wide_resnet_sizes_and_vision_preset():
    with torch.device('meta'):
        big = timm.create_model('wrn_28_10')
    assert abs(sum(p.numel() for p in big.parameters()) - 36.5e6) / 36.5e6 < 0.002     # WRN-28-10, CIFAR-100
    model = timm.create_model('wrn_10_2_digits')
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    factorize(model, rank=0.1, init='spectral_ones', verbose=False)
    assert sorted(factorized_layers(model)) == sorted(convs[1:]) and type(model.stem) is nn.Conv2d
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ValueError, match='depth=12'):
        timm.create_model('wrn_28_10', depth=12)


def test_the_vision_preset_leaves_out_the_stem_even_when_the_stem_cannot_be_factorised():
    """timm's tf_* models have a Conv2dSame stem (never eligible): 'every conv but the first' dropped the first
    eligible conv instead, a block's conv (tf_efficientnetv2_b0: blocks.0.0.conv stayed dense)."""
    from timm.layers import Conv2dSame
    model = nn.Sequential(Conv2dSame(3, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                          nn.Conv2d(16, 16, 3, padding=1))
    assert [p.name for p in plan_factorization(model, 0.25)] == ['2', '3']
    dense = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv2d(16, 16, 3), nn.Conv2d(16, 16, 3))
    assert [p.name for p in plan_factorization(dense, 0.25)] == ['1', '2']         # a plain stem: as before


def test_factorizing_twice_is_refused_by_naming_the_factorised_layers():
    """A second `factorize` finds no dense layer where the first replaced them. It said the preset "matches no
    layer" and, for a WRN (whose factorised convs no longer counted as convs), that the *transformer* preset
    matched nothing, suggesting `stem, head`; now it names the factorised layers and changes nothing."""
    model = timm.create_model('wrn_10_2_digits')
    factorize(model, rank=0.25, verbose=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"include='vision': the model is already factorised there \(9 layer"):
        factorize(model, rank=0.25, verbose=False)
    with pytest.raises(ValueError, match=r"include pattern 'stages.0.\*': the model is already factorised there"):
        factorize(model, rank=0.25, include=['stages.0.*'], verbose=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    factorize(model, rank=2, include=['head'], verbose=False)          # a layer still dense is still taken
    assert 'head' in factorized_layers(model)


def test_layers_that_cannot_be_factorised_are_named_with_what_they_lack(capsys):
    """Only grouped / 'same'-padded convs chosen: the error said no layer would 'save parameters' and advised a
    lower rank or skip_no_saving=False, neither of which can help."""
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv2d(16, 16, 3, groups=16), nn.Conv2d(16, 16, 3, padding='same'),
                          nn.Conv2d(16, 32, 3))
    with pytest.raises(ValueError) as caught:
        factorize(model, 0.25, include=['1', '2'])
    message = str(caught.value)
    assert "1 (grouped (groups=16)), 2 (padding='same')" in message and 'groups=1' in message
    assert 'skip_no_saving' not in message and 'lower the rank' not in message
    assert not factorized_layers(model)                          # nothing replaced
    factorize(model, 0.25, include=['1', '2', '3'])
    assert "skipped 2: 1 (not factorisable: grouped (groups=16)), 2 (not factorisable: padding='same')" in \
        capsys.readouterr().err
    assert list(factorized_layers(model)) == ['3']


@pytest.mark.parametrize('make', [lambda **dd: FactorizedLinear(12, 8, rank=3, **dd),
                                  lambda **dd: FactorizedLinear(12, 8, rank=0.5, init='he', bias=False, **dd),
                                  lambda **dd: FactorizedConv2d(3, 4, 3, rank=2, padding=1, **dd),
                                  lambda **dd: FactorizedConv2d(3, 4, (3, 1), rank=2, init='spectral_ones', **dd)])
def test_a_meta_built_factorised_layer_is_initialised_by_to_empty_and_reset_parameters(make):
    """torch's deferred initialisation (build on the meta device, `to_empty`, `reset_parameters()` on every module)
    gives the layer its constructor's initialisation (nn.Linear's / nn.Conv2d's init factorised by `init`); the
    layers had no reset_parameters, so U, V and the bias kept `to_empty`'s uninitialised memory."""
    torch.manual_seed(0)
    reference = make()
    from deferred_init import deferred_init
    layer = deferred_init(make, seed=0)
    expected = reference.state_dict()
    for name, value in layer.state_dict().items():    # the same draws, the same SVD: float32 rounding at most
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6 * float(expected[name].abs().max()))


@pytest.mark.parametrize('option, bad', [('kernel_size', 2.5), ('kernel_size', (3,)), ('kernel_size', (3, 3, 3)),
                                         ('stride', '3'), ('stride', (1, 2, 3)), ('dilation', '2'),
                                         ('padding', (1, 1, 1)), ('padding', 1.5)])
def test_factorized_conv_names_a_bad_size_before_it_is_built(option, bad):
    """A 2-D convolution's sizes are an integer or an (H, W) pair: kernel_size=2.5 failed with "'float' object is not
    iterable", (3,) with an IndexError; (3, 3, 3), stride '3' or (1, 2, 3) built a layer whose first forward failed
    inside F.conv2d ("expected stride to be a single integer value or a list of 2 values")."""
    kwargs = dict(in_channels=3, out_channels=4, kernel_size=3, rank=2)
    kwargs[option] = bad
    with pytest.raises(ValueError, match=rf'^{option}={re.escape(repr(bad))} must be '):
        FactorizedConv2d(**kwargs)
