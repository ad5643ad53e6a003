"""The shared bench harness: subprocess runner, timer, memory readers, environment record, atomic writers."""
import json
import os
import subprocess
import sys
import time

import pytest

from structformer.atomic import write_atomically

from structformer.bench import harness
from structformer.bench.harness import MeasurementFailed, measure_in_subprocess, median_seconds, python_json
from structformer.records import environment, write_json, write_png


# ---- subprocess runner ------------------------------------------------------------------------------

def test_subprocess_returns_the_childs_json_from_a_fresh_process():
    assert measure_in_subprocess('json:loads', '{"a": [1, 2.5, null], "b": "x"}') == {'a': [1, 2.5, None], 'b': 'x'}
    assert measure_in_subprocess('os:getpid') != os.getpid()
    # what the function prints before returning does not get in the way of its result
    assert python_json('print("chatter", end=""); print(); print(\'{"ok": true}\')') == {'ok': True}


def test_subprocess_imports_this_processs_structformer_not_the_current_folders(tmp_path, monkeypatch):
    """`python -c` puts the current folder first on the child's sys.path: an installed `structformer bench` run
    from a checkout (or beside any package named structformer) measured with one copy's code in its children and
    another's in itself. The child imports the parent's copy, whatever folder it starts in."""
    import structformer
    (tmp_path / 'structformer').mkdir()
    (tmp_path / 'structformer' / '__init__.py').write_text("raise ImportError('the copy in the current folder')\n")
    monkeypatch.chdir(tmp_path)
    assert measure_in_subprocess('structformer.requirements:release', '1.2.3') == [1, 2, 3]
    where = python_json('import json, structformer.bench.harness as h; '
                        'print(json.dumps([__import__("structformer").__file__, h.__file__]))')
    assert where == [os.path.abspath(structformer.__file__), os.path.abspath(harness.__file__)]


def test_subprocess_failure_names_the_exit_status_and_the_childs_error():
    with pytest.raises(MeasurementFailed) as info:
        measure_in_subprocess('json:loads', 'this is not json')
    assert info.value.returncode == 1
    message = str(info.value)
    assert 'exited with status 1' in message
    assert message.splitlines()[-1].startswith('json.decoder.JSONDecodeError')   # the child's exception, last

    with pytest.raises(MeasurementFailed, match='status 3'):
        python_json('import sys; sys.stderr.write("boom"); sys.exit(3)')
    with pytest.raises(MeasurementFailed, match=r'killed by SIGKILL \(out of memory\?\)') as info:
        python_json('import os, signal; os.kill(os.getpid(), signal.SIGKILL)')
    assert info.value.returncode == -9
    with pytest.raises(MeasurementFailed, match="no JSON result.*'hello'"):
        python_json('print("hello")')
    with pytest.raises(ValueError, match='module:function'):
        measure_in_subprocess('json.loads', '1')


# ---- timer ------------------------------------------------------------------------------------------

def test_median_seconds_of_a_sleep():
    calls = []

    def nap():
        calls.append(None)
        time.sleep(0.01)

    t = median_seconds(nap, repeats=5, warmup=2, device='cpu')
    assert len(calls) == 7                                # warm-up calls run, untimed
    assert 0.01 <= t < 0.01 + 0.25                        # never less than the sleep; slack for a busy machine


def test_median_seconds_ignores_one_slow_call():
    delays = iter([0.3, 0.005, 0.005, 0.005, 0.005])     # the first timed call is hit by "another process"
    t = median_seconds(lambda: time.sleep(next(delays)), repeats=5, warmup=0)
    assert 0.005 <= t < 0.15                              # a mean would be >= 0.064, the median is one nap


# ---- memory -----------------------------------------------------------------------------------------

def test_peak_rss_grows_by_an_allocation_and_resets():
    code = """if True:
        import json, os
        import numpy as np
        from structformer.bench.harness import PeakMemory, peak_rss_mib, reset_peak_rss
        memory = PeakMemory('cpu')
        idle = memory.growth_mib()
        buffer = np.ones(200 * 2 ** 20 // 8)              # 200 MiB, every page written
        grown = memory.growth_mib()
        peak = peak_rss_mib()
        del buffer                                         # large arrays are unmapped: RSS drops back
        resettable = os.access('/proc/self/clear_refs', os.W_OK)
        reset_peak_rss()
        print(json.dumps({'idle': idle, 'grown': grown, 'peak': peak, 'after_reset': peak_rss_mib(),
                          'resettable': resettable}))
    """
    r = python_json(code)
    assert abs(r['idle']) < 20
    assert 190 <= r['grown'] - r['idle'] <= 260
    if r['resettable']:                                   # the high-water mark came down to the current RSS
        assert r['after_reset'] < r['peak'] - 150


def test_saved_tensor_bytes_counts_what_backward_keeps():
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    # saved for backward: x (for W1's grad), the ReLU output (for ReLU's and W2's grads: one storage,
    # counted once) and W2 (for the gradient flowing back into the ReLU); W1 is not, as x needs no grad
    assert harness.saved_tensor_bytes(model, x) == (8 * 16 + 8 * 32 + 32 * 4) * 4
    assert all(p.grad is None for p in model.parameters())


# ---- environment ------------------------------------------------------------------------------------

def test_environment_record():
    import torch
    env = environment('cpu')
    assert set(env) >= {'torch', 'python', 'threads', 'cpu', 'platform', 'device'}
    assert env['torch'] == torch.__version__ and env['threads'] == torch.get_num_threads()
    assert env['device'] == 'cpu' and env['cpu'] and env['platform']
    json.dumps(env)                                       # it goes into the JSON outputs


# ---- atomic writers ---------------------------------------------------------------------------------

def test_write_json_is_atomic(tmp_path):
    path = tmp_path / 'deep' / 'er' / 'result.json'
    write_json(path, {'a': 1, 'when': {1, 2}}, default=sorted)      # parents made; dump options passed on
    assert json.loads(path.read_text()) == {'a': 1, 'when': [1, 2]}
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask    # like an ordinary open(), not mkstemp's 0600

    with pytest.raises(TypeError):                          # cannot serialise: the old file is intact
        write_json(path, {'a': object()})
    assert json.loads(path.read_text()) == {'a': 1, 'when': [1, 2]}

    def half_then_crash(f):
        f.write('{"a": 2, "tru')
        raise OSError('disk full')
    with pytest.raises(OSError, match='disk full'):        # fails mid-write: still the old file
        write_atomically(path, half_then_crash)
    assert json.loads(path.read_text()) == {'a': 1, 'when': [1, 2]}
    assert os.listdir(path.parent) == ['result.json']      # no temporary file left behind


def test_write_png(tmp_path, monkeypatch, capsys):
    pytest.importorskip('matplotlib')

    def draw(plt):
        fig, ax = plt.subplots(figsize=(2, 2))
        ax.plot([1, 2], [3, 4])
        return fig

    path = tmp_path / 'plot.png'
    assert write_png(path, draw)
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert os.listdir(tmp_path) == ['plot.png']

    monkeypatch.setitem(sys.modules, 'matplotlib', None)   # as if not installed: skipped with a note
    assert not write_png(tmp_path / 'other.png', draw)
    assert 'matplotlib is not installed' in capsys.readouterr().err
    assert os.listdir(tmp_path) == ['plot.png']


def test_harness_imports_nothing_heavy():
    code = ('import sys, structformer.bench.harness; '
            'heavy = [m for m in ("torch", "numpy", "matplotlib", "timm") if m in sys.modules]; '
            'assert not heavy, heavy')
    subprocess.run([sys.executable, '-c', code], check=True)


def test_paired_ratios_rotate_the_order_and_rate_each_round_against_the_reference(monkeypatch):
    """A fake clock: 'a' takes 2 units, 'b' 1 unit except in one slow round (4 units). Each round's ratio
    is a/b of that round, so b's median ratio is 2 (the slow round is an outlier, not a shift), and the
    order of the calls rotates from round to round."""
    from structformer.bench import harness
    clock, order = [0.0], []
    cost = {'a': [2, 2, 2, 2, 2, 2], 'b': [1, 1, 4, 1, 1, 1]}

    def make(label):
        def call():
            order.append(label)
            if len(order) > 2 * 2:                              # past the 2 warm-up calls each
                clock[0] += cost[label].pop(0)
        return call
    monkeypatch.setattr(harness.time, 'perf_counter', lambda: clock[0])
    result = harness.paired_ratios({'a': make('a'), 'b': make('b')}, 'a', rounds=6)
    assert order[4:8] == ['a', 'b', 'b', 'a']
    assert result['a']['ratio'] == 1.0 and result['b']['ratio'] == 2.0
    assert result['b']['median_s'] == 1.0 and result['b']['rounds'] == 6
    assert result['b']['times_s'] == [1, 1, 4, 1, 1, 1] and result['a']['times_s'] == [2] * 6   # round order
    assert result['b']['ratio_q1'] <= 2.0 <= result['b']['ratio_q3']
    with pytest.raises(ValueError, match="reference 'c'"):
        harness.paired_ratios({'a': make('a')}, 'c', rounds=1)
    with pytest.raises(ValueError, match='rounds must be >= 1'):
        harness.paired_ratios({'a': make('a')}, 'a', rounds=0)
