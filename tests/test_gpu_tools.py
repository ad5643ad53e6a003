"""The GPU check's two probes run through their CPU paths: tools/gpu_tf32.py (TF32 is a CUDA switch: off and on
coincide here, which is itself checked; a probe that forgot to switch anything would show equal columns on a GPU)
and tools/gpu_profile.py (CPU activities only: the device columns are 0 here)."""
import importlib.util
import json
from pathlib import Path

import pytest


def _script(name: str = 'gpu_tf32'):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / 'tools' / f'{name}.py')
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_tf32_probe_measures_every_part(tmp_path, capsys):
    script = _script()
    with pytest.raises(SystemExit) as bad:
        script.main([])
    assert bad.value.code == 2 and '--output' in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        script.main(['--output', str(tmp_path / 'x.json'), '--budget-s', '-1'])
    assert bad.value.code == 2 and '--budget-s' in capsys.readouterr().err
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


def test_the_profile_probe_profiles_every_model(tmp_path, capsys):
    script = _script('gpu_profile')
    with pytest.raises(SystemExit) as bad:
        script.main(['--output', str(tmp_path / 'p.json'), '--budget-s', '0'])
    assert bad.value.code == 2 and '--budget-s' in capsys.readouterr().err
    out = tmp_path / 'profile.json'
    assert script.main(['--output', str(out)]) == 0
    record = json.loads(out.read_text())
    assert record['errors'] == [] and set(record['models']) == {label for label, _ in script.MODELS}
    for row in record['models'].values():
        assert row['wall_ms'] > 0 and row['device_ops'] == 0 and row['gpu_busy_share'] == 0   # no GPU here
        ops = [r['op'] for r in row['top_ops']]
        assert len(ops) == script.TOP and any('mm' in op for op in ops)                         # the products show
    assert not list(tmp_path.glob('*.tmp*'))
