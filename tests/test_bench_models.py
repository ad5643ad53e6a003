"""`structformer bench models`: what it measures and how it reports (speed itself is not tested)."""
import argparse
import json

import pytest

from structformer.bench import model_goals
from structformer.bench import models as bench_models
from structformer.cli import main


def _args(**overrides):
    parser = argparse.ArgumentParser()
    bench_models.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_plan_measures_every_candidate_eager_and_the_headline_pair_compiled():
    plan = bench_models._plan(_args())
    eager = [p for p in plan if not p[3]]
    compiled = [p for p in plan if p[3]]
    assert [p[0] for p in eager] == [c[0] for c in bench_models.CANDIDATES]
    assert [p[0] for p in compiled] == ['ViT-T (timm), compiled', 'CRATE-T, compiled']
    assert len(bench_models._plan(_args(compile_all=True))) == 2 * len(bench_models.CANDIDATES)
    assert all(not p[3] for p in bench_models._plan(_args(modes=['eager'])))


def test_report_has_ratios_to_vit_in_the_same_mode(tmp_path, monkeypatch, capsys):
    """Measured in-process on 32 px images with fake-fast timing, the table and JSON carry ratios to
    ViT-T of the same mode, and the compiled rows name their first (compiling) step."""
    def fake(target, *call):
        if target.endswith(':measure_paired'):
            plan = call[0]
            return {label: {'median_s': 0.1, 'ratio': 0.95 if 'CRATE' in label else 1.0, 'ratio_q1': 0.9,
                            'ratio_q3': 1.0, 'rounds': 10} for label, *_ in plan}
        name, kwargs, batch_size, img_size, steps, threads, compiled, dtype, transforms = call
        speed = {'vit_tiny_patch16_224': 100.0}.get(name, 80.0) * (1.5 if compiled else 1.0)
        return {'model': name, 'kwargs': kwargs, 'transforms': transforms, 'dtype': dtype, 'params': 1,
                'mode': 'compiled' if compiled else 'eager',
                'first_compiled_step_s': 3.0 if compiled else None, 'train_img_per_s': speed,
                'infer_img_per_s': 2 * speed, 'train_peak_mib_over_baseline': 10.0, 'threads': 1}
    monkeypatch.setattr(bench_models, 'measure_in_subprocess', fake)
    out = tmp_path / 'models.json'
    assert bench_models.run(_args(rounds=1, output=str(out))) == 0
    record = json.loads(out.read_text())
    # the command's settings travel with its numbers (steps and rounds were in no field of the record)
    assert record['args']['steps'] == 5 and record['args']['rounds'] == 1 and record['args']['modes'] == ['eager', 'compiled']
    rows = {r['label']: r for r in record['rows']}
    assert rows['CRATE-T']['train_ratio'] == 0.8 and rows['CRATE-T, compiled']['train_ratio'] == 0.8
    assert rows['ViT-T (timm), compiled']['train_ratio'] == 1.0
    printed = capsys.readouterr().out
    assert 'CRATE-T, compiled' in printed
    # the goal is judged on the paired ratios (0.95 here), not the best-of-rounds ones (0.80)
    assert rows['CRATE-T']['paired_train']['ratio'] == 0.95
    assert 'met (paired: 0.950× eager, 0.950× compiled)' in printed
    assert model_goals.goal([dict(r, paired_train=None) for r in rows.values()]).startswith(
        "goal: CRATE-T trains at >= 0.9x ViT-T's speed (eager or compiled): not met (best-of-rounds: 0.800× eager")


def test_measure_one_runs_a_real_model_eager():
    row = bench_models.measure_one('crate_tiny_patch16_224', {'depth': 1}, 2, 32, 1, threads=1)
    assert row['mode'] == 'eager' and row['first_compiled_step_s'] is None
    assert row['train_img_per_s'] > 0 and row['infer_img_per_s'] > 0 and row['params'] > 0


def test_paired_timing_runs_real_models_and_rates_each_mode_against_its_vit():
    """One process, two tiny models eager: the reference's own ratio is exactly 1 and every row carries
    the median and quartiles of its per-round ratios."""
    plan = [('ViT-T (timm)', 'vit_tiny_patch16_224', {'depth': 1}, False),
            ('CRATE-T', 'crate_tiny_patch16_224', {'depth': 1}, False)]
    result = bench_models.measure_paired(plan, 2, 32, 3, threads=1)
    assert set(result) == {'ViT-T (timm)', 'CRATE-T'}
    assert result['ViT-T (timm)']['ratio'] == 1.0
    crate = result['CRATE-T']
    assert crate['rounds'] == 3 and crate['median_s'] > 0
    assert crate['ratio_q1'] <= crate['ratio'] <= crate['ratio_q3']


def test_goal_is_not_met_by_a_ratio_that_only_rounds_to_it():
    vit, crate = bench_models.CANDIDATES[0], bench_models.CANDIDATES[1]
    rows = [{'model': vit[1], 'kwargs': vit[2], 'mode': 'eager', 'paired_train': {'ratio': 1.0}},
            {'model': crate[1], 'kwargs': crate[2], 'mode': 'eager', 'paired_train': {'ratio': 0.8961}}]
    assert model_goals.goal(rows).endswith('not met (paired: 0.896× eager)')
    rows[1]['paired_train']['ratio'] = 0.9
    assert model_goals.goal(rows).endswith(': met (paired: 0.900× eager)')


# ---- --amp (float32 and bfloat16 rows) and --families ---------------------------------------------------

SMALL_CANDIDATES = [('ViT-T (timm)', 'vit_tiny_patch16_224', {'depth': 1}, True),
                    ('CRATE-T', 'crate_tiny_patch16_224', {'depth': 1}, True)]
SMALL_FAMILIES = [('CRATE', 'CRATE-T', 'crate_tiny_patch16_224', {'depth': 1}, []),
                  ('low-rank', 'ViT-T factorized', 'vit_tiny_patch16_224', {'depth': 1},
                   [{'name': 'factorize', 'kwargs': {'rank': 0.5}}])]


def _in_process(target, *call):
    """measure_in_subprocess without the subprocess (a fresh interpreter per row is seconds each): the same
    function, its arguments and result through JSON as they travel there."""
    module, _, function = target.partition(':')
    assert module == bench_models.__name__
    call = json.loads(json.dumps(call))
    return json.loads(json.dumps(getattr(bench_models, function)(*call)))


def test_plan_with_families_adds_each_family_once_with_its_transforms():
    plan = bench_models._plan(_args(families=True, modes=['eager']))
    labels = [p[0] for p in plan]
    assert labels[:len(bench_models.CANDIDATES)] == [c[0] for c in bench_models.CANDIDATES]
    assert labels.count('CRATE-T') == 1                      # the CRATE family is the CRATE-T row
    extra = {p[0]: p for p in plan[len(bench_models.CANDIDATES):]}
    assert {p[1] for p in extra.values()} >= {'soft_tiny_224', 'sparsifiner_deit_tiny_patch16_224'}
    factorized = extra['ViT-T factorized rank 0.5']
    assert factorized[1] == 'vit_tiny_patch16_224' and factorized[4] == [{'name': 'factorize', 'kwargs': {'rank': 0.5}}]
    assert all(len(p) == 5 for p in plan) and not any(p[3] for p in plan)


def test_amp_run_measures_float32_and_bfloat16_rows_and_pairs_them(tmp_path, monkeypatch, capsys):
    """A tiny real run (32 px, depth-1 models, measured in-process): every model has a float32 and a bfloat16
    row, each bfloat16 row a paired bfloat16-over-float32 ratio with its quartiles, and the JSON has the
    rows, their dtype and the verdicts, each family's beside what this CPU does in bfloat16."""
    monkeypatch.setattr(bench_models, 'CANDIDATES', SMALL_CANDIDATES)
    monkeypatch.setattr(bench_models, 'FAMILIES', SMALL_FAMILIES)
    monkeypatch.setattr(bench_models, '_mixer_224', lambda: None)
    monkeypatch.setattr(bench_models, 'measure_in_subprocess', _in_process)
    out = tmp_path / 'bf16.json'
    assert bench_models.run(_args(img_size=32, batch_size=2, steps=1, rounds=1, pairs=2, modes=['eager'],
                                  amp='bfloat16', families=True, output=str(out))) == 0
    result = json.loads(out.read_text())
    assert result['amp'] == 'bfloat16' and result['dtypes'] == ['float32', 'bfloat16']
    rows = {(r['label'], r['dtype']): r for r in result['rows']}
    labels = ['ViT-T (timm)', 'CRATE-T', 'ViT-T factorized']
    assert set(rows) == {(label, dtype) for label in labels for dtype in ('float32', 'bfloat16')}
    assert rows['ViT-T factorized', 'bfloat16']['transforms'][0]['name'] == 'factorize'
    for label in labels:
        bf16 = rows[label, 'bfloat16']
        pair = bf16['paired_over_float32']
        assert pair['rounds'] == 2 and 0 < pair['ratio_q1'] <= pair['ratio'] <= pair['ratio_q3']
        assert bf16['train_over_float32'] > 0 and bf16['paired_train']['ratio'] > 0
        assert rows[label, 'float32'].get('paired_over_float32') is None
    assert rows['ViT-T (timm)', 'bfloat16']['paired_train']['ratio'] == 1.0   # to ViT-T in bfloat16
    goals = result['amp_goals']
    families = [g for g in goals if g.get('family')]
    assert [g['family'] for g in families] == ['CRATE', 'low-rank']
    assert all(isinstance(g['met'], bool) and g['source'] == 'paired' and g['target'] == 2.0 for g in families)
    assert all(g['cpu']['native'] == model_goals.cpu_capability('bfloat16')['native'] for g in goals)
    crate = [g for g in goals if g['goal'] == 'crate_over_vit']
    assert len(crate) == 1 and crate[0]['target'] == 1.25
    assert result['goal'].startswith("goal: CRATE-T trains at >= 0.9x ViT-T's speed")   # float32 rows only
    printed = capsys.readouterr().out
    assert 'bfloat16 over float32' in printed
    assert 'goal: each family trains >= 2.0x faster in bfloat16 than in float32' in printed
    assert model_goals.cpu_capability('bfloat16')['text'] in printed
    assert "goal: CRATE-T in bfloat16 trains at >= 1.25x ViT-T's bfloat16 speed" in printed
    assert 'no mixer is registered at 224 px' in printed


def test_paired_by_dtype_times_each_models_dtypes_back_to_back(monkeypatch):
    """Fake clock: every float32 step takes 2 s, every bfloat16 step 1 s (ViT) or 4 s (CRATE), so the
    ratios are exact; and in every round a model's two steps are adjacent, their order alternating."""
    clock, calls = [0.0], []
    monkeypatch.setattr(bench_models.time, 'perf_counter', lambda: clock[0])

    def step(label, dtype, seconds):
        def call():
            calls.append((label, dtype))
            clock[0] += seconds
        return call
    steps = {'vit': {'float32': step('vit', 'float32', 2.0), 'bfloat16': step('vit', 'bfloat16', 1.0)},
             'crate': {'float32': step('crate', 'float32', 2.0), 'bfloat16': step('crate', 'bfloat16', 4.0)}}
    result = bench_models.paired_by_dtype(steps, 'vit', rounds=4, warmup=1)
    assert result['vit [bfloat16]']['over_float32']['ratio'] == 2.0
    assert result['crate [bfloat16]']['over_float32']['ratio'] == 0.5
    assert result['crate [bfloat16]']['ratio'] == 0.25 and result['crate']['ratio'] == 1.0
    assert 'over_float32' not in result['crate'] and result['crate [bfloat16]']['rounds'] == 4
    timed = calls[4:]                                          # after 1 warm-up call of each of the 4 steps
    pairs = [timed[i:i + 2] for i in range(0, len(timed), 2)]
    assert all(a[0] == b[0] and a[1] != b[1] for a, b in pairs)
    assert [p[0][1] for p in pairs] == ['float32', 'float32', 'bfloat16', 'bfloat16'] * 2


def _amp_rows(crate_speedup, crate_over_vit):
    vit, crate = bench_models.CANDIDATES[0], bench_models.CANDIDATES[1]
    rows = []
    for (label, name, kwargs, _), speedup, ratio in ((vit, 1.0, 1.0), (crate, crate_speedup, crate_over_vit)):
        rows.append({'label': label, 'model': name, 'kwargs': kwargs, 'transforms': [], 'mode': 'eager',
                     'dtype': 'bfloat16', 'train_over_float32': speedup, 'train_ratio': ratio,
                     'paired_over_float32': {'ratio': speedup, 'ratio_q1': speedup, 'ratio_q3': speedup},
                     'paired_train': {'ratio': ratio, 'ratio_q1': ratio, 'ratio_q3': ratio}})
    return rows


def test_amp_goals_name_the_cpu_and_do_not_round_up(monkeypatch):
    import structformer.train.precision as precision
    families = [('CRATE', 'CRATE-T', 'crate_tiny_patch16_224', {}, [])]
    monkeypatch.setattr(precision, 'cpu_bfloat16_native', lambda: False)
    goals = model_goals.amp_goals(_amp_rows(1.998, 1.25), families, 'bfloat16')
    assert goals[0]['line'].endswith('this CPU has no AVX512-BF16 or AMX: a bfloat16 matmul is emulated, '
                                     'so no speed-up is expected')
    assert goals[1]['line'] == '  CRATE (CRATE-T): not met (paired: 1.998× eager (quartiles 1.998–1.998))'
    assert goals[1]['met'] is False and goals[2]['met'] is True and goals[2]['line'].startswith(
        "goal: CRATE-T in bfloat16 trains at >= 1.25x ViT-T's bfloat16 speed (eager or compiled): met (paired: 1.250×")
    monkeypatch.setattr(precision, 'cpu_bfloat16_native', lambda: True)
    goals = model_goals.amp_goals(_amp_rows(2.0, 1.2), families, 'bfloat16')
    assert 'has AVX512-BF16/AMX' in goals[0]['line'] and goals[1]['met'] is True and goals[2]['met'] is False
    assert [g['goal'] for g in model_goals.amp_goals(_amp_rows(2.0, 1.2), [], 'bfloat16')] == ['crate_over_vit']
    # no paired rounds (--pairs 0): judged on the best-of-rounds ratios
    rows = [dict(r, paired_over_float32=None, paired_train=None) for r in _amp_rows(2.5, 1.0)]
    assert 'met (best-of-rounds: 2.500× eager)' in model_goals.amp_goals(rows, families, 'bfloat16')[1]['line']


@pytest.mark.parametrize('supported', [False, True])
def test_amp_float16_only_where_the_cpu_has_float16(supported, monkeypatch, capsys):
    """--amp float16 is refused as one line naming --amp before anything is measured, unless the CPU has
    AMX-FP16 (where Precision.create takes it, the run goes on: here to a deliberate stop)."""
    import structformer.train.precision as precision
    monkeypatch.setattr(precision, 'cpu_float16_supported', lambda: supported)
    monkeypatch.setattr(bench_models, '_plan', lambda args: pytest.fail('measured') if not supported else [][0])
    if supported:
        with pytest.raises(IndexError):
            bench_models.run(_args(amp='float16'))
        return
    assert main(['bench', 'models', '--amp', 'float16']) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if 'error:' in line]
    assert len(errors) == 1 and errors[0].startswith('structformer bench models: error: --amp float16 ')


def _peak_resettable() -> bool:
    """Whether this kernel lowers the peak-RSS mark (clear_refs '5'); without it a baseline cannot be moved."""
    from structformer.bench.harness import _status_mib, reset_peak_rss
    reset_peak_rss()
    return abs(_status_mib('VmHWM') - _status_mib('VmRSS')) < 8


def test_measure_one_peak_is_growth_over_the_model_and_batch(monkeypatch):
    """The training peak is taken over the model-and-batch baseline (as the module docstring and the docs table
    say): memory the model holds before its first step is not charged to training. It was: the baseline was taken
    before the model was built, so every row's 'train peak MiB' included the model's weights and the batch."""
    import torch
    if not _peak_resettable():
        pytest.skip('the peak-RSS mark cannot be reset here')

    def setup(name, kwargs, batch_size, img_size, transforms=()):
        model = torch.nn.Linear(2, 2)
        model.register_buffer('held', torch.ones(64 * 2 ** 20))        # 256 MiB, built (and touched) with the model
        return model, torch.zeros(1, 2), lambda precision=None: None
    monkeypatch.setattr(bench_models, '_training_setup', setup)
    row = bench_models.measure_one('any', {}, 1, 16, 1, threads=1)
    assert row['train_peak_mib_over_baseline'] < 128, row


def test_best_of_rounds_row_carries_the_load_of_the_round_it_kept(tmp_path, monkeypatch):
    """A row's kept training figure is the fastest round's, and its machine_load must be that round's: a quiet
    first round vouched for a faster second round measured while the machine was BUSY (and its figure was kept)."""
    rounds = iter(range(100))

    def fake(target, name, kwargs, batch_size, img_size, steps, threads, compiled, dtype, transforms):
        speed = 50.0 if next(rounds) < 4 else 80.0            # round 1 (4 eager rows) slow, round 2 fast
        return {'model': name, 'kwargs': kwargs, 'transforms': transforms, 'dtype': dtype, 'params': 1,
                'mode': 'eager', 'first_compiled_step_s': None, 'train_img_per_s': speed,
                'infer_img_per_s': speed, 'train_peak_mib_over_baseline': 10.0, 'threads': 1}
    loads = iter([{'busy': False}] * 4 + [{'busy': True, 'advice': 'x'}] * 4)
    monkeypatch.setattr(bench_models, 'measure_in_subprocess', fake)
    monkeypatch.setattr(bench_models, 'row_mark', lambda: object())
    monkeypatch.setattr(bench_models, 'row_record', lambda mark: next(loads))
    out = tmp_path / 'models.json'
    assert bench_models.run(_args(rounds=2, pairs=0, modes=['eager'], output=str(out))) == 0
    rows = {r['label']: r for r in json.loads(out.read_text())['rows']}
    assert rows['CRATE-T']['train_img_per_s'] == 80.0 and rows['CRATE-T']['machine_load']['busy'] is True


def test_a_failed_measurement_is_a_failed_row_and_the_others_are_reported(tmp_path, monkeypatch, capsys):
    """SOFT-T at 32 px, batch 1 (its 1×1 last stage fails BatchNorm in training): the subprocess failure ended
    `bench models` in a traceback and lost every other row; now, as `bench attention`, a FAILED row with the
    error's line, the rest measured, paired without it, and exit status 1."""
    from structformer.bench.harness import MeasurementFailed
    paired_plans = []

    def fake(target, *call):
        if target.endswith(':measure_paired'):
            paired_plans.append([entry[0] for entry in call[0]])
            return {}
        name, kwargs, batch_size, img_size, steps, threads, compiled, dtype, transforms = call
        if name == 'soft_tiny_224':
            raise MeasurementFailed("measurement subprocess exited with status 1: Traceback (most recent call "
                                    "last):\n  ...\nValueError: Expected more than 1 value per channel", 1)
        return {'model': name, 'kwargs': kwargs, 'transforms': transforms, 'dtype': dtype, 'params': 1,
                'mode': 'eager', 'first_compiled_step_s': None, 'train_img_per_s': 10.0,
                'infer_img_per_s': 20.0, 'train_peak_mib_over_baseline': 10.0, 'threads': 1}
    monkeypatch.setattr(bench_models, 'measure_in_subprocess', fake)
    out = tmp_path / 'models.json'
    assert bench_models.run(_args(rounds=1, pairs=2, families=True, modes=['eager'], output=str(out))) == 1
    record = json.loads(out.read_text())
    assert 'SOFT-T' not in {r['label'] for r in record['rows']} and 'CRATE-T' in {r['label'] for r in record['rows']}
    assert [(r['label'], r['error_line']) for r in record['failed_rows']] == [
        ('SOFT-T', 'ValueError: Expected more than 1 value per channel')]
    assert paired_plans and 'SOFT-T' not in paired_plans[0]
    assert 'FAILED: ValueError: Expected more than 1 value per channel' in capsys.readouterr().out
