"""An exponential moving average of the weights (timm.utils.ModelEmaV3), as a part the training loop calls.

Updated after every optimiser step with the step count since the average started (so timm's optional decay
warm-up follows the run, and starts again with an average restarted on a factorised network: train/parts.py),
evaluated beside the model every epoch (`ema_val_*` in metrics.jsonl), saved as `ema.safetensors` in each
checkpoint and restored on --resume; `structformer eval --ema` scores it.
"""
from typing import Dict

import torch

EMA_FILE = 'ema.safetensors'
# under DDP, the other processes' BatchNorm statistics of the average where they differ from rank 0's (inside an
# epoch, before --dist-bn makes them one): `rankR.NAME` tensors, so each process resumes its own average
EMA_RANKS_FILE = 'ema_ranks.safetensors'


class WeightAverage:
    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool):
        from timm.utils import ModelEmaV3
        # stochastic rounding only matters for an average kept in a low-precision dtype; ours is float32
        self.ema = ModelEmaV3(model, decay=decay, use_warmup=warmup)
        self.ema.module.requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        return self.ema.module

    def update(self, model: torch.nn.Module, step: int) -> None:
        self.ema.update(model, step=step)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.detach().contiguous().cpu() for k, v in self.ema.module.state_dict().items()}

    def load_state_dict(self, weights: Dict[str, torch.Tensor]) -> None:
        self.ema.module.load_state_dict(weights)

    def process_buffers(self) -> Dict[str, torch.Tensor]:
        """The average's floating-point buffers (BatchNorm running statistics). Under DDP each process's average
        follows its own model's statistics, which differ by the batches each process saw; its parameters are one."""
        state = self.ema.module.state_dict()
        return {name: state[name] for name, buffer in self.ema.module.named_buffers()
                if name in state and buffer.is_floating_point()}

    def load_process_buffers(self, tensors: Dict[str, torch.Tensor], rank: int) -> None:
        """Take this process's buffers (`rank{rank}.NAME` in `tensors`) where a checkpoint kept them."""
        prefix = f'rank{rank}.'
        own = {name[len(prefix):]: value for name, value in tensors.items() if name.startswith(prefix)}
        if own:
            self.ema.module.load_state_dict(own, strict=False)
