"""The test session cleans up after itself: the cache folder conftest.py makes for a session (STRUCTFORMER_CACHE) is
removed when the session ends (and a session given one, an xdist worker, makes none): /tmp had gathered one such
folder per session and per worker, 774 of them on the machine where this was found."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _caches_left(tmp: Path, env_extra) -> list:
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != 'STRUCTFORMER_CACHE'}
    env.update(TMPDIR=str(tmp), OMP_NUM_THREADS='1', **env_extra)
    proc = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                           'tests/test_records.py::test_check_output_file'],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [p.name for p in tmp.iterdir() if p.name.startswith('structformer-test-cache-')]


def test_a_session_removes_the_cache_folder_it_made(tmp_path):
    assert _caches_left(tmp_path / 'own', {}) == []
