"""The resolved configuration of a training run: one dataclass, saved as YAML beside the outputs
and accepted back with `-c`."""
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml


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
    momentum: float = 0.9
    sched: str = 'cosine'
    # None: fitted to the run, min(2, epochs / 10), so a short run never fails on a default it did not set
    warmup_epochs: Optional[float] = None
    warmup_lr: float = 1e-6
    min_lr: float = 1e-6
    label_smoothing: float = 0.1
    clip_grad: Optional[float] = None
    seed: int = 0
    output: Optional[str] = None
    keep_last: int = 2
    save_every: int = 0
    phases: List[Dict[str, Any]] = field(default_factory=list)
    limit_train_batches: int = 0
    num_workers: int = 0

    def resolved_warmup_epochs(self) -> float:
        """Warm-up length in epochs: as given, or fitted to the run's length when left unset."""
        return min(2.0, self.epochs / 10) if self.warmup_epochs is None else self.warmup_epochs

    def validate(self) -> 'TrainConfig':
        checks = [
            ('epochs', self.epochs >= 1, '>= 1'),
            ('batch_size', self.batch_size >= 1, '>= 1'),
            ('eval_batch_size', self.eval_batch_size >= 1, '>= 1'),
            ('lr', self.lr > 0, '> 0'),
            ('weight_decay', self.weight_decay >= 0, '>= 0'),
            ('warmup_epochs', 0 <= self.resolved_warmup_epochs() < self.epochs, f'in [0, epochs={self.epochs})'),
            ('label_smoothing', 0 <= self.label_smoothing < 1, 'in [0, 1)'),
            ('val_fraction', 0 < self.val_fraction < 1, 'in (0, 1)'),
            ('keep_last', self.keep_last >= 1, '>= 1'),
            ('save_every', self.save_every >= 0, '>= 0'),
            ('limit_train_batches', self.limit_train_batches >= 0, '>= 0 (0 = all)'),
            ('num_workers', self.num_workers >= 0, '>= 0'),
            ('sched', self.sched in ('cosine', 'none'), "'cosine' or 'none'"),
        ]
        for name, ok, accepted in checks:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r} is out of range: accepted {accepted}")
        if self.clip_grad is not None and self.clip_grad <= 0:
            raise ValueError(f"--clip-grad={self.clip_grad} must be > 0")
        return self

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> 'TrainConfig':
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown configuration keys {unknown}; accepted: {sorted(known)}")
        return cls(**values)


def load_config_file(path) -> Dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"-c/--config: {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"-c/--config: {path} is not valid YAML ({e})") from None
    if not isinstance(values, dict):
        raise ValueError(f"-c/--config: {path} must hold a mapping of option: value")
    return values


def save_config(config: TrainConfig, path) -> None:
    from .checkpoint import _atomic_write_text
    _atomic_write_text(Path(path), yaml.safe_dump(config.to_dict(), sort_keys=False))
