"""tools/gpu_check.sh, the one command a lent GPU runs (docs/gpu.md), on the CPU with a stand-in for its python:
what it leaves in $OUT, which is all that comes back from the device machine. And `bench gpu`'s record names."""
import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from structformer.bench.gpu import default_record
from structformer.bench.gpu_report import latest_record

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for the image's python3, for each way the script calls it: the suite writes its junit file, the bench
# writes (or, BENCH=none, fails before writing) docs/gpu/h200_2026-11-27.json, the render and the probes answer.
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$1 $2 $3 $4 $5" in
  "-m pytest"*) for a; do case "$a" in --junitxml=*) echo '<testsuites/>' > "${a#--junitxml=}";; esac; done
                echo "57 passed"; exit 0;;
  "-m structformer bench gpu --budget-s"*)
      [ "$BENCH" = none ] && { echo "bench failed"; exit 1; }
      echo '{"run": "this one"}' > docs/gpu/h200_2026-11-27.json; echo "wrote docs/gpu/h200_2026-11-27.json"; exit 0;;
  "-m structformer bench gpu --render"*) echo "tables of $6"; exit 0;;
  "tools/gpu_tf32.py --output"*|"tools/gpu_profile.py --output"*) echo '{}' > "$3"; exit 0;;
  "- "*) cat >/dev/null; echo "python 3.12.3 | torch 2.11.0"; exit 0;;
esac
echo "unexpected call: $*" >&2; exit 9
"""


def _check_copy(tmp_path: Path) -> Path:
    """A copy of the script in a repository-shaped folder whose docs/gpu holds an older record of the same name the
    bench writes (as the repository holds h200_2026-11-27.json, a second H200 run on that day)."""
    repo = tmp_path / 'repo'
    (repo / 'tools').mkdir(parents=True)
    shutil.copy(ROOT / 'tools' / 'gpu_check.sh', repo / 'tools' / 'gpu_check.sh')
    (repo / 'docs' / 'gpu').mkdir(parents=True)
    old = repo / 'docs' / 'gpu' / 'h200_2026-11-27.json'
    old.write_text('{"run": "an earlier one"}')
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    python = tmp_path / 'python3'
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return repo


@pytest.mark.skipif(shutil.which('bash') is None or shutil.which('timeout') is None, reason='needs bash and timeout')
@pytest.mark.parametrize('bench', ['writes', 'none'])
def test_gpu_check_brings_back_the_record_the_bench_wrote(tmp_path, bench):
    """The record the bench wrote comes back in $OUT with its render, also where it replaced a file of the same name
    in the copy of the repository (only a new name was copied: the run's record was lost); a bench that wrote
    nothing brings back no older record."""
    repo = _check_copy(tmp_path)
    out = tmp_path / 'out'
    env = dict(os.environ, OUT=str(out), PY=str(tmp_path / 'python3'), INSTALL='0', BENCH=bench,
               SUITE_S='60', BENCH_S='5', TF32_S='25', PROFILE_S='25')
    proc = subprocess.run(['bash', str(repo / 'tools' / 'gpu_check.sh')], env=env, capture_output=True, text=True,
                          timeout=120)
    assert 'unexpected call' not in proc.stderr + proc.stdout, proc.stderr
    worst = _worst_case_s({'SUITE_S': 60, 'BENCH_S': 5, 'TF32_S': 25, 'PROFILE_S': 25})
    assert f'worst case with the graces {worst} s' in proc.stdout        # the script's sum is its commands'
    files = sorted(p.name for p in out.iterdir())
    assert {'env.txt', 'suite.log', 'junit.xml', 'bench.log', 'tf32.json', 'profile.json'} <= set(files), files
    assert len(files) <= 8                                   # what the device tool brings back from $OUT
    if bench == 'writes':
        assert proc.returncode == 0, proc.stdout[-2000:]
        assert json.loads((out / 'h200_2026-11-27.json').read_text()) == {'run': 'this one'}
        assert 'tables of docs/gpu/h200_2026-11-27.json' in (out / 'bench_gpu.md').read_text()
    else:
        assert proc.returncode == 1                         # the suite passed: the bench's status
        assert 'h200_2026-11-27.json' not in files and 'bench_gpu.md' not in files


def _worst_case_s(values: dict = None) -> int:
    """The script's worst case read off its own `timeout` commands: each step's limit plus its grace (the SIGINT's
    or the budget's, then -k before SIGKILL), with the defaults it sets (or `values` over them)."""
    import re
    script = (ROOT / 'tools' / 'gpu_check.sh').read_text()
    names = {k: int(v) for k, v in re.findall(r'^(\w+)="\$\{\1:-(\d+)\}"', script, re.M)}
    graces = re.search(r'^((?:\w+=\d+ ?)+)$', script, re.M).group(1)
    names.update({k: int(v) for k, v in (pair.split('=') for pair in graces.split())})
    names.update(values or {})
    steps = re.findall(r'^timeout (?:-s \w+ )?-k "\$(\w+)" (.+?) "\$PY"', script, re.M)
    assert len(steps) == 4, steps                           # suite, bench, TF32 probe, profile
    arithmetic = lambda text: eval(re.sub(r'\$\(\((.*)\)\)', r'\1', text).replace('"', '').replace('$', ''),
                                   {}, names)             # noqa: E731 (integers and + only)
    return sum(names[kill] + arithmetic(limit) for kill, limit in steps)


def test_gpu_check_worst_case_fits_the_device_call():
    """Every step at its limit plus its kill grace was 600 s (240 + 20, 205 + 10, 60 + 10, 45 + 10), past the 590 s
    the device call allows (docs/gpu.md): the defaults now sum under 580 s, leaving room for the installs and the
    render, which have no limit of their own."""
    assert _worst_case_s() < 580
    assert _worst_case_s({'SUITE_S': 240, 'BENCH_S': 180}) > 580      # the old limits would not fit


def test_a_second_record_of_a_day_keeps_the_first(tmp_path):
    """`bench gpu`'s default record: <device>_<day>.json, then -2, -3 for more runs that day (the second call of a
    lease, a second lease): none replaces a record the docs quote, and the newest is the last one written."""
    assert default_record(tmp_path, 'h200', '2026-11-27') == tmp_path / 'h200_2026-11-27.json'
    for expected in ('h200_2026-11-27.json', 'h200_2026-11-27-2.json', 'h200_2026-11-27-3.json'):
        path = default_record(tmp_path, 'h200', '2026-11-27')
        assert path.name == expected
        path.write_text(json.dumps({'name': expected}))
    (tmp_path / 'h200_2026-11-26.json').write_text('{}')
    (tmp_path / 'h200-call1_2026-11-27.json').write_text('{}')
    assert latest_record(tmp_path) == ('h200_2026-11-27-3.json', {'name': 'h200_2026-11-27-3.json'})
    assert default_record(tmp_path, 'h100-80gb-hbm3', '2026-11-27').name == 'h100-80gb-hbm3_2026-11-27.json'
