import atexit
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import pytest
import torch

import structformer  # noqa: F401  (registers models)
from forking import first_backward

# The image-folder check cache (data/imagecheck.py) of the test session: a fresh folder, not the user's ~/.cache,
# removed when the session ends. Made only where the environment names none: pytest-xdist's workers and the CLI
# subprocesses inherit the session's (setdefault's argument was made, and left in /tmp, by every one of them).
if 'STRUCTFORMER_CACHE' not in os.environ:
    os.environ['STRUCTFORMER_CACHE'] = tempfile.mkdtemp(prefix='structformer-test-cache-')
    atexit.register(shutil.rmtree, os.environ['STRUCTFORMER_CACHE'], ignore_errors=True)

# Tests stand in for Ctrl-C by sending SIGINT (train/checkpoint.py crash_point). A suite started in the background
# (`make test &`, nohup, some CI runners) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
# handler: those runs would train to the end. Give the process Python's own Ctrl-C back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Kernel choices (functional/autotune.py) without timing: each takes its rule's default, so a test sees the same
# path on every run and machine; the chooser's own tests turn timing on with an injected timer.
os.environ.setdefault('STRUCTFORMER_AUTOTUNE', 'off')

# Autograd's once-per-process start before any test enters a FakeTensorMode (compile, export): else a command
# forked after such a test (tests/forking.py) could not run backward
first_backward()

# The real MNIST test set lives beside the project (never committed); tests that use it skip without it.
SHARED_MNIST = Path(__file__).resolve().parents[1].parent / 'shared' / 'data' / 'mnist'


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Every test starts seeded, and a test that sets torch's thread count (benchmarks do) does not
    change the reduction order, hence the rounding, of the tests after it."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope='module')
def one_torch_thread():
    """A module whose tests fork a command (tests/forking.py) runs at one torch thread, its module-scoped runs too
    (`pytestmark = pytest.mark.usefixtures('one_torch_thread')`): a child forked after a parallel region hangs, and
    runs compared bit for bit across parent and child must round alike. `make test` runs at one thread anyway."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_INTERRUPTS = {signal.SIGINT, signal.SIGTERM}


@pytest.fixture(autouse=True)
def _signals_as_found():
    """A test that leaves Ctrl-C or SIGTERM ignored, handled elsewhere or blocked would silently change every
    later test in its process that interrupts a run (they would train to the end instead): it fails itself,
    and the signals are put back."""
    before = {s: signal.getsignal(s) for s in _INTERRUPTS}
    main = threading.current_thread() is threading.main_thread()
    yield
    if not main:
        return
    after = {s: signal.getsignal(s) for s in _INTERRUPTS}
    blocked = _INTERRUPTS & signal.pthread_sigmask(signal.SIG_BLOCK, [])
    for number, handler in before.items():
        signal.signal(number, handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _INTERRUPTS)
    changed = [signal.Signals(s).name for s in _INTERRUPTS if after[s] is not before[s]]
    assert not changed and not blocked, (f"the test left {', '.join(changed)} with another handler" if changed else
                                         f"the test left {', '.join(signal.Signals(s).name for s in blocked)} blocked")


@pytest.fixture
def shared_mnist():
    if not SHARED_MNIST.exists():
        pytest.skip('needs ../shared/data/mnist (the real MNIST test set, not part of the repository)')
    return SHARED_MNIST


# ---- runs shared by the whole session ----------------------------------------------------------------------
# Built once per test process (make test has two) and shared by every test that only reads a finished run:
# never write into one. A test that needs to change a run copies it (shutil.copytree) first; the teardown
# fails the session if a test changed a shared run. See docs/design.md, "Keeping the suite cheap".

def _contents(folder: Path):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob('*'))}


def _shared_run(tmp_path_factory, name, **config):
    from structformer.train import TrainConfig, train
    out = tmp_path_factory.mktemp(f'shared_{name}') / 'run'
    train(TrainConfig(data='digits', epochs=1, warmup_epochs=0, log_interval=0, output=str(out), **config),
          progress=False)
    before = _contents(out)
    yield out
    assert _contents(out) == before, f'a test changed the shared run {name} ({out}): copy it before writing'


@pytest.fixture(scope='session')
def crate_digits_run(tmp_path_factory):
    """crate_digits, one epoch of two batches on the embedded digits (checkpoints epoch_0000 and epoch_0001)."""
    yield from _shared_run(tmp_path_factory, 'crate_digits', model='crate_digits', limit_train_batches=2)


@pytest.fixture(scope='session')
def vit_digits_teacher(tmp_path_factory):
    """vit_digits, one epoch of four batches at lr 3e-3: a trained teacher for Sparsifiner's distillation (and
    any finished run of a plain ViT)."""
    yield from _shared_run(tmp_path_factory, 'vit_digits', model='vit_digits', lr=3e-3, limit_train_batches=4)

