"""Devices and DDP: the same code path at 1 process; under `torchrun` it joins the process group
(gloo on CPU, nccl on CUDA, gloo where several processes share one GPU)."""
import os
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from ..errors import UsageError


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """--device: auto (the local rank's GPU when CUDA is present, else the CPU), cpu, cuda (the local rank's
    GPU under torchrun) or cuda:N."""
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    if name == 'cpu':
        return torch.device('cpu')
    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                         f"built with CUDA {torch.version.cuda}); use --device cpu or auto")
    index = local_rank if name == 'cuda' else int(name.split(':', 1)[1])
    if index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                         f"(accepted cuda:0 .. cuda:{torch.cuda.device_count() - 1})")
    return torch.device('cuda', index)


BACKEND_VARIABLE = 'STRUCTFORMER_DIST_BACKEND'       # nccl | gloo: overrides the choice below


def process_group_backend(device: torch.device, shared_device: bool) -> str:
    """The process group's backend: nccl where each process has a GPU of its own; gloo on CPUs and where the
    processes share one GPU (`--device cuda:N` under torchrun with several local processes), which nccl refuses
    ("Duplicate GPU detected"). $STRUCTFORMER_DIST_BACKEND (nccl or gloo) overrides it."""
    chosen = os.environ.get(BACKEND_VARIABLE, '').strip().lower()
    if chosen:
        if chosen not in ('nccl', 'gloo'):
            raise UsageError(f"${BACKEND_VARIABLE}={chosen!r}: accepted nccl or gloo")
        if chosen == 'nccl' and device.type != 'cuda':
            raise UsageError(f"${BACKEND_VARIABLE}=nccl needs CUDA devices; this process runs on {device}")
        return chosen
    return 'nccl' if device.type == 'cuda' and not shared_device else 'gloo'


def init_distributed(device: str = 'auto'):
    """Returns (rank, world_size, device). Reads torchrun's environment variables."""
    world_size = int(os.environ.get('WORLD_SIZE', '1'))
    rank = int(os.environ.get('RANK', '0'))
    local_rank = int(os.environ.get('LOCAL_RANK', '0'))
    resolved = resolve_device(device, local_rank)
    if resolved.type == 'cuda':
        torch.cuda.set_device(resolved)
    if world_size > 1 and not dist.is_initialized():
        # an explicit cuda:N puts every local process on that one GPU
        shared = device.startswith('cuda:') and int(os.environ.get('LOCAL_WORLD_SIZE', '1')) > 1
        dist.init_process_group(process_group_backend(resolved, shared))
    return rank, world_size, resolved


def all_reduce_sum(values: Sequence[float]) -> List[float]:
    """Sums of `values` over every process (float64, exact for counts below 2**53); integers stay integers."""
    device = 'cuda' if dist.get_backend() == 'nccl' else 'cpu'
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return [int(round(s)) if isinstance(v, int) else float(s) for v, s in zip(values, tensor.tolist())]


def gather_tensors(tensors: Dict[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
    """Every process's `tensors` (the same names and shapes on each), in rank order, on every process (CPU): one
    all_gather of their values as float64, exact for float32, float16 and bfloat16 (a collective)."""
    names = list(tensors)
    device = torch.device('cuda', torch.cuda.current_device()) if dist.get_backend() == 'nccl' else torch.device('cpu')
    flat = torch.cat([tensors[k].detach().reshape(-1).to(device, torch.float64) for k in names] +
                     [torch.zeros(0, dtype=torch.float64, device=device)])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    every = []
    for values in gathered:
        values, offset, one = values.cpu(), 0, {}
        for name in names:
            like = tensors[name]
            one[name] = values[offset:offset + like.numel()].reshape(like.shape).to(like.dtype)
            offset += like.numel()
        every.append(one)
    return every


def broadcast_module(module: torch.nn.Module) -> None:
    """Every process takes rank 0's parameters and buffers (a model made mid-run, e.g. factorised with a random
    init: each process draws its own numbers, and the weight average copies the model before DDP would)."""
    with torch.no_grad():
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, 0)


def barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def cleanup_distributed():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
