"""torch's deferred initialisation, as a user (or FSDP, or torchtitan) runs it on our layers: build on the meta device,
`to_empty`, then `reset_parameters()` on every module that has one. Shared by the layers' tests of it."""
from typing import Callable, Optional

import torch


def deferred_init(build: Callable[..., torch.nn.Module], context: bool = False,
                  seed: Optional[int] = None) -> torch.nn.Module:
    """`build()` under `torch.device('meta')` (context) or `build(device='meta')`, materialised on the CPU by
    `to_empty` and initialised by every module's `reset_parameters` (after `torch.manual_seed(seed)` when given)."""
    if context:
        with torch.device('meta'):
            layer = build()
    else:
        layer = build(device='meta')
    layer.to_empty(device='cpu')
    if seed is not None:
        torch.manual_seed(seed)
    for module in layer.modules():
        if hasattr(module, 'reset_parameters'):
            module.reset_parameters()
    return layer
