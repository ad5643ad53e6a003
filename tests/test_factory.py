"""One way to build a model: the factory, recorded transforms, and rebuilding a run from its directory."""
import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from structformer.models.factory import ModelRecipe, build_model, rebuild
from structformer.models.transforms import TRANSFORMS, normalize_transforms, register_transform
from structformer.train import CheckpointError, TrainConfig, load_model, train

# A toy transform kept in its own module file, so a fresh process can import it the way a user's
# own module would be imported before loading a run.
TOY_MODULE = textwrap.dedent('''
    import torch
    from structformer.models.transforms import register_transform

    class Scaled(torch.nn.Module):
        """Multiplies the wrapped head's output by a fixed factor and adds a learned offset."""
        def __init__(self, inner, factor):
            super().__init__()
            self.inner, self.factor = inner, factor
            self.offset = torch.nn.Parameter(torch.zeros(inner.out_features))
        def forward(self, x):
            return self.inner(x) * self.factor + self.offset

    @register_transform('toy_scale_head')
    def toy_scale_head(model, context, factor=1.0):
        model.head = Scaled(model.head, factor)
        return model
''')


@pytest.fixture()
def toy_transform(tmp_path, monkeypatch):
    (tmp_path / 'toy_transforms.py').write_text(TOY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import toy_transforms  # noqa: F401
    yield tmp_path
    TRANSFORMS.pop('toy_scale_head', None)
    sys.modules.pop('toy_transforms', None)


DATA = SimpleNamespace(num_classes=3, in_chans=1, img_size=8)


def test_build_model_takes_data_facts_unless_kwargs_set_them():
    model, recipe = build_model('crate_digits', {'depth': 2}, data=DATA)
    assert model.num_classes == 3 and len(model.blocks) == 2
    assert recipe.kwargs == {'num_classes': 3, 'in_chans': 1, 'depth': 2}   # 8 px is the default: not recorded
    assert recipe.input_size == (1, 8, 8) and recipe.transforms == []
    model, recipe = build_model('crate_digits', {'num_classes': 5}, data=DATA)
    assert model.num_classes == 5


def test_rebuild_gives_the_same_network(toy_transform):
    model, recipe = build_model('crate_digits', data=DATA, transforms=[('toy_scale_head', {'factor': 2.0})])
    again = rebuild(ModelRecipe.from_dict(json.loads(json.dumps(recipe.to_dict()))))
    assert again.head.factor == 2.0
    again.load_state_dict(model.state_dict())
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(again.eval()(x), model.eval()(x), rtol=0, atol=0)   # same code path


def test_lazy_parameters_are_shaped_by_a_recorded_transform():
    kwargs = {'patch_size': 2, 'attn_layer': 'soft', 'attn_kwargs': {'num_landmarks': 4}}
    model, recipe = build_model('vit_tiny_patch16_224', kwargs, data=SimpleNamespace(num_classes=10, in_chans=1,
                                                                                        img_size=8))
    assert [t['name'] for t in recipe.transforms] == ['materialize_lazy']
    assert not any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in model.parameters())
    again = rebuild(recipe)
    again.load_state_dict(model.state_dict())           # shapes agree without any data at hand


def test_lazy_parameters_are_shaped_on_the_models_device_and_dtype():
    """`materialize_lazy` through the Python API on a model already moved or cast (e.g. after `.cuda()`): its dry
    forward's zeros are made like the shaped weights, and the lazy weights follow them. float64 stands in for a GPU
    here: the CPU float32 zeros met the first layer's float64 weights as they met CUDA weights there."""
    import timm

    from structformer.layers.attention.registry import with_defaults
    from structformer.layers.attention.soft import SoftAttention
    from structformer.models.transforms import TransformContext, apply_transforms
    model = timm.create_model('vit_tiny_patch16_224', patch_size=2, in_chans=1, img_size=8, num_classes=10, depth=1,
                              attn_layer=with_defaults(SoftAttention, num_landmarks=4)).double()
    assert any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in model.parameters())
    apply_transforms(model, [{'name': 'materialize_lazy'}], TransformContext(input_size=(1, 8, 8)))
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert model.eval()(torch.zeros(2, 1, 8, 8, dtype=torch.float64)).shape == (2, 10)


def test_transform_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown model transform 'no_such'"):
        build_model('crate_digits', transforms=['no_such'])
    with pytest.raises(ValueError, match='JSON'):
        normalize_transforms([('materialize_lazy', {'x': object()})])
    with pytest.raises(ValueError, match='materialize_lazy'):
        build_model('crate_digits', transforms=[('materialize_lazy', {'bogus': 1})])


def test_register_transform_refuses_a_second_function_under_one_name():
    with pytest.raises(ValueError, match='already registered'):
        register_transform('materialize_lazy')(lambda model, context: model)


@pytest.mark.slow
def test_trained_run_with_a_transform_reloads_in_a_fresh_process(toy_transform, tmp_path):
    run = tmp_path / 'run'
    train(TrainConfig(model='crate_digits', data='digits', epochs=1, lr=3e-3, output=str(run),
                      model_kwargs={'depth': 1}, transforms=[{'name': 'toy_scale_head', 'kwargs': {'factor': 0.5}}],
                      limit_train_batches=3, warmup_epochs=0), progress=False)
    state = json.loads((run / 'checkpoints' / 'epoch_0001' / 'state.json').read_text())
    assert state['recipe']['transforms'][0]['name'] == 'toy_scale_head'
    model, _ = load_model(run)
    assert model.head.factor == 0.5 and model.head.offset.abs().sum() > 0      # trained, and rebuilt with it
    images = torch.linspace(0, 1, 2 * 64).reshape(2, 1, 8, 8)
    with torch.no_grad():
        here = model(images)
    code = textwrap.dedent(f'''
        import json, sys, torch
        sys.path.insert(0, {str(toy_transform)!r})
        import toy_transforms
        from structformer.train import load_model
        model, _ = load_model({str(run)!r})
        with torch.no_grad():
            print(json.dumps(model(torch.linspace(0, 1, 2 * 64).reshape(2, 1, 8, 8)).tolist()))
    ''')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
    there = torch.tensor(json.loads(out.stdout.strip().splitlines()[-1]))
    torch.testing.assert_close(there, here, rtol=0, atol=0)      # same code, same weights: identical logits

    TRANSFORMS.pop('toy_scale_head')                                    # a process that never imported it
    with pytest.raises(CheckpointError, match=r"unknown model transform 'toy_scale_head' \(it was registered by "
                                              r"module 'toy_transforms'"):
        load_model(run)


def test_old_state_without_a_recipe_still_loads():
    state = {'model': 'crate_digits', 'model_kwargs': {'depth': 1}}
    recipe = ModelRecipe.from_state(state)
    assert recipe.name == 'crate_digits' and recipe.transforms == []
    assert len(rebuild(recipe).blocks) == 1


def test_timms_own_vit_with_linformer_has_its_projections_at_build():
    """timm's vit_* with Linformer attention through structformer (build_model's attn_layer='linformer', the
    swap_attention transform, swap_attention on a built model): E, F exist when the call returns, so an optimiser made
    right after sees them; no lazy-parameter warning at the first forward. Built by timm.create_model directly with
    the class, timm tells the layer no token count: lazy until shape_sequence_projections (or the first forward)."""
    import warnings

    import timm

    from structformer.layers.attention.linformer import LinformerAttention
    from structformer.layers.attention.registry import with_defaults
    from structformer.models.attention_swap import shape_sequence_projections, swap_attention
    kwargs = dict(img_size=16, patch_size=4, depth=1, embed_dim=32, num_heads=2, num_classes=3)
    linformer = {'attn_layer': 'linformer', 'attn_kwargs': {'num_landmarks': 4}}
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        built = [build_model('vit_tiny_patch16_224', dict(kwargs, **linformer))[0],
                 build_model('vit_tiny_patch16_224', kwargs, transforms=[
                     {'name': 'swap_attention', 'kwargs': {'attn': 'linformer', 'num_landmarks': 4}}])[0],
                 swap_attention(timm.create_model('vit_tiny_patch16_224', **kwargs), 'linformer', num_landmarks=4),
                 shape_sequence_projections(timm.create_model(
                     'vit_tiny_patch16_224', attn_layer=with_defaults(LinformerAttention, num_landmarks=4), **kwargs))]
        for model in built:
            e = model.blocks[0].attn.seq_proj.e
            assert not isinstance(e, torch.nn.parameter.UninitializedParameter) and e.shape == (4, 17)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            assert any(p is e for group in optimizer.param_groups for p in group['params'])
            model(torch.randn(2, 3, 16, 16)).sum().backward()
            assert e.grad is not None
