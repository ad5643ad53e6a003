import os
from pathlib import Path

import pytest
import torch

import structformer  # noqa: F401  (registers models)

# The image-folder check cache (data/imagecheck.py) of the test session: a fresh folder, not the user's ~/.cache.
os.environ.setdefault('STRUCTFORMER_CACHE', __import__('tempfile').mkdtemp(prefix='structformer-test-cache-'))

# Kernel choices (functional/autotune.py) without timing: each takes its rule's default, so a test sees the same
# path on every run and machine; the chooser's own tests turn timing on with an injected timer.
os.environ.setdefault('STRUCTFORMER_AUTOTUNE', 'off')

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


@pytest.fixture
def shared_mnist():
    if not SHARED_MNIST.exists():
        pytest.skip('needs ../shared/data/mnist (the real MNIST test set, not part of the repository)')
    return SHARED_MNIST
