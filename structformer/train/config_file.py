"""The configuration's plain-value side, free of `TrainConfig` itself: each key's flag name, the coercion of a
YAML or command-line value to a field's type, and a YAML file read as a mapping. `train/config.py` checks a
mapping against its fields with these (`check_values`, `load_config_file`)."""
import math
import typing
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import yaml

from ..errors import UsageError

# configuration keys whose command-line flag is not --key-with-dashes; 'phases' exists only in config files
_FLAGS = {'label_smoothing': '--smoothing', 'num_workers': '--workers', 'transforms': '--transform',
          'batch_size': '-b/--batch-size', 'phases': None, 'recipe': '--recipe',
          'factorize_rank': '--rank', 'factorize_init': '--init', 'data_as_given': None}


def config_defaults(config_class) -> Dict[str, Any]:
    """Every field of a config dataclass (TrainConfig) that has a default, with that default (a fresh one from its
    default factory)."""
    import dataclasses
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(config_class)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def flag_name(key: str) -> Optional[str]:
    """The train flag that sets configuration key `key` (None where only a config file can)."""
    return _FLAGS.get(key, '--' + key.replace('_', '-'))


def _describe(key: str) -> str:
    flag = flag_name(key)
    return f"{key} ({flag})" if flag else key


_KIND_WORDS = {int: 'an integer', float: 'a number', str: 'a string', bool: 'true or false',
               dict: 'a mapping of key: value', list: 'a list'}


def _coerce(value, kind: type):
    """`value` as `kind`, or raise TypeError where the conversion would be a guess."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if isinstance(value, bool):                    # True is an int in Python; never take it as a number
        raise TypeError
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            value = value.strip()
            try:
                return int(value)
            except ValueError:
                value = float(value)               # '1e3': ValueError (-> refused) unless a number
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise TypeError
    if kind is float:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):                 # YAML 1.1 reads `lr: 1e-3` as the string '1e-3'
            number = float(value.strip())
            if math.isnan(number):
                raise TypeError
            return number
        raise TypeError
    if kind is str:
        if isinstance(value, str):
            return value
        raise TypeError
    if kind in (dict, list):
        if isinstance(value, kind):
            return value
        raise TypeError
    return value


def _field_kind(annotation) -> Tuple[type, bool]:
    """(the base type, whether None is allowed) of a dataclass field's annotation."""
    optional = False
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional, annotation = True, args[0]
    origin = typing.get_origin(annotation) or annotation
    return origin, optional


def read_yaml_mapping(path, where: str) -> Dict[str, Any]:
    """The mapping in YAML file `path` (keys and types not yet checked); every problem -- a missing, unreadable
    or non-file path, bad YAML, not a mapping -- is a UsageError starting with `where`."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{where}: no such file")
    if path.is_dir():
        raise UsageError(f"{where}: is a folder; expected a YAML file such as a run's config.yaml")
    if not path.is_file():
        raise UsageError(f"{where}: not a regular file")
    try:
        text = path.read_text(encoding='utf-8')
    except PermissionError:
        raise UsageError(f"{where}: cannot be read (permission denied)") from None
    except UnicodeDecodeError:
        raise UsageError(f"{where}: not a text file (expected YAML)") from None
    except OSError as e:
        raise UsageError(f"{where}: cannot be read ({e.strerror or e})") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, 'problem_mark', None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ''
        problem = getattr(e, 'problem', None) or str(e).splitlines()[0]
        raise UsageError(f"{where}: not valid YAML{at}: {problem}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UsageError(f"{where}: expected a mapping of key: value (e.g. 'epochs: 10'); "
                         f"got a YAML {type(values).__name__}")
    return values
