"""tests/forking.py, which the kill, signal and lock tests run their commands with: the forked child behaves as a
fresh process does where those tests depend on it (exit status, output, Ctrl-C, SIGTERM, environment, no state
back to the parent), and it refuses to fork a process whose torch runs more than one thread; `torchrun_forked`
gives its workers torchrun's environment, returns their status and ends a hung one with its agent."""
import os
import signal
import sys

import pytest
import torch

from forking import Forked, run_forked, torchrun_forked

pytestmark = pytest.mark.usefixtures('one_torch_thread')


def _speaks(code):
    print('out line')
    print('err line', file=sys.stderr)
    return code


def test_exit_status_and_output_come_back():
    done = run_forked(_speaks, 3)
    assert (done.returncode, done.stdout, done.stderr) == (3, 'out line\n', 'err line\n')
    assert run_forked(sys.exit, 4).returncode == 4
    assert run_forked(sys.exit, None).returncode == 0


def test_an_uncaught_exception_is_status_1_with_its_trace():
    def fails():
        raise RuntimeError('simulated failure')
    done = run_forked(fails)
    assert done.returncode == 1 and 'Traceback' in done.stderr and 'RuntimeError: simulated failure' in done.stderr


def test_ctrl_c_and_sigterm_are_pythons_even_when_the_parent_ignores_them():
    def interrupted(number):
        try:
            os.kill(os.getpid(), number)
        except KeyboardInterrupt:
            return 130
        return 0
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)        # as a suite started in the background has it
        signal.signal(signal.SIGTERM, lambda *a: None)
        assert run_forked(interrupted, signal.SIGINT).returncode == 130
        assert run_forked(interrupted, signal.SIGTERM).returncode == -signal.SIGTERM
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


def test_the_environment_is_the_childs_and_nothing_comes_back():
    marker = 'STRUCTFORMER_TEST_FORK_MARKER'
    assert marker not in os.environ

    def reads():
        os.environ['ONLY_IN_THE_CHILD'] = '1'
        return int(os.environ[marker])
    assert run_forked(reads, env={marker: '7'}).returncode == 7
    assert marker not in os.environ and 'ONLY_IN_THE_CHILD' not in os.environ


def test_a_child_is_killed_and_reaped_and_waits_time_out():
    import time
    with Forked(time.sleep, 60) as child:
        assert child.poll() is None and child.pid != os.getpid()
        with pytest.raises(TimeoutError, match='killed'):
            child.wait(timeout=0.2)
        assert child.returncode == -signal.SIGKILL
    with Forked(_speaks, 0) as child:
        child.wait_for_output('out line', timeout=60)
        assert child.wait() == 0 and child.stderr == 'err line\n'


def test_more_than_one_torch_thread_is_refused():
    torch.set_num_threads(2)                  # conftest's fixtures put the count back
    with pytest.raises(RuntimeError, match='one thread'):
        Forked(_speaks, 0)


def test_a_child_forked_after_an_export_and_a_backward_runs_backward():
    """In a fresh interpreter, so that nothing before it has run a backward: `first_backward` (conftest calls it at
    the session's start) then torch.export (a FakeTensorMode) and a backward in the parent; a forked child's
    backward (a training run's) works. Without `first_backward` torch 2.14 raises in the child ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing")."""
    import subprocess
    code = (
        'import os, torch; from forking import first_backward, run_forked; torch.set_num_threads(1); '
        'first_backward(); torch.export.export(torch.nn.Linear(3, 3), (torch.randn(2, 3),)); '
        'step = lambda: torch.nn.Linear(3, 3)(torch.randn(2, 3)).sum().backward() or 0; step(); '
        'done = run_forked(step); assert done.returncode == 0, done.stderr[-300:]')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get('PYTHONPATH', '')]))
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]


def _report_rank(folder, hang_rank=None, code_rank=None):
    """A worker: writes its rank, pid and torchrun's variables; rank `hang_rank` then sleeps, rank `code_rank`
    returns 2."""
    import json
    import time
    rank = int(os.environ['RANK'])
    keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT', 'TORCHELASTIC_RUN_ID', 'MARK')
    with open(os.path.join(folder, f'rank{rank}.json'), 'w') as f:
        json.dump({'pid': os.getpid(), 'threads': torch.get_num_threads(), **{k: os.environ.get(k) for k in keys}}, f)
    if rank == hang_rank:
        time.sleep(600)
    return 2 if rank == code_rank else 0


def test_torchrun_forked_gives_each_worker_torchruns_environment(tmp_path):
    import json
    done = torchrun_forked(_report_rank, str(tmp_path), nproc=2, env={'MARK': 'passed on'})
    assert done.returncode == 0, done.stderr[-2000:]
    ranks = [json.loads((tmp_path / f'rank{r}.json').read_text()) for r in (0, 1)]
    assert [(r['RANK'], r['LOCAL_RANK'], r['WORLD_SIZE']) for r in ranks] == [('0', '0', '2'), ('1', '1', '2')]
    assert ranks[0]['MASTER_PORT'] == ranks[1]['MASTER_PORT'] and ranks[0]['TORCHELASTIC_RUN_ID']
    assert all(r['MARK'] == 'passed on' and r['threads'] == 1 for r in ranks)
    assert ranks[0]['pid'] != ranks[1]['pid'] != os.getpid()


def test_torchrun_forked_reports_a_failed_worker_and_ends_a_hung_one(tmp_path):
    import json
    import time
    failed = torchrun_forked(_report_rank, str(tmp_path), None, 1)           # rank 1 returns 2
    assert failed.returncode == 2
    with pytest.raises(TimeoutError):
        torchrun_forked(_report_rank, str(tmp_path), 1, timeout=8)          # rank 1 sleeps past the timeout
    hung = json.loads((tmp_path / 'rank1.json').read_text())['pid']
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:                                      # killed with its agent, then reaped
        try:
            os.kill(hung, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f'the hung worker {hung} outlived its agent')
