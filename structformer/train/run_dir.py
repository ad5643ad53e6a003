"""A run directory as the single source of truth, whatever interrupted the process that wrote it.

    RUN/config.yaml, RUN/metrics.jsonl, RUN/summary.json, RUN/checkpoints/epoch_NNNN/, RUN/checkpoints/latest.json
    RUN/.lock   (flock'ed by the one process training into RUN; see `RunLock`)

Checkpoints commit by rename (see `checkpoint.save_checkpoint`), so after a kill the folder can hold:
an `epoch_NNNN.tmp-*` folder that never committed, a committed checkpoint that `latest.json` does not
name yet, or a `metrics.jsonl` whose last line is older or newer than the newest checkpoint. On every
start (new run, `--resume`, `--overwrite`) `reconcile` brings the records back in line with the newest
committed checkpoint: stale temporaries go, `latest.json` is rewritten from the checkpoints present,
and `metrics.jsonl` keeps exactly one line per epoch up to that checkpoint (a missing line is taken
from the checkpoint's own `state.json`, which carries that epoch's metrics).
"""
import errno
import json
import os
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List, Optional

from ..atomic import write_text_atomically
from .checkpoint import LATEST, checkpoint_epoch, committed_checkpoints, mark_latest   # noqa: F401 (re-exported)

RUN_FILES = ('config.yaml', 'metrics.jsonl', 'summary.json', 'checkpoints')




def remove_stale_temporaries(ckpt_dir: Path) -> List[str]:
    """Delete what an interrupted commit left behind; return the names removed."""
    removed = []
    for path in Path(ckpt_dir).glob('*.tmp-*'):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def read_metrics(path: Path) -> List[Dict]:
    """metrics.jsonl as records; a torn last line (killed mid-write) is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get('epoch'), int):
            records.append(record)
    return records


def holds_trained_commit(ckpt_dir: Path) -> bool:
    """Whether a run has committed a trained state: an epoch's checkpoint past the init one, or a recovery point.
    From there an interrupted new run is kept (to resume) and the run an --overwrite replaced can go."""
    from .recovery import recovery_points
    return any(checkpoint_epoch(p) >= 1 for p in committed_checkpoints(ckpt_dir)) or bool(recovery_points(ckpt_dir))


def reconcile(output: Path) -> Optional[Path]:
    """Make the records of the run in `output` agree with its newest committed checkpoint, which is
    returned (None if there is none)."""
    output = Path(output)
    ckpt_dir = output / 'checkpoints'
    from .recovery import prune as prune_recovery, recovery_points
    for aside in output.glob('.replaced-*'):           # an --overwrite that was interrupted
        if holds_trained_commit(ckpt_dir):
            discard_aside(aside)                        # ... after the new run's first trained epoch
        else:
            restore_aside(output, aside)                # ... before it: the old run comes back
    if not ckpt_dir.is_dir():
        return None
    remove_stale_temporaries(ckpt_dir)
    checkpoints = committed_checkpoints(ckpt_dir)
    if not checkpoints:
        (ckpt_dir / LATEST).unlink(missing_ok=True)
        return None
    newest = checkpoints[-1]
    mark_latest(ckpt_dir, newest)
    epoch = checkpoint_epoch(newest)
    points = recovery_points(ckpt_dir)                  # the newest inside a later epoch is kept, to resume from
    prune_recovery(ckpt_dir, keep=points[-1] if points else None, completed_epochs=epoch)
    by_epoch: Dict[int, Dict] = {}
    for record in read_metrics(output / 'metrics.jsonl'):
        if 1 <= record['epoch'] <= epoch:
            by_epoch[record['epoch']] = record              # a repeated epoch: the later line wins
    if epoch >= 1 and epoch not in by_epoch:
        state = json.loads((newest / 'state.json').read_text())
        if state.get('metrics'):
            by_epoch[epoch] = state['metrics']
    lines = ''.join(json.dumps(by_epoch[e]) + '\n' for e in sorted(by_epoch))
    if lines or (output / 'metrics.jsonl').exists():
        write_text_atomically(output / 'metrics.jsonl', lines)
    return newest


def disk_full(error: BaseException) -> bool:
    """Whether `error` says the disk (or the user's quota) is full: an OSError with ENOSPC / EDQUOT, or the
    SafetensorError that safetensors raises with the system's message inside."""
    codes = [errno.ENOSPC] + ([errno.EDQUOT] if hasattr(errno, 'EDQUOT') else [])
    if isinstance(error, OSError):
        return error.errno in codes
    return any(os.strerror(code) in str(error) for code in codes) or 'StorageFull' in str(error)


def holds_run(output: Path) -> bool:
    """Whether `output` holds a run: checkpoints (committed or not), or one an --overwrite moved aside."""
    ckpt_dir = Path(output) / 'checkpoints'
    return (ckpt_dir.is_dir() and any(ckpt_dir.iterdir())) or any(Path(output).glob('.replaced-*'))


@contextmanager
def signals_deferred():
    """SIGINT and SIGTERM held back (delivered when the block ends): for a few renames that must not stop
    half-way, such as moving a run aside, after which a failure could no longer tell old records from new."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, 'pthread_sigmask'):
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, `kill`), raised like Ctrl-C's KeyboardInterrupt, so the same clean-up runs
    (a half-started --overwrite puts the old run back). Exit status 143 = 128 + SIGTERM, as the signal's own."""
    exit_status = 128 + signal.SIGTERM


@contextmanager
def sigterm_as_interrupt():
    """For the block, SIGTERM raises `Terminated` instead of ending the process on the spot."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated(f"stopped by {signal.Signals(signum).name}")
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def move_aside(output: Path) -> Optional[Path]:
    """Move an old run's records into a hidden sibling folder (for `--overwrite`), so they can be put
    back if the new run fails before its first checkpoint. Returns that folder, or None if empty."""
    output = Path(output)
    present = [name for name in RUN_FILES if (output / name).exists()]
    if not present:
        return None
    aside = output / f'.replaced-{os.getpid()}'
    with signals_deferred():                            # all of the old run moves, or none of it
        aside.mkdir()
        for name in present:
            os.replace(output / name, aside / name)
    return aside


def restore_aside(output: Path, aside: Optional[Path]) -> None:
    """Undo `move_aside`: whatever the new run wrote is removed and the old records come back."""
    if aside is None:
        return
    with signals_deferred():                            # a second Ctrl-C must not stop it half-way
        for name in RUN_FILES:
            if (aside / name).exists():
                target = Path(output) / name
                _remove(target)
                os.replace(aside / name, target)
        shutil.rmtree(aside, ignore_errors=True)


def _remove(target: Path, ignore_errors: bool = False) -> None:
    """Delete a run record, folder or file, if it is there."""
    if target.is_dir():
        shutil.rmtree(target, ignore_errors=ignore_errors)
    elif target.exists():
        target.unlink()


def discard_aside(aside: Optional[Path]) -> None:
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def undo_new_run(output: Path, aside: Optional[Path], lock: 'RunLock') -> None:
    """Remove what a new run wrote into `output` before its first trained epoch (its config, its init
    checkpoint), put back the run that --overwrite moved aside, and remove `output` itself (or the lock
    file) if the run's `lock` created it: a command that failed leaves the folder as it found it."""
    output = Path(output)
    for name in RUN_FILES:
        _remove(output / name, ignore_errors=True)       # already on a failure path: keep its error
    restore_aside(output, aside)
    if lock.created:
        shutil.rmtree(output, ignore_errors=True)        # made by this lock: nothing in it is anyone else's
        remove_empty_parents(output, lock.created_root)
    elif lock.created_file:
        (output / RunLock.NAME).unlink(missing_ok=True)


def remove_empty_parents(path: Path, root: Path) -> None:
    """Remove the folders above `path` up to and including `root` while they are empty (`rmdir`, never a tree).
    The folders a run's lock made on the way to its --output may have been made at the same moment by another run
    into a sibling (`compare --jobs` starts its cells together; two `train` commands into outputs/a/x and
    outputs/a/y): each run counts them as its own, so removing them as a tree would take the other run's committed
    checkpoints with them."""
    path, root = Path(path).absolute(), Path(root).absolute()
    if path == root or root not in path.parents:
        return
    for folder in path.parents:
        try:
            folder.rmdir()
        except OSError:                                  # not empty (another run's), or gone: stop here
            return
        if folder == root:
            return


_HELD_LOCKS: set = set()          # the descriptors of the RunLocks this process holds


def _release_in_child() -> None:
    """In a forked child (a DataLoader worker, a writer process): close its copies of the lock's descriptor. An
    flock belongs to the open file, which a fork shares, so the loader workers that outlive a trainer killed
    with kill -9 (they notice their parent's end seconds later, a stuck one never) kept the run locked and an
    immediate --resume was refused as 'in use by another training process'. The parent's own copy holds it."""
    for fd in list(_HELD_LOCKS):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCKS.clear()


if hasattr(os, 'register_at_fork'):
    os.register_at_fork(after_in_child=_release_in_child)


class RunLock:
    """An exclusive lock on a run folder for the life of one training process (`flock` on RUN/.lock, which
    the kernel releases when the process ends however it ends, so a killed run never leaves a stale lock;
    forked children do not hold it: `_release_in_child`).
    A second `train` into the same --output while one runs is refused instead of interleaving its
    checkpoints and metrics with the first. `None` (a DDP worker that is not rank 0) locks nothing.
    Where `fcntl` does not exist (Windows) no lock is taken."""

    NAME = '.lock'

    def __init__(self, output: Optional[Path]):
        self.output = None if output is None else Path(output)
        self.fd: Optional[int] = None
        # whether this lock made the folder / the lock file (atomic: only one process can), so that a failed
        # new run can leave the folder as it found it
        self.created = self.created_file = False
        self.created_root: Optional[Path] = None         # with `created`: the outermost folder made for it

    def __enter__(self) -> 'RunLock':
        try:
            import fcntl
        except ImportError:                              # pragma: no cover - not POSIX
            return self
        if self.output is None:
            return self
        missing = self.output.absolute()
        while not missing.parent.exists():               # the outermost folder this run would make
            missing = missing.parent
        self.output.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.output.mkdir()
            self.created = True
            self.created_root = missing
        except FileExistsError:
            pass
        path = self.output / self.NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            self.created_file = True
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FileExistsError(f"--output {self.output} is in use by another training process; wait for it "
                                  "to finish or choose another --output") from None
        except OSError as e:                            # a file system without locks (some NFS mounts): go on
            os.close(fd)
            print(f"warning: --output {self.output}: cannot lock the run folder ({e.strerror or e}); make sure no "
                  "other process trains into it", file=sys.stderr)
            return self
        self.fd = fd
        _HELD_LOCKS.add(fd)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            # the file stays: unlinking it would let a process that opened it a moment earlier lock a file
            # that is no longer the one the next process opens
            _HELD_LOCKS.discard(self.fd)
            os.close(self.fd)
            self.fd = None


def training_now(run: Path) -> Optional[bool]:
    """Whether a `train` process holds RUN's lock now (it is still training into RUN): True / False, or None where
    it cannot be told (no fcntl, no lock file that this process may open, a file system without locks). Reading
    never blocks and never takes the lock from the trainer (a shared lock tried and released at once)."""
    try:
        import fcntl
    except ImportError:                                  # pragma: no cover - not POSIX
        return None
    path = Path(run) / RunLock.NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None if path.exists() else False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)                                     # closing releases a lock taken here
    return False
