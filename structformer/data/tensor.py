"""In-memory image datasets (digits, synthetic, MNIST, CIFAR-10): normalisation, light augmentation, splits."""
import math
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ..errors import UsageError
from .augment import Augmentation, raw_image_augmentation, wanted

AUGMENTATIONS = ('shift1', 'crop4_flip')


class TensorImageDataset(Dataset):
    """Images kept in their raw units ([N, C, H, W], uint8 or float) and normalised on access.

    item i -> ((raw / max_value - mean) / std as float32 [C, H, W], int label). Keeping the raw
    uint8 pixels costs a quarter of the memory of float32 copies (CIFAR-10: 150 MB, not 600 MB).

    augment: None, 'shift1' (random translation by up to 1 pixel: pad 1 + random crop, for digits
    and MNIST) or 'crop4_flip' (pad 4 + random crop + horizontal flip, for CIFAR-10). Padding is
    raw 0, i.e. the black background. All randomness comes from torch's global RNG, so a training
    engine that saves and restores `torch.get_rng_state()` resumes bit for bit.
    augmentation: timm's augmentations asked for by `structformer train`'s flags (augment.py), applied after
    `augment` on the image in raw units (scaled to 0..255 by 255 / raw_max for PIL), random erasing after
    normalisation; they draw from the global `random`, numpy and torch RNGs. None or nothing requested:
    the output is what it is without them. raw_max: the raw value of white (16 for digits, 255 for 8-bit).
    transform: an optional callable applied last, to the normalised tensor.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, mean: Sequence[float],
                 std: Sequence[float], max_value: float = 1.0, augment: Optional[str] = None,
                 transform: Optional[Callable] = None, source_indices: Optional[torch.Tensor] = None,
                 augmentation: Optional[Augmentation] = None, raw_max: float = 255.0):
        if images.ndim != 4 or len(images) != len(labels):
            raise ValueError(f'images must be [N, C, H, W] with one label each; got {tuple(images.shape)} '
                             f'and {len(labels)} labels')
        if augment not in (None,) + AUGMENTATIONS:
            raise ValueError(f'augment must be one of None, {", ".join(AUGMENTATIONS)}; got {augment!r}')
        c = images.shape[1]
        self.images = images
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.mean = torch.as_tensor(mean, dtype=torch.float32).reshape(c, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).reshape(c, 1, 1)
        self.max_value = float(max_value)
        self.augment = augment
        self.transform = transform
        self.augmentation = wanted(augmentation)
        self.pixel_augment, self.erase, self.augmentation_record = None, None, None
        if self.augmentation is not None:
            # the mean pixel in 0..255 units: fill of timm's rotations and shifts, as transforms_factory sets it
            mean_pixel = tuple((self.mean.flatten() * self.max_value * 255.0 / raw_max).tolist())
            self.pixel_augment, self.erase, self.augmentation_record = raw_image_augmentation(
                self.augmentation, channels=c, size=tuple(images.shape[-2:]), raw_max=raw_max,
                mean_pixel=mean_pixel)
        # Positions in the source collection (e.g. in load_digits()), so splits can be compared.
        self.source_indices = (torch.arange(len(images)) if source_indices is None
                               else torch.as_tensor(source_indices, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def targets(self) -> torch.Tensor:
        return self.labels

    def _normalise(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw.float() / self.max_value - self.mean) / self.std

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int]:
        x = self.images[i].float()
        if self.augment == 'shift1':
            x = _random_crop(x, pad=1)
        elif self.augment == 'crop4_flip':
            x = _random_crop(x, pad=4)
            if torch.rand(()) < 0.5:
                x = x.flip(-1)
        if self.pixel_augment is not None:
            x = self.pixel_augment(x)
        x = self._normalise(x)
        if self.erase is not None:
            x = self.erase(x)
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.labels[i])

    def normalized_images(self) -> torch.Tensor:
        """All images normalised, without augmentation or transform: [N, C, H, W] float32."""
        return self._normalise(self.images)


def _random_crop(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero-pad by `pad` and crop back to the original size at a random offset (torch global RNG)."""
    h, w = x.shape[-2:]
    padded = F.pad(x, (pad, pad, pad, pad))
    i, j = torch.randint(0, 2 * pad + 1, (2,)).tolist()
    return padded[:, i:i + h, j:j + w]


def stratified_split(labels, val_fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """Held-out split with class proportions kept (sklearn train_test_split); indices sorted for readability."""
    from sklearn.model_selection import train_test_split
    labels = np.asarray(labels)
    try:
        train_idx, val_idx = train_test_split(np.arange(len(labels)), test_size=val_fraction,
                                              random_state=seed, stratify=labels)
    except ValueError as e:     # e.g. too few samples for every class to appear on both sides
        n, (_, counts) = len(labels), np.unique(labels, return_counts=True)
        k = len(counts)
        # every class needs a sample on each side: k <= round(n f) and k <= n - round(n f), about f in [k/n, 1 - k/n]
        fits = (f"--val-fraction in [{math.ceil(100 * k / n) / 100:g}, {math.floor(100 * (1 - k / n)) / 100:g}]"
                if 2 * k <= n and counts.min() >= 2 else 'at least two samples of every class')
        raise UsageError(f'--val-fraction {val_fraction}: cannot hold out a stratified split of {n} samples of {k} '
                         f'classes ({e}); every class needs a sample on both sides: give {fits}, or data with its '
                         'own held-out split (an image folder: train/ and val/)') from None
    return np.sort(train_idx), np.sort(val_idx)


def contiguous_split(n: int, val_fraction: float) -> Tuple[np.ndarray, np.ndarray]:
    """First round(n·(1-val_fraction)) items train, the rest val (the documented MNIST-t10k split)."""
    n_train = int(round(n * (1.0 - val_fraction)))
    if not 0 < n_train < n:
        raise ValueError(f'val_fraction={val_fraction} leaves an empty split of {n} items')
    return np.arange(n_train), np.arange(n_train, n)


def split_datasets(images: torch.Tensor, labels: torch.Tensor, train_idx, val_idx, *, mean, std,
                   max_value: float = 1.0, augment: Optional[str] = None, train_transform=None,
                   eval_transform=None, augmentation: Optional[Augmentation] = None,
                   raw_max: float = 255.0) -> Tuple[TensorImageDataset, TensorImageDataset]:
    """Train/val datasets over index sets of one collection; only the train side is augmented."""
    train_idx = torch.as_tensor(np.asarray(train_idx), dtype=torch.long)
    val_idx = torch.as_tensor(np.asarray(val_idx), dtype=torch.long)
    common = dict(mean=mean, std=std, max_value=max_value)
    train = TensorImageDataset(images[train_idx], labels[train_idx], augment=augment, transform=train_transform,
                               source_indices=train_idx, augmentation=augmentation, raw_max=raw_max, **common)
    val = TensorImageDataset(images[val_idx], labels[val_idx], transform=eval_transform,
                             source_indices=val_idx, **common)
    return train, val
