"""Training-time augmentation from timm's pieces: RandAugment / AutoAugment / AugMix strings, colour jitter,
random-resized-crop scale and ratio, flips and random erasing (timm.data.create_transform and friends).

`Augmentation` is what `structformer train` asks of a dataset (its fields carry timm train.py's flag names);
each dataset builder turns it into transforms for its own image form. The randomness of these transforms comes
from Python's `random` (timm's crops, policies and erasing boxes), numpy's (AugMix's weights, RandAugment's op
choice) and torch's (flips, colour jitter, erasing noise, torchvision's RandAugment for --aa tv-rand-...), all
global; the engine seeds them per sample from (seed, epoch, position), so the augmentation of a sample does not
depend on the worker that loads it (data/seeding.py).
"""
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Optional, Tuple

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
    train_interpolation: Optional[str] = None     # resampling of the crop and the policy ('random', 'bicubic', ...)

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


# torchvision's RandAugment, as the public CRATE finetune.py applies it (`transforms.RandAugment(2, 14)`):
# 'tv-rand-n<N>-m<M>[-b<BINS>]', magnitude bin M of BINS (default 31, bins 0..30). timm's RandAugment scales
# magnitudes to 10 and clamps above it, so timm's rand-m14-n2 is full strength where torchvision's bin 14 of 30
# is 14/30 of each op's range; the public code's strength needs torchvision's transform itself.
TORCHVISION_RAND = 'tv-rand'
# timm's interpolation names (timm.data.transforms.str_to_pil_interp) and 'random' (bilinear or bicubic per image)
TRAIN_INTERPOLATIONS = ('random', 'bilinear', 'bicubic', 'nearest', 'lanczos', 'box', 'hamming')


def torchvision_rand_augment_args(policy: str) -> Dict[str, int]:
    """num_ops, magnitude, num_magnitude_bins of a 'tv-rand-n2-m14[-b31]' policy; ValueError otherwise."""
    values = {'n': 2, 'm': 9, 'b': 31}
    for part in policy[len(TORCHVISION_RAND):].split('-')[1:]:
        key, number = part[:1], part[1:]
        if key not in values or not number.isdigit():
            raise ValueError(f'unknown section {part!r}')
        values[key] = int(number)
    if values['b'] < 2 or not 0 <= values['m'] < values['b'] or values['n'] < 1:
        raise ValueError(f"needs n >= 1, b >= 2 and m in [0, b-1]; got n={values['n']}, m={values['m']}, "
                         f"b={values['b']}")
    return {'num_ops': values['n'], 'magnitude': values['m'], 'num_magnitude_bins': values['b']}


def torchvision_rand_augment(policy: str):
    """torchvision.transforms.RandAugment for a 'tv-rand-...' policy, with torchvision's defaults (nearest
    interpolation, black fill), as `transforms.RandAugment(n, m)` in the public CRATE code."""
    from torchvision import transforms as T
    return T.RandAugment(**torchvision_rand_augment_args(policy))


def check_auto_augment(policy: str) -> None:
    """Refuse an auto-augment string timm (or, for 'tv-rand-...', torchvision's RandAugment) cannot take, naming
    --aa and the accepted forms (timm asserts deep inside its parser otherwise)."""
    from timm.data.auto_augment import (augment_and_mix_transform, auto_augment_transform,
                                        rand_augment_transform)
    if policy.startswith(TORCHVISION_RAND):
        try:
            torchvision_rand_augment_args(policy)
        except ValueError as e:
            raise UsageError(f"--aa={policy!r} is not a torchvision RandAugment policy ({e}): accepted "
                             "tv-rand-n<N>-m<M>[-b<BINS>] (magnitude bin M of BINS, default 31)") from None
        return
    hparams = {'translate_const': 10, 'img_mean': (124, 116, 104)}
    # timm skips a section without a number (e.g. the typo 'rand-m9-x'); every section it reads has one,
    # except RandAugment's transform list 't<NAME>'
    skipped = [part for part in policy.split('-')[1:] if not any(ch.isdigit() for ch in part)
               and not (policy.startswith('rand') and part.startswith('t') and len(part) > 1)]
    try:
        if skipped:
            raise ValueError(f'unknown section {skipped[0]!r}')
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
                         "(AutoAugment), augmix-m<M>-w<W>-d<D> or tv-rand-n<N>-m<M> (torchvision's "
                         "RandAugment)") from None


# --data forms whose images the flags can augment, for the refusal of the others
IMAGE_FORMS = 'digits, mnist:PATH, cifar10:PATH, imagefolder:PATH, wds:TRAIN[,VAL], hfds:PATH'
_REMODES = ('const', 'rand', 'pixel')


def _flag(name: str) -> str:
    return '--' + name.replace('_', '-')


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_augmentation(aug: Augmentation) -> Augmentation:
    """`aug` with its ranges checked (UsageError naming the flag and the accepted values); scale and ratio
    become tuples of floats. TrainConfig checks the same ranges; this covers callers that build one directly."""
    def bad(name, accepted):
        raise UsageError(f'{_flag(name)}={getattr(aug, name)!r} is out of range: accepted {accepted}')
    if aug.aa is not None:
        if not isinstance(aug.aa, str):
            bad('aa', 'a timm auto-augment string, e.g. rand-m9-mstd0.5-inc1')
        check_auto_augment(aug.aa)
    if not (_number(aug.reprob) and 0 <= aug.reprob <= 1):
        bad('reprob', 'a number in [0, 1]')
    if aug.remode not in _REMODES:
        bad('remode', "'const', 'rand' or 'pixel'")
    if not (isinstance(aug.recount, int) and not isinstance(aug.recount, bool) and aug.recount >= 1):
        bad('recount', 'an integer >= 1')
    for name in ('color_jitter', 'hflip'):
        value = getattr(aug, name)
        if value is not None and not (_number(value) and 0 <= value <= 1):
            bad(name, 'a number in [0, 1]')
    if aug.train_interpolation is not None and aug.train_interpolation not in TRAIN_INTERPOLATIONS:
        bad('train_interpolation', ', '.join(TRAIN_INTERPOLATIONS))
    pairs = {}
    for name, high, span in (('scale', 1.0, '(0, 1]'), ('ratio', float('inf'), '(0, inf)')):
        value = getattr(aug, name)
        if value is None:
            continue
        if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(_number(v) for v in value)
                and 0 < value[0] <= value[1] <= high):
            bad(name, f'two numbers MIN MAX with MIN <= MAX in {span}')
        pairs[name] = (float(value[0]), float(value[1]))
    return replace(aug, **pairs) if pairs else aug


def wanted(aug: Optional[Augmentation]) -> Optional[Augmentation]:
    """The checked augmentation if any setting is requested, else None (the dataset's own default)."""
    if aug is None:
        return None
    if not isinstance(aug, Augmentation):
        raise TypeError(f'augmentation must be an Augmentation or None; got {type(aug).__name__}')
    return check_augmentation(aug) if aug.requested() else None


def given_flags(aug: Augmentation) -> str:
    """The flags whose settings differ from the defaults, e.g. '--aa, --reprob'."""
    default = Augmentation()
    return ', '.join(_flag(f.name) for f in fields(aug) if getattr(aug, f.name) != getattr(default, f.name))


def refuse_augmentation(aug: Optional[Augmentation], data: str) -> None:
    """One-line UsageError when augmentation flags are given for data that is not images."""
    if aug is not None and aug.requested():
        raise UsageError(f'{given_flags(aug)}: image augmentation applies only to --data {IMAGE_FORMS}; '
                         f'--data {data} takes none')


def record(aug: Augmentation, **applied) -> Dict[str, Any]:
    """JSON-safe record of an applied augmentation for DatasetInfo.extra: the settings, then `applied`
    (effective values and the pipeline's step names)."""
    out = {f.name: (list(v) if isinstance(v, tuple) else v) for f in fields(aug) for v in [getattr(aug, f.name)]}
    out.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in applied.items()})
    return out


def auto_augment_policy(policy: str, size: int, img_mean: Tuple[int, ...], interpolation: Optional[str] = None):
    """timm's RandAugment / AutoAugment / AugMix transform for PIL images of side `size`, with the hparams
    timm's transforms_factory gives it: its ops resample with `interpolation` (None: bilinear, as
    create_transform's default; 'random': timm's random bilinear / bicubic, as create_transform leaves it)."""
    from timm.data.auto_augment import (augment_and_mix_transform, auto_augment_transform,
                                        rand_augment_transform)
    from timm.data.transforms import str_to_pil_interp
    hparams = {'translate_const': int(size * 0.45), 'img_mean': tuple(img_mean)}
    if interpolation != 'random':
        hparams['interpolation'] = str_to_pil_interp(interpolation or 'bilinear')
    if policy.startswith(TORCHVISION_RAND):
        return torchvision_rand_augment(policy)
    if policy.startswith('rand'):
        transform = rand_augment_transform(policy, hparams)
    elif policy.startswith('augmix'):
        transform = augment_and_mix_transform(policy, dict(hparams, translate_pct=0.3))
    else:
        transform = auto_augment_transform(policy, hparams)
    return allow_zero_bit_posterize(transform)


def _posterize(img, bits_to_keep, **kwargs):
    """timm's posterize, with 0 bits kept giving the black image older Pillow gave."""
    from PIL import Image
    from timm.data.auto_augment import posterize
    if bits_to_keep < 1:
        return Image.new(img.mode, img.size, 0)
    return posterize(img, bits_to_keep, **kwargs)


def allow_zero_bit_posterize(transform):
    """Make timm's posterize ops in `transform` (an auto-augment transform or a Compose holding one) accept
    0 bits. timm's policies ask for 0 bits at their strongest magnitude (rand-m9-mstd0.5-inc1 about one sample
    in 500, 'v0' and rand-m10-inc1 more often), meaning a black image; Pillow >= 11 raises ValueError for it,
    which would stop a run in the middle of an epoch. Returns `transform`."""
    from timm.data.auto_augment import AugmentOp, posterize
    stack = list(getattr(transform, 'transforms', [transform]))
    while stack:
        item = stack.pop()
        if isinstance(item, AugmentOp):
            if item.aug_fn is posterize:
                item.aug_fn = _posterize
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            stack.extend(getattr(item, 'ops', []))
            stack.extend(getattr(item, 'policy', []))
    return transform


def _jitter_strength(aug: Augmentation) -> Optional[float]:
    """--color-jitter's strength where it applies: as in timm, not together with an auto-augment policy
    (except AutoAugment '3a', which timm keeps it for). None (our default) means no jitter, where timm's
    create_transform would jitter by 0.4."""
    if aug.color_jitter is None or (aug.aa and '3a' not in aug.aa):
        return None
    return float(aug.color_jitter)


class RawImageAugment:
    """timm's PIL augmentations on one raw image [C, H, W] (C = 1 or 3, values 0..raw_max), returned as float32
    in raw units: the image is scaled to 0..255 for PIL (digits' 0..16 included) and back."""

    def __init__(self, steps, raw_max: float):
        self.steps = steps
        self.to_pil_units = 255.0 / float(raw_max)

    def __call__(self, x):
        import numpy as np
        import torch
        from PIL import Image
        pixels = (x.float() * self.to_pil_units).round().clamp(0, 255).to(torch.uint8)
        if len(pixels) == 1:
            image = Image.fromarray(pixels[0].numpy(), 'L')
        else:
            image = Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy(), 'RGB')
        out = torch.from_numpy(np.array(self.steps(image), dtype=np.float32))
        out = out.unsqueeze(0) if out.ndim == 2 else out.permute(2, 0, 1).contiguous()
        return out / self.to_pil_units


def raw_image_augmentation(aug: Augmentation, *, channels: int, size: Tuple[int, int], raw_max: float,
                           mean_pixel: Tuple[float, ...]):
    """(RawImageAugment or None, RandomErasing or None, record) for in-memory images of `channels` x `size`.

    Steps, each only where asked: random-resized-crop (--scale / --ratio) at the image's own size, flip
    (--hflip), the --aa policy, colour jitter; then, on the normalised tensor, random erasing (--reprob).
    mean_pixel: the data's mean per channel in 0..255 units (the fill of rotations and shifts).
    Every step draws from the global `random`, numpy or torch RNGs, which the engine seeds per sample.
    """
    from timm.data.random_erasing import RandomErasing
    from timm.data.transforms import RandomResizedCropAndInterpolation
    from torchvision import transforms as T
    if channels not in (1, 3):
        raise ValueError(f'augmentation needs grey (1 channel) or RGB (3 channel) images; got {channels} channels')
    steps, applied = [], {}
    if aug.scale is not None or aug.ratio is not None:
        scale, ratio = aug.scale or (0.08, 1.0), aug.ratio or (3 / 4, 4 / 3)      # timm's defaults for the other
        steps.append(RandomResizedCropAndInterpolation(tuple(size), scale=scale, ratio=ratio,
                                                       interpolation=aug.train_interpolation or 'bilinear'))
        applied.update(scale=scale, ratio=ratio)
    if aug.hflip:
        steps.append(T.RandomHorizontalFlip(p=aug.hflip))
    if aug.aa:
        # Grey images get a one-element fill: PIL's geometric ops on an 'L' image refuse timm's RGB fill
        # tuple ("color must be int or single-element tuple"); with it every timm op works on 'L' as is.
        img_mean = tuple(min(255, int(round(m))) for m in mean_pixel)
        steps.append(auto_augment_policy(aug.aa, min(size), img_mean, aug.train_interpolation))
        applied['img_mean'] = img_mean
    jitter = _jitter_strength(aug)
    if jitter:
        steps.append(T.ColorJitter(jitter, jitter, jitter))
    applied['color_jitter'] = jitter
    eraser = RandomErasing(aug.reprob, mode=aug.remode, max_count=aug.recount, device='cpu') if aug.reprob else None
    names = [type(s).__name__ for s in steps] + (['RandomErasing'] if eraser else [])
    pixel = RawImageAugment(T.Compose(steps), raw_max) if steps else None
    return pixel, eraser, record(aug, pipeline=names, **applied)


def timm_train_transform(img_size: int, aug: Augmentation, mean, std):
    """(transform, record): timm's create_transform training pipeline for PIL images with `aug`'s settings."""
    from timm.data import create_transform
    hflip = 0.5 if aug.hflip is None else aug.hflip
    torchvision_policy = bool(aug.aa) and aug.aa.startswith(TORCHVISION_RAND)
    transform = create_transform(
        img_size, is_training=True, auto_augment=None if torchvision_policy else aug.aa, re_prob=aug.reprob,
        re_mode=aug.remode, re_count=aug.recount, scale=aug.scale, ratio=aug.ratio, hflip=hflip, mean=mean,
        std=std, interpolation=aug.train_interpolation or 'bilinear',
        # timm jitters colour by 0.4 unless told otherwise; our --color-jitter default (None) means no jitter;
        # with a policy timm leaves colour jitter out, and so do we with torchvision's
        color_jitter=None if torchvision_policy else aug.color_jitter)
    if torchvision_policy:
        # where timm puts its policy: after the crop and flip, before the tensor conversion (the public CRATE
        # finetune.py's order: RandomResizedCrop, RandomHorizontalFlip, RandAugment, ToTensor, Normalize)
        steps = list(transform.transforms)
        at = next(i for i, t in enumerate(steps) if 'ToTensor' in type(t).__name__)
        steps.insert(at, torchvision_rand_augment(aug.aa))
        transform.transforms = steps
    allow_zero_bit_posterize(transform)
    return transform, record(aug, scale=aug.scale or (0.08, 1.0), ratio=aug.ratio or (3 / 4, 4 / 3), hflip=hflip,
                             color_jitter=_jitter_strength(aug),
                             pipeline=[type(t).__name__ for t in transform.transforms])
