"""Any folder of images in torchvision's ImageFolder layout: PATH/<class>/<image> (RGB, any size).

If PATH has `train/` and `val/` (or `test/`) sub-folders, those are the two splits; otherwise the
images of PATH are split, stratified by class, with `seed` and `val_fraction`.
"""
import copy
import os

import numpy as np
from torch.utils.data import Subset

from .spec import DatasetInfo, Option, check_folder, resolve_options
from .tensor import stratified_split

OPTIONS = {
    'img_size': Option(int, 224, 'an integer >= 8', lambda v: v >= 8),
    'augment': Option(bool, True, 'true or false'),
}


def default_transforms(img_size: int, augment: bool):
    """(train, eval) PIL -> normalised tensor transforms, ImageNet mean/std.

    Eval is timm's (resize to img_size/0.875, center crop). Train is random-resized-crop + flip built
    from torchvision, not timm.create_transform: timm's random crop draws from Python's `random`,
    and we want every augmentation to draw from torch's RNG so resumed runs repeat bit for bit.
    """
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
    from torchvision import transforms as T
    eval_tf = create_transform(img_size, is_training=False)
    if not augment:
        return eval_tf, eval_tf
    train_tf = T.Compose([T.RandomResizedCrop(img_size, antialias=True), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)])
    return train_tf, eval_tf


def _image_folder(root: str, transform, spec: str):
    from torchvision.datasets import ImageFolder
    try:
        return ImageFolder(root, transform=transform)
    except FileNotFoundError as e:     # no class folders, or class folders without images
        raise FileNotFoundError(f'--data {spec!r}: {root!r} is not an image folder: expected '
                                f'{root}/<class name>/<image file> ({e})') from None


def build_imagefolder(path, *, spec, seed, val_fraction, train_transform, eval_transform, **options):
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    opts = resolve_options('imagefolder', OPTIONS, options)
    root = check_folder(path, spec)
    default_train, default_eval = default_transforms(opts['img_size'], opts['augment'])
    train_tf, eval_tf = train_transform or default_train, eval_transform or default_eval
    val_dir = next((os.path.join(root, d) for d in ('val', 'test') if os.path.isdir(os.path.join(root, d))), None)
    if os.path.isdir(os.path.join(root, 'train')) and val_dir:
        train = _image_folder(os.path.join(root, 'train'), train_tf, spec)
        val = _image_folder(val_dir, eval_tf, spec)
        if train.classes != val.classes:
            raise ValueError(f'--data {spec!r}: train/ and {os.path.basename(val_dir)}/ hold different class '
                             f'folders: {train.classes} vs {val.classes}')
        classes = train.classes
        split = f'train/ ({len(train)}) train, {os.path.basename(val_dir)}/ ({len(val)}) val'
    else:
        base = _image_folder(root, train_tf, spec)
        train_idx, val_idx = stratified_split(np.asarray(base.targets), val_fraction, seed)
        val_base = copy.copy(base)            # same file list, its own transform
        val_base.transform = eval_tf
        train, val = Subset(base, train_idx.tolist()), Subset(val_base, val_idx.tolist())
        classes = base.classes
        split = f'stratified split {len(train)} train / {len(val)} val (val_fraction={val_fraction}, seed={seed})'
    info = DatasetInfo(
        name='imagefolder', num_classes=len(classes), in_chans=3, img_size=opts['img_size'],
        train_size=len(train), val_size=len(val),
        description=f'image folder {root}: {len(classes)} classes, {split}, images at {opts["img_size"]}px',
        extra={'path': root, 'classes': list(classes), 'mean': list(IMAGENET_DEFAULT_MEAN),
               'std': list(IMAGENET_DEFAULT_STD), 'split': split, 'augment': opts['augment']})
    return train, val, info
