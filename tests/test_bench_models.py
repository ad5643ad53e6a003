"""`structformer bench models`: what it measures and how it reports (speed itself is not tested)."""
import argparse
import json

from structformer.bench import models as bench_models


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
        name, kwargs, batch_size, img_size, steps, threads, compiled = call
        speed = {'vit_tiny_patch16_224': 100.0}.get(name, 80.0) * (1.5 if compiled else 1.0)
        return {'model': name, 'kwargs': kwargs, 'params': 1, 'mode': 'compiled' if compiled else 'eager',
                'first_compiled_step_s': 3.0 if compiled else None, 'train_img_per_s': speed,
                'infer_img_per_s': 2 * speed, 'train_peak_mib_over_baseline': 10.0, 'threads': 1}
    monkeypatch.setattr(bench_models, 'measure_in_subprocess', fake)
    out = tmp_path / 'models.json'
    assert bench_models.run(_args(rounds=1, output=str(out))) == 0
    rows = {r['label']: r for r in json.loads(out.read_text())['rows']}
    assert rows['CRATE-T']['train_ratio'] == 0.8 and rows['CRATE-T, compiled']['train_ratio'] == 0.8
    assert rows['ViT-T (timm), compiled']['train_ratio'] == 1.0
    printed = capsys.readouterr().out
    assert 'CRATE-T, compiled' in printed
    # the goal is judged on the paired ratios (0.95 here), not the best-of-rounds ones (0.80)
    assert rows['CRATE-T']['paired_train']['ratio'] == 0.95
    assert 'met (paired: 0.950× eager, 0.950× compiled)' in printed
    assert bench_models.goal([dict(r, paired_train=None) for r in rows.values()]).startswith(
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
    assert bench_models.goal(rows).endswith('not met (paired: 0.896× eager)')
    rows[1]['paired_train']['ratio'] = 0.9
    assert bench_models.goal(rows).endswith(': met (paired: 0.900× eager)')
