"""build_datasets: one `--data` spec -> (train dataset, val dataset, DatasetInfo)."""
from typing import Callable, Optional, Tuple

from torch.utils.data import Dataset

from .augment import Augmentation
from .cifar import build_cifar10
from .digits import build_digits
from .imagefolder import build_imagefolder
from .mnist import build_mnist
from .sizing import resolve_img_size, resolve_seq_len
from .spec import DatasetInfo, check_val_fraction, parse_data_spec
from .synthetic import build_synthetic
from .text import build_pysource, build_text

_BUILDERS = {'digits': build_digits, 'synthetic-subspaces': build_synthetic, 'pysource': build_pysource}
_FOLDER_BUILDERS = {'mnist': build_mnist, 'cifar10': build_cifar10, 'imagefolder': build_imagefolder,
                    'text': build_text, 'wds': 'wds', 'hfds': 'hfds', 'imagenet': 'imagenet'}


def _builder(name: str):
    """The builder of a path form; the shard and Hugging Face readers are imported only when asked for."""
    if name == 'wds':
        from .wds import build_wds
        return build_wds
    if name == 'hfds':
        from .hfds import build_hfds
        return build_hfds
    if name == 'imagenet':
        from .imagenet import build_imagenet
        return build_imagenet
    return _FOLDER_BUILDERS[name]


def build_datasets(spec: str, *, seed: int = 0, val_fraction: float = 0.2,
                   train_transform: Optional[Callable] = None, eval_transform: Optional[Callable] = None,
                   augmentation: Optional[Augmentation] = None, model: Optional[str] = None,
                   model_kwargs: Optional[dict] = None, **options) -> Tuple[Dataset, Dataset, DatasetInfo]:
    """Train and val datasets for `spec` (see DATASET_FORMS), each yielding (float32 [C, H, W], int label).

    seed / val_fraction: the held-out split where the data has none of its own (digits, synthetic,
    a single MNIST pair, an imagefolder without train/ and val/); `seed` also seeds the synthetic data.
    train_transform / eval_transform: for in-memory datasets, callables applied to the normalised
    tensor after the built-in augmentation; for imagefolder, PIL -> tensor transforms that replace
    the defaults. augmentation: timm's training augmentations (`structformer train`'s --aa, --reprob,
    --remode, --recount, --color-jitter, --scale, --ratio, --hflip; augment.py) for the train split of
    image data; refused (UsageError) for synthetic-subspaces and text; recorded in
    info.extra['augmentation']. None or nothing requested: today's datasets.
    model / model_kwargs: the model the data is for: imagefolder, wds, hfds and cifar10 take its input size
    (pretrained config, or model_kwargs img_size) unless options give img_size, and a given img_size the model
    cannot take is refused naming both sizes (sizing.py).
    options: dataset options, e.g. augment=true, num_classes=4; strings are coerced.
    """
    name, path = parse_data_spec(spec)
    val_fraction = check_val_fraction(val_fraction)
    try:
        seed = int(seed)
    except (TypeError, ValueError):
        raise ValueError(f'seed must be an integer; got {seed!r}') from None
    common = dict(seed=seed, val_fraction=val_fraction, train_transform=train_transform,
                  eval_transform=eval_transform, augmentation=augmentation, **options)
    if model is not None:
        common.update(resolve_img_size(name, options, model, model_kwargs or {}))
        common.update(resolve_seq_len(name, options, model, model_kwargs or {}))
    if name in _BUILDERS:
        return _BUILDERS[name](**common)
    return _builder(name)(path, spec=spec, **common)
