"""`--data hfds:PATH`: an image classification dataset written by Hugging Face `datasets`' `save_to_disk`.

PATH holds a DatasetDict (splits 'train' and 'validation', 'val' or 'test') or a single Dataset (split with
seed and val_fraction, stratified by class). The image column is the first of type `Image` (else one named
'image' or 'img'), the label column the first `ClassLabel` (else 'label' or 'labels'); class names come from
the ClassLabel. Images are read from the memory-mapped Arrow files; the transforms are ImageFolder's.
Needs the optional extra `hf` (pip install 'structformer[hf]').
"""
import os

import numpy as np
from torch.utils.data import Dataset

from ..errors import UsageError
from .imagefolder import CROP_PCT, INTERPOLATION, ReplaceUnreadable, UnreadableImage, as_rgb, image_transforms
from .spec import DatasetInfo, Option, check_folder, resolve_options
from .tensor import stratified_split

OPTIONS = {
    'img_size': Option(int, 224, "an integer >= 8 (default: the model's input size)", lambda v: v >= 8),
    'augment': Option(bool, True, 'true or false'),
    'crop_pct': CROP_PCT,
    'interpolation': INTERPOLATION,
    'bad_images': Option(str, 'error', "'error' or 'skip' (an undecodable image is replaced by the next one, "
                         "named in the log)", lambda v: v in ('error', 'skip')),
    'image_column': Option(str, '', 'a column name (default: the first Image column)'),
    'label_column': Option(str, '', 'a column name (default: the first ClassLabel column)'),
}
VAL_SPLITS = ('validation', 'val', 'test')


def _load(path: str, what: str):
    """The saved dataset at `path`; errors begin with `what`, the argument that named it (`--data 'hfds:...'`, or
    `SOURCE hfds:...` for `structformer data shard`)."""
    try:
        import datasets
    except ImportError:
        raise UsageError(f"{what}: needs the 'datasets' package: pip install 'structformer[hf]'") from None
    try:
        return datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f'{what}: {path} is not a dataset saved with datasets.save_to_disk '
                         f'({str(e).splitlines()[0][:200]})') from None


def _columns(ds, opts, what: str, naming: str = '--data-kwargs {role}_column=NAME'):
    """(image column, label column) of `ds`: the options', else the first Image / ClassLabel feature, else the
    usual names. A missing one is named, with how the caller's command names a column (`naming`)."""
    import datasets
    features = ds.features
    image = opts['image_column'] or next((k for k, f in features.items() if isinstance(f, datasets.Image)), None) \
        or next((k for k in ('image', 'img') if k in features), None)
    label = opts['label_column'] or next((k for k, f in features.items() if isinstance(f, datasets.ClassLabel)),
                                         None) or next((k for k in ('label', 'labels') if k in features), None)
    for role, name in (('image', image), ('label', label)):
        if name is None or name not in features:
            raise UsageError(f'{what}: no {role} column among {sorted(features)}; '
                             + naming.format(role=role))
    return image, label


class HFImages(Dataset):
    """(transformed image, label) from rows `indices` of a Hugging Face Dataset."""

    def __init__(self, ds, image: str, label: str, indices, transform, spec: str):
        self.ds, self.image, self.label, self.transform, self.spec = ds, image, label, transform, spec
        self.indices = np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int):
        row = int(self.indices[index])
        try:
            item = self.ds[row]
            picture = item[self.image]
            if not hasattr(picture, 'convert'):          # a path or bytes column without the Image feature
                from PIL import Image
                picture = Image.open(picture)
            picture = as_rgb(picture)
        except UnreadableImage:
            raise
        except Exception as e:
            raise UnreadableImage(f'image row {row} of --data {self.spec} cannot be read: {e}') from None
        return (self.transform(picture) if self.transform else picture), int(item[self.label])


def build_hfds(path, *, spec, seed, val_fraction, train_transform, eval_transform, augmentation=None, **options):
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    opts = resolve_options('hfds', OPTIONS, options)
    train_tf, eval_tf, applied = image_transforms(spec, opts, augmentation, train_transform, eval_transform)
    loaded = _load(check_folder(path, spec), f'--data {spec!r}')
    import datasets
    if isinstance(loaded, datasets.DatasetDict):
        if 'train' not in loaded:
            raise UsageError(f'--data {spec!r}: the saved DatasetDict has splits {sorted(loaded)}; expected "train"')
        val_name = next((s for s in VAL_SPLITS if s in loaded), None)
        train_ds = loaded['train']
    else:
        train_ds, val_name = loaded, None
    image, label = _columns(train_ds, opts, f'--data {spec!r}')
    feature = train_ds.features[label]
    classes = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    targets = np.asarray(train_ds[label])
    if val_name:
        val_ds = loaded[val_name]
        train = HFImages(train_ds, image, label, np.arange(len(train_ds)), train_tf, spec)
        val = HFImages(val_ds, image, label, np.arange(len(val_ds)), eval_tf, spec)
        split = f'split train ({len(train)}) train, {val_name} ({len(val)}) val'
        targets = np.concatenate([targets, np.asarray(val_ds[label])])
    else:
        train_idx, val_idx = stratified_split(targets, val_fraction, seed)
        train = HFImages(train_ds, image, label, train_idx, train_tf, spec)
        val = HFImages(train_ds, image, label, val_idx, eval_tf, spec)
        split = f'stratified split {len(train)} train / {len(val)} val (val_fraction={val_fraction}, seed={seed})'
    num_classes = len(classes) if classes else int(targets.max()) + 1
    if opts['bad_images'] == 'skip':
        train, val = ReplaceUnreadable(train, spec), ReplaceUnreadable(val, spec, held_out=True)
    return train, val, DatasetInfo(
        name='hfds', num_classes=num_classes, in_chans=3, img_size=opts['img_size'], train_size=len(train),
        val_size=len(val), description=f'Hugging Face dataset {os.path.abspath(path)}: {num_classes} classes, '
                                       f'{split}, images at {opts["img_size"]}px',
        extra={'path': path, 'classes': classes, 'class_order': "the ClassLabel's names" if classes else None,
               'mean': list(IMAGENET_DEFAULT_MEAN),
               'std': list(IMAGENET_DEFAULT_STD), 'split': split, 'augment': opts['augment'],
               'augmentation': applied})
