"""Counts a user reads: the README's model table against the models it names, and where `models --flops` puts
the Mixer family's multiply-adds (closed forms of Eq. S.1-S.17)."""
import itertools
import re
from pathlib import Path

import pytest
import timm
import torch

import structformer  # noqa: F401  (registers the models)
from structformer.bench.flops import model_flops

README = Path(__file__).resolve().parents[1] / 'README.md'


def _expand(pattern: str):
    """`crate_{tiny,small}_x` -> ['crate_tiny_x', 'crate_small_x'] (shell-style braces, as the table writes them)."""
    parts = re.split(r'\{([^}]*)\}', pattern)
    choices = [[p] if i % 2 == 0 else p.split(',') for i, p in enumerate(parts)]
    return [''.join(c) for c in itertools.product(*choices)]


def _printed(text: str):
    """'52.8K' -> (52800, 50): the value and half a unit of its last printed digit."""
    match = re.fullmatch(r'([\d.]+)([KM])', text.strip())
    assert match, text
    scale = {'K': 1e3, 'M': 1e6}[match[2]]
    decimals = len(match[1].split('.')[1]) if '.' in match[1] else 0
    return float(match[1]) * scale, 0.5 * scale * 10 ** -decimals


def _model_rows():
    lines = README.read_text().split('## Models', 1)[1].split('\n## ', 1)[0].splitlines()
    for line in lines:
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if len(cells) != 3 or not cells[0].startswith('`') or '…' in cells[0] or '<' in cells[0]:
            continue
        names = [n for pattern in re.findall(r'`([^`]+)`', cells[0]) for n in _expand(pattern)]
        yield names, cells[2]


def _params(name: str) -> int:
    with torch.device('meta'):
        return sum(p.numel() for p in timm.create_model(name).parameters())


@pytest.mark.parametrize('names, printed', list(_model_rows()), ids=lambda v: v[0] if isinstance(v, list) else None)
def test_readme_model_table_gives_the_built_parameter_counts(names, printed):
    """Each count (or 'low – high' range) in the README's table is what the named models have, to its printed digits
    (the S-Mixer rows kept 72.5K / 21.4K after issue 34 took their mixing biases away: 71.5K / 21.0K)."""
    counts = [_params(n) for n in names]
    if '–' in printed:
        expected = [min(counts), max(counts)]
        values = printed.split('–')
    else:
        expected, values = counts, printed.split('/')
    assert len(values) == len(expected), (names, printed)
    for text, count in zip(values, expected):
        value, half_unit = _printed(text)
        assert abs(value - count) <= half_unit, f"README prints {text.strip()} for a model of {count:,} parameters"


def test_mixer_and_sw_mlp_multiply_adds_are_counted_as_mlp():
    """mixer_digits (S = 16, C = 32, C0 = 4, L = 4, gamma = 2) and swmlp_digits (m = 128, L = 2): the token and channel
    MLPs, and SW-MLP's sparse-weight blocks, are the 'mlp' column (they were all 'other' before), by closed form."""
    S, C, C0, L, gamma = 16, 32, 4, 4, 2
    parts = model_flops('mixer_digits')['breakdown_macs']
    token, channel = 2 * C * S * gamma * S, 2 * S * C * gamma * C           # fc1 + fc2 of each, per block
    assert parts == {'stem': S * C0 * C, 'downsampling': 0, 'attention': 0, 'mlp': L * (token + channel),
                     'head': C * 10, 'other': 0}
    m, depth = 16 * 8, 2
    parts = model_flops('swmlp_digits')['breakdown_macs']
    assert parts == {'stem': 16 * 4 * 8, 'downsampling': 0, 'attention': 0, 'mlp': depth * m * m, 'head': m * 10,
                     'other': 0}
