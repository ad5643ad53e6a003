"""The one way to build a model: registered name + kwargs + data facts + recorded transforms.

    model, recipe = build_model('crate_digits', {'depth': 2}, data=info, transforms=['my_transform'])
    model = rebuild(recipe)          # the same network, from what a checkpoint recorded

`build_model` fills what the data decides (classes, channels, image size) unless the kwargs set it,
resolves attention names (`attn_layer='soft'`, see `layers.attention.registry.resolve_layer_kwargs`:
timm's blocks construct and initialise the layer, so a swap by name happens at construction),
applies the transforms in order, and shapes lazy parameters last (`materialize_lazy`). The returned
`ModelRecipe` holds exactly what was done; the engine stores it in every checkpoint's `state.json`,
and `rebuild` replays it without looking at data, so `load_model`, `eval`, `analyze` and `--resume`
give back the trained network.
"""
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from .transforms import (TransformContext, apply_transforms, get_transform, has_lazy_parameters,
                         normalize_transforms)

__all__ = ['ModelRecipe', 'build_model', 'rebuild', 'default_input_size']


@dataclass
class ModelRecipe:
    """Everything needed to rebuild a model: JSON values only (it is written to state.json)."""
    name: str
    kwargs: Dict[str, Any] = field(default_factory=dict)
    transforms: List[Dict[str, Any]] = field(default_factory=list)
    input_size: Optional[Tuple[int, int, int]] = None        # (C, H, W), for transforms that run a forward

    def to_dict(self) -> Dict[str, Any]:
        return {'name': self.name, 'kwargs': self.kwargs, 'transforms': self.transforms,
                'input_size': list(self.input_size) if self.input_size else None}

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> 'ModelRecipe':
        size = values.get('input_size')
        return cls(values['name'], dict(values.get('kwargs') or {}), list(values.get('transforms') or []),
                   tuple(size) if size else None)

    @classmethod
    def from_state(cls, state: Dict[str, Any]) -> 'ModelRecipe':
        """From a checkpoint's state.json (runs written before recipes existed had no transforms)."""
        if 'recipe' in state:
            return cls.from_dict(state['recipe'])
        return cls(state['model'], dict(state.get('model_kwargs') or {}))


def check_registered(name: str) -> None:
    """A ValueError naming --model and the closest registered names unless `name` is a timm model (ours included)."""
    import timm          # our models are registered: this module's package (models/__init__.py) ran first
    if not isinstance(name, str) or not timm.is_model(name):
        import difflib   # the nearest names by spelling (a glob on the first word listed convit_* for vit_tny_*)
        close = difflib.get_close_matches(str(name), timm.list_models(), n=5, cutoff=0.6)
        raise ValueError(f"--model {name!r} is not a registered model"
                         + (f"; similar: {', '.join(close)}" if close else '')
                         + "; `structformer models` lists them")


def default_input_size(name: str, kwargs: Dict[str, Any]) -> Optional[Tuple[int, int, int]]:
    """(C, H, W) the model is built for: kwargs first, then its pretrained config."""
    import timm
    cfg = timm.get_pretrained_cfg(name)
    c, h, w = cfg.input_size if cfg and cfg.input_size else (3, None, None)
    c = kwargs.get('in_chans', c)
    size = kwargs.get('img_size')
    if size is not None:
        h, w = (size, size) if isinstance(size, int) else tuple(size)
    return (int(c), int(h), int(w)) if h is not None else None


def _data_kwargs(name: str, model_kwargs: Dict[str, Any], data) -> Dict[str, Any]:
    """Classes, channels and image size from the data unless `model_kwargs` set them; img_size only
    where it differs from the model's default (so convolutional nets keep their own)."""
    import timm
    kwargs: Dict[str, Any] = {}
    if data is not None:
        kwargs = {'num_classes': data.num_classes, 'in_chans': data.in_chans}
        cfg = timm.get_pretrained_cfg(name)
        default_size = cfg.input_size if cfg else None
        if default_size is None or default_size[-1] != data.img_size:
            kwargs['img_size'] = data.img_size
    kwargs.update(model_kwargs)
    return kwargs


def _construct(name: str, kwargs: Dict[str, Any], user_kwargs: Dict[str, Any], check_fit: bool = True,
               flag: Optional[str] = '--model-kwargs') -> Tuple[nn.Module, Dict[str, Any]]:
    import timm

    from ..layers.attention.registry import resolve_layer_kwargs
    from ..arguments import check_conventional_kwargs
    from .attention_swap import check_attention_fits, check_patch_dropout
    # timm's names have one meaning in every model: a bad value is named here, before a layer is built
    check_conventional_kwargs(user_kwargs, f'{flag} ' if flag else '')
    layer_kwargs = resolve_layer_kwargs(kwargs)
    if user_kwargs and check_fit:          # a recorded recipe (rebuild) was built once already: no second build
        _check_weights_fit(name, layer_kwargs, user_kwargs, flag)
    try:
        model = timm.create_model(name, **layer_kwargs)
        return check_attention_fits(check_patch_dropout(model)), kwargs
    except TypeError as e:
        if 'img_size' in kwargs and 'img_size' not in user_kwargs and 'img_size' in str(e):
            kwargs = {k: v for k, v in kwargs.items() if k != 'img_size'}   # convolutional nets take any size
            return _construct(name, kwargs, user_kwargs, check_fit, flag)
        strings = [f"{k}={v!r}" for k, v in user_kwargs.items() if isinstance(v, str)]
        # e.g. eta=abc: a comparison deep in the constructor failed ("'<' not supported ... 'str'"); img_size=abc:
        # "not all arguments converted during string formatting" (h % ph), "can only concatenate str" (SOFT)
        if strings and re.search(r"\bstr(ing)?\b", str(e)):
            raise ValueError(f"--model-kwargs {', '.join(strings)}: {name} expects another type there ({e}); "
                             "write numbers, true/false and lists as such (eta=0.1, qkv_bias=true)") from None
        raise ValueError(f"--model-kwargs do not fit {name}: {e}") from None
    except (AssertionError, ValueError) as e:      # timm's asserts often carry no message: their kind, then
        raise ValueError(f"cannot build {name} with {kwargs}: {str(e) or type(e).__name__}") from None
    except Exception as e:          # noqa: BLE001 - the kwargs' failure, named (a ZeroDivisionError in a layer)
        if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and 'alloc' in str(e)):
            raise ValueError(f"cannot build {name} with {kwargs}: its weights do not fit in memory "
                             f"({_first_line(e)})" + (f"; check {flag} sizes (img_size, embed_dim, depth)" if flag
                                                      else '')) from None
        _refuse_unless_defaults(name, kwargs, e)


# blocks beyond which the weights are counted on smaller copies and extrapolated: a meta-device build loops over
# every block in Python, as long as a real one for depth=10**12
_COUNTED_BLOCKS = 64


def _meta_parameters(name: str, kwargs: Dict[str, Any]) -> Optional[int]:
    """Parameters and buffers of `name` built on the meta device (no memory, no initialisation), or None where
    it cannot be built there."""
    import timm
    import torch
    from torch.nn.parameter import UninitializedParameter
    try:
        with torch.device('meta'):
            model = timm.create_model(name, **kwargs)
    except Exception:               # noqa: BLE001 - the real build names the failure; this is only an estimate
        return None
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() for t in tensors if not isinstance(t, UninitializedParameter))


def _estimated_parameters(name: str, kwargs: Dict[str, Any]) -> Optional[int]:
    """The parameter count `kwargs` give `name`; with more than _COUNTED_BLOCKS blocks (timm's `depth`, or
    per-stage `depths`), counted with one and two blocks per stage and extrapolated linearly in each stage."""
    depth, depths = kwargs.get('depth'), kwargs.get('depths')
    if isinstance(depth, int) and depth > _COUNTED_BLOCKS:
        one, two = (_meta_parameters(name, {**kwargs, 'depth': d}) for d in (1, 2))
        return None if one is None or two is None else one + (depth - 1) * (two - one)
    if isinstance(depths, (list, tuple)) and all(isinstance(d, int) for d in depths) and sum(depths) > _COUNTED_BLOCKS:
        ones = [1] * len(depths)
        total = base = _meta_parameters(name, {**kwargs, 'depths': tuple(ones)})
        if base is None:
            return None
        for stage, blocks in enumerate(depths):
            grown = _meta_parameters(name, {**kwargs, 'depths': tuple(ones[:stage] + [2] + ones[stage + 1:])})
            if grown is None:
                return None
            total += (blocks - 1) * (grown - base)
        return total
    return _meta_parameters(name, kwargs)


def _check_weights_fit(name: str, kwargs: Dict[str, Any], user_kwargs: Dict[str, Any], flag: Optional[str]) -> None:
    """Refuse sizes whose float32 weights alone exceed this machine's memory (a lower bound on any run's need)
    before building: `depth=10**12` looped over its blocks until the memory ran out, and a width typo filled the
    memory layer by layer until the kernel's OOM killer ended the process without a word."""
    from ..machine import check_fits_memory
    params = _estimated_parameters(name, kwargs)
    if params is not None:
        given = ' '.join(f"{k}={v!r}" for k, v in user_kwargs.items())
        what = f"{flag} {given}: {name}" if flag else f"{name} with {given}"
        check_fits_memory(4 * params, f"{what} in float32 (~{params:.3g} parameters)",
                          'check the sizes (depth, widths, img_size)' if flag else '')


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [''])[0][:160]


def _refuse_unless_defaults(name: str, kwargs: Dict[str, Any], error: Exception) -> None:
    """A failure to build with the data's or the user's kwargs is theirs: one ValueError naming them and the
    layer's own words (`patch_size=0`: "integer modulo by zero" in timm's PatchEmbed). Built with no kwargs at all,
    the model itself is broken: the error is raised as it came."""
    if not kwargs:
        raise error
    raise ValueError(f"cannot build {name} with {kwargs}: {type(error).__name__}"
                     + (f": {_first_line(error)}" if _first_line(error) else '')) from None


def build_model(name: str, model_kwargs: Optional[Dict[str, Any]] = None, data=None,
                transforms: Sequence[Any] = (), kwargs_flag: Optional[str] = '--model-kwargs'
                ) -> Tuple[nn.Module, ModelRecipe]:
    """Build `name` for `data` (any object with num_classes, in_chans, img_size; None: the model's
    defaults), then apply `transforms` in order. Returns the model and the recipe that rebuilds it.
    `kwargs_flag` is what a refusal of `model_kwargs` names: the flag they came from, or None for a command that
    chose them itself (the message then names the model and its kwargs)."""
    check_registered(name)
    model_kwargs = dict(model_kwargs or {})
    # timm.create_model drops every None (it means "the model's default"), so KEY=None would build the default
    # silently (swmlp_cifar with mlp_ratio=None kept its γ = 2); a run's recorded kwargs (rebuild) keep timm's way
    unset = sorted(k for k, v in model_kwargs.items() if v is None)
    if unset:
        given = ' '.join(k + '=None' for k in unset)
        raise ValueError(f"{kwargs_flag or name} {given}: timm.create_model drops a None, so "
                         f"{name} would keep its own default there; give the value (a Mixer's or SW-MLP's single-layer "
                         "blocks: mlp_ratio=0), or leave the key out for the default")
    specs = normalize_transforms(transforms)
    model, kwargs = _construct(name, _data_kwargs(name, model_kwargs, data), model_kwargs, flag=kwargs_flag)
    input_size = (data.in_chans, data.img_size, data.img_size) if data is not None else default_input_size(name, kwargs)
    context = TransformContext(input_size=input_size)
    model = apply_transforms(model, specs, context)
    if has_lazy_parameters(model):                     # last, so transforms may add lazy layers too
        lazy = {'name': 'materialize_lazy', 'kwargs': {}, 'module': get_transform('materialize_lazy').__module__}
        model = apply_transforms(model, [lazy], context)
        specs.append(lazy)
    return model, ModelRecipe(name, kwargs, specs, input_size)


def rebuild(recipe: ModelRecipe) -> nn.Module:
    """The model a recipe describes, with fresh weights: construction and transforms replayed as recorded."""
    check_registered(recipe.name)
    for spec in recipe.transforms:                     # fail before building, naming the missing transform
        get_transform(spec['name'], spec.get('module'))
    model, _ = _construct(recipe.name, dict(recipe.kwargs), dict(recipe.kwargs), check_fit=False)
    return apply_transforms(model, recipe.transforms, TransformContext(input_size=recipe.input_size))
