"""Helpers for our lazy modules (`LazyModuleMixin`) that keep a built module free of lazy machinery.

`LazyModuleMixin` removes its pre-forward hook only from inside that hook, at the first forward. A
module whose parameters exist from construction therefore keeps a hook that calls `is_lazy` on every
forward, which `torch.compile` cannot trace (a graph break per layer). `drop_lazy_hooks` removes it
as soon as every parameter exists, and `is_uninitialized` is the check dynamo can trace.
"""
from torch import nn
from torch.nn.parameter import UninitializedParameter


def is_uninitialized(param) -> bool:
    """Whether `param` is a not-yet-shaped lazy parameter (an `isinstance`, which dynamo traces)."""
    return isinstance(param, UninitializedParameter)


def drop_lazy_hooks(module: nn.Module) -> None:
    """Remove LazyModuleMixin's initialise / load hooks of a module whose parameters all exist.
    The handles stay as attributes (removing twice is a no-op), so the mixin's own `_infer_parameters`
    can still run its clean-up if its hook was already scheduled."""
    for name in ('_initialize_hook', '_load_hook'):
        handle = getattr(module, name, None)
        if handle is not None:
            handle.remove()
