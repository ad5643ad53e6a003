"""Reproductions of the papers' tables at a scale that runs on the embedded data.

Each module offers `add_arguments(parser)` and `run(args) -> int` for `structformer reproduce NAME`.
"""
from pathlib import Path
from typing import Dict, List, Tuple


def command_line(args, target: str) -> str:
    """The `structformer reproduce TARGET ...` command that repeats this run, every flag spelled out from the parsed
    `args` (defaults included, so a later change of a default does not change what the record says was run): the
    `command` of each results.json. Flags are the dests with '-' for '_', as every reproduce parser names them."""
    import shlex
    words = ['structformer', 'reproduce', target]
    for dest, value in vars(args).items():
        if dest in ('command', 'target', 'func') or value is None or value is False:
            continue
        flag = '--' + dest.replace('_', '-')
        if value is True:
            words.append(flag)
        elif isinstance(value, dict):
            words += [flag, *(f'{k}={v!r}' for k, v in value.items())] if value else []
        elif isinstance(value, (list, tuple)):
            words += [flag, *(str(v) for v in value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def check_distinct(values, flag: str) -> None:
    """Refuse a list flag that names one value twice: the runs of a repeated value share a folder (the second
    overwrites the first) and its rows count twice, as if they were two seeds that agree exactly."""
    from ..errors import UsageError
    seen, repeated = set(), []
    for value in values or ():
        if value in seen and value not in repeated:
            repeated.append(value)
        seen.add(value)
    if repeated:
        raise UsageError(f"{flag} names {', '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in repeated)} "
                         "more than once: give each value once")


def mnist_spec(data: str) -> str:
    """The `--data` spec of a reproduction's MNIST folder ('mnist:PATH'), refused by name when the folder is missing
    or not given (the data belongs to the user: no default path)."""
    from ..errors import UsageError
    if not data:
        from ..data.spec import MNIST_HOWTO
        raise UsageError(f'--data PATH is required: a folder of MNIST IDX files. {MNIST_HOWTO}')
    folder = Path(data)
    if not folder.is_dir():
        raise FileNotFoundError(f"--data {data}: no such folder (resolved to {folder.resolve()}); "
                                "point it at a folder holding the MNIST IDX files, e.g. t10k-images-idx3-ubyte.gz")
    return f'mnist:{folder}'


def trained_on(saved_config: dict, spec: str) -> bool:
    """Whether a run's saved configuration trained on the data `spec` names (paths compared absolute, as the
    engine stores them): a finished run is reused only for the same data, never for another --data folder."""
    from ..train.data_paths import absolute_data
    return saved_config.get('data') == absolute_data(spec)[0]


def finished_run(run_dir: Path, settings: Dict, spec: str) -> bool:
    """Whether `run_dir` holds a finished run of `settings` (the keyword arguments of the TrainConfig a reproduction
    plans for it; its data and output aside) on the data `spec`, trained by this code: its summary.json at the planned
    epochs, its config.yaml equal in every planned setting (compared as JSON: a tuple saved as a list is the same),
    and every checkpoint it keeps stamped with this code's `records.source_digest` (state.json's environment, written
    by the process that trained it). A study run again into its --output takes up where it stopped; a run of another
    setting, of other code or without its summary (interrupted) trains anew."""
    import json

    import yaml

    from ..records import source_digest
    from ..train.checkpoint_paths import committed_checkpoints
    try:
        saved = yaml.safe_load((run_dir / 'config.yaml').read_text())
        summary = json.loads((run_dir / 'summary.json').read_text())
    except (OSError, ValueError, yaml.YAMLError):      # not there, or torn: nothing to reuse
        return False
    if not isinstance(saved, dict) or not isinstance(summary, dict) or not trained_on(saved, spec):
        return False
    if summary.get('epochs') != settings.get('epochs'):
        return False

    def plain(value):
        return json.loads(json.dumps(value, default=str))
    if any(plain(saved.get(key)) != plain(value) for key, value in settings.items() if key not in ('data', 'output')):
        return False
    stamps = []
    for checkpoint in committed_checkpoints(run_dir / 'checkpoints'):
        try:
            stamps.append(((json.loads((checkpoint / 'state.json').read_text()) or {}).get('environment')
                           or {}).get('source'))
        except (OSError, ValueError, AttributeError):
            return False
    return bool(stamps) and all(stamp == source_digest() for stamp in stamps)


def start(args) -> Tuple[str, Path]:
    """A reproduction's first steps once its arguments are checked: our models registered with timm, torch's
    thread count from --threads (0: torch's own), and its data (`mnist_spec`) and output folder."""
    import torch

    import structformer  # noqa: F401  (registers the models)
    if args.threads:
        torch.set_num_threads(args.threads)
    return mnist_spec(args.data), Path(args.output)


def learned(top1: float, labels: List[int]) -> Dict:
    """Whether the trained network learnt anything: its held-out top-1 above the share of the most frequent class
    among the held-out `labels` (what a constant prediction scores) by more than two binomial standard errors."""
    import math
    from collections import Counter
    n = len(labels)
    majority = 100 * max(Counter(labels).values()) / n
    two_se = 200 * math.sqrt(majority / 100 * (1 - majority / 100) / n)
    return {'top1': top1, 'majority_class': majority, 'two_standard_errors': two_se, 'held_out': n,
            'learned': top1 - majority > two_se}
