"""The dtype policy of structformer's own ops under autocast (the table is docs/precision.md).

`torch.autocast` casts the operands of the ops it knows (matmuls, convolutions, SDPA) to its lower-precision
dtype and leaves everything else alone. Custom ops and the numerically delicate steps of this package state their
own rule and keep it with these helpers:

* `float32_island` / `computes_in_float32`: autocast off, float16/bfloat16 inputs upcast to float32 (float32 and
  float64 pass through unchanged). For steps that are wrong in half precision, not merely less accurate: SOFT's
  Gaussian-kernel exponent and Newton–Schulz pseudo-inverse, Sparsifiner's predictor scores and top-k, coding rates.
* `autocast_dtype`: the dtype autocast would run a product in, for code that casts explicitly (an op autocast cannot
  see, or the matmuls just after a float32 island), so they run in bfloat16/float16 like any matmul would.
* `full_precision` / `no_autocast`: autocast off on every device, inputs untouched, for measurements (analysis) that
  run a whole model and must not depend on whether the caller sits inside an autocast context.
"""
import functools
from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch

__all__ = ['LOW_PRECISION', 'upcast', 'autocast_dtype', 'float32_island', 'computes_in_float32', 'no_autocast',
           'full_precision']

LOW_PRECISION = (torch.float16, torch.bfloat16)

# device types whose autocast state `no_autocast` checks (an unknown one is skipped)
_AUTOCAST_DEVICES = ('cpu', 'cuda', 'xpu', 'mps', 'hpu')


def upcast(t: torch.Tensor) -> torch.Tensor:
    """t in float32 when it is float16/bfloat16, else t itself."""
    return t.float() if t.dtype in LOW_PRECISION else t


def autocast_dtype(device_type: str, default: torch.dtype) -> torch.dtype:
    """autocast's lower-precision dtype on `device_type` when autocast is on there, else `default` (also on a
    device type autocast does not know, such as 'meta', where a dry run shapes a model)."""
    if _autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return default


@contextmanager
def float32_island(device_type: str) -> Iterator[None]:
    """Autocast off on `device_type` for the block (the caller upcasts its half inputs with `upcast`). Where autocast
    is not on there is nothing to turn off, and no context is entered: under torch.export each one became a
    `wrap_with_autocast` sub-graph that the decompositions re-trace (SOFT digits' dynamic-batch ONNX export spent
    32 of its 42 s of decomposition in its four; 2-core Zen 1). On a device type autocast does not know ('meta':
    `train --dry-run` shapes lazy weights there) there is nothing to turn off either, and torch.autocast would
    refuse it."""
    if not _autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type=device_type, enabled=False):
        yield


def _device_type(args, kwargs) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return 'cpu'


def computes_in_float32(fn):
    """Decorator: `fn` runs with autocast off on its tensors' device, its float16/bfloat16 tensor arguments
    (top level, positional or keyword) upcast to float32; float32 and float64 arguments pass unchanged, so its
    result is float32 (float64 for float64 inputs) whatever autocast context it is called in."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with float32_island(_device_type(args, kwargs)):
            args = tuple(upcast(a) if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: upcast(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            return fn(*args, **kwargs)
    return wrapper


def _autocast_known(device_type: str) -> bool:
    try:
        torch.is_autocast_enabled(device_type)
    except RuntimeError:                                 # a device type this torch build does not know
        return False
    return True


def _autocast_enabled(device_type: str) -> bool:
    return _autocast_known(device_type) and torch.is_autocast_enabled(device_type)


@contextmanager
def no_autocast() -> Iterator[None]:
    """Autocast off, for the block, on every device type where it is on (inputs are not touched)."""
    with ExitStack() as stack:
        for device_type in _AUTOCAST_DEVICES:
            if _autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        yield


def full_precision(fn):
    """Decorator: `fn` runs under `no_autocast` (for measurements that run a model and compute statistics:
    they give the same numbers inside an autocast context as outside it)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with no_autocast():
            return fn(*args, **kwargs)
    return wrapper
