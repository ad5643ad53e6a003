"""Datasets for `--data`: digits, synthetic subspaces (CRATE §2.2), MNIST, CIFAR-10, image folders."""
from .build import build_datasets
from .cifar import CIFAR10_MEAN, CIFAR10_STD, read_cifar_batch
from .digits import DIGITS_MEAN, DIGITS_STD
from .mnist import MNIST_MEAN, MNIST_STD, read_idx
from .spec import DATASET_FORMS, DatasetInfo, parse_data_spec
from .synthetic import image_to_tokens, random_subspace_bases, sample_tokens, tokens_to_image
from .tensor import TensorImageDataset

__all__ = ['build_datasets', 'parse_data_spec', 'DATASET_FORMS', 'DatasetInfo', 'TensorImageDataset',
           'tokens_to_image', 'image_to_tokens', 'random_subspace_bases', 'sample_tokens', 'read_idx',
           'read_cifar_batch', 'DIGITS_MEAN', 'DIGITS_STD', 'MNIST_MEAN', 'MNIST_STD', 'CIFAR10_MEAN',
           'CIFAR10_STD']
