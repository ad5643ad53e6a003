"""Atomic file writes, shared by the run folder (train/) and the benchmarks (bench/). No torch here.

A file is written to a temporary sibling `NAME.tmp-XXXX` and moved over `NAME` in one rename (same
folder, so one file system: atomic on POSIX), so a reader sees the old file or the whole new one and an
interruption leaves at most a temporary that `train.run_dir.remove_stale_temporaries` recognises.
"""
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def permissions_from_umask(path, mode: int) -> None:
    """mkstemp / mkdtemp create 0600 / 0700 for privacy; finished outputs follow the user's umask instead."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def write_atomically(path, write: Callable[[Any], None], binary: bool = False) -> Path:
    """Call `write(file)` on a temporary file beside `path`, then rename it over `path`; the temporary is
    removed if anything fails. Parent folders are created. Returns the absolute path."""
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + '.tmp-')
    try:
        with os.fdopen(fd, 'wb' if binary else 'w') as f:
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
