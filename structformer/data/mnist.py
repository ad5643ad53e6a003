"""MNIST-format folders: IDX files (LeCun et al.), gzip-compressed or raw, read with numpy from the bytes.

`mnist:PATH` reads `train-images-idx3-ubyte[.gz]` / `train-labels-idx1-ubyte[.gz]` and/or the `t10k-*`
pair. With both pairs: train = train files, val = t10k. With one pair (e.g. the shared copy of the
10,000-image MNIST test set): a contiguous split, first round(n·(1-val_fraction)) images train, the
rest val -- with the default val_fraction=0.2 that is the documented 8,000 / 2,000 split.
"""
import gzip
import os
import struct
import zlib

import numpy as np
import torch

from .pixel_stats import MNIST_MEAN, MNIST_STD
from .spec import MNIST_HOWTO, DatasetInfo, Option, check_folder, resolve_options
from .tensor import contiguous_split, split_datasets

IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049
_IDX_DTYPES = {0x08: '>u1', 0x09: '>i1', 0x0B: '>i2', 0x0C: '>i4', 0x0D: '>f4', 0x0E: '>f8'}

OPTIONS = {'augment': Option(bool, True, 'true or false')}


def _read_bytes(path: str) -> bytes:
    with open(path, 'rb') as f:
        raw = f.read()
    if raw[:2] != b'\x1f\x8b':     # gzip magic: decide by content, not by the file name
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as e:
        raise ValueError(f'{path}: corrupt or truncated gzip file ({e})') from None


def read_idx(path: str, expected_magic: int = None) -> np.ndarray:
    """An IDX file as a numpy array; ValueError naming the file when the header or the size is wrong."""
    raw = _read_bytes(path)
    if len(raw) < 4 or raw[:2] != b'\0\0' or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        raise ValueError(f'{path}: not an IDX file (bad magic number {raw[:4].hex() or "(empty file)"})')
    magic, ndim = int.from_bytes(raw[:4], 'big'), raw[3]
    if expected_magic is not None and magic != expected_magic:
        raise ValueError(f'{path}: IDX magic number {magic}, expected {expected_magic}')
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f'{path}: truncated IDX header ({len(raw)} bytes, {ndim} dims need {header})')
    dims = struct.unpack(f'>{ndim}I', raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    count = int(np.prod(dims))
    if len(raw) - header != count * dtype.itemsize:
        raise ValueError(f'{path}: truncated or corrupt IDX file: header says shape {tuple(dims)} '
                         f'({count * dtype.itemsize} data bytes) but {len(raw) - header} bytes follow it')
    return np.frombuffer(raw, dtype, count=count, offset=header).reshape(dims).astype(dtype.newbyteorder('='))


def _find(folder: str, stem: str):
    for name in (stem, stem + '.gz'):
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(folder, name)
    return None


def read_idx_pair(images_path: str, labels_path: str):
    """(images uint8 [n, 1, H, W], labels int64 [n]) from an images/labels pair of IDX files."""
    images = read_idx(images_path, IMAGES_MAGIC)
    labels = read_idx(labels_path, LABELS_MAGIC)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise ValueError(f'{images_path} holds shape {images.shape} and {labels_path} holds shape {labels.shape}: '
                         f'expected [n, H, W] images with n labels')
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def find_mnist_files(folder: str, spec: str):
    """{'train': (images, labels) or None, 't10k': ...}; FileNotFoundError listing the expected files."""
    if _find(folder, 't10k-images-idx3-ubyte') is None and _find(folder, 'train-images-idx3-ubyte') is None \
            and os.path.isdir(os.path.join(folder, 'MNIST', 'raw')):
        folder = os.path.join(folder, 'MNIST', 'raw')        # torchvision's download layout
    pairs, incomplete = {}, []
    for prefix in ('train', 't10k'):
        imgs = _find(folder, f'{prefix}-images-idx3-ubyte')
        labs = _find(folder, f'{prefix}-labels-idx1-ubyte')
        pairs[prefix] = (imgs, labs) if imgs and labs else None
        if bool(imgs) != bool(labs):
            incomplete.append(prefix)
    if incomplete or not any(pairs.values()):
        raise FileNotFoundError(
            f'--data {spec!r}: folder {folder!r} lacks the expected MNIST IDX files: '
            f't10k-images-idx3-ubyte[.gz] with t10k-labels-idx1-ubyte[.gz], and/or '
            f'train-images-idx3-ubyte[.gz] with train-labels-idx1-ubyte[.gz]'
            + (f' (incomplete pair: {", ".join(incomplete)})' if incomplete else '') + f'. {MNIST_HOWTO}')
    return pairs


def build_mnist(path, *, spec, seed, val_fraction, train_transform, eval_transform, augmentation=None, **options):
    opts = resolve_options('mnist', OPTIONS, options)
    pairs = find_mnist_files(check_folder(path, spec), spec)
    if pairs['train'] and pairs['t10k']:
        tr_x, tr_y = read_idx_pair(*pairs['train'])
        va_x, va_y = read_idx_pair(*pairs['t10k'])
        if tr_x.shape[1:] != va_x.shape[1:]:
            raise ValueError(f'{pairs["train"][0]} and {pairs["t10k"][0]} hold images of different sizes')
        images, labels = torch.cat([tr_x, va_x]), torch.cat([tr_y, va_y])
        train_idx, val_idx = np.arange(len(tr_x)), np.arange(len(tr_x), len(images))
        split = f'train files ({len(tr_x)}) train, t10k files ({len(va_x)}) val'
    else:
        files = pairs['train'] or pairs['t10k']
        images, labels = read_idx_pair(*files)
        train_idx, val_idx = contiguous_split(len(images), val_fraction)
        split = (f'{os.path.basename(files[0])} split contiguously: images 0..{len(train_idx) - 1} train, '
                 f'{len(train_idx)}..{len(images) - 1} val (val_fraction={val_fraction})')
    h, w = images.shape[-2:]
    if h != w:
        raise ValueError(f'--data {spec!r}: expected square images; the IDX files hold {h}x{w}')
    train, val = split_datasets(images, labels, train_idx, val_idx, mean=[MNIST_MEAN], std=[MNIST_STD],
                                max_value=255.0, augment='shift1' if opts['augment'] else None,
                                train_transform=train_transform, eval_transform=eval_transform,
                                augmentation=augmentation, raw_max=255.0)
    info = DatasetInfo(
        name='mnist', num_classes=max(10, int(labels.max()) + 1), in_chans=1, img_size=int(h),
        train_size=len(train), val_size=len(val),
        description=f'MNIST-format IDX folder {path}: {len(train)} train / {len(val)} val ({split})',
        extra={'path': path, 'mean': [MNIST_MEAN], 'std': [MNIST_STD], 'max_value': 255.0, 'split': split,
               'augment': opts['augment'], 'augmentation': train.augmentation_record})
    return train, val, info
