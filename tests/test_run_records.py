"""A run folder tells the truth after any interruption (issue 16): kills at every step of a checkpoint
commit, --overwrite that fails, schedules of shortened epochs, permissions, foreign checkpoints."""
import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from structformer.train import CheckpointError, TrainConfig, train
from structformer.train.checkpoint import resolve_checkpoint
from structformer.train.engine import Trainer
from structformer.train.run_dir import committed_checkpoints, read_metrics, reconcile

from forking import run_forked

pytestmark = pytest.mark.usefixtures('one_torch_thread')

EPOCHS = 2
TINY = dict(model='crate_digits', data='digits', epochs=EPOCHS, batch_size=64, lr=3e-3, warmup_epochs=0,
            limit_train_batches=2, model_kwargs={'depth': 1})


def _config(output, **overrides):
    return TrainConfig(**dict(TINY, output=str(output), **overrides))


def _train_killed(output, kill_at, overwrite=False):
    """Train TINY in a process of its own (forked: tests/forking.py) that the test hook ends, as kill -9 would
    (os._exit(137)), at `kill_at`. The fork keeps this process's thread count: the resumed half runs here and must
    round the same way."""
    done = run_forked(lambda: train(_config(output), progress=False, overwrite=overwrite),
                      env={'STRUCTFORMER_TEST_KILL_AT': kill_at})
    assert done.returncode == 137, (kill_at, done.returncode, done.stderr[-2000:])


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
    """The same run, never interrupted: what every interrupted-then-resumed run must end as."""
    output = tmp_path_factory.mktemp('straight') / 'run'
    result = train(_config(output), progress=False)
    return output, load_file(str(result.last_checkpoint / 'model.safetensors'))


def _assert_records_agree(output):
    """latest.json names the newest committed checkpoint, no temporaries, one metrics line per epoch."""
    ckpt_dir = output / 'checkpoints'
    checkpoints = committed_checkpoints(ckpt_dir)
    assert not list(ckpt_dir.glob('*.tmp-*'))
    assert resolve_checkpoint(ckpt_dir) == checkpoints[-1]
    newest = int(checkpoints[-1].name.split('_')[1])
    assert [r['epoch'] for r in read_metrics(output / 'metrics.jsonl')] == list(range(1, newest + 1))
    return newest


KILL_STEPS = ['epoch_0000:weights', 'epoch_0000:renamed', 'epoch_0000:latest',
              'epoch_0001:weights', 'epoch_0001:renamed', 'epoch_0001:latest', 'epoch 1:metrics',
              'epoch_0002:renamed']
EXPECTED_NEWEST = [None, 0, 0, 0, 1, 1, 1, 2]      # the newest committed checkpoint after each kill


@pytest.mark.parametrize('kill_at, newest', list(zip(KILL_STEPS, EXPECTED_NEWEST)), ids=KILL_STEPS)
def test_kill_at_each_commit_step_leaves_true_records_and_a_resumable_run(tmp_path, straight, kill_at, newest):
    output = tmp_path / 'run'
    _train_killed(output, kill_at)
    reconcile(output)                                  # what every start (new, --resume, --overwrite) does first
    if newest is None:                                 # nothing committed: no run to resume, a new one starts
        assert not committed_checkpoints(output / 'checkpoints')
        assert not list((output / 'checkpoints').glob('*.tmp-*'))
        result = train(_config(output), progress=False)
    else:
        assert _assert_records_agree(output) == newest
        result = train(_config(output), progress=False, resume=True)
    assert _assert_records_agree(output) == EPOCHS
    summary = json.loads((output / 'summary.json').read_text())
    records = read_metrics(output / 'metrics.jsonl')
    assert summary['best_epoch'] == max(records, key=lambda r: r['val_top1'])['epoch']   # over every epoch
    weights = load_file(str(result.last_checkpoint / 'model.safetensors'))
    for key, value in straight[1].items():             # resume is bit-exact: same code path, same RNG states
        assert torch.equal(weights[key], value), key


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob('*')) if p.is_file()}


def test_overwrite_with_a_bad_argument_keeps_the_old_run(tmp_path, straight):
    output = tmp_path / 'run'
    train(_config(output), progress=False)
    before = _snapshot(output)
    with pytest.raises(ValueError, match='crate_digitz'):
        Trainer(_config(output, model='crate_digitz'), overwrite=True, progress=False).fit()
    with pytest.raises(ValueError):
        Trainer(_config(output, data='digitz'), overwrite=True, progress=False).fit()
    assert _snapshot(output) == before


@pytest.mark.parametrize('kill_at', ['epoch_0000:weights', 'epoch_0001:weights'])
def test_overwrite_killed_before_its_first_trained_epoch_brings_the_old_run_back(tmp_path, kill_at):
    """Killed before the new run's init checkpoint, or after it but before its first trained epoch: on the next
    start the old run comes back (it is discarded only once the new run has trained an epoch)."""
    output = tmp_path / 'run'
    train(_config(output), progress=False)
    before = _snapshot(output)
    _train_killed(output, kill_at, overwrite=True)
    reconcile(output)
    assert _snapshot(output) == before and not list(output.glob('.replaced-*'))


def test_overwrite_replaces_the_old_run_once_the_new_one_has_committed(tmp_path):
    output = tmp_path / 'run'
    train(_config(output, epochs=3), progress=False)
    train(_config(output), progress=False, overwrite=True)
    assert [r['epoch'] for r in read_metrics(output / 'metrics.jsonl')] == [1, 2]
    assert not (output / 'checkpoints' / 'epoch_0003').exists() and not list(output.glob('.replaced-*'))


def test_schedule_follows_the_steps_of_a_limited_run(tmp_path):
    """With --limit-train-batches 2 an epoch is 2 steps, so 1 warm-up epoch ends after step 2 and cosine
    reaches min_lr at the last step (with the full 23 steps per epoch counted, the run ends mid warm-up)."""
    lr, min_lr = 3e-3, 1e-5
    result = train(_config(tmp_path / 'run', epochs=3, warmup_epochs=1, warmup_lr=1e-6, min_lr=min_lr, lr=lr),
                   progress=False)
    steps = [r['step'] for r in result.history]
    assert steps == [2, 4, 6]
    # timm's cosine (no warm-up prefix) at update t of T = 6: min_lr + (lr - min_lr)(1 + cos(pi t / T)) / 2
    expected = [min_lr + (lr - min_lr) * (1 + torch.cos(torch.tensor(torch.pi * t / 6)).item()) / 2 for t in steps]
    expected[-1] = min_lr                               # t = T: the schedule has ended at min_lr
    assert [r['lr'] for r in result.history] == pytest.approx(expected, rel=1e-6)


@pytest.mark.skipif(os.name != 'posix', reason='POSIX permissions')
def test_checkpoints_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        result = train(_config(tmp_path / 'run', epochs=1), progress=False)
    finally:
        os.umask(old)
    folder, weights = result.last_checkpoint, result.last_checkpoint / 'model.safetensors'
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert stat.S_IMODE(weights.stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / 'run' / 'checkpoints' / 'latest.json').stat().st_mode) == 0o644


def test_foreign_checkpoint_error_is_short_and_names_the_first_keys(tmp_path, straight):
    """Weights of another model under a run's state.json: one short error, not thousands of keys."""
    import shutil
    from structformer.train import load_model
    crate, soft = tmp_path / 'crate', tmp_path / 'soft'
    shutil.copytree(straight[0], crate)
    train(_config(soft, model='soft_digits', model_kwargs={}, epochs=1), progress=False)
    foreign = resolve_checkpoint(crate)
    shutil.copy(resolve_checkpoint(soft) / 'model.safetensors', foreign / 'model.safetensors')
    for attempt in (lambda: load_model(foreign),
                    lambda: Trainer(_config(tmp_path / 'resumed'), resume=str(foreign), progress=False).fit()):
        with pytest.raises(CheckpointError) as info:
            attempt()
        message = str(info.value)
        assert len(message) < 600 and 'missing' in message and 'in all)' in message, message


def test_resume_from_a_checkpoint_into_a_new_folder(tmp_path, straight):
    first = resolve_checkpoint(straight[0]).parent / 'epoch_0001'
    result = train(_config(tmp_path / 'continued'), resume=str(first), progress=False)
    assert [r['epoch'] for r in result.history] == [2]
    assert result.last_checkpoint == tmp_path / 'continued' / 'checkpoints' / 'epoch_0002'


def _fail_in_first_epoch(monkeypatch):
    def broken(self, epoch, phase):
        raise RuntimeError(f'simulated failure in epoch {epoch}')
    monkeypatch.setattr(Trainer, '_train_epoch', broken)


def test_a_new_run_that_fails_in_its_first_epoch_leaves_nothing(tmp_path, monkeypatch):
    """A command that failed before training an epoch (a bad forward, a diverged first step) must not leave
    a config and an init checkpoint that make the corrected command answer 'already holds a run'."""
    _fail_in_first_epoch(monkeypatch)
    with pytest.raises(RuntimeError, match='simulated'):
        train(_config(tmp_path / 'new' / 'deeper' / 'run'), progress=False)
    assert not (tmp_path / 'new').exists()           # the folders made for it go too
    existing = tmp_path / 'existing'                 # a folder the user made: it stays, empty
    existing.mkdir()
    with pytest.raises(RuntimeError, match='simulated'):
        train(_config(existing), progress=False)
    assert list(existing.iterdir()) == []


def test_overwrite_that_fails_in_its_first_epoch_brings_the_old_run_back(tmp_path, monkeypatch):
    output = tmp_path / 'run'
    train(_config(output), progress=False)
    before = _snapshot(output)
    _fail_in_first_epoch(monkeypatch)
    with pytest.raises(RuntimeError, match='simulated'):
        train(_config(output, seed=3), progress=False, overwrite=True)
    assert _snapshot(output) == before and not list(output.glob('.replaced-*'))


def test_a_second_process_cannot_train_into_a_run_in_use(tmp_path):
    """Two `train` processes into one --output: the second is refused by name, the first's records stay its own."""
    from structformer.train.run_dir import RunLock
    output = tmp_path / 'run'
    with RunLock(output):                            # as a running `train` holds it
        done = run_forked(lambda: train(_config(output), progress=False))
        assert done.returncode != 0 and 'is in use by another training process' in done.stderr, done.stderr[-800:]
        assert not (output / 'config.yaml').exists() and not (output / 'checkpoints').exists()
    train(_config(output), progress=False)        # released: the folder is usable again


def test_a_forked_child_that_outlives_the_trainer_does_not_hold_the_run(tmp_path):
    """A trainer killed outright (kill -9) leaves its DataLoader workers running for seconds (they notice their
    parent's end by polling; a stuck one never does). They are forked, so they shared the flock'ed file and kept
    the run locked: an immediate --resume was refused as 'in use by another training process'."""
    import signal
    import time

    from structformer.train.run_dir import RunLock, training_now
    output = tmp_path / 'run'

    def trainer_killed_with_a_worker_left():
        import multiprocessing as mp
        RunLock(output).__enter__()
        worker = mp.get_context('fork').Process(target=time.sleep, args=(60,))
        worker.start()
        pid_file.write_text(str(worker.pid))
        os._exit(137)

    pid_file = tmp_path / 'child.pid'
    assert run_forked(trainer_killed_with_a_worker_left, timeout=60).returncode == 137
    child = int(pid_file.read_text())
    try:
        os.kill(child, 0)                                  # the orphan still runs ...
        assert training_now(output) is False              # ... and holds nothing
        with RunLock(output):
            pass
    finally:
        os.kill(child, signal.SIGKILL)
        time.sleep(0.1)


def test_a_run_finished_by_another_process_meanwhile_is_not_overwritten(tmp_path):
    """The 'already holds a run' check is made again under the lock: a process that started while the folder
    was empty must not write into the run another process completed in the meantime."""
    output = tmp_path / 'run'
    late = Trainer(_config(output, seed=5), progress=False)       # checked while the folder was empty
    train(_config(output), progress=False)
    before = _snapshot(output)
    with pytest.raises(FileExistsError, match='another process'):
        late.fit()
    assert _snapshot(output) == before


def test_a_file_system_without_locks_trains_with_a_warning(tmp_path, monkeypatch, capsys):
    """flock fails with ENOLCK on some network mounts: that is not a reason to refuse the run."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, 'No locks available')
    monkeypatch.setattr(fcntl, 'flock', no_locks)
    train(_config(tmp_path / 'run', epochs=1), progress=False)
    assert committed_checkpoints(tmp_path / 'run' / 'checkpoints')
    assert 'cannot lock the run folder (No locks available)' in capsys.readouterr().err
