"""Issue 34, item 6: the S-Mixer's mixing layers have no biases (Eq. S.3, S.7–S.8), and the Mixer reproduction
reports the SW-MLP density it really used (the width is rounded to a multiple of S₀)."""
import math

import pytest
import torch
from timm import create_model

import structformer.models  # noqa: F401  (registers the models)
from structformer.layers.linear import PKLinear
from structformer.models.mixer import SparseMixer


def _pk_biases(model):
    return [m.bias for m in model.modules() if isinstance(m, PKLinear) and m.bias is not None]


@pytest.mark.parametrize('name', ['smixer_mnist', 'rp_smixer_mnist', 'smixer_cifar', 'rp_smixer_cifar'])
def test_paper_smixers_have_no_mixing_biases(name):
    assert _pk_biases(create_model(name)) == []


def test_mixing_bias_is_an_option_and_mlp_mixer_blocks_keep_timms():
    assert _pk_biases(create_model('mixer_digits'))                   # MLP-Mixer blocks: as timm's MlpMixer
    with_bias = SparseMixer(img_size=8, patch_size=2, in_chans=1, embed_dim=8, depth=2, mixing_bias=True)
    assert len(_pk_biases(with_bias)) == 4                            # token and channel mixing, two blocks
    plain = SparseMixer(img_size=8, patch_size=2, in_chans=1, embed_dim=8, depth=2)
    # the bias-free S-Mixer is the biased one with zero biases (they start at zero): same function at init
    plain.load_state_dict({k: v for k, v in with_bias.state_dict().items() if k in plain.state_dict()})
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(plain(x), with_bias(x))


def test_reproduction_reports_the_realised_sw_mlp_density():
    """Requested p = 1/2, 1/8, 1/32 at Ω = 2¹⁵ give widths 245, 490, 1029 (multiples of S₀ = 49) and realised
    densities Ω/m² = 0.546, 0.136, 0.031: the runs use those, and the report's width table prints them."""
    import argparse

    from structformer.reproduce import mixer
    p = argparse.ArgumentParser()
    mixer.add_arguments(p)
    args = p.parse_args([])
    rows = [dict(r, val_top1=98.0) for r in mixer.plan(args, 49) if r['group'] == 'width']
    sw = [r for r in rows if r['kind'] == 'SW-MLP']
    for r, requested in zip(sw, args.sw_densities):
        assert r['width'] % 49 == 0 and r['width'] == 49 * round(math.sqrt(args.omega / requested) / 49)
        assert r['density'] == pytest.approx(args.omega / r['width'] ** 2)
    report = mixer._report(rows, [], {}, {}, [])
    lines = [line for line in report.splitlines() if line.startswith('| SW-MLP')]
    assert [line.split(' | ')[5] for line in lines] == ['0.546', '0.136', '0.031']
    assert '| density p |' in report


def test_rp_channels_on_a_plain_mixer_is_refused_not_ignored():
    """rp_channels permutes an RP-Mixer's channel mixing; on permutation='mixer' it was silently dropped."""
    with pytest.raises(ValueError, match="rp_channels=True .* needs permutation='random'"):
        create_model('mixer_digits', rp_channels=True)
    assert create_model('rp_mixer_digits', rp_channels=True).blocks[0].mlp_channels.fc1.perm_in_kind == 'random'
