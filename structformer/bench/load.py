"""Was the machine busy while we measured? The CPU time other processes took, beside our own.

On a 2-core machine shared with other work, a 2-thread step slowed by up to 25× at random inside one
`bench models` run, and the table looked like any other. So every benchmark records, for each interval
it measures:

- `other_cores`: CPU time used by everything else on the CPUs we may run on (their busy time in /proc/stat,
  minus our process's and its waited-for children's CPU time), per second of wall time, in cores;
- `steal_share`: the share of the interval a hypervisor gave our CPUs to other guests;
- `cpu_share`: the CPU time our process (and its measured children) got against wall time × threads;
- the 1-minute load average at both ends (recorded, not judged: it lags by a minute and counts our own
  threads).

An interval is **busy** when the cores others used do not fit beside our threads (`other_cores` more than
`BUSY_MARGIN` above the idle cores `cpus - threads`), or steal exceeds `STEAL_LIMIT`. With `--threads 1`
on a 2-core machine one competing process leaves a measurement unflagged, which is why the advice names it.

Only the standard library: `structformer --help` imports the bench modules' parsers.
"""
from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass
from typing import Optional

BUSY_MARGIN = 0.3            # cores: background daemons on an idle machine take ~0.05
STEAL_LIMIT = 0.10
ADVICE = "the machine was busy while this was measured: re-run on a quiet machine, or with --threads 1"
ADVICE_ONE_THREAD = "the machine was busy while this was measured: re-run on a quiet machine"


def advice(threads: int) -> str:
    """What to do about a busy run; fewer threads is advice only to a run that used more than one."""
    return ADVICE if threads > 1 else ADVICE_ONE_THREAD


def _affinity() -> Optional[frozenset]:
    """The CPUs this process may run on (its threads and its measuring subprocesses too), None where unknown."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _proc_stat_ticks(cpus: Optional[frozenset] = None, text: Optional[str] = None) -> Optional[tuple]:
    """(busy, steal) jiffies from /proc/stat (or `text`, its contents), summed over `cpus` (the per-CPU 'cpuN'
    lines), or over every CPU (the first line) where `cpus` is None; None off Linux. Only our CPUs count: in a
    container or job pinned to 2 of a host's 64 CPUs, /proc/stat still shows the host, and the other 62 CPUs' work
    never competed with ours (summed over all of them, every run there read BUSY)."""
    if text is None:
        try:
            with open('/proc/stat') as f:
                text = f.read()
        except OSError:
            return None
    lines = [line.split() for line in text.splitlines() if line.startswith('cpu')]
    if not lines or lines[0][0] != 'cpu':
        return None
    if cpus is not None:
        mine = [fields for fields in lines[1:] if fields[0][3:].isdigit() and int(fields[0][3:]) in cpus]
        lines = mine if mine else lines[:1]
    else:
        lines = lines[:1]
    busy = steal = 0
    for fields in lines:
        user, nice, system, idle, iowait, irq, softirq, stolen = (int(v) for v in (fields[1:9] + ['0'] * 8)[:8])
        busy, steal = busy + user + nice + system + irq + softirq, steal + stolen
    return busy, steal


def _own_cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


@dataclass(frozen=True)
class Snapshot:
    wall: float
    own_cpu: float
    ticks: Optional[tuple]
    load_average: Optional[float]


def snapshot() -> Snapshot:
    return Snapshot(time.monotonic(), _own_cpu_seconds(), _proc_stat_ticks(_affinity()), _load_average())


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def judge(other_cores: Optional[float], steal_share: Optional[float], threads: int, cpus: int) -> bool:
    """Busy when others' CPU use does not fit in the cores our threads leave idle, or steal is high."""
    if other_cores is None:
        return False
    idle_cores = max(cpus - threads, 0)
    return other_cores > idle_cores + BUSY_MARGIN or (steal_share or 0.0) > STEAL_LIMIT


def between(start: Snapshot, end: Snapshot, threads: int, cpus: Optional[int] = None) -> dict:
    """The load record of the interval from `start` to `end` for a measurement using `threads` threads."""
    cpus = cpus or cpu_count()
    wall = max(end.wall - start.wall, 1e-9)
    own = max(end.own_cpu - start.own_cpu, 0.0)
    other_cores = steal_share = None
    if start.ticks and end.ticks:
        hz = os.sysconf('SC_CLK_TCK') if hasattr(os, 'sysconf') else 100
        busy_s = (end.ticks[0] - start.ticks[0]) / hz
        steal_s = (end.ticks[1] - start.ticks[1]) / hz
        other_cores = max(busy_s - own, 0.0) / wall
        steal_share = steal_s / (wall * cpus)
    busy = judge(other_cores, steal_share, threads, cpus)
    record = {'wall_s': round(wall, 3), 'cpu_s': round(own, 3), 'threads': threads, 'cpus': cpus,
              'cpu_share': round(own / (wall * max(threads, 1)), 3),
              'other_cores': None if other_cores is None else round(other_cores, 3),
              'steal_share': None if steal_share is None else round(steal_share, 4),
              'load_average': [start.load_average, end.load_average], 'busy': busy}
    if busy:
        record['advice'] = advice(threads)
    return record


class LoadWatch:
    """Snapshots from construction on: `since(mark)` for one row, `record()` for the whole run."""

    def __init__(self, threads: Optional[int] = None):
        if not threads:
            import torch
            threads = torch.get_num_threads()
        self.threads = threads
        self.start = snapshot()

    def mark(self) -> Snapshot:
        return snapshot()

    def since(self, mark: Snapshot) -> dict:
        return between(mark, snapshot(), self.threads)

    def record(self) -> dict:
        return between(self.start, snapshot(), self.threads)


# The CLI starts one watch per `structformer bench` run (module state, not an argparse attribute, so the
# benchmarks' `vars(args)` records stay JSON); a benchmark called directly from Python has none.
_current: Optional[LoadWatch] = None


def start_watch(threads: Optional[int] = None) -> LoadWatch:
    global _current
    _current = LoadWatch(threads)
    return _current


def run_record() -> Optional[dict]:
    """The whole run's record so far, for a benchmark's JSON (None without the CLI's watch)."""
    return _current.record() if _current else None


def row_mark() -> Optional[Snapshot]:
    return _current.mark() if _current else None


def row_record(mark: Optional[Snapshot]) -> Optional[dict]:
    """The record from `mark` to now, for one row of a table."""
    return _current.since(mark) if _current and mark else None


def summary_line(record: dict) -> str:
    """One line for under a table: quiet or busy, with the numbers that decided it."""
    load = record.get('load_average') or [None, None]
    load_text = ('' if None in load else f"; load average {load[0]:.2f} -> {load[1]:.2f}")
    if record.get('other_cores') is None:
        return f"machine load: unknown (no /proc/stat){load_text}"
    numbers = (f"other processes used {record['other_cores']:.2f} of {record['cpus']} cores beside our "
               f"{record['threads']} thread(s), steal {100 * record['steal_share']:.0f} %{load_text}")
    if record['busy']:
        return f"machine: BUSY ({numbers}): {advice(record['threads'])}"
    return f"machine: quiet ({numbers})"


def row_flag(record: Optional[dict]) -> str:
    """The table marker for a row measured while the machine was busy."""
    return ' BUSY' if record and record.get('busy') else ''
