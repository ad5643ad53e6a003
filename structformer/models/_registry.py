"""Registration of structformer models with timm's registry.

`register_model` wraps `timm.models.register_model` and also records the name, so
tests and `structformer models` can list exactly the models this package adds. Language models
(token ids in, next-token logits out) register with `register_language_model` and are listed apart:
the image-classifier contract (images in, one label out) does not apply to them.
"""
from typing import Callable, List

from timm.models import register_model as _timm_register_model

_STRUCTFORMER_MODELS: List[str] = []
_LANGUAGE_MODELS: List[str] = []


def _register(fn: Callable, names: List[str]) -> Callable:
    fn = _timm_register_model(fn)
    if fn.__name__ not in names:
        names.append(fn.__name__)
    return fn


def register_model(fn: Callable) -> Callable:
    """Register `fn` with timm (so `timm.create_model(fn.__name__)` works) and remember it."""
    return _register(fn, _STRUCTFORMER_MODELS)


def list_structformer_models() -> List[str]:
    """Names of every model registered by structformer, in registration order."""
    return list(_STRUCTFORMER_MODELS)


def register_language_model(fn: Callable) -> Callable:
    """As `register_model`, for a causal language model."""
    return _register(fn, _LANGUAGE_MODELS)


def list_structformer_language_models() -> List[str]:
    """Names of the language models registered by structformer, in registration order."""
    return list(_LANGUAGE_MODELS)
