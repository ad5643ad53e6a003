"""Constructor arguments checked where they enter a layer or a model: a bad value is a ValueError naming the
argument and the range it takes, raised before any tensor is built.

Without these, a bad size or rate surfaced far from its cause: `patch_size=0` as a ZeroDivisionError in timm's
PatchEmbed, `embed_dim=-1` as "Trying to create tensor with negative dimension" in a convolution,
`mlp_ratio=inf` as an OverflowError, `depth=-1` as a model with no blocks (silently), and `drop_path_rate=1.5` only
in the first training step, as "bernoulli_ expects p to be in [0, 1]" from timm's DropPath.

`check_conventional_kwargs` applies the same checks by timm's argument names (`drop_rate`, `drop_path_rate`,
`mlp_ratio`, `depth`, `embed_dim`, `num_heads`, `patch_size`, `img_size`, ...), which every timm model uses with
one meaning, so `--model-kwargs` is checked for any model, timm's own included; the model classes of this package
check their own arguments with the helpers below as well, for users who build them directly.
"""
import math
from numbers import Integral, Real
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

__all__ = ['positive_int', 'count', 'optional_positive_int', 'positive_ints', 'rate', 'positive_number',
           'nonnegative_number', 'image_size', 'check_conventional_kwargs']


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def positive_int(name: str, value: Any, meaning: str = '') -> int:
    """An integer >= 1 (a width, a head count, a patch side); `meaning` says what it counts, in the message."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer" + (f" ({meaning})" if meaning else ''))
    return int(value)


def count(name: str, value: Any) -> int:
    """An integer >= 0 (a number of blocks or of register tokens, where none is a model timm builds)."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0")
    return int(value)


def optional_positive_int(name: str, value: Any, meaning: str = '') -> Optional[int]:
    """None, or an integer >= 1 (a size that is otherwise inferred)."""
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be None or a positive integer" + (f" ({meaning})" if meaning else ''))
    return int(value)


def positive_ints(name: str, values: Any, length: Optional[int] = None, least: int = 1) -> Tuple[int, ...]:
    """A sequence of integers >= `least` (one per stage), of `length` entries when given."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}={values!r} must be a sequence of integers >= {least}"
                         + (f", one per stage ({length})" if length else ''))
    if (length is not None and len(values) != length) or not all(_is_int(v) and v >= least for v in values):
        raise ValueError(f"{name}={tuple(values)!r} must be {length or 'some'} integers >= {least}"
                         + (" (one per stage)" if length else ''))
    return tuple(int(v) for v in values)


def rate(name: str, value: Any) -> float:
    """A dropout or stochastic-depth rate: a number in [0, 1) (1 would drop everything)."""
    if not _is_number(value) or not 0 <= value < 1:
        raise ValueError(f"{name}={value!r} must be a number in [0, 1)")
    return float(value)


def positive_number(name: str, value: Any) -> float:
    """A finite number > 0 (an epsilon, a ratio that must widen)."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    return float(value)


def nonnegative_number(name: str, value: Any) -> float:
    """A finite number >= 0 (an MLP ratio where 0 means no hidden layer)."""
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be a finite number >= 0")
    return float(value)


def image_size(name: str, value: Any) -> Tuple[int, int]:
    """An image or patch side: a positive integer or an (H, W) pair of them."""
    if _is_int(value) and value >= 1:
        return int(value), int(value)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == 2 \
            and all(_is_int(v) and v >= 1 for v in value):
        return int(value[0]), int(value[1])
    raise ValueError(f"{name}={value!r} must be a positive integer or an (H, W) pair of them")


def _each(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    """`check` on a value, or on every entry of a sequence (timm's per-stage forms: Swin's num_heads=(3, 6, ...))."""
    def checked(name: str, value: Any) -> Any:
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            if not value:
                raise ValueError(f"{name}={value!r} must not be empty")
            return [check(f"{name}[{i}]", v) for i, v in enumerate(value)]
        return check(name, value)
    return checked


# timm's argument names and what each takes, for every model (ours, timm's, another package's); a key that is not
# here is left to the model
_CONVENTIONS: Dict[str, Callable[[str, Any], Any]] = {
    'depth': _each(count), 'embed_dim': _each(positive_int), 'num_heads': _each(positive_int),
    'in_chans': positive_int, 'num_classes': count, 'reg_tokens': count,
    'patch_size': image_size, 'img_size': image_size,
    'mlp_ratio': _each(nonnegative_number),
}


def _convention(key: str) -> Optional[Callable[[str, Any], Any]]:
    if key in _CONVENTIONS:
        return _CONVENTIONS[key]
    if key.endswith('_rate') and 'drop' in key:     # drop_rate, drop_path_rate, drop_block_rate, ...
        return rate
    if key == 'eps' or key.endswith('_eps'):        # norm_eps, layer_norm_eps
        return positive_number
    return None


def check_conventional_kwargs(kwargs: Dict[str, Any], prefix: str = '') -> None:
    """A ValueError for the first key of `kwargs` that has timm's conventional meaning and a value outside it
    (`prefix` starts the message, e.g. '--model-kwargs '). A None is left alone: timm.create_model drops it."""
    for key, value in kwargs.items():
        check = _convention(key)
        if check is not None and value is not None:
            check(prefix + key, value)
