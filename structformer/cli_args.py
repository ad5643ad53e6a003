"""argparse pieces shared by the command modules and the library modules that build parsers (the reproductions,
`structformer convert`): KEY=VALUE lists, model transforms, counts, the Mixer's Ω. Import-light (the standard
library only) and importing no command module, so any module may use it without an import circle."""
import argparse
import ast
import math
import re
from typing import Optional


def parse_value(text: str):
    """A Python literal where the text is one (3, 0.1, True, None, [1, 2], {'a': 1}), else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


class ParseKwargs(argparse.Action):
    """KEY=VALUE ... into a dict, values as Python literals (timm's convention), with a one-line
    error naming the flag for an item without '='."""

    def __call__(self, parser, namespace, values, option_string=None):
        out = dict(getattr(namespace, self.dest, None) or {})
        for item in values:
            key, sep, value = item.partition('=')
            if not sep or not key.isidentifier():
                parser.error(f"{option_string} {item!r}: expected KEY=VALUE with KEY a Python name "
                             "(e.g. depth=6 or attn_kwargs=\"{'num_landmarks': 4}\")")
            out[key] = parse_value(value)
        setattr(namespace, self.dest, out)


class ParseTransform(argparse.Action):
    """`--transform NAME KEY=VALUE ...`, repeatable, into [{'name': NAME, 'kwargs': {...}}, ...] in order."""

    def __call__(self, parser, namespace, values, option_string=None):
        name, items = values[0], values[1:]
        if not name.isidentifier():
            parser.error(f"{option_string} {name!r}: expected a transform name, then KEY=VALUE arguments")
        kwargs = {}
        for item in items:
            key, sep, value = item.partition('=')
            if not sep or not key.isidentifier():
                parser.error(f"{option_string} {name} {item!r}: expected KEY=VALUE")
            kwargs[key] = parse_value(value)
        transforms = list(getattr(namespace, self.dest, None) or [])
        transforms.append({'name': name, 'kwargs': kwargs})
        setattr(namespace, self.dest, transforms)


class ParsePhaseSettings(argparse.Action):
    """`--phase-settings NAME KEY=VALUE ...`, repeatable, into {NAME: {KEY: VALUE}} (merged over the recipe's and
    the config file's settings of that phase by the train command)."""

    def __call__(self, parser, namespace, values, option_string=None):
        name, items = values[0], values[1:]
        if not name.isidentifier() or not items:
            parser.error(f"{option_string} {' '.join(values)!r}: expected a phase name, then KEY=VALUE settings "
                         "(e.g. predictor warmup_epochs=0 lr=3e-4)")
        settings = {}
        for item in items:
            key, sep, value = item.partition('=')
            if not sep or not key.isidentifier():
                parser.error(f"{option_string} {name} {item!r}: expected KEY=VALUE")
            settings[key] = parse_value(value)
        out = {k: dict(v) for k, v in (getattr(namespace, self.dest, None) or {}).items()}
        out[name] = {**out.get(name, {}), **settings}
        setattr(namespace, self.dest, out)


class StoreOnce(argparse.Action):
    """A flag that may be given once: a second one (e.g. two --recipe) is refused by name, not silently taken."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, self.dest, None)
        if given is not None and given is not argparse.SUPPRESS:
            parser.error(f"{option_string} given twice ({given!r}, then {values!r}): give it once")
        setattr(namespace, self.dest, values)


def bounded_int(flag: str, low: int, high: Optional[int] = None, accepted: Optional[str] = None):
    """argparse type: an int in [low, high] (no upper bound where `high` is None), else a one-line error naming the
    flag and what it accepts (`accepted`, by default the range)."""
    accepted = accepted or (f">= {low}" if high is None else f"in [{low}, {high}]")

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or number < low or (high is not None and number > high):
            raise argparse.ArgumentTypeError(f"{flag} must be an integer {accepted}, got {value!r}")
        return number
    return parse


def positive_int(flag: str, most: Optional[int] = None):
    """argparse type: an int >= 1 (and <= `most`, where given)."""
    return bounded_int(flag, 1, most)


MAX_THREADS = 4096            # beyond any CPU torch runs on; torch.set_num_threads overflows past 2**31 - 1
# --threads: 0 is torch's own count
thread_count = bounded_int('--threads', 0, MAX_THREADS, f"in [0, {MAX_THREADS}] (0: torch's own count)")
# a command's --seed: the range `train --seed` and numpy's generators take
seed_value = bounded_int('--seed', 0, 2 ** 32 - 1, 'in [0, 2**32)')

# --interpolate-steps (analyze, reproduce lowrank): points on the line between two models, each one evaluation of the
# held-out split; 1001 puts t at steps of 0.001, finer than any figure reads (10**9 listed every t and evaluated
# them one by one, for days)
MAX_INTERPOLATE_STEPS = 1001
interpolate_steps = bounded_int('--interpolate-steps', 2, MAX_INTERPOLATE_STEPS)


def rank_value(text: str):
    """argparse type for --rank: an integer count, or a fraction (validated with the configuration)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--rank must be an integer >= 1 or a fraction in (0, 1], got {text!r}")


OMEGA_MAX_LOG2 = 64          # far beyond any layer that fits in memory; keeps every width exact in float64


def parse_omega(text: str) -> int:
    """'32768', '2^15' or '2**15' -> 32768."""
    m = re.fullmatch(r'\s*(\d+)\s*(?:(?:\^|\*\*)\s*(\d+))?\s*', text)
    if not m:
        raise argparse.ArgumentTypeError(f"--omega expects an integer or a power like 2^15, got {text!r}")
    base, exponent = int(m.group(1)), int(m.group(2) or 1)
    # bounded before the power is computed: 9^99999999 would otherwise take minutes and gigabytes
    if base > 1 and exponent * math.log2(base) > OMEGA_MAX_LOG2:
        raise argparse.ArgumentTypeError(f"--omega must be at most 2^{OMEGA_MAX_LOG2} connections, got {text.strip()}")
    value = base ** exponent
    if value < 16:
        raise argparse.ArgumentTypeError(f"--omega must be >= 16 connections, got {value}")
    return value
