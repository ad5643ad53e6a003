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
    def fake(target, name, kwargs, batch_size, img_size, steps, threads, compiled):
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
    assert 'CRATE-T, compiled' in capsys.readouterr().out


def test_measure_one_runs_a_real_model_eager():
    row = bench_models.measure_one('crate_tiny_patch16_224', {'depth': 1}, 2, 32, 1, threads=1)
    assert row['mode'] == 'eager' and row['first_compiled_step_s'] is None
    assert row['train_img_per_s'] > 0 and row['infer_img_per_s'] > 0 and row['params'] > 0
