"""Name -> attention class, so configs and benchmarks can swap attention by name
(`--model-kwargs attn=soft`). Every class here takes timm's `attn_layer` constructor
signature (`dim, num_heads, qkv_bias, ..., attn_drop, proj_drop, norm_layer, device, dtype`)
and is called as `layer(x, attn_mask=None, is_causal=False, grid_size=None)`.

Options are strict: a keyword a class does not take is a TypeError naming it (as timm's `Attention`).
Code that offers the same facts to any attention (a model's stage: landmarks, grid, sequence length)
passes them through `select_options(cls, options)`; options a user typed go through
`check_options(cls, options)`, which names the unknown keys and the closest accepted ones.
"""
import copyreg
import difflib
import inspect
from typing import Dict, FrozenSet, Iterable, Mapping, Type

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


_KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def accepted_options(cls: Type[nn.Module]) -> FrozenSet[str]:
    """The keyword options `cls(...)` accepts: its `__init__` parameters, and those of the classes it
    forwards `**kwargs` to along the MRO (a subclass such as `SoftPlusPlusAttention` or a `with_defaults`
    preset adds its own and passes the rest up)."""
    names = set()
    for klass in inspect.getmro(cls):
        if klass in (nn.Module, object):
            break
        init = klass.__dict__.get('__init__')
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]         # drop self
        names.update(p.name for p in params if p.kind in _KEYWORD_KINDS)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return frozenset(names)


def unknown_options_error(owner: str, unknown: Iterable[str], accepted: Iterable[str]) -> TypeError:
    """`TypeError: <owner> got unknown option(s) a, b (did you mean: a -> aa); accepted: ...`."""
    unknown, accepted = sorted(unknown), sorted(accepted)
    hints = [f"{k} -> {close[0]}" for k in unknown
             for close in [difflib.get_close_matches(k, accepted, n=1, cutoff=0.6)] if close]
    return TypeError(f"{owner} got unknown option(s) {', '.join(unknown)}"
                     + (f" (did you mean: {', '.join(hints)})" if hints else '')
                     + f"; accepted: {', '.join(accepted)}")


def check_options(cls: Type[nn.Module], options: Iterable[str]) -> None:
    """Raise a TypeError naming every key of `options` that `cls` does not accept."""
    accepted = accepted_options(cls)
    unknown = [k for k in options if k not in accepted]
    if unknown:
        raise unknown_options_error(cls.__name__, unknown, accepted)


def select_options(cls: Type[nn.Module], options: Mapping) -> Dict:
    """The part of a shared option dict that `cls` accepts: a model passes the facts it knows about a
    stage (landmarks, grid, sequence length) to whichever attention it was given, and each class takes
    only its own. User options are checked with `check_options` first, so a typo never lands here."""
    accepted = accepted_options(cls)
    return {k: v for k, v in options.items() if k in accepted}


class _PresetClass(type):
    """Metaclass of `with_defaults` presets. A class made at run time cannot be pickled by reference, and timm
    keeps the `attn_layer` class in `model._model_args`, so `torch.save(model)` pickles it: the reducer
    registered below pickles a preset as (base class, defaults) and rebuilds it on load."""


def _rebuild_preset(cls: Type[nn.Module], defaults: Dict) -> Type[nn.Module]:
    return with_defaults(cls, **defaults)


copyreg.pickle(_PresetClass, lambda preset: (_rebuild_preset, (preset.preset_base, dict(preset.preset_defaults))))


def with_defaults(cls: Type[nn.Module], **defaults) -> Type[nn.Module]:
    """A subclass of `cls` whose constructor defaults to `defaults` (explicit kwargs still win). A class,
    not a functools.partial, because timm checks `issubclass(attn_layer, ...)` before building.
    A key `cls` does not accept raises a TypeError here, before any layer is built. The layers it builds
    are plain `cls` instances; the class itself pickles as (cls, defaults)."""
    if not defaults:
        return cls
    check_options(cls, defaults)

    class Preset(cls, metaclass=_PresetClass):
        preset_base, preset_defaults = cls, dict(defaults)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**defaults, **kwargs})
            # the preset only supplies constructor defaults: the built layer is a plain `cls`, so it pickles
            # by reference and type checks see `cls`
            self.__class__ = cls

    Preset.__name__ = Preset.__qualname__ = cls.__name__
    return Preset


def resolve_layer_kwargs(kwargs: Dict) -> Dict:
    """A copy of model kwargs where `attn_layer='<name>'` naming a class registered here is replaced by
    that class, so `--model-kwargs attn_layer=soft attn_kwargs="{'num_landmarks': 16}"` swaps the
    attention of any timm ViT from a config or the command line. `attn_kwargs` (a dict, only taken
    together with such a name) presets the layer's own options, which timm's blocks do not pass.
    timm's own names ('' / 'attn' / 'diff') and classes pass through untouched; any other name is refused with the
    accepted ones (timm's own message named None), and so are attn_kwargs keys timm's Block passes itself
    (`BLOCK_PASSES`: a preset of them was silently overridden by the block, or clashed)."""
    out = dict(kwargs)
    name = out.get('attn_layer')
    if isinstance(name, str) and name not in ATTENTION_LAYERS:
        from timm.models.vision_transformer import ATTN_LAYERS as timm_names   # lazy: timm imports our models
        if name not in timm_names:                 # timm's own refusal read "Unknown attn_layer: None"
            accepted = sorted(ATTENTION_LAYERS) + sorted(repr(k) for k in timm_names)
            close = difflib.get_close_matches(name, sorted(ATTENTION_LAYERS), n=1, cutoff=0.6)
            raise ValueError(f"unknown attn_layer {name!r}" + (f" (did you mean {close[0]!r}?)" if close else '')
                             + f"; accepted: {', '.join(accepted)}")
    if 'attn_kwargs' in out and 'attn_layer' in out and not (isinstance(name, str) and name in ATTENTION_LAYERS):
        raise ValueError(f"attn_kwargs is taken only with attn_layer set to a structformer attention name "
                         f"({', '.join(sorted(ATTENTION_LAYERS))}), got attn_layer={name!r}")
    if isinstance(name, str) and name in ATTENTION_LAYERS:
        options = out.pop('attn_kwargs', None) or {}
        if not isinstance(options, dict):
            raise ValueError(f"attn_kwargs must be a dict of {name!r} options, got {options!r}")
        passed = sorted(set(options) & BLOCK_PASSES)
        if passed:
            # timm's Block passes these to every attention: a preset of them was overridden (proj_drop=0.3 became
            # the model's 0.0) or clashed (dim: "got multiple values")
            raise ValueError(f"attn_kwargs: {', '.join(passed)} set by the model's blocks for every attention, not by "
                             "attn_kwargs; use the model's own option (embed_dim, num_heads, qkv_bias, qk_norm, "
                             "proj_bias, attn_drop_rate, proj_drop_rate, norm_layer)")
        out['attn_layer'] = with_defaults(ATTENTION_LAYERS[name], **options)
    return out


# what timm's ViT `Block` passes every `attn_layer` (timm.models.vision_transformer._create_attn)
BLOCK_PASSES = frozenset({'dim', 'num_heads', 'qkv_bias', 'qk_norm', 'scale_norm', 'proj_bias', 'attn_drop',
                          'proj_drop', 'norm_layer', 'device', 'dtype'})
