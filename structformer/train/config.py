"""The resolved configuration of a training run: one dataclass, saved as YAML beside the outputs
and accepted back with `-c`."""
import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from ..errors import UsageError

# configuration keys whose command-line flag is not --key-with-dashes; 'phases' exists only in config files
_FLAGS = {'label_smoothing': '--smoothing', 'num_workers': '--workers', 'transforms': '--transform',
          'batch_size': '-b/--batch-size', 'phases': None,
          'factorize_rank': '--rank', 'factorize_init': '--init'}


# the learning rate that the warm-up starts from and the cosine schedule ends at, unless given (at most lr)
DEFAULT_FLOOR_LR = 1e-6
FLOAT32_MAX = 3.4028234663852886e38
# data-loader worker processes: more than this only forks processes that wait on each other (and a typo such
# as 100000 would fork until the machine stops); the ceiling grows with the machine
MAX_WORKERS = max(32, 2 * (os.cpu_count() or 1))


def flag_name(key: str) -> Optional[str]:
    """The train flag that sets configuration key `key` (None where only a config file can)."""
    return _FLAGS.get(key, '--' + key.replace('_', '-'))


def _describe(key: str) -> str:
    flag = flag_name(key)
    return f"{key} ({flag})" if flag else key


@dataclass
class TrainConfig:
    model: str = 'crate_digits'
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    # model transforms applied after construction, in order: [{'name': ..., 'kwargs': {...}}]
    # (structformer.models.transforms); recorded in every checkpoint so the run rebuilds exactly
    transforms: List[Dict[str, Any]] = field(default_factory=list)
    data: str = 'digits'
    data_kwargs: Dict[str, Any] = field(default_factory=dict)
    val_fraction: float = 0.2
    epochs: int = 30
    batch_size: int = 64
    eval_batch_size: int = 256
    opt: str = 'adamw'
    lr: float = 1e-3
    weight_decay: float = 0.05
    # False (timm's default): norms, biases and the model's no_weight_decay() set (cls/pos) are not decayed;
    # True decays every parameter, as the official CRATE recipe does
    decay_everything: bool = False
    momentum: float = 0.9
    sched: str = 'cosine'
    # None: fitted to the run, min(2, epochs / 10), so a short run never fails on a default it did not set
    warmup_epochs: Optional[float] = None
    # None: 1e-6, or lr when that is lower (an explicit value above lr is refused)
    warmup_lr: Optional[float] = None
    min_lr: Optional[float] = None
    label_smoothing: float = 0.1
    clip_grad: Optional[float] = None
    seed: int = 0
    output: Optional[str] = None
    keep_last: int = 2
    save_every: int = 0
    phases: List[Dict[str, Any]] = field(default_factory=list)
    limit_train_batches: int = 0
    num_workers: int = 0
    # torch.compile backend for training and evaluation, None = eager (timm's train script: --torchcompile);
    # checkpoints hold the plain module's weights, loadable without compile
    compile: Optional[str] = None
    # low-rank training (seed 004, structformer.lowrank): factorise with `factorize_rank` (an int, or a fraction
    # of min(m, n)) after `factorize_at` epochs of dense pre-training (None or 0: from the start), by
    # `factorize_init`, over `factorize_include` (patterns or a preset; None: the paper's default)
    factorize_at: Optional[int] = None
    factorize_rank: Optional[Any] = None
    factorize_init: str = 'spectral'
    factorize_include: Optional[List[str]] = None
    # 'l2': the factors are in the optimiser's weight decay like any weight; 'frobenius': they leave it and
    # the loss gains weight_decay/2 * sum ||U V^T||_F^2 instead (Frobenius decay, §3.3)
    factor_decay: str = 'l2'
    # distillation from a dense teacher (Sparsifiner §4, structformer.train.distill): the teacher's run directory
    # or checkpoint (recorded as the resolved checkpoint); without `phases`, the paper's two stages with
    # `predictor_epochs` of stage 1 (None: about the paper's 5 of 45, 0 when the student has no predictor)
    teacher: Optional[str] = None
    predictor_epochs: Optional[int] = None

    def resolved_warmup_epochs(self) -> float:
        """Warm-up length in epochs: as given, or fitted to the run's length when left unset."""
        return min(2.0, self.epochs / 10) if self.warmup_epochs is None else self.warmup_epochs

    def resolved_warmup_lr(self) -> float:
        """The learning rate the warm-up starts from: as given, or 1e-6 (at most lr) when left unset."""
        return min(DEFAULT_FLOOR_LR, self.lr) if self.warmup_lr is None else self.warmup_lr

    def resolved_min_lr(self) -> float:
        """The cosine schedule's floor: as given, or 1e-6 (at most lr) when left unset."""
        return min(DEFAULT_FLOOR_LR, self.lr) if self.min_lr is None else self.min_lr

    def validate(self) -> 'TrainConfig':
        self._validate_numbers()
        self._validate_optimizer()
        checks = [
            ('epochs', self.epochs >= 1, '>= 1'),
            ('batch_size', self.batch_size >= 1, '>= 1'),
            ('eval_batch_size', self.eval_batch_size >= 1, '>= 1'),
            ('lr', self.lr > 0, '> 0'),
            ('weight_decay', self.weight_decay >= 0, '>= 0'),
            ('warmup_lr', self.warmup_lr is None or 0 <= self.warmup_lr <= self.lr, f'in [0, lr={self.lr:g}]'),
            ('min_lr', self.min_lr is None or 0 <= self.min_lr <= self.lr, f'in [0, lr={self.lr:g}]'),
            ('momentum', 0 <= self.momentum < 1, 'in [0, 1)'),
            ('seed', 0 <= self.seed < 2 ** 32, 'in [0, 2**32)'),
            ('warmup_epochs', 0 <= self.resolved_warmup_epochs() < self.epochs, f'in [0, epochs={self.epochs})'),
            ('label_smoothing', 0 <= self.label_smoothing < 1, 'in [0, 1)'),
            ('val_fraction', 0 < self.val_fraction < 1, 'in (0, 1)'),
            ('keep_last', self.keep_last >= 1, '>= 1'),
            ('save_every', self.save_every >= 0, '>= 0'),
            ('limit_train_batches', self.limit_train_batches >= 0, '>= 0 (0 = all)'),
            ('num_workers', 0 <= self.num_workers <= MAX_WORKERS, f'in [0, {MAX_WORKERS}]'),
            ('sched', self.sched in ('cosine', 'none'), "'cosine' or 'none'"),
        ]
        for name, ok, accepted in checks:
            if not ok:
                raise UsageError(f"{flag_name(name)}={getattr(self, name)!r} is out of range: accepted {accepted}")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise UsageError(f"--clip-grad={self.clip_grad} is out of range: accepted > 0")
        self._validate_lowrank()
        self._validate_distillation()
        if self.compile is not None:
            import torch._dynamo        # only when asked: validating a config needs no torch otherwise
            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile not in backends:
                raise UsageError(f"--compile={self.compile!r} is not a torch.compile backend: accepted "
                                 f"{', '.join(backends)}")
        return self

    def _validate_numbers(self) -> None:
        """Every real-valued setting finite and within float32's range: the optimiser and the schedule
        hand them to float32 tensors, where 1e300 overflows deep inside torch and inf turns the loss nan."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
                raise UsageError(f"{flag_name(f.name)}={value!r} is out of range: accepted a finite number "
                                 f"of magnitude at most {FLOAT32_MAX:.3g} (float32)")

    def _validate_optimizer(self) -> None:
        from timm.optim import list_optimizers     # only here: a config is read without timm elsewhere
        name = self.opt.lower()
        base = name[len('lookahead_'):] if name.startswith('lookahead_') else name
        known = list_optimizers()
        if base not in known:
            close = difflib.get_close_matches(base, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ''
            raise UsageError(f"--opt={self.opt!r} is not a timm optimiser: {hint}accepted any of timm.optim."
                             f"list_optimizers() (e.g. adamw, sgd, lion, lamb), optionally prefixed 'lookahead_'")

    def _validate_lowrank(self) -> None:
        if self.factor_decay not in ('l2', 'frobenius'):
            raise UsageError(f"--factor-decay={self.factor_decay!r}: accepted 'l2' or 'frobenius'")
        inits = ('spectral', 'spectral_ones', 'he')          # structformer.layers.linear.factorized.INITS
        if self.factorize_init not in inits:
            raise UsageError(f"--init={self.factorize_init!r} is not a factor initialisation: accepted {', '.join(inits)}")
        rank = self.factorize_rank
        if rank is None:
            if self.factorize_at is not None:
                raise UsageError(f"--factorize-at={self.factorize_at} needs --rank (an integer count or a fraction "
                                 "in (0, 1] of min(m, n))")
            return
        if (isinstance(rank, bool) or not isinstance(rank, (int, float))
                or not (rank >= 1 if isinstance(rank, int) else 0 < rank <= 1)):
            raise UsageError(f"--rank={rank!r} is out of range: accepted an integer >= 1 or a fraction in (0, 1]")
        if self.factorize_at is not None and not 0 <= self.factorize_at < self.epochs:
            raise UsageError(f"--factorize-at={self.factorize_at} is out of range: accepted an epoch in "
                             f"[0, epochs={self.epochs})")

    def _validate_distillation(self) -> None:
        if self.teacher is not None and self.factorize_at:
            raise UsageError(f"--teacher cannot be combined with --factorize-at={self.factorize_at}: the student would "
                             "change its layers in the middle of the distillation; factorise from the start or not at all")
        if self.predictor_epochs is None:
            return
        if self.teacher is None:
            raise UsageError(f"--predictor-epochs={self.predictor_epochs} needs --teacher RUN_DIR")
        if self.phases:
            raise UsageError("--predictor-epochs and a config file's `phases` both set the stages; give one")
        if not 0 <= self.predictor_epochs <= self.epochs:
            raise UsageError(f"--predictor-epochs={self.predictor_epochs} is out of range: accepted [0, "
                             f"epochs={self.epochs}]")

    def default_predictor_epochs(self) -> int:
        """Stage-1 epochs when not given: the paper's 5 of 45 epochs, at least one when there are two."""
        return max(1, round(self.epochs / 9)) if self.epochs >= 2 else 0

    def factorize_spec(self) -> Optional[Dict[str, Any]]:
        """The `factorize` transform this configuration asks for (None: no low-rank training)."""
        if self.factorize_rank is None:
            return None
        kwargs: Dict[str, Any] = {'rank': self.factorize_rank, 'init': self.factorize_init}
        if self.factorize_include:
            include = self.factorize_include
            kwargs['include'] = include[0] if len(include) == 1 and include[0] in ('vision', 'transformer', 'lm', 'all') \
                else list(include)
        return {'name': 'factorize', 'kwargs': kwargs}

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Dict[str, Any], source: str = 'configuration') -> 'TrainConfig':
        """A config from plain values (a YAML file, a checkpoint's state): unknown keys are refused with
        the closest valid name, values coerced to the field's type where that is unambiguous ('3' -> 3
        for an integer, 3 -> 3.0 for a float) and refused with the expected type otherwise. `source`
        starts every error message (e.g. '-c/--config run.yaml')."""
        return cls(**check_values(values, source))


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


def check_values(values: Dict[str, Any], source: str = 'configuration') -> Dict[str, Any]:
    """Keys and types of configuration `values` checked against TrainConfig; see `TrainConfig.from_dict`."""
    if not isinstance(values, dict):
        raise UsageError(f"{source}: expected a mapping of key: value; got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ''
            raise UsageError(f"{source}: unknown key {key!r}; {hint}accepted keys: {', '.join(sorted(fields))}")
        kind, optional = _field_kind(hints[key])
        if value is None and optional:
            out[key] = None
            continue
        try:
            out[key] = _coerce(value, kind)
        except (TypeError, ValueError, OverflowError):
            expected = _KIND_WORDS.get(kind, kind.__name__) + (' or null' if optional else '')
            raise UsageError(f"{source}: {_describe(key)} must be {expected}; got {value!r}") from None
    return out


def load_config_file(path) -> Dict[str, Any]:
    """The mapping in a YAML config file, keys and types checked (see `TrainConfig.from_dict`); every
    problem -- a missing, unreadable or non-file path, bad YAML, an unknown key, a wrong type -- is a
    UsageError naming -c/--config, the file and the key."""
    where = f"-c/--config {path}"
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
    return check_values(values, where)


def save_config(config: TrainConfig, path) -> None:
    from ..atomic import write_text_atomically
    write_text_atomically(Path(path), yaml.safe_dump(config.to_dict(), sort_keys=False))
