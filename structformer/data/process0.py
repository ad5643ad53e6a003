"""Work on the data done once under torchrun: by process 0, its result (or its error) shared with the others.

Every process of a torchrun group builds the same data sets. What reads the whole data set before training (the
validation shards' tar headers, the header scan of shards without `_info.json`, ImageNet's tar index) was done
by each process, P times the reads of one, all at once on the same disk. Here process 0 does it and the others
take its result. An error raised on process 0 (a damaged shard) is raised on every process with the same
message: the others would otherwise wait in the broadcast for good.
"""
from typing import Callable, TypeVar

T = TypeVar('T')


def distributed() -> bool:
    """True inside an initialised torch.distributed group of several processes."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _portable(error: BaseException) -> BaseException:
    """`error`, or a RuntimeError with its text where it does not pickle (it crosses to the other processes)."""
    import pickle
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f'{type(error).__name__}: {error}')


def on_process_0(work: Callable[[], T]) -> T:
    """work() on process 0, its result broadcast to the others (a plain call without torch.distributed)."""
    if not distributed():
        return work()
    import torch.distributed as dist
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ('ok', work())
        except Exception as e:
            box[0] = ('error', _portable(e))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == 'error':
        raise value
    return value


def process_0_first(work: Callable[[], T]) -> T:
    """work() on process 0, then on the others: for work that process 0 leaves in a cache the others then read
    (a result too big to broadcast). An error on process 0 is raised everywhere, before the others start."""
    if not distributed():
        return work()
    import torch.distributed as dist
    done = []
    on_process_0(lambda: done.append(work()))        # what crosses is None, or process 0's error
    return done[0] if dist.get_rank() == 0 else work()
