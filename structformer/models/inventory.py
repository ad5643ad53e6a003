"""Parameter counts of registered models, built on the meta device (no memory, no init cost): every weight stored
(timm's count) and the weights a masked layer keeps (`effective_parameter_count`)."""
from typing import Dict, List

import timm
import torch


def model_inventory(names: List[str]) -> List[Dict]:
    rows = []
    for name in names:
        with torch.device('meta'):
            model = timm.create_model(name)
        cfg = timm.get_pretrained_cfg(name)
        rows.append({'name': name, 'params': sum(p.numel() for p in model.parameters()),
                     'effective_params': effective_parameter_count(model),
                     'input_size': list(cfg.input_size) if cfg else None})
    return rows


def effective_parameter_count(model: torch.nn.Module) -> int:
    """Trainable weights a model really has: every parameter once, except that a masked layer (a module with a
    boolean `mask` buffer the shape of its `weight`, such as SW-MLP's MaskedLinear) counts only the weights its
    mask keeps; entries off the mask are zero and get no gradient. On the meta device a MaskedLinear counts the mask its
    seed draws (the real count); another masked module's mask has no values there, so its `density` is counted."""
    seen, total = set(), 0.0
    for module in model.modules():
        mask = getattr(module, 'mask', None)
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if name == 'weight' and hasattr(module, 'kept_weights'):          # MaskedLinear: exact on meta too
                total += module.kept_weights()
            elif name == 'weight' and isinstance(mask, torch.Tensor) and mask.shape == param.shape:
                total += param.numel() * float(module.density) if mask.is_meta else int(mask.count_nonzero())
            else:
                total += param.numel()
    return int(round(total))
