"""scikit-learn's handwritten digits: 1,797 real 8x8 grey images, 10 classes, pixel values 0..16.

Bundled with scikit-learn (UCI "Optical Recognition of Handwritten Digits", test part), so it needs
no download: the project's demo and quick tests train on it.
"""
import numpy as np
import torch

from .pixel_stats import DIGITS_MEAN, DIGITS_STD
from .spec import DatasetInfo, Option, resolve_options
from .tensor import split_datasets, stratified_split

OPTIONS = {'augment': Option(bool, False, 'true or false')}


def load_digits_arrays():
    """(images uint8 [1797, 1, 8, 8], labels int64 [1797])."""
    from sklearn.datasets import load_digits
    d = load_digits()
    images = torch.from_numpy(d.images.astype(np.uint8)).unsqueeze(1)    # values are integers 0..16
    return images, torch.from_numpy(d.target.astype(np.int64))


def build_digits(*, seed, val_fraction, train_transform, eval_transform, augmentation=None, **options):
    opts = resolve_options('digits', OPTIONS, options)
    images, labels = load_digits_arrays()
    train_idx, val_idx = stratified_split(labels.numpy(), val_fraction, seed)
    train, val = split_datasets(images, labels, train_idx, val_idx, mean=[DIGITS_MEAN], std=[DIGITS_STD],
                                augment='shift1' if opts['augment'] else None,
                                train_transform=train_transform, eval_transform=eval_transform,
                                augmentation=augmentation, raw_max=16.0)     # raw pixels are 0..16
    info = DatasetInfo(
        name='digits', num_classes=10, in_chans=1, img_size=8, train_size=len(train), val_size=len(val),
        description=(f"scikit-learn digits (1,797 real 8x8 grey images, 10 classes): stratified split "
                     f"{len(train)} train / {len(val)} val (val_fraction={val_fraction}, seed={seed})"),
        extra={'mean': [DIGITS_MEAN], 'std': [DIGITS_STD], 'max_value': 1.0, 'split': 'stratified',
               'seed': seed, 'augment': opts['augment'], 'augmentation': train.augmentation_record})
    return train, val, info
