"""The `--data` argument: its accepted forms, its parsing, and the checks shared by every dataset."""
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

# The forms `--data` accepts, with one line of help each (the CLI prints this table).
DATASET_FORMS: Dict[str, str] = {
    'digits': "scikit-learn's 1,797 8x8 grey digits (real data, bundled; 10 classes), stratified split",
    'synthetic-subspaces': 'tokens drawn from K random subspaces (CRATE §2.2); options num_classes, subspace_dim, '
                           'token_dim, num_tokens, num_samples, noise, purity',
    'mnist:PATH': 'a folder of MNIST IDX files (t10k-* and/or train-*, gzip or raw), 28x28 grey, 10 classes',
    'cifar10:PATH': 'the CIFAR-10 python folder (data_batch_1..5, test_batch), 32x32 RGB, 10 classes',
    'imagefolder:PATH': 'a torchvision ImageFolder tree (class sub-folders; train/ and val/, valid/, validation/ or test/ used if present)',
    'wds:TRAIN[,VAL]': 'webdataset tar shards (KEY.jpg + KEY.cls), brace patterns, e.g. '
                       'DIR/train-{000000..000146}.tar,DIR/validation-000000.tar, or DIR with _info.json; '
                       'streamed (docs/data.md)',
    'hfds:PATH': "a Hugging Face dataset written by datasets' save_to_disk (image + ClassLabel columns; extra 'hf')",
    'imagenet:PATH': 'ILSVRC-2012 as downloaded: ILSVRC2012_img_train.tar (tar of class tars) or train/, the flat '
                     "val/ (or ILSVRC2012_img_val.tar) labelled by the devkit or Kaggle's LOC_val_solution.csv",
    'pysource': "byte-level language modelling on the Python standard library's own .py files (offline); "
                'options seq_len, max_bytes',
    'text:PATH': 'byte-level language modelling on a text file or a folder of .txt/.md/.rst/.py files (others: '
                 "option files=GLOB); options seq_len, max_bytes, files",
}
# Said wherever an MNIST folder is missing: the data belongs to the user, nothing downloads at run time.
MNIST_HOWTO = ('MNIST in IDX format is four files, train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, '
               't10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz (yann.lecun.com/exdb/mnist or a mirror); or run '
               'python -c "import torchvision; torchvision.datasets.MNIST(\'DIR\', download=True)" once and pass DIR')
_NEEDS_PATH = {'mnist', 'cifar10', 'imagefolder', 'text', 'wds', 'hfds', 'imagenet'}
_NO_PATH = {'digits', 'synthetic-subspaces', 'pysource'}


def accepted_forms() -> str:
    return ', '.join(DATASET_FORMS)


@dataclass
class DatasetInfo:
    """What a model and a report need to know about a dataset (sizes, shapes, provenance)."""
    name: str
    num_classes: int
    in_chans: int
    img_size: int
    train_size: int
    val_size: int
    description: str
    extra: Dict[str, Any] = field(default_factory=dict)

    def summary(self) -> Dict[str, Any]:
        """A JSON-safe dict for run configs and reports: tensors in `extra` become 'tensor[shape]'."""
        out = {k: getattr(self, k) for k in ('name', 'num_classes', 'in_chans', 'img_size', 'train_size',
                                              'val_size', 'description')}
        out['extra'] = {k: f'tensor{list(v.shape)}' if hasattr(v, 'shape') else v for k, v in self.extra.items()}
        return out


def parse_data_spec(spec: str) -> Tuple[str, Optional[str]]:
    """'digits' -> ('digits', None); 'mnist:/data/mnist' -> ('mnist', '/data/mnist').

    The name is case-insensitive; only the first ':' splits, so the path may itself hold colons.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f'--data: expected one of {accepted_forms()}; got {spec!r}')
    name, sep, path = spec.strip().partition(':')
    name = name.strip().lower()
    if name in _NO_PATH:
        if sep:
            raise ValueError(f'--data {spec!r}: {name!r} takes no path; accepted forms: {accepted_forms()}')
        return name, None
    if name in _NEEDS_PATH:
        if not path.strip():
            hint = f'. {MNIST_HOWTO}' if name == 'mnist' else ''
            raise ValueError(f'--data {spec!r}: {name!r} needs a folder, as {name}:PATH; '
                             f'accepted forms: {accepted_forms()}{hint}')
        return name, os.path.expanduser(path.strip())
    raise ValueError(f'--data {spec!r}: unknown dataset {name!r}; accepted forms: {accepted_forms()}')


def check_folder(path: str, spec: str) -> str:
    """The folder must exist: say which path and that it came from --data."""
    if not os.path.exists(path):
        raise FileNotFoundError(f'--data {spec!r}: path {path!r} does not exist')
    if not os.path.isdir(path):
        raise NotADirectoryError(f'--data {spec!r}: path {path!r} is not a folder')
    return path


# build_datasets' own keywords, each set by a flag of its own: as a --data-kwargs key it collided with the flag's
# value ("build_datasets() got multiple values for keyword argument 'val_fraction'", a traceback)
SET_BY_FLAGS = {'seed': '--seed', 'val_fraction': '--val-fraction', 'model': '--model',
                'model_kwargs': '--model-kwargs', 'augmentation': 'the augmentation flags (--aa, --reprob, --scale, ...)',
                'train_transform': "build_datasets' own argument (Python)",
                'eval_transform': "build_datasets' own argument (Python)"}


def check_data_kwargs(options: Dict[str, Any]) -> None:
    """A ValueError for a --data-kwargs key that is not a dataset option but build_datasets' own keyword."""
    for key in options or {}:
        if key in SET_BY_FLAGS:
            raise ValueError(f"--data-kwargs {key}: not a dataset option but the setting of {SET_BY_FLAGS[key]}")


def check_val_fraction(val_fraction) -> float:
    try:
        v = float(val_fraction)
    except (TypeError, ValueError):
        v = float('nan')
    if not 0.0 < v < 1.0:     # NaN fails this too
        raise ValueError(f'val_fraction must be a number in the open interval (0, 1); got {val_fraction!r}')
    return v


# ----- options (they may arrive as strings from `--data-kwargs key=value`) -----

_TRUE = {'1', 'true', 'yes', 'on', 'y', 't'}
_FALSE = {'0', 'false', 'no', 'off', 'n', 'f'}


def _coerce(value, kind: type, key: str, accepted: str):
    bad = ValueError(f'--data-kwargs {key}: expected {accepted}; got {value!r}')
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise bad
    if kind is str:
        if isinstance(value, str):
            return value.strip()
        raise bad
    if isinstance(value, bool):           # True is an int in Python; never take it as a count
        raise bad
    try:
        number = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise bad from None
    if kind is int:
        if not number.is_integer():
            raise bad
        return int(number)
    if math.isnan(number):
        raise bad
    return number


@dataclass
class Option:
    """One dataset option: its type, default and the accepted range (checked after coercion)."""
    kind: type
    default: Any
    accepted: str                                     # words for error messages, e.g. 'an integer >= 1'
    check: Callable[[Any], bool] = lambda v: True


def resolve_options(dataset: str, schema: Dict[str, Option], options: Dict[str, Any]) -> Dict[str, Any]:
    """Coerce and range-check `options` against `schema`; unknown keys are an error naming the accepted ones."""
    unknown = sorted(set(options) - set(schema))
    if unknown:
        names = ', '.join(sorted(schema)) or '(none)'
        raise ValueError(f'--data-kwargs: unknown option(s) {", ".join(unknown)} for --data {dataset}; '
                         f'accepted options: {names}')
    out = {}
    for key, opt in schema.items():
        value = _coerce(options[key], opt.kind, key, opt.accepted) if key in options else opt.default
        if not opt.check(value):
            raise ValueError(f'--data-kwargs {key}: expected {opt.accepted}; got {options.get(key, value)!r}')
        out[key] = value
    return out


def is_square(n: int) -> bool:
    return n >= 1 and math.isqrt(n) ** 2 == n
