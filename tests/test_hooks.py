"""structformer.hooks.capture: pattern matching, what is recorded, and that nothing stays attached."""
import pytest
import timm
import torch

from structformer.hooks import capture, match_modules
from structformer.layers.linear import StructuredLinear


def test_patterns_match_whole_segments():
    model = timm.create_model('crate_digits')
    assert list(match_modules(model, 'blocks.*')) == [f'blocks.{i}' for i in range(4)]
    assert list(match_modules(model, 'blocks.1.mlp')) == ['blocks.1.mlp']
    assert list(match_modules(model, '**.norm2')) == [f'blocks.{i}.norm2' for i in range(4)]
    assert 'patch_embed.norm_in' in match_modules(model, '**.norm_*')
    with pytest.raises(ValueError, match=r"'blocks\.\*\.mlpx' matches no sub-module of CRATE"):
        match_modules(model, 'blocks.*.mlpx')


def test_capture_records_what_the_modules_saw_and_removes_its_hooks():
    torch.manual_seed(0)
    model = timm.create_model('crate_digits').eval()
    x = torch.randn(3, 1, 8, 8)
    with capture(model, outputs='blocks.*.mlp', inputs='blocks.0') as seen:
        model(x)
        model(x[:1])
    assert len(seen.outputs['blocks.3.mlp']) == 2 and seen.outputs['blocks.3.mlp'][1].shape == (1, 17, 64)
    # the last block's output is what forward_features returns; block 0's input is the embedding
    torch.testing.assert_close(seen.outputs['blocks.3.mlp'][0], model.forward_features(x))
    torch.testing.assert_close(seen.inputs['blocks.0'][0], model._embed(x))
    assert not seen.outputs['blocks.0.mlp'][0].requires_grad
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_capture_streams_to_a_callback_and_cleans_up_after_an_error():
    model = timm.create_model('crate_digits')
    calls = []
    with pytest.raises(RuntimeError, match='boom'):
        with capture(model, outputs='blocks.*', callback=lambda kind, name, t: calls.append((kind, name))):
            model(torch.randn(1, 1, 8, 8))
            raise RuntimeError('boom')
    assert calls == [('output', f'blocks.{i}') for i in range(4)]
    assert all(not m._forward_hooks for m in model.modules())


def test_capture_can_keep_the_graph_for_losses():
    model = timm.create_model('crate_digits')
    with capture(model, outputs='blocks.0.attn', detach=False) as seen:
        model(torch.randn(2, 1, 8, 8))
    seen.outputs['blocks.0.attn'][0].square().sum().backward()
    assert model.blocks[0].attn.qkv.weight.grad is not None


class _Diagonal(StructuredLinear):
    """The smallest structured layer: W = diag(d), applied as an elementwise product."""

    def __init__(self, features):
        super().__init__(features, features)
        self.d = torch.nn.Parameter(torch.randn(features))

    def to_dense(self):
        return torch.diag(self.d)

    def forward(self, x):
        return x * self.d + self.bias


def test_structured_linear_interface_and_reference():
    layer = _Diagonal(5)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    layer = layer.double()
    torch.testing.assert_close(layer(x), layer.forward_reference(x))
    assert 'in_features=5, out_features=5, bias=True' in repr(layer)
    with pytest.raises(ValueError, match='^in_features=0 must be a positive integer$'):
        StructuredLinear(0, 3)
    with pytest.raises(NotImplementedError, match='to_dense'):
        StructuredLinear(2, 3)(torch.randn(1, 2))
