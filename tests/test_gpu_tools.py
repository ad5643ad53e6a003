"""The GPU check's two probes (and their shared plumbing, bench/probes.py) run through their CPU paths:
tools/gpu_tf32.py (TF32 is a CUDA switch: off and on coincide here, which is itself checked; a probe that forgot to
switch anything would show equal columns on a GPU) and tools/gpu_profile.py (CPU activities only: the device columns
are 0 here)."""
import importlib.util
import json
from pathlib import Path

import pytest


def _script(name: str = 'gpu_tf32'):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / 'tools' / f'{name}.py')
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize('name', ['gpu_tf32', 'gpu_profile'])
def test_the_probes_refuse_bad_arguments_in_one_line(name, tmp_path, capsys):
    script = _script(name)
    for argv, flag in (([], '--output'), (['--budget-s', '0'], '--budget-s'), (['--budget-s', '-1'], '--budget-s')):
        with pytest.raises(SystemExit) as bad:
            script.main(argv + (['--output', str(tmp_path / 'x.json')] if argv else []))
        err = capsys.readouterr().err
        assert bad.value.code == 2 and flag in err.strip().splitlines()[-1]
    assert not list(tmp_path.iterdir())


def test_parts_run_under_the_budget_and_a_failure_is_recorded(tmp_path, capsys):
    """bench/probes.run_parts: each part's result in its section, a failing part's error beside the others' results,
    the parts after the budget recorded as not run, the record on disk after every part."""
    import time

    import torch

    from structformer.bench.probes import probe_record, run_parts
    out = tmp_path / 'r.json'

    def slow():
        time.sleep(0.2)
        assert json.loads(out.read_text())['a']['fine'] == {'x': 1}     # written after the first part already
        return {'x': 3}

    def broken():
        raise ValueError('no such kernel')

    record = probe_record('tools/x.py', ['--output', str(out)], torch.device('cpu'), ['a', 'b'], batch_size=2)
    parts = [('a', 'fine', lambda: {'x': 1}, lambda row: f"fine {row['x']}"), ('b', 'broken', broken, None),
             ('b', 'slow', slow, None), ('a', 'late', lambda: {'x': 4}, None)]
    assert run_parts(record, parts, 0.1, out, torch.device('cpu')) == 0
    saved = json.loads(out.read_text())
    assert saved['command'] == f'python3 tools/x.py --output {out}' and saved['batch_size'] == 2
    assert saved['a'] == {'fine': {'x': 1}} and saved['b'] == {'slow': {'x': 3}}
    assert saved['errors'] == ['b broken: ValueError: no such kernel', 'a late: not run (budget)']
    assert 'fine 1' in capsys.readouterr().out
    nothing = probe_record('tools/x.py', [], torch.device('cpu'), ['a'])
    assert run_parts(nothing, [('a', 'broken', broken, None)], 1.0, tmp_path / 'n.json', torch.device('cpu')) == 1


def test_the_tf32_probe_measures_every_part(tmp_path):
    script = _script()
    out = tmp_path / 'tf32.json'
    assert script.main(['--output', str(out)]) == 0
    record = json.loads(out.read_text())
    assert record['errors'] == []
    labels = [label for label, _ in script.MODELS]
    assert set(record['train_img_per_s']) == set(labels)
    assert set(record['accuracy']) == set(labels) | {'Newton-Schulz pinv'}
    for label in labels:
        row = record['accuracy'][label]
        # float32 against float64 through a few dozen layers: rounding of order 1e-6, far from 1e-3 (TF32's scale)
        assert 0 < row['fp32'] < 1e-4 and row['tf32'] == pytest.approx(row['fp32'], rel=1e-6)
        assert record['train_img_per_s'][label]['fp32'] > 0
    pinv = record['accuracy']['Newton-Schulz pinv']
    # well conditioned (spread 1): float32 Newton–Schulz reaches the SVD's inverse to float32 rounding × cond
    assert pinv['spread 1.0']['cond_median'] < 10 and pinv['spread 1.0']['fp32'] < 1e-5
    conds = [pinv[f'spread {s}']['cond_median'] for s in (1.0, 0.3, 0.1)]
    assert conds == sorted(conds)                         # tighter landmarks, worse conditioned
    assert not list(tmp_path.glob('*.tmp*'))              # written by rename, nothing left behind


def test_the_profile_probe_profiles_every_model(tmp_path):
    script = _script('gpu_profile')
    out = tmp_path / 'profile.json'
    assert script.main(['--output', str(out)]) == 0
    record = json.loads(out.read_text())
    assert record['errors'] == [] and set(record['models']) == {label for label, _ in script.MODELS}
    for row in record['models'].values():
        assert row['wall_ms'] > 0 and row['device_ops'] == 0 and row['gpu_busy_share'] == 0   # no GPU here
        ops = [r['op'] for r in row['top_ops']]
        assert len(ops) == script.TOP and any('mm' in op for op in ops)                         # the products show
    assert not list(tmp_path.glob('*.tmp*'))
