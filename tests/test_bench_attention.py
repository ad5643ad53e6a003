"""`structformer bench attention` (SOFT Fig. 1b sweep) on a tiny configuration, run in this process."""
import argparse
import json

import pytest
import torch

from structformer.bench.attention import add_arguments as add_attention_bench_arguments, build_layer, goal_ratios, grid_for, run as run_attention_bench
from structformer.bench.flops import counted_flops, linear_flops, softmax_flops


def _args(*argv):
    p = argparse.ArgumentParser()
    add_attention_bench_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope='module')
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('bench') / 'attention.json'
    args = _args('--base-tokens', '64', '--multipliers', '1', '4', '--attn', 'softmax_naive', 'soft',
                 '--landmarks', '16', '--repeats', '1', '--warmup', '0', '--in-process', '--output', str(out))
    assert run_attention_bench(args) == 0
    return json.loads(out.read_text()), out


def test_every_row_measured(tiny_run):
    result, out = tiny_run
    rows = {(r['attention'], r['tokens']): r for r in result['rows']}
    assert set(rows) == {(a, n) for a in ('softmax_naive', 'soft') for n in (64, 256)}
    for r in rows.values():
        assert not r['skipped']
        assert r['forward_ms'] > 0 and r['forward_backward_ms'] > 0
        assert r['flops_counted_forward'] > 0 and r['flops_counted_forward_backward'] > r['flops_counted_forward']
        assert r['flops_analytic_core_forward'] > 0 and r['flops_analytic_formula']
    assert rows[('soft', 256)]['grid'] == [16, 16]
    assert out.with_suffix('.png').stat().st_size > 0


def test_grids_follow_fig1b_axis():
    assert [grid_for(784, k) for k in (1, 2, 4, 8, 16)] == [(28, 28), (28, 56), (56, 56), (56, 112), (112, 112)]


@pytest.mark.parametrize('n', [64, 256])
def test_flop_counter_matches_softmax_formula(n):
    # QKᵀ and AV are each n·n·d multiply-adds per head, 2 FLOPs per multiply-add:
    # core = heads · 2 · (2 · n² · d). The qkv / proj Linear layers are counted separately and removed.
    dim, heads = 64, 2
    grid = grid_for(n, 1)
    layer = build_layer('softmax_naive', dim, heads, 16, grid)
    counted = counted_flops(layer, torch.randn(1, n, dim), grid) - linear_flops(layer, n)
    expected = softmax_flops(n, dim // heads, heads)
    assert expected == heads * 2 * (2 * n * n * (dim // heads))
    assert abs(counted - expected) <= 0.1 * expected


@pytest.mark.parametrize('argv, flag', [
    (['--multipliers', '0'], '--multipliers'),
    (['--attn', 'softmax', 'no_such_attention'], '--attn'),
    (['--repeats', '0'], '--repeats'),
    (['--landmarks', '100', '--base-tokens', '64'], '--landmarks'),
    (['--max-quadratic-gib', '0'], '--max-quadratic-gib'),
    (['--pairs', '-1'], '--pairs'),
    (['--compile', 'no_such_backend'], '--compile'),      # was a FAILED row per configuration, after the sweep began
])
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        run_attention_bench(_args(*argv))


def test_quadratic_configurations_are_skipped_not_failed(tmp_path):
    out = tmp_path / 'attention.json'
    # 4 buffers × 2 heads × 256² × 4 B = 2 MiB > 0.001 GiB: naive softmax at n = 256 is skipped
    args = _args('--base-tokens', '64', '--multipliers', '1', '4', '--attn', 'softmax_naive', '--landmarks', '16',
                 '--repeats', '1', '--warmup', '0', '--in-process', '--max-quadratic-gib', '0.001', '--output', str(out))
    assert run_attention_bench(args) == 0
    rows = {r['tokens']: r for r in json.loads(out.read_text())['rows']}
    assert not rows[64]['skipped'] and rows[64]['forward_ms'] > 0
    assert rows[256]['skipped'] and 'max-quadratic-gib' in rows[256]['reason']


def test_compiled_columns_beside_eager(tmp_path, capsys):
    """--compile BACKEND times the same layer compiled and prints it beside eager (the eager backend here:
    dynamo's graph with torch's kernels, so the test does not pay for inductor's code generation)."""
    import torch
    torch._dynamo.reset()
    out = tmp_path / 'attention.json'
    args = _args('--base-tokens', '64', '--multipliers', '1', '--attn', 'soft', '--landmarks', '16', '--repeats',
                 '1', '--warmup', '0', '--in-process', '--compile', 'eager', '--output', str(out))
    assert run_attention_bench(args) == 0
    (row,) = json.loads(out.read_text())['rows']
    assert row['forward_ms_compiled'] > 0 and row['forward_backward_ms_compiled'] > 0 and row['compile_s'] > 0
    printed = capsys.readouterr().out
    assert 'fwd ms (c)' in printed and 'torch.compile (eager)' in printed      # the backend used, not 'inductor'


def test_goal_b_is_judged_on_the_paired_ratio(tmp_path, capsys):
    """--pairs times every attention's forward at the largest n back to back (SDPA the reference, first);
    goal (b) then reports the paired median, and the sweep's ratio of medians beside it."""
    out = tmp_path / 'attention.json'
    args = _args('--base-tokens', '64', '--multipliers', '1', '4', '--attn', 'soft', 'softmax', '--landmarks', '16',
                 '--repeats', '1', '--warmup', '0', '--in-process', '--pairs', '3', '--output', str(out))
    assert run_attention_bench(args) == 0
    result = json.loads(out.read_text())
    paired = result['paired']
    assert paired['tokens'] == 256 and paired['reference'] == 'softmax'
    assert list(paired['ratios']) == ['softmax', 'soft']
    assert paired['ratios']['softmax']['ratio'] == 1.0 and paired['ratios']['soft']['rounds'] == 3
    soft = paired['ratios']['soft']
    assert soft['ratio_q1'] <= soft['ratio'] <= soft['ratio_q3'] and soft['median_s'] > 0
    goal = result['goals']['sdpa_over_soft_forward_time']
    assert goal['source'] == 'paired' and goal['ratio'] == soft['ratio']
    rows = {(r['attention'], r['tokens']): r for r in result['rows']}
    assert goal['sweep_ratio'] == pytest.approx(rows[('softmax', 256)]['forward_ms'] / rows[('soft', 256)]['forward_ms'])
    assert 'paired forward at 256 tokens' in capsys.readouterr().out


def test_the_profile_is_kept_in_the_record(tmp_path, capsys):
    """--profile (as `make bench-records` runs the SOFT goal's benchmark): the profiler's table of SOFT's forward at
    the largest n is printed and kept in the JSON, so a kind that misses the goal has its breakdown on record."""
    out = tmp_path / 'attention.json'
    args = _args('--base-tokens', '64', '--multipliers', '1', '4', '--attn', 'softmax', 'soft', '--landmarks', '16',
                 '--repeats', '2', '--warmup', '0', '--in-process', '--profile', '--output', str(out))
    assert run_attention_bench(args) == 0
    profiled = json.loads(out.read_text())['profile']
    assert profiled['attention'] == 'soft' and profiled['tokens'] == 256
    assert 'aten::' in profiled['table'] and profiled['table'] in capsys.readouterr().out
    args = _args('--base-tokens', '64', '--multipliers', '1', '--attn', 'soft', '--landmarks', '16', '--repeats', '1',
                 '--warmup', '0', '--in-process', '--output', str(out))
    assert run_attention_bench(args) == 0 and json.loads(out.read_text())['profile'] is None


def test_goal_b_falls_back_to_sweep_medians_without_pairs():
    rows = [{'attention': a, 'tokens': 12544, 'forward_ms': ms, 'skipped': False} for a, ms in
            (('softmax', 400.0), ('soft', 8.0))]
    sweep = goal_ratios(rows, ['softmax', 'soft'])['sdpa_over_soft_forward_time']
    assert sweep['source'] == 'sweep medians' and sweep['ratio'] == 50.0 and sweep['pass']
    paired = {'tokens': 12544, 'reference': 'softmax',
              'ratios': {'softmax': {'ratio': 1.0}, 'soft': {'ratio': 35.0, 'ratio_q1': 33.0, 'ratio_q3': 37.0}}}
    judged = goal_ratios(rows, ['softmax', 'soft'], paired)['sdpa_over_soft_forward_time']
    assert judged['source'] == 'paired' and judged['ratio'] == 35.0 and not judged['pass']
    assert judged['sweep_ratio'] == 50.0 and judged['quartiles'] == [33.0, 37.0]


def test_goal_a_needs_a_memory_growth_above_zero_at_both_ends():
    """An in-process run at tiny n read -0.3 MiB (the high-water mark lags the resident set); its ratio, negative,
    passed goal (a) (≤ 1.25 × the token ratio). A growth of 0 or below is no reading: (a) is then n/a."""
    rows = [{'attention': 'soft', 'tokens': n, 'peak_mib': peak, 'forward_ms': 1.0, 'skipped': False}
            for n, peak in ((64, -0.3), (256, 5.0))]
    assert 'soft_memory_growth' not in goal_ratios(rows, ['soft'])
    rows[0]['peak_mib'] = 1.0
    growth = goal_ratios(rows, ['soft'])['soft_memory_growth']
    assert growth['ratio'] == 5.0 and growth['pass']
