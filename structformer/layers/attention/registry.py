"""Name -> attention class, so configs and benchmarks can swap attention by name
(`--model-kwargs attn=soft`). Every class here takes timm's `attn_layer` constructor
signature (`dim, num_heads, qkv_bias, ..., attn_drop, proj_drop, norm_layer, device, dtype`)
and is called as `layer(x, attn_mask=None, is_causal=False, grid_size=None)`.
"""
from typing import Dict, Type

from torch import nn

ATTENTION_LAYERS: Dict[str, Type[nn.Module]] = {}


def register_attention(name: str):
    """Class decorator: make an attention class available under `name`."""
    def wrap(cls):
        if name in ATTENTION_LAYERS and ATTENTION_LAYERS[name] is not cls:
            raise ValueError(f"attention name {name!r} is already registered to {ATTENTION_LAYERS[name].__name__}")
        ATTENTION_LAYERS[name] = cls
        return cls
    return wrap


def get_attention(name_or_cls) -> Type[nn.Module]:
    """Resolve an attention class from a registered name (or pass a class through)."""
    if isinstance(name_or_cls, type):
        return name_or_cls
    try:
        return ATTENTION_LAYERS[name_or_cls]
    except KeyError:
        raise ValueError(
            f"unknown attention {name_or_cls!r}; accepted: {', '.join(sorted(ATTENTION_LAYERS))}") from None
