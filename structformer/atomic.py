"""Atomic writes and their temporaries, shared by every writer of the package (run folders, records,
`convert`, `export`, `data shard`). No torch here.

An output is written to a temporary sibling and moved over its name in one rename (same folder, so one file
system: atomic on POSIX), so a reader sees the old output or the whole new one. A writer killed before the
rename (kill -9, power loss) leaves its temporary behind; these are named so that they are recognisably ours and
say who wrote them:

    OUT.tmp-PID-HOST-XXXXXXXX[SUFFIX]     the output being written (a file or a folder)
    OUT.old-PID-HOST-XXXXXXXX/            the previous OUT, moved aside while a folder is replaced

PID is the writing process, HOST eight hex digits of a hash of its host name (a writer on another machine
sharing the folder is never judged dead from here), XXXXXXXX tempfile's random part. `prepare_output(OUT, flag)`,
called by a writer before it writes OUT, removes the temporaries of OUT whose writer is no longer running (a
moved-aside previous output is put back first when OUT itself is missing), says what it removed, and refuses with
one line when another running process is writing OUT. Readers refuse a temporary given as input
(`describe_temporary`), so a half-written folder is never taken for an output.
"""
import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ['permissions_from_umask', 'temporary_sibling', 'describe_temporary', 'prepare_output',
           'stale_temporaries', 'write_atomically', 'write_text_atomically', 'uninterrupted', 'replace_together']

_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
_KINDS = ('tmp', 'old')
_NAME = re.compile(r'^(?P<target>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-[a-z0-9_]{8}(\.[\w-]+)?$')


def permissions_from_umask(path, mode: int) -> None:
    """mkstemp / mkdtemp create 0600 / 0700 for privacy; finished outputs follow the user's umask instead."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def temporary_sibling(target, directory: bool = False, suffix: str = '', kind: str = 'tmp') -> Path:
    """Create and return an empty temporary file (or folder) beside `target`, named for it and this process
    (module docstring). The caller renames it over `target` when complete and removes it on failure."""
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r}: accepted {', '.join(_KINDS)}")
    target = Path(target).absolute()
    prefix = f"{target.name}.{kind}-{os.getpid()}-{_HOST}-"
    try:
        if directory:
            return Path(tempfile.mkdtemp(dir=target.parent, prefix=prefix, suffix=suffix))
        handle, name = tempfile.mkstemp(dir=target.parent, prefix=prefix, suffix=suffix)
    except OSError as e:
        # said of the temporary, the error would name a file the user never gave (OUT.tmp-PID-HOST-X): it names OUT
        raise type(e)(e.errno, e.strerror, str(target)) from None
    os.close(handle)
    return Path(name)


def _owner(path: Path) -> Optional[Tuple[str, str, int, str]]:
    """(target name, kind, pid, host) of a temporary named by `temporary_sibling`, else None."""
    m = _NAME.match(Path(path).name)
    return (m['target'], m['kind'], int(m['pid']), m['host']) if m else None


def _process_start(pid: int) -> Optional[float]:
    """When process `pid` started (seconds since the epoch), from /proc on Linux; None where unknown."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            fields = f.read().rsplit(')', 1)[1].split()
        with open('/proc/stat') as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith('btime '))
        return boot + float(fields[19]) / os.sysconf('SC_CLK_TCK')
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _running(pid: int, host: str, path: Optional[Path] = None) -> bool:
    """Whether the writer of temporary `path` may still be running: True unless it ran on this host and its PID
    is gone, or the PID now belongs to a process that started after the temporary was last written (the PID was
    reused)."""
    if host != _HOST:
        return True                                  # another machine's process: not ours to judge
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                          # a process of another user holds the PID
        pass
    started = _process_start(pid)
    if started is not None and path is not None:
        try:
            written = os.lstat(path).st_mtime
        except OSError:
            return True
        return started <= written + 2.0              # /proc's start time is in clock ticks: a little slack
    return True


def describe_temporary(path) -> str:
    """'' unless `path` is a temporary of ours; else one sentence saying whose it is, for an error message."""
    owner = _owner(Path(path))
    if owner is None:
        return ''
    target, kind, pid, host = owner
    what = 'an unfinished output' if kind == 'tmp' else 'a previous output moved aside'
    if _running(pid, host, Path(path)):
        return f"is {what} of {target} that process {pid} is writing now, not an output"
    return (f"is {what} of {target}, left by process {pid}, which was interrupted; not an output (the next "
            f"structformer command writing {target} removes it)")


def stale_temporaries(target) -> List[Path]:
    """The temporaries of `target` (beside it, named for it) whose writer is no longer running."""
    target = Path(target).absolute()
    found = []
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return []
    for entry in entries:
        owner = _owner(Path(entry.name))
        if owner and owner[0] == target.name and not _running(owner[2], owner[3], target.parent / entry.name):
            found.append(target.parent / entry.name)
    return sorted(found)


def _live_writers(target: Path) -> List[Tuple[Path, int]]:
    found = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    for name in names:
        owner = _owner(Path(name))
        if owner and owner[0] == target.name and owner[2] != os.getpid() and \
                _running(owner[2], owner[3], target.parent / name):
            found.append((target.parent / name, owner[2]))
    return sorted(found)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prepare_output(target, flag: str) -> List[str]:
    """Before writing `target`: remove the temporaries that interrupted writers left beside it (a previous output
    moved aside goes back to `target` first when `target` is missing, as it was before that writer started), and
    refuse, naming `flag`, when another running process is writing `target`. Returns what was done, one line each."""
    from .errors import UsageError
    target = Path(target).absolute()
    if not target.parent.is_dir():
        return []
    live = _live_writers(target)
    if live:
        path, pid = live[0]
        raise UsageError(f"{flag} {target}: process {pid} is writing it now ({path.name}); wait for it to finish, "
                         "or stop it, and run again")
    done = []
    for path in stale_temporaries(target):
        _, kind, pid, _ = _owner(path)
        inner = path / target.name
        if kind == 'old' and not os.path.lexists(target) and os.path.lexists(inner):
            os.replace(inner, target)
            done.append(f"restored {target.name} from {path.name} (process {pid} was interrupted while replacing it)")
        _remove(path)
        done.append(f"removed {path.name}, left by process {pid}, which was interrupted while writing {target.name}")
    return done


def write_atomically(path, write: Callable[[Any], None], binary: bool = False) -> Path:
    """Call `write(file)` on a temporary file beside `path`, then rename it over `path`; the temporary is
    removed if anything fails (and by the next write of `path` if this process is killed). Parent folders are
    created. Returns the absolute path."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in stale_temporaries(path):
        _remove(stale)
    tmp = temporary_sibling(path)
    try:
        with open(tmp, 'wb' if binary else 'w') as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        permissions_from_umask(tmp, 0o666)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_text_atomically(path, text: str) -> Path:
    return write_atomically(path, lambda f: f.write(text))


@contextlib.contextmanager
def uninterrupted():
    """Ctrl-C (SIGINT) and SIGTERM held until the block ends (a signal that arrives meanwhile is delivered after),
    so the few renames inside happen all or none. Off the main thread signals cannot be held: a plain block."""
    held = {signal.SIGINT, signal.SIGTERM}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, 'pthread_sigmask'):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def replace_together(folder, fill: Callable[[Path], Dict[Path, str]], flag: str) -> Path:
    """Publish a folder and the files that describe it as one step: `fill(staging)` fills a temporary sibling of
    `folder` and returns {path: text} of the files outside it to write. Everything is written beside its target
    first; then, with signals held (`uninterrupted`), the old folder is moved aside, the new one renamed into place
    and each file renamed over its target. A failure or interruption before the renames leaves everything as it
    was; the temporaries (and the old folder) are removed. `flag` names the output in prepare_output's refusal."""
    folder = Path(folder).absolute()
    folder.parent.mkdir(parents=True, exist_ok=True)
    prepare_output(folder, flag)                    # what an interrupted publish left (renames undone)
    temporaries = [temporary_sibling(folder, directory=True)]
    try:
        permissions_from_umask(temporaries[0], 0o777)
        files = fill(temporaries[0])
        for target, content in files.items():
            temporaries.append(temporary_sibling(target))
            temporaries[-1].write_text(content)
            if Path(target).exists():               # mkstemp's 0600 would stick to the renamed file
                shutil.copymode(target, temporaries[-1])
            else:
                permissions_from_umask(temporaries[-1], 0o666)
        with uninterrupted():
            if folder.exists():
                temporaries.append(temporary_sibling(folder, directory=True, kind='old'))
                os.replace(folder, temporaries[-1])
            os.replace(temporaries[0], folder)
            for target, temporary in zip(files, temporaries[1:]):
                os.replace(temporary, target)
    finally:
        for path in temporaries:
            _remove(path)                           # not renamed into place (a failure), or the old folder
    return folder
