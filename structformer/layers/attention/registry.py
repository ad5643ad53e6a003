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


def with_defaults(cls: Type[nn.Module], **defaults) -> Type[nn.Module]:
    """A subclass of `cls` whose constructor defaults to `defaults` (explicit kwargs still win). A class,
    not a functools.partial, because timm checks `issubclass(attn_layer, ...)` before building."""
    if not defaults:
        return cls

    class Preset(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**defaults, **kwargs})

    Preset.__name__ = Preset.__qualname__ = cls.__name__
    return Preset


def resolve_layer_kwargs(kwargs: Dict) -> Dict:
    """A copy of model kwargs where `attn_layer='<name>'` naming a class registered here is replaced by
    that class, so `--model-kwargs attn_layer=soft attn_kwargs="{'num_landmarks': 16}"` swaps the
    attention of any timm ViT from a config or the command line. `attn_kwargs` (a dict, only taken
    together with such a name) presets the layer's own options, which timm's blocks do not pass.
    timm's own names ('' / 'attn' / 'diff') and classes pass through untouched."""
    out = dict(kwargs)
    name = out.get('attn_layer')
    if isinstance(name, str) and name in ATTENTION_LAYERS:
        options = out.pop('attn_kwargs', None) or {}
        if not isinstance(options, dict):
            raise ValueError(f"attn_kwargs must be a dict of {name!r} options, got {options!r}")
        out['attn_layer'] = with_defaults(ATTENTION_LAYERS[name], **options)
    return out
