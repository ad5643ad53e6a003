"""The errors a user's input can cause, and which of them the CLI reports as one line.

Light on purpose (no torch, no timm): every layer of the package may import it.

`UsageError` is what a validation site raises for bad input: its message names the argument (the flag,
config key or path) and what is accepted. It subclasses ValueError, so library callers that catch
ValueError keep working. The CLI turns it, and the other expected failures `expected_failure` recognises,
into `structformer CMD: error: MESSAGE` and exit status 2; anything else is a bug and keeps its traceback.
"""
import errno
import os
import sys

__all__ = ['UsageError', 'expected_failure', 'one_line']


class UsageError(ValueError):
    """Bad input from the user: a flag, a config value, a data or output path. The message says which
    and what is accepted."""


# OSErrors that describe the user's environment, not the code: a read-only or full disk, no permission
_ENVIRONMENT_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, getattr(errno, 'EDQUOT', errno.ENOSPC)}
# OSErrors about a path the user gave (the project's own checks raise these with the flag in the message)
_PATH_ERRORS = (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _raised_by_package(exc: BaseException) -> bool:
    """True when the innermost frame of the traceback is structformer's own code: a `raise ValueError(...)`
    at one of its validation sites, rather than a ValueError escaping from torch, numpy or timm (a bug)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep)


def expected_failure(exc: BaseException) -> bool:
    """Whether `exc` is bad input or a hostile environment (report one line, exit 2) rather than a bug."""
    if isinstance(exc, UsageError):
        return True
    checkpoint = sys.modules.get('structformer.train.checkpoint')    # torch-heavy: only if already loaded
    if checkpoint is not None and isinstance(exc, checkpoint.CheckpointError):
        return True
    if isinstance(exc, _PATH_ERRORS):
        return True
    if isinstance(exc, OSError) and exc.errno in _ENVIRONMENT_ERRNOS:
        return True
    if isinstance(exc, ValueError) and (type(exc) is ValueError or type(exc).__module__.startswith('structformer')):
        return _raised_by_package(exc)
    return False


def one_line(exc: BaseException) -> str:
    """The message of `exc` on one line; an OSError from the system as 'PATH: reason'."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None and len(exc.args) == 2:
        text = f"{exc.filename}: {exc.strerror[0].lower() + exc.strerror[1:]}"
        if exc.filename2 is not None:
            text += f" (-> {exc.filename2})"
    else:
        text = str(exc) or type(exc).__name__
    if 'Original Traceback' in text:      # re-raised from a DataLoader worker: the worker's own last line
        text = text.strip().splitlines()[-1].split(': ', 1)[-1]
    return ' '.join(part.strip() for part in text.splitlines() if part.strip())
