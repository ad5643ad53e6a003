"""tools/gpu_tf32.py, the GPU check's TF32 probe, run through its CPU path (TF32 is a CUDA switch: off and on
coincide here, which is itself checked, so a probe that forgot to switch anything would still be caught on a GPU by
its equal columns)."""
import importlib.util
import json
from pathlib import Path

import pytest


def _script():
    spec = importlib.util.spec_from_file_location(
        'gpu_tf32', Path(__file__).resolve().parents[1] / 'tools' / 'gpu_tf32.py')
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_tf32_probe_measures_every_part(tmp_path, capsys):
    script = _script()
    with pytest.raises(SystemExit) as bad:
        script.main([])
    assert bad.value.code == 2 and '--output' in capsys.readouterr().err
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
