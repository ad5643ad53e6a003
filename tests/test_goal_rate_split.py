"""A missed speed goal says why in numbers (issue 44): its ratio split into the FLOP ratio the arithmetic fixes and
the FLOP-rate ratio this machine's kernels give, by every benchmark that judges a goal."""
import json
from types import SimpleNamespace

import pytest

from structformer.bench import attention, kinds, mlp, model_goals, sparse_attention


@pytest.mark.parametrize('goal, value, flop_ratio', [
    ('soft_sdpa', 37.1, 71.7), ('soft_sdpa', 51.4, 71.7), ('monarch_step', 2.59, 32.0),
    ('sparsifiner_sdpa', 0.83, 1 / 0.38), ('sparsifiner_sdpa', 0.54, 1 / 0.38), ('rp_mixer_step', 1.3, 1.0),
    ('crate_vit', 0.86, 0.693)])
def test_the_split_multiplies_back_to_the_measured_ratio(goal, value, flop_ratio):
    rates, bound = kinds.flop_rate_split(goal, value, flop_ratio)
    target = float(kinds.GOALS[goal][3])
    speedup = kinds.GOALS[goal][2] == '>='
    back = flop_ratio * rates['rate'] if speedup else 1 / (flop_ratio * rates['rate'])
    just = flop_ratio * rates['rate_needed'] if speedup else 1 / (flop_ratio * rates['rate_needed'])
    assert back == pytest.approx(value, rel=1e-12) and just == pytest.approx(target, rel=1e-12)
    assert (rates['rate'] >= rates['rate_needed'] * (1 - 1e-12)) == kinds.met(goal, value)
    assert (bound == '') == kinds.met(goal, value)


def test_a_missed_goal_names_the_rate_it_needed_and_the_rate_it_got():
    rates, bound = kinds.flop_rate_split('soft_sdpa', 37.1, 71.7)
    assert rates['rate'] == pytest.approx(37.1 / 71.7) and rates['rate_needed'] == pytest.approx(40 / 71.7)
    assert bound.startswith("SOFT does 71.7× fewer FLOPs than SDPA (matmul FLOPs, FlopCounterMode): the goal needs "
                            "SOFT at 56% of SDPA's FLOP rate, it ran at 52% (SOFT's thin products")
    _, more = kinds.flop_rate_split('crate_vit', 0.86, 0.693)
    assert '1.44× the FLOPs of ViT-T' in more and "at 130% of ViT-T's FLOP rate (above the baseline's own" in more
    assert kinds.flop_rate_split('soft_sdpa', 37.1, None) == (None, '')
    assert kinds.flop_rate_split('soft_sdpa', None, 70.0) == (None, '')
    assert set(kinds.SPLITS) == set(kinds.GOALS) - {'lowrank_layer', 'lowrank_stack'}   # those split finer


def _attention_row(name, tokens, ms, counted, linear, analytic, missed):
    return {'attention': name, 'tokens': tokens, 'forward_ms': ms, 'flops_counted_forward': counted,
            'flops_linear_forward': linear, 'flops_analytic_core_forward': analytic, 'flops_counter_missed': missed}


def test_bench_attention_counts_sdpa_analytically_where_the_counter_missed_it():
    rows = [_attention_row('softmax', 12544, 450.0, 411_041_792, 411_041_792, 40_282_095_616, True),
            _attention_row('soft', 12544, 12.0, 567_761_824, 308_281_344, 446_501_328, False)]
    goals = attention.goal_ratios(rows, ['softmax', 'soft'])
    found = goals['sdpa_over_soft_forward_time']
    assert found['flop_ratio'] == pytest.approx((411_041_792 + 40_282_095_616) / 567_761_824)
    entry, = kinds.soft_goal_entries(goals, {'threads': 1, 'device': 'cpu'}, None)
    assert entry['met'] is False and entry['rates']['flop_ratio'] == found['flop_ratio']
    assert entry['bound'].startswith('SOFT does 71.7× fewer FLOPs than SDPA') and 'it ran at 52%' in entry['bound']
    assert 'on this kind: SOFT does' in kinds.verdict_line(entry)
    json.dumps(entry)


def test_bench_sparse_attention_splits_by_the_kept_share_of_the_flops():
    base = {'tokens': 577, 'keep': 0.25, 'ms': 1.0}
    rows = [dict(base, path='block-kernel core', vs_dense=0.83, vs_dense_q1=0.8, vs_dense_q3=0.86,
                 flops_vs_dense=0.38, density=0.33),
            dict(base, path='dense SDPA core', vs_dense=1.0, flops_vs_dense=1.0, density=1.0)]
    args = SimpleNamespace(train=False, device='cpu')
    entry, = sparse_attention.kind_goals(rows, args, {'threads': 1}, None)
    assert entry['rates']['flop_ratio'] == pytest.approx(1 / 0.38)
    assert entry['rates']['rate'] == pytest.approx(0.38 / 0.83)
    assert "at 63% of SDPA's FLOP rate, it ran at 46%" in entry['bound']
    met, = sparse_attention.kind_goals([dict(rows[0], vs_dense=0.55), rows[1]], args, {'threads': 1}, None)
    assert met['bound'] == '' and met['rates']['rate'] == pytest.approx(0.38 / 0.55)


def test_bench_mlp_splits_both_goals_by_their_counted_flops():
    goals = {'rp_step_ratio': 1.3, 'rp_flop_ratio': 0.98, 'monarch_step_speedup': 2.59,
             'monarch_forward_speedup': 4.76, 'monarch_flop_ratio': 32.0, 'source': 'paired, 10 rounds'}
    args = SimpleNamespace(img_size=32, side=64, batch_size=1024, model_batch_size=128)
    rp, monarch = mlp.kind_goals(goals, None, args, {'threads': 1}, None)
    assert rp['goal'] == 'rp_mixer_step' and rp['rates']['flop_ratio'] == 0.98
    assert "RP-Mixer does 1.02× the FLOPs of the Mixer" in rp['bound']
    assert monarch['rates']['rate'] == pytest.approx(2.59 / 32)
    assert "MonarchLinear does 32× fewer FLOPs than nn.Linear" in monarch['bound'] and 'at 12%' in monarch['bound']


def test_bench_models_splits_crate_by_both_models_flops(monkeypatch):
    rows = [{'model': 'vit_tiny_patch16_224', 'kwargs': {}, 'mode': 'eager', 'dtype': 'float32'},
            {'model': 'crate_tiny_patch16_224', 'kwargs': {}, 'mode': 'eager', 'dtype': 'float32', 'threads': 1,
             'paired_train': {'ratio': 0.86, 'ratio_q1': 0.85, 'ratio_q3': 0.87}}]
    monkeypatch.setattr(model_goals, "vit_over_crate_flops", lambda img_size, pair: 0.693)
    entry, = model_goals.kind_goals(rows, None, 16)
    assert entry['rates']['rate'] == pytest.approx(0.86 / 0.693) and 'CRATE-T does 1.44× the FLOPs' in entry['bound']


def test_the_crate_split_counts_both_models_in_full():
    """ViT-T (width 192, MLP 4×) and CRATE-T (width 384, square ISTA block) at 224 px, 197 tokens, 12 blocks, per
    image in multiply-adds: projections and QKᵀ / AV per token and block, the 16×16 patch stem, the 1000-way head.
    CRATE-T does more work per image, so at equal FLOP rates it would train at 0.69× ViT-T."""
    n, blocks, patches, stem_in = 197, 12, 196, 3 * 16 * 16
    vit = blocks * n * (12 * 192 ** 2 + 2 * n * 192) + patches * stem_in * 192 + 192 * 1000
    crate = blocks * n * (4 * 384 ** 2 + 2 * n * 384) + patches * stem_in * 384 + 384 * 1000
    assert model_goals.vit_over_crate_flops(224) == pytest.approx(vit / crate, rel=1e-12)
