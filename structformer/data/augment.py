"""Training-time augmentation from timm's pieces: RandAugment / AutoAugment / AugMix strings, colour jitter,
random-resized-crop scale and ratio, flips and random erasing (timm.data.create_transform and friends).

`Augmentation` is what `structformer train` asks of a dataset (its fields carry timm train.py's flag names);
each dataset builder turns it into transforms for its own image form. The randomness of timm's transforms comes
from Python's `random` (and torch's for random erasing); the engine seeds both per sample from (seed, epoch,
position), so the augmentation of a sample does not depend on the worker that loads it (train/seeding.py).
"""
from dataclasses import dataclass, fields
from typing import Optional, Tuple

from ..errors import UsageError


@dataclass(frozen=True)
class Augmentation:
    """Augmentation asked for by flags; None keeps a dataset's own default for that setting."""
    aa: Optional[str] = None                      # timm auto-augment string, e.g. 'rand-m9-mstd0.5-inc1'
    reprob: float = 0.0                           # random erasing probability
    remode: str = 'pixel'
    recount: int = 1
    color_jitter: Optional[float] = None
    scale: Optional[Tuple[float, float]] = None   # random-resized-crop area range
    ratio: Optional[Tuple[float, float]] = None   # random-resized-crop aspect range
    hflip: Optional[float] = None

    @classmethod
    def from_config(cls, config) -> 'Augmentation':
        """The augmentation settings of a TrainConfig (same field names)."""
        values = {f.name: getattr(config, f.name) for f in fields(cls)}
        for key in ('scale', 'ratio'):
            if values[key] is not None:
                values[key] = tuple(float(v) for v in values[key])
        return cls(**values)

    def requested(self) -> bool:
        """True if any setting differs from 'leave the dataset's default'."""
        return self != Augmentation()


def check_auto_augment(policy: str) -> None:
    """Refuse an auto-augment string timm cannot parse, naming --aa and the accepted forms (timm asserts
    deep inside its parser otherwise)."""
    from timm.data.auto_augment import (augment_and_mix_transform, auto_augment_transform,
                                        rand_augment_transform)
    hparams = {'translate_const': 10, 'img_mean': (124, 116, 104)}
    try:
        if policy.startswith('rand'):
            rand_augment_transform(policy, hparams)
        elif policy.startswith('augmix'):
            augment_and_mix_transform(policy, hparams)
        else:
            auto_augment_transform(policy, hparams)
    except (AssertionError, ValueError, KeyError, IndexError) as e:
        reason = str(e) or type(e).__name__
        raise UsageError(f"--aa={policy!r} is not a timm augmentation policy ({reason}): accepted "
                         "rand-m<M>[-n<N>][-mstd<S>][-inc1] (RandAugment), original, originalr, v0, v0r, 3a "
                         "(AutoAugment) or augmix-m<M>-w<W>-d<D>") from None
