"""Linear interpolation between a dense and a low-rank network (seed 004 Fig. 2): densify reproduces
the factorised network, the curve's endpoints are the two networks, mismatches are clear errors."""
import json

import pytest
import timm
import torch

from structformer.cli import main
from structformer.models.factorize import factorize
from structformer.analysis.interpolate import densify, interpolate_parameters, interpolation_curve
from structformer.train import evaluate


def _pair():
    torch.manual_seed(0)
    dense = timm.create_model('wrn_10_2_digits').eval()
    low = factorize(timm.create_model('wrn_10_2_digits'), rank=0.3, verbose=False).eval()
    return dense, low


def test_densify_applies_the_same_function():
    _, low = _pair()
    x = torch.randn(4, 1, 8, 8)
    dense = densify(low)
    assert not any(hasattr(m, 'factors') for m in dense.modules())
    torch.testing.assert_close(dense(x), low(x), rtol=1e-5, atol=1e-5)


def test_curve_endpoints_are_the_two_networks():
    dense, low = _pair()
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    loader = [(x[:16], y[:16]), (x[16:], y[16:])]
    rows = interpolation_curve(dense, low, loader, [0.0, 0.5, 1.0])
    assert rows[0]['loss'] == pytest.approx(evaluate(dense, loader, 'cpu')['loss'], rel=1e-5)
    assert rows[-1]['loss'] == pytest.approx(evaluate(low, loader, 'cpu')['loss'], rel=1e-4)
    half = interpolate_parameters(dense.state_dict(), densify(low).state_dict(), 0.5)
    key = 'stages.0.0.conv1.weight'
    torch.testing.assert_close(half[key], (dense.state_dict()[key] + densify(low).state_dict()[key]) / 2)
    with pytest.raises(ValueError, match='differ in their parameters'):
        interpolate_parameters(dense.state_dict(), timm.create_model('wrn_16_2_mnist').state_dict(), 0.5)


def test_analyze_interpolate_end_to_end(tmp_path, capsys):
    common = ['--data', 'digits', '--epochs', '1', '--limit-train-batches', '2', '--no-progress']
    assert main(['train', '--model', 'wrn_10_2_digits', '--output', str(tmp_path / 'dense'), *common]) == 0
    assert main(['train', '--model', 'wrn_10_2_digits', '--rank', '0.2', '--output', str(tmp_path / 'low'),
                 *common]) == 0
    out = tmp_path / 'interp'
    assert main(['analyze', '--checkpoint', str(tmp_path / 'dense'), '--interpolate', str(tmp_path / 'low'),
                 '--interpolate-steps', '3', '--num-samples', '64', '--output', str(out)]) == 0
    report = json.loads((out / 'interpolation.json').read_text())
    assert [r['t'] for r in report['curve']] == [0.0, 0.5, 1.0] and report['samples'] == 64
    assert report['seed'] == 0 and report['data_seed'] == 0      # which held-out images (a --seed picks others)
    assert (out / 'interpolation.png').exists()
    capsys.readouterr()
    for steps in ('1', '1002'):                  # refused by the parser: [2, 1001]
        with pytest.raises(SystemExit) as e:
            main(['analyze', '--checkpoint', str(tmp_path / 'dense'), '--interpolate', str(tmp_path / 'low'),
                  '--interpolate-steps', steps, '--output', str(out)])
        assert e.value.code == 2 and '--interpolate-steps must be an integer in [2, 1001]' in capsys.readouterr().err
    assert main(['analyze', '--checkpoint', str(tmp_path / 'dense'), '--interpolate', str(tmp_path / 'nothing'),
                 '--output', str(out)]) == 2
    assert '--interpolate' in capsys.readouterr().err
