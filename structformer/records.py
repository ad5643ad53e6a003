"""Records, figures, the machine a number was measured on, and output checks: the one place that
benchmarks (`bench/`), reproductions (`reproduce/`), analyses (`analysis/`) and training (`train/`)
take them from, so none of those packages imports another for a utility.

- `write_text`, `write_json`, `write_png`: outputs written atomically (a temporary file in the same
  folder, then `os.replace`), so an interrupted or failed write never leaves half a file behind.
- `environment`, `cpu_model`, `cpu_kind`: the machine and library versions a number was measured with, and the
  kind of CPU (`machine.py`: vendor, model, the ISA features that decide which kernels are fast: AVX2, AVX-512,
  VNNI, BF16, AMX), by which benchmark goals are judged and docs/benchmarks.md groups its tables.
- `check_writable`: an output folder checked before any work, so a long job never dies at its first write;
  `removed_on_failure`: the output folder a failed command created is removed again.
- `read_record`: a JSON record a command reads back (a grid's manifest, a cell's summary, a results.json for
  --report-only); one that is torn, foreign or lacks what is needed is refused in one line naming the file.

Only the standard library is imported at module level: `structformer --help` builds parsers that
import this module and must not pay for torch, numpy or matplotlib.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

from .atomic import write_atomically, write_text_atomically
from .machine import ISA_FLAGS, cpu_kind, kind_id  # noqa: F401  (re-exported: records name the machine)


# ---- where a number was measured --------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's marketing name ('model name' in /proc/cpuinfo), else what `platform` knows."""
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# the packages whose code decides what a trained model is: how it is built (functional, layers, models, csrc), fed
# (data) and trained (train). A change to any of their files changes `source_digest`, so a result kept for reuse
# (compare's cells and timings) is known to be another code's; coarse on purpose: a change the stamp missed would
# reuse a wrong number silently, one it over-counts costs a retrain or a mark
SOURCE_PACKAGES = ('functional', 'layers', 'models', 'train', 'data', 'csrc')
SOURCE_SUFFIXES = ('.py', '.cpp', '.h')


def source_digest(root: Path = None) -> str:
    """SHA-256 (hex, 16 digits) of the structformer release, timm's version and every source file of
    SOURCE_PACKAGES (path and bytes, in path order): the stamp of the code that builds and trains a model, the same
    in a git checkout and an installed wheel, and different after any edit there (a commit that touches only docs,
    the CLI or the benchmarks leaves it as it was)."""
    if root is None:
        return _installed_source_digest()
    import hashlib

    from . import __version__
    digest = hashlib.sha256(f"structformer {__version__}\n".encode())
    try:                                              # the installed timm's version, without importing it
        from importlib.metadata import PackageNotFoundError, version
        digest.update(f"timm {version('timm')}\n".encode())
    except PackageNotFoundError:
        pass
    root = Path(root)
    files = sorted(p for package in SOURCE_PACKAGES for p in (root / package).rglob('*')
                   if p.suffix in SOURCE_SUFFIXES and p.is_file())
    for path in files:
        digest.update(f"{path.relative_to(root).as_posix()}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_DIGEST: dict = {}


def _installed_source_digest() -> str:
    # once per process: the files do not change under a running command (a --jobs worker hashes them itself)
    if 'source' not in _DIGEST:
        _DIGEST['source'] = source_digest(Path(__file__).resolve().parent)
    return _DIGEST['source']


def code_version() -> dict:
    """The structformer release, the stamp of its model and training code (`source_digest`) and, in a git checkout,
    its commit (with `+dirty` when the tree has uncommitted changes): the code a number was measured with, so a
    record can be traced to the commit that made it, and a kept result to the code that made it."""
    import subprocess

    from . import __version__
    root = Path(__file__).resolve().parents[1]
    commit = None
    if (root / '.git').exists():
        try:
            commit = subprocess.run(['git', '-C', str(root), 'describe', '--always', '--dirty=+dirty', '--abbrev=12'],
                                    capture_output=True, text=True, timeout=5).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {'structformer': __version__, 'source': source_digest(), 'commit': commit}


def environment(device='cpu') -> dict:
    """The record printed and saved beside every measurement: versions, threads, CPU (its kind and the kernel
    level ATen dispatches to), platform, device, and the kernel choices this machine made
    (`functional.autotune.report`)."""
    import torch

    from .functional import autotune
    on_cuda = str(device).startswith('cuda') and torch.cuda.is_available()
    return {'torch': torch.__version__, 'python': platform.python_version(), 'threads': torch.get_num_threads(),
            'cpu': cpu_model(), 'cpu_kind': cpu_kind(), 'aten_cpu_capability': torch.backends.cpu.get_cpu_capability(),
            'platform': platform.platform(),
            'device': torch.cuda.get_device_name(torch.device(device)) if on_cuda else 'cpu',
            'cuda': torch.version.cuda if on_cuda else None, 'choices': autotune.report(), **code_version()}


# ---- output checks ----------------------------------------------------------------------------------

def check_writable(path, flag: str, shown=None) -> None:
    """Raise ValueError naming `flag` and the path the user gave (`shown`, default `path`) unless `path` (or the
    nearest folder that exists above it) can be written, saying which folder is read-only, or where no file can be
    created (a file is made there and removed): checked before any work, so a long run never dies at its first
    output."""
    shown = path if shown is None else shown
    probe = Path(path).absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{flag} {shown}: {probe} is a file, not a folder")
    where = 'it' if probe == Path(shown).absolute() else (
        f"its folder {probe}" if probe == Path(shown).absolute().parent else f"its nearest existing folder {probe}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {shown}: cannot be written: {where} is not writable (read-only file system or "
                         "no permission)")
    # access(2) answers for the permission bits, which root passes everywhere: /proc and /sys say writable, yet no
    # file can be made there. A file is made and removed, so that the failure is said here, naming `flag`, and not
    # by the first temporary of the output (OUT.tmp-PID-...), a name the user never gave
    from .atomic import temporary_sibling
    before = probe.stat()
    try:
        temporary_sibling(probe / '.write-check').unlink()
    except OSError as e:
        reason = (e.strerror or str(e)).lower()
        raise ValueError(f"{flag} {shown}: cannot be written: no file can be created in {where} ({reason})") from None
    with contextlib.suppress(OSError):            # a check leaves the folder as it found it, its time included
        os.utime(probe, ns=(before.st_atime_ns, before.st_mtime_ns))


@contextlib.contextmanager
def removed_on_failure(path):
    """Run the block that writes into the folder `path`; if it fails, the folders it created are removed again
    (from the first of `path` and its parents that did not exist), so a command that stops with an error leaves
    no empty or half-filled output folder behind. A folder that existed before is left as it was found, apart
    from the files the block replaced (each written atomically)."""
    first_new = None
    probe = Path(path).absolute()
    while not probe.exists():
        first_new, probe = probe, probe.parent
    try:
        yield
    except BaseException:
        if first_new is not None and first_new.is_dir():
            shutil.rmtree(first_new, ignore_errors=True)
        raise


def check_output_file(path, flag: str) -> None:
    """Like `check_writable`, for an output that is one file: it must not be an existing folder, and
    the folder it goes into (or the nearest one above that exists) must be writable."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; give a file name")
    check_writable(target.absolute().parent, flag, shown=path)


# ---- reading a record back ---------------------------------------------------------------------------

def read_record(path, what: str, keys=(), remedy: str = '') -> dict:
    """The JSON object in `path`, which the command wrote earlier as `what`; a file that is not JSON, not an
    object, or lacks one of `keys` (another command's record) raises UsageError naming the file, what it should
    be, and `remedy` (what the user can do), instead of a JSONDecodeError or KeyError traceback."""
    from .errors import UsageError
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        reason = f"is not valid JSON ({getattr(e, 'msg', e)}{f' at line {e.lineno}' if hasattr(e, 'lineno') else ''})"
    else:
        missing = [k for k in keys if k not in value] if isinstance(value, dict) else None
        if missing == []:
            return value
        reason = (f"is a JSON {type(value).__name__}, not an object" if missing is None
                  else f"has no {', '.join(repr(k) for k in missing)}")
    raise UsageError(f"{path}: should be {what}, but it {reason} (torn by a kill, or another file)"
                     + (f"; {remedy}" if remedy else ''))


# ---- atomic writers ---------------------------------------------------------------------------------

def write_text(path, text: str) -> str:
    """Write `text` to `path` atomically (parent folders created); returns the absolute path."""
    return str(write_text_atomically(path, text))


def write_json(path, obj, indent: int = 1, **dump_kwargs) -> str:
    """Write `obj` as JSON atomically. Serialised before the file is opened, so an object that cannot
    be serialised raises with the old file untouched."""
    text = json.dumps(obj, indent=indent, **dump_kwargs)
    return write_text(path, text)


def write_png(path, draw: Callable[[Any], Any], dpi: int = 110) -> bool:
    """Draw with `draw(pyplot) -> figure` and save it as a PNG atomically; returns whether it was written.

    matplotlib is optional: without it the plot is skipped with a note on stderr, and the numbers
    (written separately as JSON) are not lost. The Agg backend draws without a display.
    """
    try:
        import matplotlib
    except ImportError:
        print(f"note: matplotlib is not installed, so {path} was not drawn (pip install matplotlib)",
              file=sys.stderr)
        return False
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig = draw(plt)
    try:
        write_atomically(path, lambda f: fig.savefig(f, format='png', dpi=dpi), binary=True)
    finally:
        plt.close(fig)
    return True


def label_axes(ax, xlabel: str, ylabel: str, title: str, legend_size=None, title_size=None) -> None:
    """A panel's axis labels and title (matplotlib's `Axes.set`), and its legend when `legend_size` is given:
    what every figure of the reproductions and analyses sets on each panel."""
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, **({'fontsize': title_size} if title_size else {}))
    if legend_size:
        ax.legend(fontsize=legend_size)
