"""Benchmarks notice a busy machine: the CPU others took during a measurement is recorded and judged
(`bench/load.py`), and a run under an artificial competing load flags itself in its table and JSON."""
import json
import os
import subprocess
import sys

from structformer.bench import load
from structformer.bench.load import Snapshot, between, judge, summary_line

HZ = os.sysconf('SC_CLK_TCK')


def _snap(wall, own_cpu, busy_ticks, steal_ticks=0, load_average=0.5):
    return Snapshot(wall, own_cpu, (busy_ticks, steal_ticks), load_average)


def test_others_cpu_is_busy_time_minus_ours():
    # 10 s wall; the machine's CPUs were busy 25 s in all, 20 s of it ours: others took 0.5 cores
    record = between(_snap(0, 0, 0), _snap(10, 20, 25 * HZ), threads=2, cpus=2)
    assert abs(record['other_cores'] - 0.5) < 1e-9
    assert abs(record['cpu_share'] - 1.0) < 1e-9
    assert record['busy'] and 'threads 1' in record['advice']


def test_a_one_thread_run_is_not_advised_to_use_one_thread():
    record = between(_snap(0, 0, 0), _snap(10, 10, 30 * HZ), threads=1, cpus=2)   # others took 2 cores
    assert record['busy'] and 'threads' not in record['advice'] and 'quiet machine' in record['advice']
    assert '--threads' not in summary_line(record)


def test_quiet_interval_is_not_flagged():
    record = between(_snap(0, 0, 0), _snap(10, 19.5, 20 * HZ), threads=2, cpus=2)   # 0.05 cores of daemons
    assert not record['busy'] and 'advice' not in record
    assert summary_line(record).startswith('machine: quiet')


def test_steal_and_idle_cores():
    assert judge(0.0, 0.2, threads=2, cpus=2)                 # a hypervisor took a fifth of our CPUs
    assert not judge(1.0, 0.0, threads=1, cpus=2)             # one competitor fits beside --threads 1
    assert judge(1.0, 0.0, threads=2, cpus=2)
    assert not judge(None, None, threads=2, cpus=2)           # no /proc/stat: unknown, not flagged


def test_bench_under_competing_load_flags_itself(tmp_path, capsys):
    """A real `structformer bench lowrank` run while busy subprocesses hold every core: the JSON record says
    busy with the advice, and the line under the table says BUSY. Threads = cores, so the competitors can
    never fit into idle cores whatever machine runs this. (The bench runs in this process, with the spinners
    already spinning: run in a fresh process it spent most of its time importing torch beside them, which
    starved the other test process for as long.)"""
    from structformer.cli import main
    cpus = load.cpu_count()
    spin = [subprocess.Popen([sys.executable, '-c', 'print("spinning", flush=True)\nwhile True: pass'],
                             stdout=subprocess.PIPE, text=True) for _ in range(cpus)]
    try:
        assert all(p.stdout.readline().strip() == 'spinning' for p in spin)
        out = tmp_path / 'lowrank.json'
        code = main(['bench', 'lowrank', '--tokens', '256', '--in-features', '64', '--out-features', '256',
                     '--ranks', '0.25', '--depth', '0', '--steps', '10', '--rounds', '2', '--threads', str(cpus),
                     '--output', str(out)])
    finally:
        for p in spin:
            p.kill()
            p.wait()
            p.stdout.close()
    stdout = capsys.readouterr().out
    assert code == 0
    record = json.loads(out.read_text())['machine_load']
    assert record['busy'], record
    assert record['other_cores'] > 0.3
    assert 'machine: BUSY' in stdout and '--threads 1' in stdout


STAT = """cpu  400 0 0 900 0 0 0 0 0 0
cpu0 10 0 0 300 0 0 0 0 0 0
cpu1 20 0 0 300 0 0 0 0 0 0
cpu2 170 0 0 150 0 0 0 0 0 0
cpu3 200 0 0 150 0 0 0 5 0 0
intr 12345
"""


def test_only_the_cpus_we_may_run_on_are_counted():
    """A container or job pinned to CPUs 0 and 1 of a 4-CPU host: /proc/stat shows the host, and the host's other
    CPUs' work (cpu2, cpu3) never competed with ours. Summed over every CPU, a pinned run read BUSY whatever ran on
    its own cores."""
    assert load._proc_stat_ticks(frozenset({0, 1}), STAT) == (30, 0)
    assert load._proc_stat_ticks(None, STAT) == (400, 0)                  # every CPU: the first line
    assert load._proc_stat_ticks(frozenset({3}), STAT) == (200, 5)
    assert load._proc_stat_ticks(frozenset({7}), STAT) == (400, 0)        # no such line: the whole machine
    assert load._proc_stat_ticks(None, 'nothing') is None
