"""Work on the data done once under torchrun: by process 0, its result (or its error) shared with the others.

Every process of a torchrun group builds the same data sets. What reads the whole data set before training (the
validation shards' tar headers, the header scan of shards without `_info.json`, ImageNet's tar index) was done
by each process, P times the reads of one, all at once on the same disk. Here process 0 does it and the others
take its result. An error raised on process 0 (a damaged shard) is raised on every process with the same
message: the others would otherwise wait in the broadcast for good.

The others wait in a broadcast on a gloo group of their own with a day's timeout, not on the training group: a first
run's ImageNet index (1.28 M tar headers) can outlast the training group's collective timeout (NCCL's default is 10
minutes), and its watchdog stopped the waiting processes. Should process 0 die instead, torchrun stops the others.
"""
from datetime import timedelta
from typing import Callable, TypeVar

T = TypeVar('T')
WAIT = timedelta(hours=24)
_groups = {}          # the training group (torch's WORLD object) -> the waiting group made for it


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


def _waiting_group():
    """A gloo group of every process with the WAIT timeout, made once per training group (every process calls this,
    in the same order, as new_group requires). gloo: CPU objects, whichever backend trains."""
    import torch.distributed as dist
    world = dist.group.WORLD
    if world not in _groups:
        _groups.clear()                # a group of an earlier, destroyed training group is not kept
        _groups[world] = dist.new_group(backend='gloo', timeout=WAIT)
    return _groups[world]


def on_process_0(work: Callable[[], T]) -> T:
    """work() on process 0, its result broadcast to the others (a plain call without torch.distributed)."""
    if not distributed():
        return work()
    import torch.distributed as dist
    group = _waiting_group()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ('ok', work())
        except Exception as e:
            box[0] = ('error', _portable(e))
    dist.broadcast_object_list(box, src=0, group=group)
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
