"""One timer for every benchmark and reproduction: median wall time of a call, GPU-synchronised."""
import statistics
import time
from typing import Callable

import torch


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int, device) -> float:
    """Median seconds per call of `fn` over `repeats` timed calls, after `warmup` untimed ones.

    `device` ('cpu' / 'cuda' or a torch.device): on CUDA each call is bracketed by a synchronise, so
    the time is the kernels' and not the launch's. The median, not the mean, because one call hit by
    another process on a shared machine should not move the figure.
    """
    on_cuda = torch.device(device).type == 'cuda'
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
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
