"""Datasets for `--data`: digits, synthetic subspaces (CRATE §2.2), MNIST, CIFAR-10, image folders.

The names below load on first use (PEP 562), not with the package: a config's checks read `data.spec` and
`data.augment`'s names, which need no torch, so a value out of range is refused before torch's import (as
`structformer.train` does).
"""
from ..lazy_names import lazy_exports

_EXPORTS = {'build_datasets': 'build', 'CIFAR10_MEAN': 'cifar', 'CIFAR10_STD': 'cifar', 'read_cifar_batch': 'cifar',
            'DIGITS_MEAN': 'digits', 'DIGITS_STD': 'digits', 'MNIST_MEAN': 'mnist', 'MNIST_STD': 'mnist',
            'read_idx': 'mnist', 'DATASET_FORMS': 'spec', 'DatasetInfo': 'spec', 'parse_data_spec': 'spec',
            'image_to_tokens': 'synthetic', 'random_subspace_bases': 'synthetic', 'sample_tokens': 'synthetic',
            'tokens_to_image': 'synthetic', 'TensorImageDataset': 'tensor'}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
