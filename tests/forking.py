"""A command in a process of its own without a fresh interpreter: `os.fork` of the test process.

Tests that kill or signal a command part-way need it in a separate process, but not in a new interpreter, which
spends ~7 s importing torch and timm (2-core AMD EPYC Zen 1, `python -c "import structformer, timm"`) before the
command starts. A forked child starts from this process's imports and runs the same function the console script
runs (`structformer.cli.main`, or the library call under test); it has its own PID, is killed, signalled and reaped
as any process is, and what it writes is on disk for the parent to read. What a fork cannot test (the console
script, `python -m structformer`, imports in a fresh interpreter, torchrun) stays with the tests that start a new
interpreter: test_new_user, test_cli_errors, test_lazy_imports, and some of test_ddp_* (`torchrun_forked` runs the
others' workers as forks too).

The child is made to look like a fresh process where that matters: Ctrl-C raises KeyboardInterrupt and SIGTERM
ends it (as Python sets them up), no signal is blocked, stdin is empty, stdout and stderr go to files of its own,
and it ends with os._exit (no atexit handler or pytest teardown of the parent runs in it).

Torch must be at one thread in the parent (conftest's `one_torch_thread` fixture): GNU OpenMP is not fork-safe,
and a child of a process that ran a parallel region hangs in its first one (measured: a 2000x2000 matmul at two
threads, fork, the same matmul in the child never returned). At one thread torch enters no parallel region.

Autograd's first backward in the parent must come before any FakeTensorMode (torch.compile, torch.export, the dynamo
ONNX exporter enter one): torch's autograd engine decides once, at a process's first backward, whether it has
devices that need threads of their own, and after a FakeTensorMode it starts them and marks every later fork as
one whose backward raises "Unable to handle autograd's threading in combination with fork-based multiprocessing"
(torch 2.14; on this CPU-only machine too). conftest calls `first_backward` when the session starts, so a forked
training run does not fail or pass by which tests its xdist worker happened to run before it.
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback


def first_backward():
    """One backward of a one-element tensor: the autograd engine's once-per-process start, made here (see above)."""
    import torch
    leaf = torch.ones(1, requires_grad=True)
    leaf.sum().backward()


def _child(function, args, env, out_fd, err_fd):
    """Runs in the forked process; never returns."""
    code = 1
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, 'w', buffering=1, closefd=False)     # new objects: pytest's capture stays the parent's
        sys.stderr = open(2, 'w', buffering=1, closefd=False)
        for number, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                                (signal.SIGALRM, signal.SIG_DFL)):                 # SIGALRM: pytest-timeout's
            signal.signal(number, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.environ.update(env or {})
        result = function(*args)
        code = result if isinstance(result, int) else 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:                          # as an uncaught exception ends a fresh interpreter: its trace
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class Forked:
    """`function(*args)` in a forked copy of this process, with `env` added to its environment; a Popen-like
    handle (pid, poll, wait, send_signal, kill, returncode) whose stdout and stderr are read from files."""

    def __init__(self, function, *args, env=None):
        torch = sys.modules.get('torch')
        if torch is not None and torch.get_num_threads() != 1:
            raise RuntimeError(f"fork needs torch at one thread here, not {torch.get_num_threads()} (GNU OpenMP "
                               "is not fork-safe): give the test conftest's one_torch_thread fixture")
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(function, args, env, self._out.fileno(), self._err.fileno())
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=300):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"forked child {self.pid} still ran after {timeout} s; killed")
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, number):
        if self.poll() is None:
            os.kill(self.pid, number)

    def kill(self):
        self.send_signal(signal.SIGKILL)
        if self.returncode is None:
            os.waitpid(self.pid, 0)
            self.returncode = -signal.SIGKILL

    @staticmethod
    def _read(file):
        # pread: the child shares the file's offset, and a read that moved it would move where the child writes
        return os.pread(file.fileno(), os.fstat(file.fileno()).st_size, 0).decode(errors='replace')

    @property
    def stdout(self):
        return self._read(self._out)

    @property
    def stderr(self):
        return self._read(self._err)

    def wait_for_output(self, text, timeout=300):
        """Until `text` is in the child's stdout; fails if the child ends first (its stderr said)."""
        deadline = time.monotonic() + timeout
        while text not in self.stdout:
            if self.poll() is not None:
                raise AssertionError(f"forked child ended ({self.returncode}) before printing {text!r}: "
                                     f"{self.stderr[-2000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"forked child printed no {text!r} in {timeout} s; killed")
            time.sleep(0.02)

    def close(self):
        if self.poll() is None:
            self.kill()
        self._out.close()
        self._err.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_forked(function, *args, env=None, timeout=300) -> subprocess.CompletedProcess:
    """As `subprocess.run(..., capture_output=True, text=True)`, for `function(*args)` in a forked process."""
    with Forked(function, *args, env=env) as child:
        code = child.wait(timeout)
        return subprocess.CompletedProcess([getattr(function, '__name__', str(function)), *map(str, args)], code,
                                           child.stdout, child.stderr)


def _elastic_launch(nproc, function, args):
    """In the forked child: torch's elastic agent (what torchrun runs) starting `nproc` workers that fork from
    this process and call `function(*args)`; exit status 0 where every worker returned 0."""
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    os.setpgid(0, 0)                       # the agent and its workers one process group: a timeout ends them all
    # as `torchrun --standalone`: a c10d rendezvous on a free local port, one node, no restarts
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend='c10d',
                          rdzv_endpoint='localhost:0', run_id=uuid.uuid4().hex, max_restarts=0, start_method='fork',
                          monitor_interval=0.1)
    results = elastic_launch(config, function)(*args)        # raises ChildFailedError where a worker failed
    return max(int(r or 0) for r in results.values())


def torchrun_forked(function, *args, nproc=2, env=None, timeout=600) -> subprocess.CompletedProcess:
    """`function(*args)` on `nproc` processes as torchrun starts them, without a fresh interpreter: a forked child
    runs torch's elastic agent (the LocalElasticAgent torchrun runs, rendezvous as `--standalone`), whose workers are
    forks of it with the environment torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    TORCHELASTIC_*). A real torchrun of `python -m structformer train` starts an agent and `nproc` interpreters that
    import torch and timm before the first step: 12.7 s of wall on a 2-core Zen 1 for one run of a digits model,
    3-6 s this way. torchrun's command line and a fresh worker's imports stay with the tests that run the real thing
    (test_ddp_families' first CRATE run, test_ddp_draws' non-finite loss, test_shards, test_data_scale)."""
    if 'OMP_NUM_THREADS' not in os.environ and nproc > 1:       # as torchrun sets it for its workers
        env = {'OMP_NUM_THREADS': '1', **(env or {})}
    with Forked(_elastic_launch, nproc, function, args, env=env) as agent:
        try:
            code = agent.wait(timeout)
        except TimeoutError:              # a worker waiting in a collective another skipped: end the workers too
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
        return subprocess.CompletedProcess(['torchrun_forked', getattr(function, '__name__', str(function)),
                                            *map(str, args)], code, agent.stdout, agent.stderr)
