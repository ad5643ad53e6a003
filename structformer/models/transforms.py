"""Model transforms: named functions that rewrite a built model, recorded in every run.

A transform is `fn(model, context, **kwargs) -> model`, registered under a name with
`@register_transform(name)`. The factory (`structformer.models.factory`) applies a run's transforms in
order after construction and stores them, with their arguments, in each checkpoint's `state.json`, so
`load_model`, `eval`, `analyze` and `--resume` rebuild exactly the trained network. Transforms to come
(`sparsify`, `factorize`) replace modules of a built model while keeping its weights, which is why
they act on a model rather than on constructor arguments.

Arguments must be JSON values (they are written to `state.json`). Loading a run never imports
anything: a transform must already be registered in the loading process (importing structformer
registers the built-in ones; a user's own must be imported by the user), else `UnknownTransform`.
"""
import inspect
import json
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

__all__ = ['TRANSFORMS', 'TransformContext', 'UnknownTransform', 'register_transform', 'get_transform',
           'normalize_transforms', 'apply_transforms', 'materialize_lazy']

TRANSFORMS: Dict[str, Callable[..., nn.Module]] = {}


class UnknownTransform(ValueError):
    """A transform name that is not registered in this process."""


@dataclass(frozen=True)
class TransformContext:
    """What a transform may need to know beyond its own arguments.

    `input_size`: (channels, height, width) of the model's input, for transforms that run a forward.
    """
    input_size: Optional[Tuple[int, int, int]] = None


def register_transform(name: str):
    """Decorator: make `fn(model, context, **kwargs) -> model` available under `name`."""
    def wrap(fn):
        if name in TRANSFORMS and TRANSFORMS[name] is not fn:
            raise ValueError(f"model transform {name!r} is already registered to {TRANSFORMS[name].__module__}."
                             f"{TRANSFORMS[name].__name__}")
        TRANSFORMS[name] = fn
        return fn
    return wrap


def get_transform(name: str, module: Optional[str] = None) -> Callable[..., nn.Module]:
    try:
        return TRANSFORMS[name]
    except KeyError:
        where = f" (it was registered by module {module!r}: import it first)" if module else ''
        raise UnknownTransform(f"unknown model transform {name!r}{where}; registered: "
                               f"{', '.join(sorted(TRANSFORMS)) or 'none'}") from None


def _check_argument_names(name: str, fn, kwargs: Dict[str, Any]) -> None:
    """A misspelt argument (`rnk=0.3`) is named with the ones the transform takes, before any model is built."""
    if not isinstance(kwargs, dict):
        return
    params = list(inspect.signature(fn).parameters.values())[2:]          # after (model, context)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                     inspect.Parameter.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise ValueError(f"--transform {name}: unknown argument(s) {', '.join(map(repr, unknown))}; accepted: "
                         f"{', '.join(accepted) or '(none)'}")


def normalize_transforms(items: Sequence[Any]) -> List[Dict[str, Any]]:
    """Accept 'name', ('name', {kwargs}) or {'name': ..., 'kwargs': {...}}; return the dict form,
    checked: the name is registered and the arguments are JSON values."""
    out = []
    for item in items or ():
        if isinstance(item, str):
            name, kwargs = item, {}
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], dict):
            name, kwargs = item
        elif isinstance(item, dict) and set(item) <= {'name', 'kwargs', 'module'} and 'name' in item:
            name, kwargs = item['name'], item.get('kwargs') or {}
        else:
            raise ValueError(f"--transform: {item!r} is not a transform; accepted: 'NAME', (NAME, {{kwargs}}) "
                             "or {'name': NAME, 'kwargs': {...}}")
        fn = get_transform(name, item.get('module') if isinstance(item, dict) else None)
        try:
            kwargs = json.loads(json.dumps(kwargs))          # JSON round trip: what state.json will hold
        except (TypeError, ValueError) as e:
            raise ValueError(f"--transform {name}: arguments must be JSON values ({e})") from None
        _check_argument_names(name, fn, kwargs)
        out.append({'name': name, 'kwargs': kwargs, 'module': fn.__module__})
    return out


def apply_transforms(model: nn.Module, transforms: Sequence[Dict[str, Any]], context: TransformContext) -> nn.Module:
    """Apply normalised transforms in order; a transform that raises TypeError on its arguments
    becomes a ValueError naming the transform."""
    for spec in transforms:
        fn = get_transform(spec['name'], spec.get('module'))
        try:
            result = fn(model, context, **spec.get('kwargs', {}))
        except TypeError as e:
            raise ValueError(f"--transform {spec['name']}: {e}") from None
        if not isinstance(result, nn.Module):
            raise TypeError(f"model transform {spec['name']!r} returned {type(result).__name__}, not an nn.Module")
        model = result
    return model


def has_lazy_parameters(model: nn.Module) -> bool:
    return any(isinstance(p, UninitializedParameter) for p in model.parameters())


@register_transform('materialize_lazy')
def materialize_lazy(model: nn.Module, context: TransformContext) -> nn.Module:
    """Give lazily shaped parameters (e.g. SOFT's conv sampler inside a timm ViT, whose k×k weight needs
    the token grid) their shapes with one forward of zeros, so the optimizer, weight-decay groups, DDP
    and `load_state_dict` see every parameter. RNG state and train/eval mode are kept. The zeros are made on the
    device and in the dtype of the model's shaped weights, so a model moved to a GPU (or cast) before it is shaped
    takes them, and its lazy weights are created there too."""
    if not has_lazy_parameters(model):
        return model
    if context.input_size is None:
        raise ValueError("materialize_lazy needs the input size (channels, height, width) of the model")
    shaped = next((t for t in (*model.parameters(), *model.buffers())
                   if not isinstance(t, nn.parameter.UninitializedTensorMixin) and t.is_floating_point()), None)
    device, dtype = (shaped.device, shaped.dtype) if shaped is not None else (torch.device('cpu'), None)
    was_training = model.training
    # the RNGs the initialisers may draw from: the CPU's, and the GPU's of a model on one
    gpus = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == 'cuda' else []
    with torch.random.fork_rng(devices=gpus), torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='.*created at the first forward')   # handled here
        model.eval()
        try:
            model(torch.zeros(1, *context.input_size, device=device, dtype=dtype))
        except (RuntimeError, ValueError, AssertionError, NotImplementedError) as e:
            # the input is the data's or the recipe's size, which this model may not take (patch 16 on 8-px digits):
            # one line saying so, as a training run's first batch gets (train/scoring_data.check_model_input),
            # not torch's traceback from inside the forward
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            size = 'x'.join(str(s) for s in context.input_size)
            raise ValueError(f"the model cannot take a {size} input, at which its lazily shaped layers are shaped "
                             f"(one forward of zeros): {first}") from None
        finally:
            model.train(was_training)
    return model
