"""data/process0.py: work done once by process 0 under torchrun, its result shared, however long it takes."""
import json
from datetime import timedelta
from pathlib import Path


def _slow_work_on_rank(rank, world, init_file, out):
    """One process of a gloo group whose collectives time out after 1 s: process 0's work takes 3 s."""
    import time

    import torch.distributed as dist

    from structformer.data.process0 import on_process_0
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world,
                            timeout=timedelta(seconds=1))
    try:
        result = on_process_0(lambda: time.sleep(3) or {'index': [1, 2, 3]})
    except Exception as e:                       # the old broadcast on the default group: a timeout on process 1
        result = f'{type(e).__name__}: {e}'
    Path(out, f'rank{rank}.json').write_text(json.dumps(result))
    dist.destroy_process_group()


def test_the_others_wait_for_process_0_past_the_groups_timeout(tmp_path):
    """Process 0 indexing ImageNet's 1.28 M tar headers on a first run can take longer than the training group's
    collective timeout (NCCL's default is 10 minutes), and the others wait for it in a broadcast: on the training
    group they were stopped by its watchdog. The wait is on a group of its own without that limit."""
    import torch.multiprocessing as mp
    mp.start_processes(_slow_work_on_rank, args=(2, str(tmp_path / 'init'), str(tmp_path)), nprocs=2,
                       start_method='fork')
    results = [json.loads((tmp_path / f'rank{r}.json').read_text()) for r in (0, 1)]
    assert results == [{'index': [1, 2, 3]}] * 2, results
