"""`--data hfds:PATH`: an image classification dataset written by Hugging Face `datasets`' `save_to_disk`.

PATH holds a DatasetDict (splits 'train' and 'validation', 'val' or 'test') or a single Dataset (split with
seed and val_fraction, stratified by class). The image column is the first of type `Image` (else one named
'image' or 'img'), the label column the first `ClassLabel` (else 'label' or 'labels'); class names come from
the ClassLabel. Images are read from the memory-mapped Arrow files; the transforms are ImageFolder's.
Needs the optional extra `hf` (pip install 'structformer[hf]').
"""
import io
import os
from typing import List, Optional, Tuple

import numpy as np
from torch.utils.data import Dataset

from ..errors import UsageError
from .imagefolder import CROP_MODE, CROP_PCT, INTERPOLATION, ReplaceUnreadable, UnreadableImage, as_rgb, image_transforms
from .spec import DatasetInfo, Option, check_folder, resolve_options
from .tensor import stratified_split

OPTIONS = {
    'img_size': Option(int, 224, "an integer >= 8 (default: the model's input size)", lambda v: v >= 8),
    'augment': Option(bool, True, 'true or false'),
    'crop_pct': CROP_PCT,
    'interpolation': INTERPOLATION,
    'crop_mode': CROP_MODE,
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
        hub = _hub_files(path)
        if hub:                 # a Hub download (huggingface-cli download ...): parquet files, not save_to_disk's Arrow
            raise UsageError(
                f'{what}: {path} holds {hub} files as the Hub has them (a download), not a dataset saved with '
                "datasets.save_to_disk; convert it once (a copy: about the download's size), e.g. python -c \"import "
                f"datasets; datasets.load_dataset('{path}').save_to_disk('{path.rstrip(os.sep)}-arrow')\", then pass "
                'that folder') from None
        raise UsageError(f'{what}: {path} is not a dataset saved with datasets.save_to_disk '
                         f'({str(e).splitlines()[0][:200]})') from None


def _hub_files(path: str) -> Optional[str]:
    """'parquet' (or another data file type) when `path` holds a Hub dataset repository's data files, else None."""
    for _, _, files in os.walk(path):
        for suffix in ('parquet', 'arrow', 'jsonl', 'csv'):
            if any(f.endswith('.' + suffix) for f in files):
                return suffix
    return None


def labels_of(ds, label: str, what: str) -> np.ndarray:
    """The label column of `ds` as integers, read as one Arrow column (np.asarray(ds[label]) walks the rows: ~10 s
    for ImageNet's 1.28 M); a column that does not hold integers is one line."""
    values = np.asarray(ds.with_format('numpy', columns=[label])[:][label])
    if values.dtype.kind not in 'iu':
        raise UsageError(f'{what}: the label column {label!r} holds {values.dtype} values, not class indices; '
                         'name an integer or ClassLabel column')
    return values.astype(np.int64)


def labelled_splits(loaded, label: str, what: str) -> Tuple[np.ndarray, Optional[str], Optional[np.ndarray], List[str]]:
    """(train labels, the validation split's name or None, its labels, splits passed over) of a loaded dataset.

    The validation split is the first of VAL_SPLITS holding labels: a split whose labels are all -1 holds none
    (the Hub's imagenet-1k `test`: its labels are not public) and is passed over, where it was scored as class -1."""
    import datasets
    if not isinstance(loaded, datasets.DatasetDict):
        return labels_of(loaded, label, what), None, None, []
    passed = []
    for name in VAL_SPLITS:
        if name in loaded:
            values = labels_of(loaded[name], label, f'{what} split {name!r}')
            if len(values) and (values < 0).all():
                passed.append(name)
                continue
            check_class_names(loaded['train'], loaded[name], label, name, what)
            return labels_of(loaded['train'], label, what), name, values, passed
    return labels_of(loaded['train'], label, what), None, None, passed


def check_class_names(train, val, label: str, split: str, what: str) -> None:
    """The validation split's ClassLabel names equal the training split's, in order: index k must mean the same
    class in both, or the validation scores are of other classes than the names say (silently)."""
    import datasets
    ours, theirs = train.features.get(label), val.features.get(label)
    if not (isinstance(ours, datasets.ClassLabel) and isinstance(theirs, datasets.ClassLabel)):
        return
    if list(ours.names) != list(theirs.names):
        k = next((i for i, (a, b) in enumerate(zip(ours.names, theirs.names)) if a != b),
                 min(len(ours.names), len(theirs.names)))
        where = (f'class {k} is {theirs.names[k]!r} there, {ours.names[k]!r} in train'
                 if k < min(len(ours.names), len(theirs.names))
                 else f'{len(theirs.names)} classes there, {len(ours.names)} in train')
        raise UsageError(f"{what}: split {split!r} has other ClassLabel names than split 'train' ({where}); its labels "
                         "would mean other classes: re-map it to train's names (datasets' align_labels_with_mapping)")


def check_labels(values: np.ndarray, num_classes: int, split: str, what: str) -> None:
    """Every label of `split` in [0, num_classes): one line naming the first row outside (cross-entropy would
    stop the run with a traceback at that batch, or count -1 as a class)."""
    bad = np.flatnonzero((values < 0) | (values >= num_classes))
    if len(bad):
        raise UsageError(f'{what}: split {split!r} row {int(bad[0])} has label {int(values[bad[0]])}, outside the '
                         f'{num_classes} classes [0, {num_classes - 1}] ({len(bad)} such rows); unlabelled rows '
                         '(-1) belong in a split of their own')


def image_cell(cell) -> Tuple[Optional[bytes], Optional[str]]:
    """(bytes, path) of an image cell read undecoded: the Image feature's {'bytes', 'path'} (also what a column of
    that struct holds when the feature was lost, e.g. parquet written without it), raw bytes (a binary column),
    or a path (a string column)."""
    if isinstance(cell, dict):
        return cell.get('bytes'), cell.get('path')
    if isinstance(cell, (bytes, bytearray, memoryview)):
        return bytes(cell), None
    return None, cell


def open_image(cell):
    """A PIL image from a cell: decoded by the Image feature already, else from its bytes or its path."""
    if hasattr(cell, 'convert'):
        return cell
    from PIL import Image
    data, path = image_cell(cell)
    return Image.open(io.BytesIO(data)) if data is not None else Image.open(path)


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
            picture = as_rgb(open_image(item[self.image]))   # bytes, a path, or {'bytes', 'path'}: no Image feature
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
    what = f'--data {spec!r}'
    if isinstance(loaded, datasets.DatasetDict):
        if 'train' not in loaded:
            raise UsageError(f'{what}: the saved DatasetDict has splits {sorted(loaded)}; expected "train"')
        train_ds = loaded['train']
    else:
        train_ds = loaded
    image, label = _columns(train_ds, opts, what)
    feature = train_ds.features[label]
    classes = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    targets, val_name, val_targets, passed = labelled_splits(loaded, label, what)
    if passed:
        print(f'--data {spec}: split(s) {", ".join(passed)} hold no labels (all -1): not used for validation',
              flush=True)
    seen = np.concatenate([targets, val_targets]) if val_name else targets
    num_classes = len(classes) if classes else int(seen.max(initial=-1)) + 1
    check_labels(targets, num_classes, 'train', what)
    if val_name:
        check_labels(val_targets, num_classes, val_name, what)
        val_ds = loaded[val_name]
        train = HFImages(train_ds, image, label, np.arange(len(train_ds)), train_tf, spec)
        val = HFImages(val_ds, image, label, np.arange(len(val_ds)), eval_tf, spec)
        split = f'split train ({len(train)}) train, {val_name} ({len(val)}) val'
    else:
        train_idx, val_idx = stratified_split(targets, val_fraction, seed)
        train = HFImages(train_ds, image, label, train_idx, train_tf, spec)
        val = HFImages(train_ds, image, label, val_idx, eval_tf, spec)
        split = f'stratified split {len(train)} train / {len(val)} val (val_fraction={val_fraction}, seed={seed})'
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
