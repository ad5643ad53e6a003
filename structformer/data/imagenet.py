"""ILSVRC-2012 as it is downloaded: `--data imagenet:PATH`, and a SOURCE of `structformer data shard`.

PATH is the download folder, nothing unpacked or re-foldered:

- training: `ILSVRC2012_img_train.tar`, a tar of 1,000 per-class tars (`n01440764.tar`, ...), read in place
  (as timm's ReaderImageInTar does; here indexed by seeking over the headers, so the index reads a few
  hundred bytes per image instead of the 147 GB, and cached by the tar's size and modification time);
  or `train/` with class folders or per-class tars; or Kaggle's `ILSVRC/Data/CLS-LOC/train/`;
- validation: the flat `val/` folder (`ILSVRC2012_val_00000001.JPEG`, ...) or `ILSVRC2012_img_val.tar`,
  labelled by the devkit (`ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt` with
  `meta.mat`, as a folder or inside `ILSVRC2012_devkit_t12.tar.gz`) or by Kaggle's `LOC_val_solution.csv`
  with `LOC_synset_mapping.txt`; a `val/` already in class folders is read as it is.

Class order: the synsets (WNIDs) sorted, which is `LOC_synset_mapping.txt`'s order and the index of
torchvision's ImageNet and of timm's pretrained heads (0 = n01440764, tench); the same for training and
validation. The devkit's own ILSVRC2012_ID numbering (1 = n02119789, kit fox) is another order: it is used
only to read the ground-truth file. Class names are the WNIDs; their words travel as `class_descriptions`.
"""
import csv
import hashlib
import io
import os
import re
import tarfile
import zipfile
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..errors import UsageError
from .shard_sources import FileSplit, RangeSplit, Source
from .tars import _Watched, end_problem

TRAIN_TAR, VAL_TAR = 'ILSVRC2012_img_train.tar', 'ILSVRC2012_img_val.tar'
DEVKIT = 'ILSVRC2012_devkit_t12'
KAGGLE = os.path.join('ILSVRC', 'Data', 'CLS-LOC')
IMAGE_SUFFIXES = ('.jpeg', '.jpg', '.png')
_WNID = re.compile(r'^n\d{8}$')
_VAL_NUMBER = re.compile(r'ILSVRC2012_val_(\d+)')


def _listdir(path: str) -> List[str]:
    """The entries of a folder that can be ImageNet's: no synset, image or tar of it starts with '.', while a
    desktop, a notebook or a copy on a Mac leaves .DS_Store, .Trash-1000/, .ipynb_checkpoints/ and an AppleDouble
    '._NAME' (no image) beside every file; those were read as classes, images or a half-done extraction."""
    return [n for n in os.listdir(path) if not n.startswith('.')]


def _hidden(name: str) -> bool:
    """A tar member of the same kind ('._n01440764_10026.JPEG' from a tar made on a Mac)."""
    return os.path.basename(name).startswith('.')


class Layout:
    """Where the parts of a download are: train (kind, path), val (kind, path), the label files."""

    def __init__(self, root: str, what: str):
        self.root, self.what = root, what
        self.train = self._train()
        self.val = self._val()

    def _train(self) -> Optional[Tuple[str, str]]:
        for kind, path in (('tar-of-tars', os.path.join(self.root, TRAIN_TAR)), ('dir', os.path.join(self.root, 'train')),
                           ('dir', os.path.join(self.root, KAGGLE, 'train'))):
            if kind == 'tar-of-tars' and os.path.isfile(path):
                return kind, path
            if kind == 'dir' and os.path.isdir(path):
                names = _listdir(path)
                # the download moved into train/ to be extracted there (and kept) is not a class tar
                tars = sorted(n for n in names if n.endswith('.tar') and n != TRAIN_TAR)
                folders = [n for n in names if os.path.isdir(os.path.join(path, n))]
                if TRAIN_TAR in names and not tars and not folders:
                    return 'tar-of-tars', os.path.join(path, TRAIN_TAR)
                if tars and folders:          # the usual extraction loop (a folder per class tar, then rm the tar), cut
                    raise UsageError(f'{self.what}: {path} holds both class folders ({len(folders)}) and class tars '
                                     f'({len(tars)}, e.g. {tars[0]}), where one of them was read and the other left '
                                     'out unsaid: an extraction not finished? finish it, or keep one form')
                return ('class-tars' if tars else 'class-folders'), path
        return None

    def _val(self) -> Optional[Tuple[str, str]]:
        for path in (os.path.join(self.root, 'val'), os.path.join(self.root, KAGGLE, 'val')):
            names = _listdir(path) if os.path.isdir(path) else []
            if names:                                          # an empty val/ (made to extract into): the tar is read
                folders = any(os.path.isdir(os.path.join(path, n)) for n in names)
                flat = sorted(n for n in names if n.lower().endswith(IMAGE_SUFFIXES)
                              and not os.path.isdir(os.path.join(path, n)))
                if not folders and not flat and VAL_TAR in names:     # the download moved into val/, not extracted
                    return 'flat-tar', os.path.join(path, VAL_TAR)
                if folders and flat:          # valprep.sh moves the images into class folders one by one: cut
                    raise UsageError(f'{self.what}: {path} holds class folders and {len(flat)} images outside them '
                                     f'(e.g. {flat[0]}), which were left out unsaid: sorting them into class folders '
                                     '(valprep.sh) not finished? finish it, or keep the flat folder')
                return ('class-folders' if folders else 'flat'), path
        path = os.path.join(self.root, VAL_TAR)
        return ('flat-tar', path) if os.path.isfile(path) else None

    def label_file(self, name: str) -> Optional[bytes]:
        """A devkit or Kaggle file's bytes: beside PATH, in the devkit folder, or inside the devkit's tar.gz."""
        for path in (os.path.join(self.root, name), os.path.join(self.root, DEVKIT, 'data', name)):
            if os.path.isfile(path):
                with open(path, 'rb') as f:
                    return f.read()
        archive = os.path.join(self.root, DEVKIT + '.tar.gz')
        if os.path.isfile(archive):
            try:
                with tarfile.open(archive, 'r:gz') as tar:
                    try:
                        return tar.extractfile(f'{DEVKIT}/data/{name}').read()
                    except KeyError:
                        return None
            except (tarfile.TarError, EOFError, OSError) as e:     # a cut download: gzip's EOFError was a traceback
                raise UsageError(f'{self.what}: {archive} cannot be read ({type(e).__name__}: {e}); the file holds '
                                 f'{os.path.getsize(archive):,} bytes (an incomplete download?)') from None
        return None


def read_synsets(layout: Layout) -> Tuple[Optional[List[str]], Dict[str, str], Optional[Dict[int, str]]]:
    """(WNIDs in class order or None, {wnid: words}, the devkit's {ILSVRC2012_ID: wnid} or None)."""
    mapping = layout.label_file('LOC_synset_mapping.txt')
    if mapping is not None:
        words = {}
        for line in mapping.decode('utf-8-sig').splitlines():
            if line.strip():
                wnid, _, text = line.strip().partition(' ')
                words[wnid] = text
        return sorted(words), words, None
    meta = layout.label_file('meta.mat')
    if meta is None:
        return None, {}, None
    import scipy.io
    try:
        synsets = scipy.io.loadmat(io.BytesIO(meta), squeeze_me=True)['synsets']
        leaves = [s for s in synsets if int(s['num_children']) == 0]
        ids = {int(s['ILSVRC2012_ID']): str(s['WNID']) for s in leaves}
        words = {str(s['WNID']): str(s['words']) for s in leaves}
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise UsageError(f'{layout.what}: meta.mat is not the devkit\'s (a "synsets" struct with ILSVRC2012_ID, WNID, '
                         f'words, num_children): {e}') from None
    return sorted(words), words, ids


def val_labels(layout: Layout, ids: Optional[Dict[int, str]]) -> Optional[Dict[int, str]]:
    """{validation image number: wnid} from Kaggle's LOC_val_solution.csv or the devkit's ground truth."""
    solution = layout.label_file('LOC_val_solution.csv')
    if solution is not None:
        out = {}
        # utf-8-sig: a file saved again by a spreadsheet starts with a BOM, which named the first column
        # '\ufeffImageId' (every image then 'has no label'), and the first synset '\ufeffn01440764'
        for row in csv.DictReader(io.StringIO(solution.decode('utf-8-sig'))):
            number = _VAL_NUMBER.search(row.get('ImageId', ''))
            if number and row.get('PredictionString', '').split():
                out[int(number.group(1))] = row['PredictionString'].split()[0]
        return out
    truth = layout.label_file('ILSVRC2012_validation_ground_truth.txt')
    if truth is None:
        return None
    if ids is None:
        raise UsageError(f'{layout.what}: the devkit\'s ILSVRC2012_validation_ground_truth.txt needs its meta.mat '
                         '(the ILSVRC2012_ID -> WNID table) beside it')
    try:
        return {k + 1: ids[int(v)] for k, v in enumerate(truth.decode('ascii').split())}
    except (KeyError, ValueError) as e:
        raise UsageError(f'{layout.what}: ILSVRC2012_validation_ground_truth.txt holds an id meta.mat does not '
                         f'name: {e}') from None


# ----------------------------------------------------------------------------- indexing tars in place

INDEX_FORMAT = 4          # in the cache key: bump when what an index holds changes (2: per_class names; 3: UTF-8;
                          # 4: hidden members '._NAME' left out)
KEEP_INDEXES = 8          # index files kept in the cache, the most recently used


def _cache_path(paths: List[str], nested: bool, per_class: bool) -> str:
    from .imagecheck import cache_dir
    digest = hashlib.sha256(f'{INDEX_FORMAT}\t{nested}\t{per_class}\n'.encode())
    for p in paths:
        st = os.stat(p)
        digest.update(f'{os.path.abspath(p)}\t{st.st_size}\t{st.st_mtime_ns}\n'.encode())
    return os.path.join(os.path.dirname(cache_dir()), 'imagenet-index', digest.hexdigest() + '.npz')


def _members(tar: tarfile.TarFile, where: str):
    """Regular members of a tar opened for seeking (headers only), then a check that it ended where tar ends."""
    for member in tar:
        if member.isreg():
            yield member
    problem = end_problem(tar)
    if problem:
        raise UsageError(f'{where} {problem}')


def index_tars(paths: List[str], nested: bool, what: str,
               per_class: bool = False) -> Tuple[List[str], List[Tuple[str, int, int]]]:
    """(member names, (file, offset, size)) of the images in uncompressed tars, or in the tars inside them
    (`nested`: a tar of per-class tars, the names then 'n01440764/n01440764_10026.JPEG'; `per_class`: each tar is a
    class, its name the prefix, 'n01440764/...'); cached. Under torchrun process 0 indexes first and the others read
    its cache (each process indexed the 1.28 M headers at once on a first run; where the cache cannot be written
    they index again)."""
    from .process0 import process_0_first
    return process_0_first(lambda: _index_tars(paths, nested, what, per_class))


def _index_tars(paths: List[str], nested: bool, what: str, per_class: bool):
    cache = _cache_path(paths, nested, per_class)
    try:
        with np.load(cache, allow_pickle=False) as z:
            names = [n.decode('utf-8') for n in z['names'].tolist()]
            _touch(cache)
            return names, [(paths[t], int(o), int(s)) for t, o, s in zip(z['tar'], z['offset'], z['size'])]
    except (OSError, KeyError, ValueError, IndexError, EOFError, zipfile.BadZipFile):
        pass                                  # none, or damaged (np.load of an empty file: EOFError): index again
    names, ranges = [], []
    for path in paths:
        member = None
        try:
            with tarfile.open(path, 'r:', tarinfo=_Watched) as outer:
                for member in _members(outer, f'{what}: {path}'):
                    if _hidden(member.name):
                        continue
                    if nested and member.name.lower().endswith('.tar'):
                        wnid = os.path.splitext(os.path.basename(member.name))[0]
                        with tarfile.open(fileobj=outer.extractfile(member), mode='r:', tarinfo=_Watched) as inner:
                            for m in _members(inner, f'{what}: {path}: {member.name}'):
                                if m.name.lower().endswith(IMAGE_SUFFIXES) and not _hidden(m.name):
                                    names.append(f'{wnid}/{os.path.basename(m.name)}')
                                    ranges.append((path, member.offset_data + m.offset_data, m.size))
                    elif member.name.lower().endswith(IMAGE_SUFFIXES):
                        # a class tar's images are its class's, however many class tars there are (one: the
                        # names lacked the class and the run stopped, 'training class n01440764_0.JPEG')
                        prefix = os.path.splitext(os.path.basename(path))[0] + '/' if per_class else ''
                        names.append(prefix + os.path.basename(member.name))
                        ranges.append((path, member.offset_data, member.size))
        except tarfile.ReadError as e:
            # a member whose bytes run past the end of the file (a download cut mid-way): tarfile raises ReadError
            # ('unexpected end of data', 'empty file') as it seeks to the next header; was a traceback
            inside = f' (in or after {member.name}, at byte {member.offset})' if member is not None else ''
            size = os.path.getsize(path)
            raise UsageError(f'{what}: {path} is cut short or damaged{inside}: {e}; the file holds {size:,} bytes '
                             '(an incomplete download? compare its size and checksum with the published ones)') from None
    try:
        from ..atomic import write_atomically
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        where = {p: i for i, p in enumerate(paths)}
        # names as UTF-8 bytes: numpy's str arrays hold 4 bytes a character (ImageNet's train index: 174 MB, 63 MB so)
        write_atomically(cache, lambda f: np.savez(
            f, names=np.array([n.encode('utf-8') for n in names], dtype=bytes),
            tar=np.array([where[r[0]] for r in ranges], np.int32), offset=np.array([r[1] for r in ranges], np.int64),
            size=np.array([r[2] for r in ranges], np.int64)), binary=True)
        _prune(os.path.dirname(cache))
    except OSError:
        pass                                  # a read-only home: index again next time
    return names, ranges


def _touch(cache: str) -> None:
    """Mark an index file used (its modification time is what _prune keeps the newest by)."""
    try:
        os.utime(cache)
    except OSError:
        pass                                  # a read-only cache: it is read all the same


def _prune(folder: str) -> None:
    """Keep the KEEP_INDEXES most recently used index files. Each copy of a download (a cluster job copying it to
    local disk: another path, another modification time) is indexed anew, and its file of tens of MB stayed in
    the home folder's cache for good. A removed index only costs indexing again."""
    entries = sorted((e for e in os.scandir(folder) if e.name.endswith('.npz')),
                     key=lambda e: e.stat().st_mtime_ns, reverse=True)
    for entry in entries[KEEP_INDEXES:]:
        try:
            os.unlink(entry.path)
        except OSError:
            pass                              # removed by another process meanwhile


# ----------------------------------------------------------------------------- splits

def _labelled(names: List[str], classes: List[str], what: str) -> List[int]:
    """Class index of each 'wnid/...' name; one line naming a class folder or tar outside the synset list."""
    index = {c: i for i, c in enumerate(classes)}
    out = []
    for name in names:
        wnid = name.split('/')[0]
        if wnid not in index:
            raise UsageError(f'{what}: training class {wnid!r} ({name}) is not in the synset list of the labels '
                             f'({len(classes)} classes)')
        out.append(index[wnid])
    return out


def _train_split(layout: Layout, classes: Optional[List[str]]):
    kind, path = layout.train
    if kind == 'class-folders':
        folders = sorted(c for c in _listdir(path) if os.path.isdir(os.path.join(path, c)))
        files = sorted(os.path.join(c, n) for c in folders
                       for n in _listdir(os.path.join(path, c)) if n.lower().endswith(IMAGE_SUFFIXES))
        classes = classes or _found_classes(folders, files, os.sep, layout.what, path)
        labels = _labelled([f.replace(os.sep, '/') for f in files], classes, layout.what)
        return classes, FileSplit([os.path.join(path, f) for f in files], labels)
    tars = [path] if kind == 'tar-of-tars' else sorted(os.path.join(path, n) for n in _listdir(path)
                                                      if n.endswith('.tar'))
    names, ranges = index_tars(tars, nested=kind == 'tar-of-tars', what=layout.what, per_class=kind == 'class-tars')
    if not classes and kind == 'class-tars':
        classes = _found_classes([os.path.basename(t)[:-4] for t in tars], names, '/', layout.what, path)
    classes = classes or sorted({n.split('/')[0] for n in names})
    return classes, RangeSplit(names, _labelled(names, classes, layout.what), ranges)


def _found_classes(expected: List[str], names: List[str], sep: str, what: str, path: str) -> List[str]:
    """The classes of a training folder without a synset list: its class folders (or class tars), sorted; one that
    holds no image is one line, as torchvision's ImageFolder refuses it (it was dropped, and the model built with
    a class fewer than the folders, its indices shifted against the val/ folders)."""
    found = {n.split(sep)[0] for n in names}
    empty = [c for c in expected if c not in found]
    if empty:
        raise UsageError(f'{what}: {len(empty)} training class(es) of {path} hold no image, e.g. {empty[0]} (an '
                         'incomplete extraction?); complete or remove them, or put the labels (LOC_synset_mapping.txt '
                         'or the devkit) beside them to fix the class list')
    return sorted(expected)


def _val_split(layout: Layout, classes: List[str], ids):
    kind, path = layout.val
    if kind == 'class-folders':
        files = sorted(os.path.join(c, n) for c in _listdir(path) if os.path.isdir(os.path.join(path, c))
                       for n in _listdir(os.path.join(path, c)) if n.lower().endswith(IMAGE_SUFFIXES))
        return FileSplit([os.path.join(path, f) for f in files],
                         _labelled([f.replace(os.sep, '/') for f in files], classes, layout.what))
    truth = val_labels(layout, ids)
    if truth is None:
        raise UsageError(f'{layout.what}: the flat validation images of {path} need their labels: the devkit '
                         f'({DEVKIT}/ or {DEVKIT}.tar.gz, with ILSVRC2012_validation_ground_truth.txt and meta.mat) '
                         'or LOC_val_solution.csv with LOC_synset_mapping.txt, in the same folder')
    if kind == 'flat':
        names = sorted(n for n in _listdir(path) if n.lower().endswith(IMAGE_SUFFIXES))
        split_of = lambda names, labels: FileSplit([os.path.join(path, n) for n in names], labels)   # noqa: E731
    else:
        names, ranges = index_tars([path], nested=False, what=layout.what)
        split_of = lambda names, labels: RangeSplit(names, labels, ranges)   # noqa: E731
    index, labels = {c: i for i, c in enumerate(classes)}, []
    for name in names:
        number = _VAL_NUMBER.search(name)
        wnid = truth.get(int(number.group(1))) if number else None
        if wnid is None or wnid not in index:
            raise UsageError(f'{layout.what}: validation image {name} has no label in the label file'
                             if wnid is None else f'{layout.what}: validation image {name} is labelled {wnid}, '
                             'which is not a training class')
        labels.append(index[wnid])
    if len(names) != len(truth):
        raise UsageError(f'{layout.what}: the label file labels {len(truth)} validation images; {path} holds '
                         f'{len(names)} (an incomplete download?)')
    return split_of(names, labels)


def imagenet_source(path: str, what: str, validation_only: bool = False) -> Source:
    """The training and validation splits of a download folder, in the synset order (see the module's doc).
    `validation_only`: a folder with the validation images alone (and the synset list, or val/ in class folders)
    gives the 'validation' split alone, enough to score a model; else it is refused."""
    root = os.path.expanduser(path)
    if not os.path.isdir(root):
        raise UsageError(f'{what}{path}: not a folder (expected the ImageNet download folder)')
    layout = Layout(root, f'{what}{path}')
    no_train = f'{what}{path}: no training images: expected {TRAIN_TAR}, train/ or {KAGGLE}/train/'
    if layout.train is None and not (validation_only and layout.val is not None):
        raise UsageError(no_train)
    classes, words, ids = read_synsets(layout)
    splits = {}
    if layout.train is not None:
        classes, splits['train'] = _train_split(layout, classes)
    elif classes is None and layout.val[0] == 'class-folders':
        classes = sorted(c for c in _listdir(layout.val[1]) if os.path.isdir(os.path.join(layout.val[1], c)))
    elif classes is None:
        raise UsageError(f'{no_train}; and no synset list (LOC_synset_mapping.txt or the devkit\'s meta.mat) to '
                         'name the classes of the validation images by')
    if layout.val is not None:
        splits['validation'] = _val_split(layout, classes, ids)
    source = Source(f'ImageNet download folder {os.path.abspath(root)}', classes, splits,
                    'the synset list: WNIDs sorted (LOC_synset_mapping.txt order)')
    source.descriptions = [words.get(c, '') for c in classes]
    return source


# ----------------------------------------------------------------------------- --data imagenet:PATH

def _options():
    from .imagefolder import CROP_MODE, CROP_PCT, INTERPOLATION
    from .spec import Option
    return {
        'img_size': Option(int, 224, "an integer >= 8 (default: the model's input size)", lambda v: v >= 8),
        'augment': Option(bool, True, 'true or false'),
        'crop_pct': CROP_PCT,
        'interpolation': INTERPOLATION,
        'crop_mode': CROP_MODE,
        'bad_images': Option(str, 'error', "'error' or 'skip' (an undecodable image is replaced by the next one, "
                             "named in the log)", lambda v: v in ('error', 'skip')),
    }


class NoTrainingImages:
    """The training split of a download that holds the validation images alone: empty; training on it is refused
    with `empty_because` (the loaders' check), scoring does not read it."""

    targets: List[int] = []

    def __init__(self, empty_because: str):
        self.empty_because = empty_because

    def __len__(self) -> int:
        return 0

    def __getitem__(self, index: int):
        raise UsageError(self.empty_because)


class SplitImages:
    """(transformed image, class) of a Split, decoded on access (a map-style data set for the loaders).

    `spec` given (bad_images=error): an image that does not decode stops the run with one line naming it and
    --data-kwargs bad_images=skip, which trains past it (the wds form's line said so, this one did not); under
    bad_images=skip ReplaceUnreadable reads the bare UnreadableImage instead."""

    def __init__(self, split, transform, indices=None, spec: Optional[str] = None):
        self.split, self.transform, self.spec = split, transform, spec
        self.indices = list(range(len(split))) if indices is None else [int(i) for i in indices]

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def targets(self) -> List[int]:
        return [self.split.labels[i] for i in self.indices]

    def __getitem__(self, index: int):
        from .imagefolder import UnreadableImage
        from .tars import decode_rgb
        i = self.indices[index]
        _, data = self.split.read(i)
        try:
            image = decode_rgb(data, self.split.names[i])
        except UnreadableImage as e:
            if self.spec is None:
                raise
            raise UnreadableImage(f'--data {self.spec!r}: {e}; pass --data-kwargs bad_images=skip to go on past '
                                  'such images (each replaced by the next one, named in the log)') from None
        return (self.transform(image) if self.transform else image), self.split.labels[i]


def build_imagenet(path, *, spec, seed, val_fraction, train_transform, eval_transform, augmentation=None, **options):
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    from .imagefolder import ReplaceUnreadable, image_transforms
    from .spec import DatasetInfo, resolve_options
    from .tensor import stratified_split
    opts = resolve_options('imagenet', _options(), options)
    train_tf, eval_tf, applied = image_transforms(spec, opts, augmentation, train_transform, eval_transform)
    source = imagenet_source(path, '--data imagenet:', validation_only=True)
    named = spec if opts['bad_images'] == 'error' else None      # the stop on an undecodable image names the option
    images = lambda split, transform, indices=None: SplitImages(split, transform, indices, named)   # noqa: E731
    train_split = source.splits.get('train')
    if train_split is None:         # the val tar and the devkit alone, as downloaded to score pretrained models
        val = images(source.splits['validation'], eval_tf)
        train = NoTrainingImages(f'--data {spec}: holds the validation images alone (no {TRAIN_TAR}, train/ or '
                                 f'{KAGGLE}/train/): enough to score a model on them, not to train one or score '
                                 'its training split')
        split = f'validation images alone: {len(val)} (no training images)'
    elif 'validation' in source.splits:
        train, val = images(train_split, train_tf), images(source.splits['validation'], eval_tf)
        split = f'{len(train)} train, {len(val)} validation images'
    else:
        train_idx, val_idx = stratified_split(np.asarray(train_split.labels), val_fraction, seed)
        train, val = images(train_split, train_tf, train_idx), images(train_split, eval_tf, val_idx)
        split = (f'no validation images found: stratified split {len(train)} train / {len(val)} val '
                 f'(val_fraction={val_fraction}, seed={seed})')
    if opts['bad_images'] == 'skip':
        train = train if train_split is None else ReplaceUnreadable(train, spec)
        val = ReplaceUnreadable(val, spec, held_out=True)
    classes = source.classes
    return train, val, DatasetInfo(
        name='imagenet', num_classes=len(classes), in_chans=3, img_size=opts['img_size'], train_size=len(train),
        val_size=len(val), description=f'{source.description}: {len(classes)} classes, {split}, images at '
                                       f'{opts["img_size"]}px',
        extra={'path': path, 'classes': list(classes), 'class_descriptions': source.descriptions,
               'class_order': source.class_order, 'mean': list(IMAGENET_DEFAULT_MEAN),
               'std': list(IMAGENET_DEFAULT_STD), 'split': split, 'augment': opts['augment'],
               'augmentation': applied})
