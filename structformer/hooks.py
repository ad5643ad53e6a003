"""Capture the inputs and outputs of named sub-modules, by pattern, for as long as a `with` block lasts.

    with capture(model, outputs=['blocks.*.mlp'], inputs=['blocks.*.norm2']) as seen:
        model(images)
    seen.outputs['blocks.0.mlp']          # [tensor of the first call, tensor of the second, ...]

Patterns are module names (as in `model.named_modules()`) split at dots, matched segment by segment
with shell wildcards: `*` matches one segment (`blocks.*` is every block, not their children), `**`
any number of segments (`**.attn` is every module called attn, at any depth). A pattern matching
nothing is an error, so a renamed module never makes a measurement silently empty.

The white-box analysis reads CRATE's Z^ℓ, Z^{ℓ+½}, Z^{ℓ+1} through this; attention distillation and
effective-rank logging use it the same way. Hooks only read; they are removed on exit, even after an
exception. With `callback=fn(kind, name, tensor)` nothing is stored, so a long evaluation can reduce
each tensor to a few numbers as it goes.
"""
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn

__all__ = ['capture', 'Captured', 'match_modules']

Patterns = Union[str, Sequence[str], None]


def _segments_match(pattern: List[str], name: List[str]) -> bool:
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == '**':
        return any(_segments_match(rest, name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatchcase(name[0], head) and _segments_match(rest, name[1:])


def match_modules(model: nn.Module, patterns: Patterns) -> Dict[str, nn.Module]:
    """{name: module} for every sub-module matching one of `patterns`, in `named_modules` order.
    Raises ValueError naming a pattern that matches nothing."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns or ())
    modules = dict(model.named_modules())
    found: Dict[str, nn.Module] = {}
    for pattern in patterns:
        hits = [n for n in modules if n and _segments_match(pattern.split('.'), n.split('.'))]
        if not hits:
            sample = ', '.join(n for n in list(modules)[1:9])
            raise ValueError(f"hook pattern {pattern!r} matches no sub-module of {type(model).__name__} "
                             f"(names look like: {sample}, ...)")
        found.update((n, modules[n]) for n in hits)
    return {n: m for n, m in modules.items() if n in found}


@dataclass
class Captured:
    """Tensors seen per module name, one entry per call: `inputs` (first positional argument) and `outputs`."""
    inputs: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    outputs: Dict[str, List[torch.Tensor]] = field(default_factory=dict)


def _first_tensor(value):
    if torch.is_tensor(value):
        return value
    if isinstance(value, (tuple, list)) and value and torch.is_tensor(value[0]):
        return value[0]
    return None


@contextmanager
def capture(model: nn.Module, outputs: Patterns = None, inputs: Patterns = None, *,
            callback: Optional[Callable[[str, str, torch.Tensor], None]] = None,
            detach: bool = True) -> Iterator[Captured]:
    """Record the outputs of modules matching `outputs` and the first positional input of those
    matching `inputs` (see the module docstring for patterns). `callback(kind, name, tensor)`, kind
    'input' or 'output', replaces storing. `detach=False` keeps the autograd graph (distillation
    losses need it)."""
    seen = Captured()
    out_modules, in_modules = match_modules(model, outputs), match_modules(model, inputs)

    def record(kind: str, name: str, value) -> None:
        tensor = _first_tensor(value)
        if tensor is None:
            return
        if detach:
            tensor = tensor.detach()
        if callback is not None:
            callback(kind, name, tensor)
        else:
            (seen.inputs if kind == 'input' else seen.outputs).setdefault(name, []).append(tensor)

    handles = []
    try:
        for name, module in in_modules.items():
            handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: record('input', name, args)))
        for name, module in out_modules.items():
            handles.append(module.register_forward_hook(
                lambda m, args, out, name=name: record('output', name, out)))
        yield seen
    finally:
        for handle in handles:
            handle.remove()
