"""A run's data path, stored so the run opens from any folder.

`--data imagefolder:imgs32` means `imgs32` under the folder the command ran in; config.yaml and every
checkpoint store the absolute path (`data`) and, for the record, the spec as it was typed (`data_as_given`),
so `eval`, `--resume` and `-c config.yaml` from another folder read the same files. Where the stored path
is gone, the error names it and the flag that points elsewhere.
"""
import os
from pathlib import Path
from typing import Optional, Tuple

from ..errors import UsageError


def data_path(spec: str) -> Optional[str]:
    """The path of a `--data` spec (None for the forms without one: digits, synthetic-subspaces, pysource)."""
    from ..data.spec import parse_data_spec
    try:
        name, path = parse_data_spec(spec)
    except ValueError:              # not a valid spec: the dataset builder says so, naming --data
        return None
    return None if name == 'wds' else path    # shard patterns, not a path: the shard reader names a missing shard


def absolute_data(spec: str) -> Tuple[str, Optional[str]]:
    """(the spec with its path made absolute, the spec as given where that differed, else None)."""
    if spec.strip().lower().startswith('wds:'):
        from ..data.shards import absolute_patterns
        absolute = 'wds:' + absolute_patterns(spec.strip()[4:])
        return absolute, (spec if absolute != spec else None)
    path = data_path(spec)
    if path is None or os.path.isabs(path):
        return spec, None
    name = spec.strip().partition(':')[0]
    return f"{name}:{os.path.abspath(path)}", spec


def check_stored_data(spec: str, as_given: Optional[str], whose: str, override: str) -> None:
    """Refuse, naming the path and the flag `override` that replaces it, a stored data path that is gone."""
    path = data_path(spec)
    if path is None or os.path.exists(path):
        return
    typed = f" (given as {as_given})" if as_given and as_given != spec else ''
    hint = ('' if os.path.isabs(path) else
            f"; it is relative, so it was read from the folder the run was started in, not {os.getcwd()}")
    raise UsageError(f"--data {spec}: {whose} data path {path}{typed} does not exist{hint}; "
                     f"pass {override} to read the data from where it is now")


# the --data forms whose every sub-folder is data: a folder a run writes there is read as a class the next time
_FOLDERS_ARE_CLASSES = ('imagefolder', 'imagenet')


def check_output_outside_data(output, spec: str) -> None:
    """Refuse an --output that is empty (the current folder, by accident) or is an image folder's own folder or
    inside it: a run writes checkpoints/, config.yaml ... there, and `checkpoints/` reads as one more class folder the
    next time the data is built (or breaks the class list of train/ against val/)."""
    if not str(output).strip():
        raise UsageError("--output '': empty; give the run's folder (default: outputs/MODEL_DATA)")
    from ..data.spec import parse_data_spec
    path = data_path(spec)
    if path is None or not os.path.isdir(path) or parse_data_spec(spec)[0] not in _FOLDERS_ARE_CLASSES:
        return
    if Path(os.path.realpath(os.path.abspath(output))).is_relative_to(os.path.realpath(path)):
        raise UsageError(f"--output {output}: inside the data folder of --data {spec}; a run's checkpoints there "
                         "would be read as data (a class folder) the next time; give a folder outside it")
