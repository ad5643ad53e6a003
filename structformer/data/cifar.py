"""CIFAR-10 (Krizhevsky, 2009) in its "python version" folder: data_batch_1..5 (train), test_batch (val).

Each batch file is a pickled dict with b'data' (uint8, N x 3072: 1024 red, then green, then blue
values, each row-major 32x32) and b'labels' (N ints in 0..9). 50,000 train / 10,000 val, 10 classes.
"""
import os
import pickle

import numpy as np
import torch

from .pixel_stats import CIFAR10_MEAN, CIFAR10_STD
from .spec import DatasetInfo, Option, check_folder, resolve_options
from .tensor import split_datasets

TRAIN_FILES = tuple(f'data_batch_{i}' for i in range(1, 6))
VAL_FILE = 'test_batch'
CLASSES = ('airplane', 'automobile', 'bird', 'cat', 'deer', 'dog', 'frog', 'horse', 'ship', 'truck')

OPTIONS = {'augment': Option(bool, True, 'true or false'),
           'img_size': Option(int, 32, "an integer >= 8 (default: the model's input size; other than 32, the "
                              "images are resized after augmentation)", lambda v: v >= 8)}


# Everything a CIFAR-10 batch pickle names (written by Python 2 + numpy, read here with encoding='bytes'):
# numpy arrays are rebuilt through these, py2 byte strings through _codecs.encode. Nothing else is callable.
_CIFAR_GLOBALS = frozenset({
    ('numpy.core.multiarray', '_reconstruct'), ('numpy._core.multiarray', '_reconstruct'),
    ('numpy', 'ndarray'), ('numpy', 'dtype'), ('_codecs', 'encode'),
})


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles only dicts, lists, bytes/str, ints and numpy arrays: pickle resolves every callable it
    will invoke through `find_class`, so refusing all but the numpy rebuild functions means a planted
    payload (os.system, eval, ...) is refused before anything runs."""

    def find_class(self, module, name):
        if (module, name) not in _CIFAR_GLOBALS:
            raise pickle.UnpicklingError(f'refusing to load {module}.{name}: a CIFAR-10 batch holds only '
                                         'a dict of numpy arrays, lists and byte strings')
        return super().find_class(module, name)


def _load_batch_dict(path: str):
    with open(path, 'rb') as f:
        batch = _CifarUnpickler(f, encoding='bytes').load()
    if not isinstance(batch, dict):
        raise TypeError(f'the pickle holds a {type(batch).__name__}, not a dict')
    return batch


def read_cifar_batch(path: str):
    """(images uint8 [n, 3, 32, 32], labels int64 [n]) from one CIFAR-10 batch file."""
    # CIFAR-10's own format is pickle, and plain unpickling runs whatever the file names: read it with an
    # unpickler that admits only what the format needs, and only the fixed file names in --data.
    try:
        batch = _load_batch_dict(path)
        data = np.asarray(batch[b'data'], dtype=np.uint8)
        labels = np.asarray(batch[b'labels'], dtype=np.int64)
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a CIFAR-10 batch (a pickled dict with b'data' and b'labels'): "
                         f'{type(e).__name__}: {e}') from None
    if data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (len(data),):
        raise ValueError(f"{path}: b'data' has shape {data.shape} and b'labels' {labels.shape}; "
                         f'expected [n, 3072] and [n]')
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f'{path}: labels outside 0..9')
    return torch.from_numpy(data.reshape(-1, 3, 32, 32)), torch.from_numpy(labels)


def build_cifar10(path, *, spec, seed, val_fraction, train_transform, eval_transform, augmentation=None,
                  **options):
    opts = resolve_options('cifar10', OPTIONS, options)
    folder = check_folder(path, spec)
    if not os.path.isfile(os.path.join(folder, VAL_FILE)) and os.path.isdir(os.path.join(folder,
                                                                                         'cifar-10-batches-py')):
        folder = os.path.join(folder, 'cifar-10-batches-py')     # the archive's (and torchvision's) layout
    expected = TRAIN_FILES + (VAL_FILE,)
    missing = [name for name in expected if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise FileNotFoundError(f'--data {spec!r}: folder {folder!r} lacks CIFAR-10 files {", ".join(missing)} '
                                f'(the python version: data_batch_1..5 and test_batch)')
    parts = [read_cifar_batch(os.path.join(folder, name)) for name in expected]
    images = torch.cat([x for x, _ in parts])
    labels = torch.cat([y for _, y in parts])
    n_val = len(parts[-1][1])
    size = opts['img_size']
    if size != 32:           # resized last, after the 32-px augmentation and normalisation
        from .sizing import TensorResize
        train_transform, eval_transform = TensorResize(size, train_transform), TensorResize(size, eval_transform)
    train_idx, val_idx = np.arange(len(images) - n_val), np.arange(len(images) - n_val, len(images))
    train, val = split_datasets(images, labels, train_idx, val_idx, mean=CIFAR10_MEAN, std=CIFAR10_STD,
                                max_value=255.0, augment='crop4_flip' if opts['augment'] else None,
                                train_transform=train_transform, eval_transform=eval_transform,
                                augmentation=augmentation, raw_max=255.0)
    info = DatasetInfo(
        name='cifar10', num_classes=10, in_chans=3, img_size=size, train_size=len(train), val_size=len(val),
        description=f'CIFAR-10 folder {folder}: data_batch_1..5 ({len(train)}) train, test_batch ({len(val)}) val'
                    + (f', resized to {size}px' if size != 32 else ''),
        extra={'path': folder, 'classes': list(CLASSES), 'mean': list(CIFAR10_MEAN), 'std': list(CIFAR10_STD),
               'max_value': 255.0, 'augment': opts['augment'], 'augmentation': train.augmentation_record})
    return train, val, info
