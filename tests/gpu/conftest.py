"""The GPU suite (`make test-gpu`): every test here is marked `gpu` and skipped without CUDA, so the default suite
collects it cleanly on a CPU. The runs are `structformer train` itself (`train(TrainConfig)` in this process, or
the CLI under torchrun), on a small image folder made here, at each family's 224-px model (the Wide-ResNet at its
32 px).

$STRUCTFORMER_GPU_SUITE_DEVICE=cpu runs the suite's code on a CPU instead (a rehearsal for whoever changes it: slow,
and every CUDA-only check skips); it is no part of any make target.
"""
import os
import time
from pathlib import Path

# before cuBLAS starts in this process: the workspace setting that makes its GEMMs deterministic, which
# `torch.use_deterministic_algorithms` asks for (the resume test)
os.environ.setdefault('CUBLAS_WORKSPACE_CONFIG', ':4096:8')

import numpy as np   # noqa: E402
import pytest        # noqa: E402
import torch         # noqa: E402

from .checks import DEADLINE_ENV, deadline_skip_reason                   # noqa: E402
from .runs import DEVICE, FamilyRuns, image_folder_at, train_teacher   # noqa: E402

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    missing = DEVICE == 'cuda' and not torch.cuda.is_available()
    skip = pytest.mark.skip(reason='needs a CUDA device (tests/gpu: `make test-gpu` on a GPU)')
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if missing:
                item.add_marker(skip)


def pytest_configure(config):
    """A malformed $STRUCTFORMER_GPU_SUITE_DEADLINE stops the run at its start, in one line."""
    try:
        deadline_skip_reason(os.environ.get(DEADLINE_ENV), 0.0)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Past $STRUCTFORMER_GPU_SUITE_DEADLINE no test starts (skipped, before its fixtures are built): the suite
    ends on its own before tools/gpu_check.sh's hard limit interrupts it (`checks.deadline_skip_reason`)."""
    reason = deadline_skip_reason(os.environ.get(DEADLINE_ENV), time.time())
    if reason:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch; no test's graphs count towards another's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope='session')
def image_folder(tmp_path_factory) -> Path:
    return image_folder_at(tmp_path_factory.mktemp('images'))


@pytest.fixture(scope='session')
def teacher(tmp_path_factory, image_folder) -> Path:
    return train_teacher(tmp_path_factory.mktemp('teacher') / 'deit_tiny', image_folder)


@pytest.fixture(scope='session')
def family_runs(tmp_path_factory, image_folder, request) -> FamilyRuns:
    """Each family's runs, trained once per session and kept: (family, precision) -> (result, step losses)."""
    return FamilyRuns(tmp_path_factory.mktemp('runs'), image_folder, lambda: request.getfixturevalue('teacher'))


@pytest.fixture
def no_tf32():
    """float32 products in float32 (cuDNN's convolutions take TF32 by default), restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def seeded_images(n: int, side: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, 3, side, side)).astype(np.float32))
