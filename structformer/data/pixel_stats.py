"""The normalisation `structformer train` applies to each image dataset, in timm's pixel units.

timm's `resolve_data_config` + `create_transform` read an 8-bit image as values in [0, 1] (ToTensor) and
then subtract `mean` and divide by `std` from the model's `pretrained_cfg`. For a model to see the same
inputs through timm as through `structformer train`, its config must hold the training normalisation in
those units. The digits are stored as 8-bit images holding their raw values 0..16 (`load_digits_arrays`),
which the engine normalises in raw units, so their statistics divide by 255 here. Synthetic subspace data
has no 8-bit image form and no entry.
"""
from typing import Any, Dict, Optional, Tuple

# The datasets' own statistics live here, imported by their loaders (cifar, digits, mnist): this module imports
# nothing of the package, so the models (models/base.py: pretrained_cfg) read it without reaching the loaders.
# Per-channel mean and std of CIFAR-10's 50,000 training images, for pixels scaled to [0, 1].
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
# Mean and std of all 1,797 x 64 digits pixel values, in raw units (0..16): normalised pixels have mean 0, std 1.
DIGITS_MEAN = 4.884164579855314
DIGITS_STD = 6.016787548672236
# The usual MNIST constants, for pixels scaled to [0, 1] (mean and std of the 60,000 training images).
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081

# timm's IMAGENET_DEFAULT_MEAN / _STD, written out: importing timm here would re-enter structformer.models (which
# imports this module) through timm's model-registration hook when this module is the first one imported
IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD = (0.229, 0.224, 0.225)

PIXEL_STATS = {
    'digits': ((DIGITS_MEAN / 255,), (DIGITS_STD / 255,)),
    'mnist': ((MNIST_MEAN,), (MNIST_STD,)),
    'cifar10': (tuple(CIFAR10_MEAN), tuple(CIFAR10_STD)),
    'imagefolder': (tuple(IMAGENET_DEFAULT_MEAN), tuple(IMAGENET_DEFAULT_STD)),
}
# shards, Hugging Face image datasets and ImageNet as downloaded go through the image folder's transforms
for _name in ('wds', 'hfds', 'imagenet'):
    PIXEL_STATS[_name] = PIXEL_STATS['imagefolder']


# how the eval images reach the model: the tensor datasets are used at their own size (no resize, no crop);
# image folders go through timm's default eval transform (resize to img_size / 0.875, centre crop)
EVAL_GEOMETRY = {name: {'crop_pct': 0.875, 'interpolation': 'bilinear', 'crop_mode': 'center'}
                 for name in ('imagefolder', 'wds', 'hfds', 'imagenet')}
TENSOR_GEOMETRY = {'crop_pct': 1.0, 'interpolation': 'nearest', 'crop_mode': 'center'}


def pixel_stats(dataset: str) -> Optional[Tuple[tuple, tuple]]:
    """(mean, std) per channel in timm's [0, 1] pixel units for a dataset name of `DatasetInfo.name`, or
    None for data without an 8-bit image form (synthetic subspaces, text)."""
    return PIXEL_STATS.get(dataset)


def eval_data_config(dataset: str, crop_pct: Optional[float] = None, interpolation: Optional[str] = None,
                     crop_mode: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The `pretrained_cfg` entries (mean, std, crop_pct, interpolation, crop_mode) with which timm's eval
    transform reproduces what `structformer train` fed the model on `dataset`, or None (no image form). `crop_pct`,
    `interpolation`, `crop_mode`: the run's `--data-kwargs` of those names (image folders and the forms that share
    their transforms), else the defaults."""
    stats = pixel_stats(dataset)
    if stats is None:
        return None
    geometry = dict(EVAL_GEOMETRY.get(dataset, TENSOR_GEOMETRY))
    if crop_pct is not None and dataset in EVAL_GEOMETRY:
        geometry['crop_pct'] = float(crop_pct)
    if interpolation is not None and dataset in EVAL_GEOMETRY:
        geometry['interpolation'] = str(interpolation)
    if crop_mode is not None and dataset in EVAL_GEOMETRY:
        geometry['crop_mode'] = str(crop_mode)
    return dict(geometry, mean=stats[0], std=stats[1])
