"""Parameter counts of registered models, built on the meta device (no memory, no init cost)."""
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
                     'input_size': list(cfg.input_size) if cfg else None})
    return rows
