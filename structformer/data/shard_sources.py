"""What `structformer data shard SOURCE OUT` reads: an image folder, `hfds:PATH` or a timm `create_dataset` data
set (`timm:NAME:ROOT`) here, ImageNet as downloaded in imagenet.py; each as splits of (encoded image, class index)
items. `shard_writer.open_source` picks the form.

A split lists its items cheaply up front (`label`, `name`); the bytes are read in the writer processes
(`read`: the image file's own bytes where its format is one a shard holds, else re-encoded as PNG). Class
indices are the source's own: torchvision's sorted folder names for an image folder, the ClassLabel's for
hfds, the synset order for ImageNet, the reader's `class_to_idx` for timm (timm sorts folder names without
case, torchvision by code point: for `Zebra`, `ant`, `Bee` the two differ; `_info.json` records the names
in the order used).
"""
import io
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import UsageError
from .imagefolder import as_rgb

# the member extension of each image format stored as it is: webdataset's names, the ones timm's wds reader looks
# for ('jpg;png;webp'); MPO is a JPEG with extra pictures appended (some cameras' files), read as JPEG
_FORMAT_KEYS = {'JPEG': 'jpg', 'MPO': 'jpg', 'PNG': 'png', 'WEBP': 'webp'}


def as_shard_image(data: bytes, ext: Optional[str]) -> Tuple[str, bytes]:
    """(extension, bytes) to store: the bytes as they are, named by their format as PIL reads it from the header
    (not the file name's: ImageNet's `.JPEG` files were stored as `KEY.jpeg`, which timm's wds reader passes over,
    reading none of them, and its PNG named `.JPEG` as a JPEG); another format is re-encoded as PNG. Bytes PIL
    cannot open keep the name's extension (the writer's decode check names them)."""
    from PIL import Image
    try:
        with Image.open(io.BytesIO(data)) as im:
            key = _FORMAT_KEYS.get(im.format or '')
            if key:
                return key, data
            out = io.BytesIO()
            as_rgb(im).save(out, 'PNG')
    except Exception:               # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
        return (ext or '').lower().lstrip('.') or 'jpg', data
    return 'png', out.getvalue()


class Split:
    """Items of one split: `labels[i]`, `names[i]` (for keys and messages); `read(i)` -> (extension, bytes)."""

    def __init__(self, names: Sequence[str], labels: Sequence[int]):
        self.names, self.labels = list(names), [int(v) for v in labels]

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, i: int) -> Tuple[str, bytes]:
        raise NotImplementedError


class FileSplit(Split):
    """Image files, read whole."""

    def __init__(self, paths: Sequence[str], labels: Sequence[int]):
        super().__init__(paths, labels)

    def read(self, i: int) -> Tuple[str, bytes]:
        path = self.names[i]
        with open(path, 'rb') as f:
            return as_shard_image(f.read(), os.path.splitext(path)[1])


class RangeSplit(Split):
    """Byte ranges of files (images inside uncompressed tars): [(file, offset, size)]."""

    def __init__(self, names: Sequence[str], labels: Sequence[int], ranges: Sequence[Tuple[str, int, int]]):
        super().__init__(names, labels)
        self.ranges = list(ranges)

    def read(self, i: int) -> Tuple[str, bytes]:
        path, offset, size = self.ranges[i]
        with open(path, 'rb') as f:
            f.seek(offset)
            return as_shard_image(f.read(size), os.path.splitext(self.names[i])[1])


class HFSplit(Split):
    """Rows of a Hugging Face Dataset whose image column is read undecoded ({'bytes', 'path'})."""

    def __init__(self, ds, image: str, labels: Sequence[int], where: str):
        super().__init__([f'{where} row {i}' for i in range(len(labels))], labels)
        self.ds, self.image = ds, image

    def read(self, i: int) -> Tuple[str, bytes]:
        from .hfds import image_cell
        data, path = image_cell(self.ds[i][self.image])          # {'bytes', 'path'}, raw bytes, or a path
        if data is None:
            with open(path, 'rb') as f:
                data = f.read()
        return as_shard_image(data, os.path.splitext(path)[1] if path else None)


class TimmSplit(Split):
    """A map-style timm data set: its reader's open file where it has one (folder, tar readers), else the
    image it returns, encoded as PNG."""

    def __init__(self, ds, names: Sequence[str], labels: Sequence[int]):
        super().__init__(names, labels)
        self.ds = ds

    def read(self, i: int) -> Tuple[str, bytes]:
        reader = getattr(self.ds, 'reader', None)
        if reader is not None:
            handle = reader[i][0]
            try:
                return as_shard_image(handle.read(), os.path.splitext(self.names[i])[1])
            finally:
                handle.close()
        image = self.ds[i][0]
        out = io.BytesIO()
        as_rgb(image).save(out, 'PNG')
        return 'png', out.getvalue()


class Source:
    """Splits ('train' and, where the source has one, 'validation') with their class names."""

    def __init__(self, description: str, classes: Optional[List[str]], splits: Dict[str, Split],
                 class_order: str = ''):
        self.description, self.classes, self.splits, self.class_order = description, classes, splits, class_order


# ----------------------------------------------------------------------------- the forms

def folder_source(folder: str) -> Source:
    from .imagefolder import image_folder
    folder = os.path.expanduser(folder)
    if not os.path.isdir(folder):
        raise UsageError(f'SOURCE {folder}: not a folder (accepted: an image folder, imagefolder:PATH, hfds:PATH, '
                         'imagenet:PATH, timm:NAME:ROOT)')
    from .imagefolder import split_folders
    train_dir, val_path = split_folders(folder)           # train/ alone was read as one class named 'train'
    val_dir = os.path.basename(val_path) if val_path else None
    roots = {'train': train_dir or folder, **({'validation': val_path} if val_path else {})}
    splits, classes = {}, None
    for split, root in roots.items():
        try:
            ds = image_folder(root)
        except FileNotFoundError as e:
            from .imagefolder import imagenet_hint
            raise UsageError(f'SOURCE {root}: not an image folder: expected {root}/<class>/<image> ({e})'
                             + imagenet_hint(root).replace('pass imagenet:', 'give SOURCE imagenet:')) from None
        if classes is not None:          # val/ labelled by train/'s class index (it may lack some of its classes)
            from .imagefolder import label_by_train_classes
            label_by_train_classes(ds, classes, f'SOURCE {folder}', val_dir)
        classes = ds.classes
        splits[split] = FileSplit([p for p, _ in ds.samples], [t for _, t in ds.samples])
    from .imagefolder import FOLDER_CLASS_ORDER
    return Source(f'image folder {os.path.abspath(folder)}', classes, splits, FOLDER_CLASS_ORDER)


def hfds_source(path: str) -> Source:
    from .hfds import OPTIONS, _columns, _load, check_labels, labelled_splits
    from .spec import resolve_options
    spec = f'hfds:{path}'
    what = f'SOURCE {spec}'
    loaded = _load(os.path.expanduser(path), what)
    import datasets
    if isinstance(loaded, datasets.DatasetDict) and 'train' not in loaded:
        raise UsageError(f'{what}: the saved DatasetDict has splits {sorted(loaded)}; expected "train"')
    train = loaded['train'] if isinstance(loaded, datasets.DatasetDict) else loaded
    image, label = _columns(train, resolve_options('hfds', OPTIONS, {}), what,
                            "data shard takes the first Image and ClassLabel columns (else 'image' / 'img' and "
                            "'label' / 'labels'): name the {role} column so with datasets' rename_column")
    feature = train.features[label]
    classes = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    train_labels, val_name, val_labels, passed = labelled_splits(loaded, label, what)
    if passed:       # the Hub's imagenet-1k `test` (labels -1): was written as the validation shards, class -1
        print(f'data shard: split(s) {", ".join(passed)} hold no labels (all -1): not written', flush=True)
    parts = {'train': (train, train_labels), **({'validation': (loaded[val_name], val_labels)} if val_name else {})}
    seen = np.concatenate([values for _, values in parts.values()])
    num_classes = len(classes) if classes else int(seen.max(initial=-1)) + 1
    splits = {}
    for name, (ds, values) in parts.items():
        check_labels(values, num_classes, val_name if name == 'validation' else name, what)
        raw = ds.cast_column(image, datasets.Image(decode=False)) if isinstance(ds.features[image], datasets.Image) \
            else ds
        splits[name] = HFSplit(raw, image, values.tolist(), f'{spec} {name}')
    return Source(f'Hugging Face dataset {os.path.abspath(os.path.expanduser(path))}', classes, splits,
                  "the ClassLabel's names")


def timm_source(name: str, root: str) -> Source:
    """timm's create_dataset(name, root, split) for 'train' and 'validation' (timm's split search: a folder's
    train/ and val/ sub-folders); a root without split folders is one 'train' split."""
    from timm.data import create_dataset
    spec = f'timm:{name}:{root}'
    if not os.path.exists(os.path.expanduser(root)):
        raise UsageError(f'SOURCE {spec}: {root} does not exist')
    splits, classes, seen = {}, None, {}
    for split in ('train', 'validation'):
        try:
            ds = create_dataset(name, root=os.path.expanduser(root), split=split, load_bytes=True)
        except (AssertionError, RuntimeError, ValueError, FileNotFoundError) as e:
            if split == 'validation':
                continue
            raise UsageError(f'SOURCE {spec}: timm.data.create_dataset refused it: {e}') from None
        if not hasattr(ds, '__getitem__') or not hasattr(ds, '__len__'):
            raise UsageError(f'SOURCE {spec}: an iterable timm data set; data shard reads map-style ones (folder, '
                             'tar, hfds/, torch/)')
        reader = getattr(ds, 'reader', None)
        where = getattr(reader, 'root', None) or getattr(ds, 'root', None)
        if where is not None and where in seen.values():
            continue                       # no split folders: timm gave the same data for both splits
        seen[split] = where
        mapping = getattr(reader, 'class_to_idx', None) or getattr(reader, 'class_name_to_idx', None) \
            or getattr(ds, 'class_to_idx', None)
        names = [reader._filename(i, absolute=True) if hasattr(reader, '_filename') else f'{spec} {split} {i}'
                 for i in range(len(ds))] if reader is not None else [f'{spec} {split} {i}' for i in range(len(ds))]
        labels = _timm_labels(ds, reader)
        split_classes = [c for c, _ in sorted(mapping.items(), key=lambda kv: kv[1])] if mapping else None
        if classes is not None and split_classes != classes:
            raise UsageError(f'SOURCE {spec}: its train and validation splits have different classes')
        classes = split_classes
        splits[split] = TimmSplit(ds, names, labels)
    return Source(f'timm create_dataset({name!r}, {os.path.abspath(os.path.expanduser(root))!r})', classes, splits,
                  "timm's reader: folder names in natural order, case ignored")


def _timm_labels(ds, reader) -> List[int]:
    if reader is not None and hasattr(reader, 'samples') and hasattr(reader, 'targets'):
        return [int(t) for t in reader.targets]                # ReaderImageInTar
    if reader is not None and hasattr(reader, 'samples'):
        return [int(t) for _, t in reader.samples]             # ReaderImageFolder
    targets = getattr(ds, 'targets', None)
    if targets is not None:
        return [int(t) for t in targets]
    return [int(ds[i][1]) for i in range(len(ds))]
