"""`structformer bench lowrank` runs end to end at a tiny size (tests never time things: only the
structure of the report, its exact FLOP ratios and its memory accounting are checked)."""
import json

import pytest

from structformer.cli import main


def test_bench_lowrank_tiny_run_writes_consistent_ratios(tmp_path, capsys):
    out = tmp_path / 'lowrank.json'
    assert main(['bench', 'lowrank', '--tokens', '32', '--in-features', '16', '--out-features', '64', '--ranks', '0.25',
                 '--depth', '1', '--batch-size', '1', '--steps', '1', '--rounds', '1', '--output', str(out)]) == 0
    report = json.loads(out.read_text())
    layer = {r['label']: r for r in report['layer']}
    assert set(layer) == {'dense nn.Linear', 'dense, oneDNN kernels', 'FactorizedLinear r=4 (0.25)',
                          'FactorizedLinear r=4 (0.25), torch kernels', 'two nn.Linear r=4 (0.25)'}
    fact = layer['FactorizedLinear r=4 (0.25)']
    # 'same kernels': that round's time of the dense layer on oneDNN's kernels / the row's
    assert fact['speedup_same_kernels'] == pytest.approx(layer['dense, oneDNN kernels']['step_s'] / fact['step_s'])
    assert layer['FactorizedLinear r=4 (0.25), torch kernels']['params'] == fact['params']
    assert fact['flop_ratio'] == pytest.approx(16 * 64 / (4 * 80))          # mn / r(m + n)
    # one paired round: the speed-up is that round's dense / factorised time, and its quartiles collapse on it
    assert fact['speedup'] == pytest.approx(layer['dense nn.Linear']['step_s'] / fact['step_s'])
    assert fact['speedup_q1'] == fact['speedup'] == fact['speedup_q3']
    assert fact['params'] == 4 * 80 + 64
    # memory: 3 x parameter bytes (weights, grads, momentum) + saved activations (h: tokens x r, float32)
    assert fact['memory_mib'] * 2 ** 20 == 3 * 4 * fact['params'] + 4 * 32 * 4
    assert layer['dense nn.Linear']['memory_mib'] * 2 ** 20 == 3 * 4 * (16 * 64 + 64)   # saves only x and W
    stack = report['stack']
    assert [r['label'] for r in stack] == ['ViT-S blocks, dense', 'ViT-S blocks, dense, oneDNN kernels',
                                           'ViT-S blocks, rank 0.25']
    assert stack[1]['flop_ratio'] == 1 and stack[1]['params'] == stack[0]['params']
    assert 2.5 < stack[2]['flop_ratio'] < 3.5 and stack[2]['memory_ratio'] < 1
    # the goal is judged on FactorizedLinear itself, not on its torch-kernels twin
    assert [g['part'] for g in report['goals']] == ['layer', 'stack']
    assert report['goals'][0]['measured_speedup'] == fact['speedup']
    assert 'ViT-S block stack' in capsys.readouterr().out


def test_bench_lowrank_stack_factorises_every_linear_at_any_rank(tmp_path):
    """Above rank 0.5 attn.proj (384×384) saves nothing; the stack still factorises it, as its title says,
    rather than aborting (rank 1.0) or skipping it silently (rank 0.6)."""
    out = tmp_path / 'lowrank.json'
    assert main(['bench', 'lowrank', '--tokens', '8', '--in-features', '16', '--out-features', '16', '--ranks', '0.6',
                 '1.0', '--depth', '1', '--batch-size', '1', '--steps', '1', '--rounds', '1', '--output', str(out)]) == 0
    stack = {r['label']: r for r in json.loads(out.read_text())['stack']}
    d = 384
    for frac in (0.6, 1.0):
        r = round(frac * d)
        expected = r * (d + 3 * d) + r * (d + d) + r * (d + 4 * d) + r * (4 * d + d)    # qkv, proj, fc1, fc2
        dense_linear = 3 * d * d + d * d + 2 * 4 * d * d
        assert stack[f'ViT-S blocks, rank {frac:g}']['params'] - stack['ViT-S blocks, dense']['params'] == \
            expected - dense_linear


@pytest.mark.parametrize('argv, message', [(['--ranks', '0'], '--ranks'), (['--ranks', '1.5'], '--ranks'),
                                           (['--tokens', '0'], '--tokens'), (['--depth', '-1'], '--depth')])
def test_bench_lowrank_bad_arguments(argv, message, capsys):
    assert main(['bench', 'lowrank', *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize('rank', [None, 3])
def test_gemm_products_are_the_products_a_training_step_runs(rank):
    """The ceiling's product list against FlopCounterMode on a real step (input grad included): the same
    multiply-adds in all, so the ceiling times the work the layer's step does."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from structformer.bench.lowrank import gemm_products
    from structformer.functional.onednn_linear import torch_kernels
    from structformer.layers.linear.factorized import FactorizedLinear
    tokens, n, m = 12, 10, 14
    layer = torch.nn.Linear(n, m, bias=False) if rank is None else FactorizedLinear(n, m, rank=rank, bias=False)
    x = torch.randn(tokens, n, requires_grad=True)
    with torch_kernels(), FlopCounterMode(display=False) as counter:
        layer(x).sum().backward()
    expected = [2 * a * k * b for _, (a, k, b) in gemm_products(tokens, n, m, rank)]
    assert counter.get_total_flops() == sum(expected)
    assert len(expected) == (3 if rank is None else 6)


def test_bench_lowrank_records_the_gemm_ceiling_and_a_miss_cites_it(tmp_path):
    from structformer.bench.lowrank import kind_goals
    out = tmp_path / 'lowrank.json'
    assert main(['bench', 'lowrank', '--tokens', '32', '--in-features', '16', '--out-features', '64', '--ranks', '0.25',
                 '--depth', '0', '--steps', '1', '--rounds', '1', '--output', str(out)]) == 0
    report = json.loads(out.read_text())
    [ceiling] = report['gemms']
    assert ceiling['r'] == 4 and len(ceiling['dense']) == 3 and len(ceiling['products']) == 6
    assert [p['shape'] for p in ceiling['products']] == [[32, 16, 4], [32, 4, 64], [32, 64, 4], [64, 32, 4],
                                                         [32, 4, 16], [4, 32, 16]]
    assert ceiling['ceiling_q1'] <= ceiling['ceiling'] <= ceiling['ceiling_q3'] and ceiling['rounds'] == 5
    assert ceiling['efficiency'] == pytest.approx(ceiling['ceiling'] / (16 * 64 / (4 * 80)))
    for p in ceiling['dense'] + ceiling['products']:
        a, k, b = p['shape']
        assert p['gflops'] == pytest.approx(2 * a * k * b / p['ms'] / 1e6)
    # at the goal's shape, a miss names what the GEMMs alone allow (rows and ceiling made up: no timing here)
    args = type('A', (), {'tokens': 4096, 'in_features': 1024, 'out_features': 4096})()
    rows = [{'label': 'dense nn.Linear', 'rank': None, 'step_s': 3.0, 'speedup': 1.0, 'speedup_q1': 1, 'speedup_q3': 1,
             'flop_ratio': 1.0},
            {'label': 'dense, oneDNN kernels', 'rank': None, 'step_s': 3.0, 'speedup': 1.0, 'speedup_q1': 1,
             'speedup_q3': 1, 'flop_ratio': 1.0},
            {'label': 'FactorizedLinear r=256 (0.25)', 'rank': 0.25, 'step_s': 1.2, 'speedup': 2.5, 'speedup_q1': 2.4,
             'speedup_q3': 2.6, 'flop_ratio': 3.2, 'speedup_same_kernels': 2.5}]
    fake = [{'rank': 0.25, 'ceiling': 2.9, 'efficiency': 2.9 / 3.2}]
    [entry] = kind_goals(rows, [], args, {'threads': 1}, None, fake)
    assert 'allow 2.90×' in entry['bound'] and '91% of the dense' in entry['bound'] and 'the kernels, not' in entry['bound']
    fake[0]['ceiling'] = 3.1
    [entry] = kind_goals(rows, [], args, {'threads': 1}, None, fake)
    assert 'allow 3.10×' in entry['bound'] and 'the kernels, not' not in entry['bound']
