"""DDP setup: the same code path at 1 process; under `torchrun` it joins the process group
(gloo on CPU, nccl on CUDA)."""
import os

import torch
import torch.distributed as dist


def init_distributed():
    """Returns (rank, world_size, device). Reads torchrun's environment variables."""
    world_size = int(os.environ.get('WORLD_SIZE', '1'))
    rank = int(os.environ.get('RANK', '0'))
    local_rank = int(os.environ.get('LOCAL_RANK', '0'))
    if torch.cuda.is_available():
        device = torch.device('cuda', local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device('cpu')
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    return rank, world_size, device


def barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def cleanup_distributed():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
