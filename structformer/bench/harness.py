"""The bench harness every benchmark and reproduction shares, so a sweep file holds only its sweep.

- `measure_in_subprocess` / `python_json`: run one measurement in a fresh Python, read its JSON back.
- `median_seconds`: the timer (warm-up, median, CUDA-synchronised); `paired_ratios`: speed ratios from
  calls taken back to back, for machines whose speed drifts.
- `PeakMemory`, `peak_rss_mib`, `reset_peak_rss`, `saved_tensor_bytes`: memory readers.

Records, figures, the environment record and output checks live in `structformer.records`, shared with
reproduce/, analysis/ and train/.

Only the standard library is imported here: `structformer --help` builds the bench and reproduce
parsers, which import this module, and must not pay for torch, numpy or matplotlib.
"""
from __future__ import annotations

import json
import resource
import signal
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch

MIB = 2 ** 20


# ---- a measurement in its own process --------------------------------------------------------------

class MeasurementFailed(RuntimeError):
    """A measurement subprocess exited non-zero (or printed no JSON); the message ends with its stderr."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def _exit_reason(returncode: int) -> str:
    if returncode < 0:                                   # killed by a signal; SIGKILL is usually the OOM killer
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f'signal {-returncode}'
        return f"was killed by {name}" + (' (out of memory?)' if name == 'SIGKILL' else '')
    return f"exited with status {returncode}"


# The child imports the structformer this process runs, from its files, not the first `structformer` on its own
# sys.path: `python -c` puts the current folder first there, so run from a checkout (or beside any folder named
# structformer) an installed `structformer bench` / `compare` measured with one copy's code and its children with
# another's. The package's __path__ then keeps every submodule in the same folder.
_SAME_PACKAGE = ("import importlib.util as _util, sys as _sys\n"
                 "_spec = _util.spec_from_file_location('structformer', {init!r}, submodule_search_locations=[{folder!r}])\n"
                 "_sys.modules['structformer'] = _package = _util.module_from_spec(_spec)\n"
                 "_spec.loader.exec_module(_package)\n")


def python_command(code: str, *args: str) -> list:
    """`python -c CODE ARGS...` in this interpreter, importing this process's copy of structformer."""
    import os
    init = os.path.abspath(sys.modules['structformer'].__file__)
    return [sys.executable, '-c', _SAME_PACKAGE.format(init=init, folder=os.path.dirname(init)) + code, *args]


def python_json(code: str) -> Any:
    """Run `code` in a fresh interpreter (this one's executable) and return the JSON of its last stdout line.

    A fresh process because peak memory is a per-process high-water mark: two configurations measured
    in one process would hide each other, and would share allocator caches and warmed-up libraries.
    """
    out = subprocess.run(python_command(code), capture_output=True, text=True, check=False)
    # the stderr tail goes last, so its last line (usually the exception) is the message's last line
    tail = out.stderr.strip()[-1500:]
    if out.returncode:
        raise MeasurementFailed(f"measurement subprocess {_exit_reason(out.returncode)}: {tail}", out.returncode)
    lines = out.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        last = repr(lines[-1][:200]) if lines else 'nothing'
        raise MeasurementFailed(f"measurement subprocess printed no JSON result (last stdout line: {last}): {tail}",
                                out.returncode) from None


def measure_in_subprocess(target: str, *args, **kwargs) -> Any:
    """`module:function(*args, **kwargs)` called in a fresh interpreter; returns what it returns.

    Arguments and the result travel as JSON (tuples arrive as lists), so the function must take and
    return JSON values. Raises MeasurementFailed, naming the exit status or signal and ending with
    the child's stderr, when the call fails.
    """
    module, _, function = target.partition(':')
    if not module or not function:
        raise ValueError(f"target must be 'module:function', got {target!r}")
    payload = json.dumps([args, kwargs])
    code = (f"import importlib, json\n"
            f"args, kwargs = json.loads({payload!r})\n"
            f"result = getattr(importlib.import_module({module!r}), {function!r})(*args, **kwargs)\n"
            f"print('\\n' + json.dumps(result), flush=True)")   # own line, whatever the call printed
    return python_json(code)


# ---- timer ------------------------------------------------------------------------------------------

def _on_cuda(device) -> bool:
    # str() of a torch.device is 'cuda' / 'cuda:1', so this needs no torch import on CPU
    return str(device).startswith('cuda')


def _synchroniser(device) -> Callable[[], None]:
    """torch.cuda.synchronize on CUDA (kernels run asynchronously), a no-op elsewhere."""
    if _on_cuda(device):
        import torch
        return torch.cuda.synchronize
    return lambda: None


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int, device='cpu') -> float:
    """Median seconds per call of `fn` over `repeats` timed calls, after `warmup` untimed ones.

    `device` ('cpu' / 'cuda' or a torch.device): on CUDA each call is bracketed by a synchronise, so
    the time is the kernels' and not the launch's. The median, not the mean, because one call hit by
    another process on a shared machine should not move the figure.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sync = _synchroniser(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_ratios(calls: dict, reference: str, rounds: int, warmup: int = 2, device='cpu') -> dict:
    """Speed ratios of callables timed back to back: each round calls every one of `calls` ({label: fn})
    once, in an order rotated from round to round, and records time(reference) / time(label) for that
    round. Returns {label: {'median_s', 'ratio', 'ratio_q1', 'ratio_q3', 'rounds', 'times_s'}}: the median
    step time, the median and quartiles of the per-round ratios, and the round times in round order (so
    two non-reference labels can be paired too).

    Why pairs: on a shared machine the speed of the same code drifts by tens of percent from one second
    to the next (a 1024³ matmul took 30–53 ms in consecutive seconds on this project's 2-core machine),
    so two medians taken minutes apart can disagree by more than the effect measured, while two calls
    taken within seconds of each other mostly see the same machine. On CUDA (`device`) each call is
    bracketed by a synchronise, as in `median_seconds`."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if reference not in calls:
        raise ValueError(f"reference {reference!r} is not one of the calls: {', '.join(calls)}")
    labels = list(calls)
    sync = _synchroniser(device)
    for label in labels:
        for _ in range(warmup):
            calls[label]()
    times = {label: [] for label in labels}
    for round_index in range(rounds):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            sync()
            start = time.perf_counter()
            calls[label]()
            sync()
            times[label].append(time.perf_counter() - start)
    result = {}
    for label in labels:
        ratios = sorted(r / t for r, t in zip(times[reference], times[label]))
        q1, _, q3 = statistics.quantiles(ratios, n=4, method='inclusive') if len(ratios) > 1 else ratios * 3
        result[label] = {'median_s': statistics.median(times[label]), 'ratio': statistics.median(ratios),
                         'ratio_q1': q1, 'ratio_q3': q3, 'rounds': rounds, 'times_s': times[label]}
    return result


# ---- memory -----------------------------------------------------------------------------------------

def _status_mib(key: str) -> Optional[float]:
    """A kB field of /proc/self/status (Linux) in MiB, or None where there is no such file or field."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _maxrss_mib() -> float:
    # ru_maxrss is KiB on Linux but bytes on macOS
    scale = 1024.0 * 1024.0 if sys.platform == 'darwin' else 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def peak_rss_mib() -> float:
    """This process's peak resident memory (MiB): VmHWM, which `reset_peak_rss` can lower, else ru_maxrss."""
    hwm = _status_mib('VmHWM')
    return hwm if hwm is not None else _maxrss_mib()


def reset_peak_rss() -> float:
    """Reset the peak-RSS mark where the kernel allows it and return the baseline (MiB) to subtract.

    Imports and warm-up runs leave the high-water mark above what a small measured run reaches, which
    would read as zero growth; Linux lowers VmHWM to the current RSS on '5' > /proc/self/clear_refs, and
    the baseline is then the current RSS. Where that is refused, the mark cannot move, so the baseline
    is the peak so far and the reading is the growth beyond it (a lower bound).
    """
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        rss = _status_mib('VmRSS')
        if rss is not None:
            return rss
    except OSError:
        pass
    return peak_rss_mib()


class PeakMemory:
    """Peak memory from construction on: process RSS on CPU, `max_memory_allocated` on CUDA.

    >>> memory = PeakMemory(device)        # resets the peak and takes the baseline
    >>> run()
    >>> memory.growth_mib()                # peak during run() minus the baseline
    """

    def __init__(self, device='cpu'):
        self.on_cuda = _on_cuda(device)
        if self.on_cuda:
            import torch
            torch.cuda.synchronize()                      # let queued frees land before the baseline
            torch.cuda.reset_peak_memory_stats()
            self.baseline_mib = torch.cuda.memory_allocated() / MIB
        else:
            self.baseline_mib = reset_peak_rss()

    def peak_mib(self) -> float:
        """The peak itself (MiB), baseline included."""
        if self.on_cuda:
            import torch
            return torch.cuda.max_memory_allocated() / MIB
        return peak_rss_mib()

    def growth_mib(self) -> float:
        return self.peak_mib() - self.baseline_mib


def saved_tensor_bytes(model: torch.nn.Module, inputs: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for backward in one training forward of `model`.

    The part of training memory that depends on the layers (not on the allocator or the device), so
    it reads the same on CPU and GPU. Storages are counted once however many views of them are saved.
    """
    import torch
    seen = {}

    def pack(t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            pass                                           # e.g. tensors without storage
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs).sum().backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())
