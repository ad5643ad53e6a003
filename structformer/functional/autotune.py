"""Kernel choices made by the machine: where a fast path has alternatives that compute the same function,
pick the one that is fastest on this CPU, once per shape class, and remember it.

Why: the crossovers of the fast paths were measured on one machine and do not carry over. On an AMD EPYC with
AVX2 oneDNN's GEMMs beat MKL's by 14–16 %, on an Intel Xeon MKL's beat oneDNN's, and on an AMD EPYC with
AVX-512 oneDNN's ran 1.5× MKL's (which takes its AVX2 path on AMD); CRATE's shared-QKV backward beat SDPA up
to N ≈ 300 tokens on the first and lost to it at N = 197 on the second. The alternatives a choice names are
equal up to the dtype's rounding (each is tested against the path's reference on every shape class it
distinguishes), so a choice changes speed, never results beyond rounding.

A choice is `decide(name, shape_class, default, calls, isa=None)`. In order:

1. an override, `STRUCTFORMER_CHOICE_<NAME>=candidate` in the environment (or the caller's `override=`,
   e.g. a layer's own option), checked against the candidates (a bad one is one line naming the accepted);
   inside `twice_differentiable()`, the candidate a second derivative can go through (`TWICE_DIFFERENTIABLE`);
2. `isa`, the caller's hardware rule, where the machine's features decide it outright;
3. this process's earlier decision for (name, shape class, thread count);
4. while a graph is recorded (export, ONNX, tracing, FX: `tracing.recording_graph`), under torch.compile, under
   a dispatch mode (FlopCounterMode) or saved-tensor hooks, inside another choice's timing, with deterministic
   algorithms on, or with timing off (`STRUCTFORMER_AUTOTUNE=off`): `default`, the rule the code followed
   before, not remembered;
5. the decision cached on disk for this machine;
6. timing: the candidates (`calls()`, built only now) run back to back for a few rounds, about a tenth of a
   second in all; a candidate replaces `default` only when its median per-round speed-up over it exceeds
   `MARGIN`, so noise keeps the default. The decision is cached on disk.

The disk cache is JSON (read without executing anything) at `$STRUCTFORMER_CACHE/choices/` (else
`$XDG_CACHE_HOME/structformer/choices/`, default `~/.cache/...`), one file per machine key: CPU model, family /
model numbers, ISA flags, ATen's CPU capability, the ISA caps set in the environment (`machine.ISA_CAPS`: oneDNN's
and MKL's too, which ATen's capability does not show), torch version and thread count. A new torch, another CPU or
another thread count reads another file; a corrupt or foreign file is ignored and rewritten; writes are atomic, and
processes adding decisions at once take turns (a lock file beside it), so none loses another's.
Delete the folder to time again.

Every decision is recorded (`report()`), and `records.environment()` carries the report, so every benchmark
JSON and every checkpoint's state.json says what ran. Tests inject a timer (`use_timer`).

The hardware rules that decide outright are the availability checks at the call sites: oneDNN's op exists on
x86-64 builds of torch only, the Sparsifiner tile kernel only where it builds (Linux x86-64, a compiler), and
neither runs off the CPU; between candidates that all run, no flag predicted the faster one on the three kinds of
CPU measured, so those are timed. A first run and a later one on the same machine take the same paths once a
choice is cached; for paths fixed across machines, set `STRUCTFORMER_AUTOTUNE=off` (the defaults) or the
overrides.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import torch

from ..atomic import write_text_atomically
from ..errors import UsageError
from ..machine import cpu_kind
from .tracing import recording_graph

__all__ = ['CHOICES', 'decide', 'report', 'override_of', 'check_overrides', 'check_environment', 'use_timer',
           'timing_allowed', 'cache_file', 'forget', 'size_class', 'power_class', 'twice_differentiable', 'TWICE_DIFFERENTIABLE',
           'ENV_PREFIX', 'ENV_TIMING', 'ENV_LOG', 'MARGIN']

# Every choice, its candidates and what it picks between. A name here is what STRUCTFORMER_CHOICE_<NAME> takes.
CHOICES: Dict[str, tuple] = {
    'ssa_impl': (('shared', 'sdpa'),
                 "CRATE's MSSA in training on a CPU: the shared-QKV backward or torch's SDPA (layers/attention/mssa.py)"),
    'linear_kernel': (('onednn', 'torch'),
                      "FactorizedLinear's products in float32 on an x86-64 CPU: oneDNN's or torch's (MKL) GEMMs "
                      "(functional/onednn_linear.py)"),
    'newton_loop': (('host', 'device'),
                    "SOFT's Newton-Schulz iteration on a CPU: the host loop that stops when every matrix has "
                    "converged, or the sync-free masked loop (functional/newton_pinv.py)"),
    'sparsifiner_tiles': (('kernel', 'gather'),
                          "Sparsifiner's block attention on a CPU: the C++ tile kernel or gathered tiles "
                          "(layers/attention/sparsifiner.py)"),
}
# the choices whose fast candidate has no second derivative (CRATE's shared-QKV backward is a custom op without one),
# and the candidate taken inside `twice_differentiable()`; the other fast paths differentiate twice themselves
TWICE_DIFFERENTIABLE = {'ssa_impl': 'sdpa'}
ENV_PREFIX = 'STRUCTFORMER_CHOICE_'
# a file every process of one run appends its decisions to (set by `structformer bench` around a benchmark, whose
# measurements run in subprocesses), so the record made by the parent lists what the children chose
ENV_LOG = 'STRUCTFORMER_CHOICES_LOG'
ENV_TIMING = 'STRUCTFORMER_AUTOTUNE'          # 'off' (or 0, no, false): no timing, defaults and hardware rules only;
                                              # 'on' (1, yes, true, unset); anything else is refused
MARGIN = 0.05                                 # a candidate must beat the default by 5 % per round (median)
MIN_ROUNDS, MAX_ROUNDS, BUDGET_S = 3, 9, 0.1  # timing: at least 3 paired rounds, more while within budget
FORMAT = 1

_lock = threading.RLock()
_memory: Dict[tuple, str] = {}                # (name, class key, threads) -> candidate, this process's decisions
_log: Dict[tuple, dict] = {}                  # (name, class key, threads, source) -> record (report())
_state = threading.local()                    # .timing: inside a timing (nested choices take their default)
_timer: Optional[Callable] = None             # injected by tests (use_timer)


# ---- overrides --------------------------------------------------------------------------------------

def _accepted(name: str) -> str:
    return ', '.join(repr(c) for c in CHOICES[name][0])


def override_of(name: str) -> Optional[str]:
    """The candidate that `STRUCTFORMER_CHOICE_<NAME>` forces, None where it is unset; a value that is not a
    candidate raises UsageError naming the variable and the accepted values."""
    value = os.environ.get(ENV_PREFIX + name.upper())
    if value is None or value == '':
        return None
    if value not in CHOICES[name][0]:
        raise UsageError(f"{ENV_PREFIX}{name.upper()}={value!r}: accepted {_accepted(name)}")
    return value


def check_overrides() -> Dict[str, str]:
    """Every STRUCTFORMER_CHOICE_* in the environment, checked: {name: candidate}. An unknown name or a value
    that is not a candidate raises UsageError (one line naming what is accepted)."""
    found = {}
    for variable in sorted(os.environ):
        if not variable.startswith(ENV_PREFIX) or not os.environ[variable]:
            continue
        name = variable[len(ENV_PREFIX):].lower()
        if name not in CHOICES:
            raise UsageError(f"{variable}: no such choice; accepted "
                             f"{', '.join(ENV_PREFIX + n.upper() for n in CHOICES)}")
        found[name] = override_of(name)
    return found


def _check_candidate(name: str, value: str, where: str) -> str:
    if value not in CHOICES[name][0]:
        raise UsageError(f"{where}={value!r}: accepted {_accepted(name)}")
    return value


# ---- the machine key and the disk cache --------------------------------------------------------------

@lru_cache(maxsize=None)
def _static_machine() -> tuple:
    kind = cpu_kind()
    return (('cpu', kind['model']), ('family_model', kind['family_model']), ('kind', kind['kind']),
            ('flags', tuple(kind['flags'])), ('aten_capability', torch.backends.cpu.get_cpu_capability()),
            ('isa_caps', ' '.join(f'{k}={v}' for k, v in sorted(kind['isa_caps'].items()))),   # str: JSON-stable
            ('torch', torch.__version__))


def machine() -> dict:
    """What a cached decision is valid for: the CPU (model, family / model, ISA flags, ATen's capability, the ISA
    caps in the environment), torch's version and the thread count."""
    record = {k: (list(v) if isinstance(v, tuple) else v) for k, v in _static_machine()}
    record['threads'] = torch.get_num_threads()
    return record


def cache_root() -> Path:
    base = os.environ.get('STRUCTFORMER_CACHE') or os.path.join(
        os.environ.get('XDG_CACHE_HOME') or os.path.expanduser('~/.cache'), 'structformer')
    return Path(base) / 'choices'


def cache_file(record: Optional[dict] = None) -> Path:
    """This machine's decision file (`machine()` hashed into its name)."""
    record = record or machine()
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / f'{digest}.json'


def _read_cache(record: dict) -> Dict[str, Dict[str, dict]]:
    """{name: {class key: entry}} from this machine's file; {} when it is missing, unreadable, not valid JSON,
    of another format or another machine, and entries naming no candidate are dropped."""
    try:
        data = json.loads(cache_file(record).read_text())
    except (OSError, ValueError, RecursionError):        # RecursionError: nested too deep for the parser
        return {}
    if not isinstance(data, dict) or data.get('format') != FORMAT or data.get('machine') != record:
        return {}
    choices = data.get('choices')
    if not isinstance(choices, dict):
        return {}
    clean = {}
    for name, entries in choices.items():
        if name in CHOICES and isinstance(entries, dict):
            kept = {k: e for k, e in entries.items()
                    if isinstance(e, dict) and e.get('choice') in CHOICES[name][0]}
            if kept:
                clean[name] = kept
    return clean


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`.lock across processes (POSIX flock), so that two processes adding decisions to
    one file at once (DDP ranks, loader workers, two runs) do not each rewrite it without the other's: read, update
    and rewrite happen under it. OSError where the lock file cannot be made (a read-only cache); where the file
    system refuses locks, the rewrite goes ahead unlocked, as atomic as ever."""
    try:
        import fcntl
    except ImportError:                               # not POSIX: rewrites may race, each is still atomic
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix('.lock'), 'a') as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:                               # a file system without locks (some NFS): write unlocked
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_cache(record: dict, name: str, class_key: str, entry: dict) -> None:
    """Add one decision to this machine's file (locked read, update, atomic rewrite); a read-only cache is skipped:
    the decision still holds for this process."""
    with _lock:
        try:
            with _file_lock(cache_file(record)):
                choices = _read_cache(record)
                choices.setdefault(name, {})[class_key] = entry
                write_text_atomically(cache_file(record), json.dumps(
                    {'format': FORMAT, 'machine': record, 'choices': choices}, indent=1, sort_keys=True))
        except OSError:
            pass


# ---- timing -------------------------------------------------------------------------------------------

_TIMING_VALUES = {'': True, 'on': True, '1': True, 'yes': True, 'true': True,
                  'off': False, '0': False, 'no': False, 'false': False}


def _timing_setting() -> bool:
    """STRUCTFORMER_AUTOTUNE: on (unset, on / 1 / yes / true) or off (off / 0 / no / false); another value raises
    UsageError naming the accepted ones (a typo such as 'of' must not leave timing on unnoticed)."""
    value = os.environ.get(ENV_TIMING, '')
    setting = _TIMING_VALUES.get(value.strip().lower())
    if setting is None:
        raise UsageError(f"{ENV_TIMING}={value!r}: accepted on, off (or 1 / 0, yes / no, true / false)")
    return setting


def check_environment() -> None:
    """STRUCTFORMER_AUTOTUNE and every STRUCTFORMER_CHOICE_* checked at once, before a command does any work (the
    CLI calls this): a misspelt choice name or value is one line naming what is accepted, not an override that a
    run silently ignores or a refusal minutes in, at the first layer that consults it."""
    _timing_setting()
    check_overrides()


def timing_allowed() -> bool:
    """Whether `decide` may time candidates now: not while a graph is recorded or compiled, not under a dispatch
    mode (FlopCounterMode would count the candidates) or saved-tensor hooks (they would pack the candidates'
    tensors), not inside another timing, not with `torch.use_deterministic_algorithms(True)` (a first run and a
    rerun must take the same paths) and not with STRUCTFORMER_AUTOTUNE=off."""
    if not _timing_setting() or getattr(_state, 'timing', False):
        return False
    if torch.are_deterministic_algorithms_enabled():      # a run asked to repeat itself: no machine-timed paths
        return False
    if torch.compiler.is_compiling() or recording_graph() or torch.jit.is_scripting():
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    if _get_current_dispatch_mode() is not None:
        return False
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def paired_round_times(calls: Mapping[str, Callable[[], object]]) -> Dict[str, List[float]]:
    """Seconds per call of each candidate, round by round: one warm-up call each, then rounds that call every
    candidate once in an order rotated from round to round, at least MIN_ROUNDS, more while the whole stays
    within BUDGET_S, at most MAX_ROUNDS."""
    labels = list(calls)
    for label in labels:
        calls[label]()
    times = {label: [] for label in labels}
    start = time.perf_counter()
    for round_index in range(MAX_ROUNDS):
        if round_index >= MIN_ROUNDS and time.perf_counter() - start > BUDGET_S:
            break
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            began = time.perf_counter()
            calls[label]()
            times[label].append(time.perf_counter() - began)
    return times


def _pick(times: Dict[str, List[float]], default: str) -> str:
    """The candidate whose median per-round speed-up over `default` is largest, if above 1 + MARGIN; else default."""
    base = times[default]
    best, best_gain = default, 1.0 + MARGIN
    for label, series in times.items():
        if label == default or not series:
            continue
        gain = statistics.median(b / max(t, 1e-12) for b, t in zip(base, series))
        if gain > best_gain:
            best, best_gain = label, gain
    return best


@contextlib.contextmanager
def twice_differentiable() -> Iterator[None]:
    """Inside: forwards whose graph will be differentiated twice (a gradient penalty, a Hessian-vector product,
    timm's AdaHessian; `structformer train` enters it for a second-order optimiser). Each choice in
    `TWICE_DIFFERENTIABLE` takes its differentiable candidate (an explicit argument or STRUCTFORMER_CHOICE_*
    still wins), and SDPA runs its math kernel: torch's fused SDPA kernels have no double backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    previous = getattr(_state, 'twice', False)
    _state.twice = True
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        _state.twice = previous


@contextlib.contextmanager
def use_timer(timer: Callable[[Mapping[str, Callable[[], object]]], Dict[str, List[float]]]) -> Iterator[None]:
    """Within this block `decide` times with `timer(calls) -> {candidate: [seconds per round]}` (tests: a fake
    that returns set times without running anything)."""
    global _timer
    previous, _timer = _timer, timer
    try:
        yield
    finally:
        _timer = previous


def _time(calls: Mapping[str, Callable[[], object]]) -> Dict[str, List[float]]:
    _state.timing = True
    try:
        with torch.random.fork_rng(devices=[]):      # candidates that draw random numbers leave the stream alone
            return (_timer or paired_round_times)(calls)
    finally:
        _state.timing = False


# ---- the decision ------------------------------------------------------------------------------------

def size_class(size: int) -> int:
    """Sizes alike in speed share one class: the largest 2^(k/4) (rounded down) not above `size`, so a class
    spans at most 19 % (N = 181–214 tokens is one class: CRATE-T's 197)."""
    return int(2 ** (math.floor(4 * math.log2(max(size, 1))) / 4))


def power_class(size: int) -> int:
    """The power of two at or below `size` (at least 1): a coarser class, for batch and row counts."""
    return 1 << (max(int(size), 1).bit_length() - 1)


def _class_key(shape_class: Sequence) -> str:
    return ','.join(str(part) for part in shape_class)


def _note(name: str, class_key: str, threads: int, choice: str, source: str, **extra) -> None:
    key = (name, class_key, threads, source)
    if key in _log:
        return
    record = {'name': name, 'class': class_key, 'threads': threads, 'choice': choice, 'source': source, **extra}
    with _lock:
        _log[key] = record
    log = os.environ.get(ENV_LOG)
    if log:                                       # the run's shared log: a benchmark's measuring subprocesses too
        try:
            with open(log, 'a') as f:
                f.write(json.dumps(record, sort_keys=True) + '\n')
        except OSError:
            pass


def _logged() -> List[dict]:
    """The decisions in the run's shared log (ENV_LOG), lines that are not a decision skipped."""
    path = os.environ.get(ENV_LOG)
    found = []
    try:
        with open(path or '') as f:
            for line in f:
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(record, dict) and {'name', 'class', 'threads', 'source', 'choice'} <= set(record):
                    found.append(record)
    except OSError:
        pass
    return found


def decide(name: str, shape_class: Sequence, default: str,
           calls: Callable[[], Mapping[str, Callable[[], object]]],
           isa: Optional[str] = None, override: Optional[str] = None) -> str:
    """The candidate of choice `name` (a key of CHOICES) for `shape_class` (a tuple of ints / strings that
    groups the inputs alike in speed), by the order of the module docstring. `default` is the rule's answer
    without timing; `isa` a decisive hardware answer or None; `calls()` builds {candidate: zero-argument
    callable} running each candidate once on representative inputs, called only when timing; `override` a
    caller's forced candidate (checked)."""
    compiling = torch.compiler.is_compiling()            # no bookkeeping inside a traced graph
    fixed, source = None, None
    if override is not None:
        fixed, source = _check_candidate(name, override, name), 'argument'
    elif override_of(name) is not None:
        fixed, source = override_of(name), 'override'
    elif getattr(_state, 'twice', False) and name in TWICE_DIFFERENTIABLE:
        fixed, source = TWICE_DIFFERENTIABLE[name], 'twice-differentiable'
    elif isa is not None:
        fixed, source = isa, 'isa'
    if fixed is not None or compiling:
        if fixed is not None and not compiling:
            _note(name, _class_key(shape_class), torch.get_num_threads(), fixed, source)
        return default if fixed is None else fixed
    threads = torch.get_num_threads()
    class_key = _class_key(shape_class)
    remembered = _memory.get((name, class_key, threads))
    if remembered is not None:
        return remembered
    if not timing_allowed():
        _note(name, class_key, threads, default, 'default')
        return default
    record = machine()
    cached = _read_cache(record).get(name, {}).get(class_key)
    if cached is not None:
        choice = cached['choice']
        _memory[(name, class_key, threads)] = choice
        _note(name, class_key, threads, choice, 'cache')
        return choice
    candidates = dict(calls())
    times = _time(candidates)
    choice = _pick(times, default)
    medians = {label: round(statistics.median(series) * 1e3, 4) for label, series in times.items() if series}
    rounds = min((len(series) for series in times.values()), default=0)
    _memory[(name, class_key, threads)] = choice
    _note(name, class_key, threads, choice, 'timed', median_ms=medians, rounds=rounds, default=default)
    _write_cache(record, name, class_key, {'choice': choice, 'median_ms': medians, 'rounds': rounds,
                                           'default': default, 'when': time.strftime('%Y-%m-%dT%H:%M:%S')})
    return choice


def forget() -> None:
    """Drop this process's decisions and their record (the disk cache stays); for tests."""
    with _lock:
        _memory.clear()
        _log.clear()


def report() -> dict:
    """What this process chose and why, for records: the timing setting, the overrides in force, each decision
    made here or, under a run's shared log (ENV_LOG), by any process of the run (name, shape class, threads,
    choice, source: argument / override / isa / timed / cache / default),
    and the
    decisions cached on disk for this machine at the current thread count (those of benchmark subprocesses too)."""
    try:
        overrides = check_overrides()
    except UsageError as e:
        overrides = {'error': str(e)}
    try:
        timing = 'on' if _timing_setting() else 'off'
    except UsageError as e:
        timing = f"error: {e}"
    record = machine()
    cached = {name: {k: e['choice'] for k, e in entries.items()} for name, entries in _read_cache(record).items()}
    decisions = {(r['name'], r['class'], r['threads'], r['source']): r for r in _logged() + list(_log.values())}
    return {'timing': timing, 'overrides': overrides,
            'decisions': [decisions[key] for key in sorted(decisions, key=lambda k: tuple(map(str, k)))],
            'cached': cached, 'cache_file': _home_relative(cache_file(record))}


def _home_relative(path: Path) -> str:
    """`path` with the user's home written as ~ (records are committed; the home folder is the user's)."""
    home = os.path.expanduser('~')
    text = str(path)
    return '~' + text[len(home):] if home not in ('', '/') and text.startswith(home + os.sep) else text
