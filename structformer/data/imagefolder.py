"""Any folder of images in torchvision's ImageFolder layout: PATH/<class>/<image> (RGB, any size).

If PATH has `train/` and `val/` (or `test/`) sub-folders, those are the two splits; otherwise the
images of PATH are split, stratified by class, with `seed` and `val_fraction`.

Before training every file is checked once (option `check`): 'header' (default) opens each file's
header in parallel threads, without decoding, so a file that is not an image is found up front and
named; 'decode' decodes every image (JPEGs at 1/8 scale, which still reads every byte); 'none' skips
the pass. The result is cached by the file list, sizes and modification times (imagecheck.py) and, under
torchrun, computed by process 0 and shared. Option `bad_images`: 'error' (default) stops before training,
naming the files and the reasons; 'skip' leaves them out and prints how many, and which, in the log; a
file that still fails to decode during training (e.g. truncated: its header was fine) is then replaced
by the next readable sample and named in the log, never a crash mid-epoch.
"""
import copy
import os
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import Dataset, Subset

from ..errors import UsageError
from .augment import given_flags, timm_train_transform, wanted
from .spec import DatasetInfo, Option, check_folder, resolve_options
from .tensor import stratified_split

# the held-out images' geometry, timm's crop_pct: resize to img_size / crop_pct, then centre-crop img_size; timm's
# 0.875 unless given. 1.0 keeps the whole image, as the standard CIFAR / STL evaluation and the public CRATE
# finetune.py (Resize((224, 224))) do; shared by every image form that goes through image_transforms
CROP_PCT = Option(float, None, "a number in (0, 1] (held-out images resized to img_size / crop_pct, then centre-"
                  "cropped; default timm's 0.875)", lambda v: v is None or 0 < v <= 1)
# and the resampling of that resize (timm's --interpolation; DeiT and the public SOFT code evaluate bicubic)
EVAL_INTERPOLATIONS = ('bilinear', 'bicubic', 'nearest', 'lanczos', 'box', 'hamming')
INTERPOLATION = Option(str, None, "one of " + ', '.join(EVAL_INTERPOLATIONS) + " (the held-out images' resize; "
                       "default bilinear)", lambda v: v is None or v in EVAL_INTERPOLATIONS)
# and how that resize meets the square: timm's crop_mode. 'squash' resizes both sides to img_size / crop_pct without
# keeping the aspect ratio (at crop_pct 1.0 torchvision's Resize((s, s)), the public CRATE finetune.py's test
# transform); 'border' fits the long side and pads
CROP_MODES = ('center', 'squash', 'border')
CROP_MODE = Option(str, None, "one of center (short side resized, centre crop; default), squash (both sides "
                   "resized, aspect ratio not kept) or border (long side fitted, padded)",
                   lambda v: v is None or v in CROP_MODES)
OPTIONS = {
    'img_size': Option(int, 224, "an integer >= 8 (default: the model's input size)", lambda v: v >= 8),
    'augment': Option(bool, True, 'true or false'),
    'crop_pct': CROP_PCT,
    'interpolation': INTERPOLATION,
    'crop_mode': CROP_MODE,
    'bad_images': Option(str, 'error', "'error' (stop before training) or 'skip' (leave them out, counted in the log)",
                         lambda v: v in ('error', 'skip')),
    'check': Option(str, 'header', "'header' (open each file's header, default), 'decode' (decode every image) "
                    "or 'none'", lambda v: v in ('header', 'decode', 'none')),
}
_SHOWN = 3        # unreadable files named in a message; the rest are counted
# The class index of an image folder: torchvision's ImageFolder sorts the folder names by code point ('Bee', 'Zebra',
# 'ant'); timm's folder reader sorts them without case ('ant', 'Bee', 'Zebra'). We keep torchvision's (earlier runs
# used it) and record it with the names, so a run, its checkpoints and its exports say which index is which class.
FOLDER_CLASS_ORDER = "torchvision's ImageFolder: folder names sorted by code point"


class UnreadableImage(UsageError):
    """An image file of an --data imagefolder cannot be decoded."""


def image_problem(path: str) -> Optional[str]:
    """None if `path` decodes as an image, else the reason it does not (imagecheck.decode_problem)."""
    from .imagecheck import decode_problem
    return decode_problem(path)


def find_unreadable(paths: Sequence[str], mode: str = 'decode') -> List[Tuple[str, str]]:
    """(path, reason) for every file of `paths` that fails the check `mode` ('header' or 'decode'), uncached."""
    from .imagecheck import run_check
    return run_check(list(paths), mode)


LEFT_OUT = -1       # the target of a held-out item that could not be read: evaluation counts it nowhere


def report_replaced(holder, name: str, why: str, replacement_name: str) -> None:
    """One log line per unreadable file a loader process meets (bad_images=skip), with its count."""
    seen = holder.__dict__.setdefault('bad_seen', [])
    if name not in seen:
        seen.append(name)
        done = ('left out of the evaluation' if getattr(holder, 'held_out', False)
                else f'replaced by {replacement_name}')
        print(f'--data {getattr(holder, "spec", "")}: {why}; {done} (bad_images=skip; '
              f'{len(seen)} unreadable image(s) met by this loader process)', flush=True)


class ReplaceUnreadable(Dataset):
    """`dataset` whose items that fail to decode (UnreadableImage) are replaced by the next readable item, each
    failure named in the log once: bad_images=skip never stops a run mid-epoch. `held_out` (a validation split):
    the replacement keeps the batch's shape but carries the target LEFT_OUT, so `train.evaluate` leaves it out
    (standing in with the next item's label, that item was counted twice and the unreadable one not at all)."""

    def __init__(self, dataset, spec: str, held_out: bool = False):
        self.dataset, self.spec, self.held_out = dataset, spec, held_out

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):           # classes, targets, transform ... of the wrapped dataset
        if name in ('dataset', 'spec', 'held_out', '__setstate__'):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, index: int):
        n = len(self.dataset)
        for k in range(min(n, 100)):
            try:
                image, target = self.dataset[(index + k) % n]
                return image, (LEFT_OUT if self.held_out and k else target)
            except UnreadableImage as e:
                report_replaced(self, str(e).split(' cannot be read')[0].removeprefix('image '), str(e),
                                f'item {(index + k + 1) % n}')
        raise UnreadableImage(f'--data {self.spec!r}: {min(n, 100)} consecutive images from item {index} cannot be '
                              'read; the data is broken beyond skipping')


def _name_files(bad: List[Tuple[str, str]]) -> str:
    shown = '; '.join(f'{p} ({why})' for p, why in bad[:_SHOWN])
    return shown + (f'; and {len(bad) - _SHOWN} more' if len(bad) > _SHOWN else '')


_WIDE_GREY = ('I;16', 'I;16L', 'I;16B', 'I;16N', 'I')


def as_rgb(image):
    """`image.convert('RGB')`, except for 16-bit greyscale (a 16-bit PNG opens as 'I;16' or 'I'): PIL's convert
    clips those values at 255, so such an image read ~98 % white (torchvision's and timm's loaders alike); their
    top 8 bits are taken instead."""
    if image.mode not in _WIDE_GREY:
        return image.convert('RGB')
    import numpy as np
    from PIL import Image
    values = np.asarray(image).astype(np.int64) >> 8
    return Image.fromarray(np.clip(values, 0, 255).astype(np.uint8), 'L').convert('RGB')


def load_rgb(path: str):
    """torchvision's PIL loader (16-bit greyscale scaled: `as_rgb`), naming the file if it fails (e.g. changed after
    the check)."""
    from PIL import Image
    try:
        with open(path, 'rb') as f:
            return as_rgb(Image.open(f))
    except (OSError, SyntaxError, ValueError) as e:        # e.g. a JPEG cut after its header: 'image file is truncated'
        raise UnreadableImage(f'image {path} cannot be read: {e}') from None


class NamingLoader:
    """`load_rgb` for bad_images=error: an image that passed the header check and still fails to decode (a PNG or
    JPEG cut after its header) stops the command with one line naming --data and the option that goes on without
    it (it said 'image X cannot be read' alone; imagenet:PATH's SplitImages names both). Picklable for loader
    workers. Under bad_images=skip ReplaceUnreadable reads the bare UnreadableImage instead."""

    def __init__(self, spec: str):
        self.spec = spec

    def __call__(self, path: str):
        try:
            return load_rgb(path)
        except UnreadableImage as e:
            raise UnreadableImage(f'--data {self.spec!r}: {e}; pass --data-kwargs bad_images=skip to go on without '
                                  'such images (named in the log)') from None


def _drop_unreadable(folder, spec: str, mode: str, check: str = 'header'):
    """Check every image of an ImageFolder (imagecheck.py); stop ('error') or leave the bad ones out ('skip')."""
    from .imagecheck import shared_check
    bad = shared_check([path for path, _ in folder.samples], check, f'--data {spec}')
    if not bad:
        return folder
    total = len(folder.samples)
    if mode == 'error' or len(bad) == total:
        raise UnreadableImage(
            f'--data {spec!r}: {len(bad)} of {total} images cannot be read: {_name_files(bad)}. '
            + ('Fix or remove them, or pass --data-kwargs bad_images=skip to leave them out'
               if len(bad) < total else 'No image of the folder can be read'))
    skipped = {p for p, _ in bad}
    folder.samples = [s for s in folder.samples if s[0] not in skipped]
    folder.imgs = folder.samples
    folder.targets = [target for _, target in folder.samples]
    print(f'--data {spec}: skipped {len(bad)} unreadable image(s) of {total} (bad_images=skip): {_name_files(bad)}',
          flush=True)
    return folder


def default_transforms(img_size: int, augment: bool, crop_pct: Optional[float] = None,
                       interpolation: Optional[str] = None, crop_mode: Optional[str] = None):
    """(train, eval) PIL -> normalised tensor transforms, ImageNet mean/std.

    Eval is timm's (resize to img_size / crop_pct with `interpolation`, then the crop of `crop_mode`; None: timm's
    0.875, bilinear and centre crop). Train is random-resized-crop + flip built
    from torchvision, drawing from torch's RNG; it is kept as it was so runs without augmentation flags
    are unchanged. The flags (--aa, --reprob, ...) replace it with timm's create_transform (augment.py).
    """
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
    from torchvision import transforms as T
    eval_tf = create_transform(img_size, is_training=False, crop_pct=crop_pct,
                               interpolation=interpolation or 'bilinear', crop_mode=crop_mode or 'center')
    if not augment:
        return eval_tf, eval_tf
    train_tf = T.Compose([T.RandomResizedCrop(img_size, antialias=True), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)])
    return train_tf, eval_tf


def image_transforms(spec: str, opts, augmentation, train_transform, eval_transform):
    """(train, eval, applied augmentation record) PIL -> tensor transforms of an image dataset with options
    img_size and augment (image folders, shards, Hugging Face datasets)."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    aug = wanted(augmentation)
    if aug is not None and not opts['augment']:
        raise UsageError(f'--data-kwargs augment=false turns off the training augmentation of --data {spec} '
                         f'that {given_flags(aug)} configure; give one or the other')
    if aug is not None and train_transform is not None:
        raise ValueError('train_transform replaces the training transform that augmentation configures; '
                         'give one or the other')
    if train_transform is None or eval_transform is None:      # a default transform will resize to img_size
        from .sizing import check_image_side
        check_image_side(opts['img_size'], opts.get('crop_pct'))
    default_train, default_eval = default_transforms(opts['img_size'], opts['augment'], opts.get('crop_pct'),
                                                     opts.get('interpolation'), opts.get('crop_mode'))
    applied = None
    if aug is not None:
        default_train, applied = timm_train_transform(opts['img_size'], aug, IMAGENET_DEFAULT_MEAN,
                                                      IMAGENET_DEFAULT_STD)
    return train_transform or default_train, eval_transform or default_eval, applied


def symlink_loop(root: str, samples) -> Optional[str]:
    """What is wrong, if a folder among the samples' is reached through a symlink to a folder above it. The listing
    (torchvision's, as timm's: os.walk following links) goes round such a loop until the path is too long: a
    class folder holding `up -> ..` read every class's images again some 40 times, all labelled as that class.
    Checked on the samples' distinct folders, a few per class."""
    checked = set()
    for directory in sorted({os.path.dirname(path) for path, _ in samples}):
        parts = os.path.relpath(directory, root).split(os.sep)
        for i in range(1, len(parts) + 1):
            sub = os.path.join(root, *parts[:i])
            if sub in checked:
                continue
            checked.add(sub)
            if os.path.islink(sub):
                target = os.path.realpath(sub)
                if Path(os.path.realpath(os.path.dirname(sub))).is_relative_to(target):
                    return (f'{sub} is a link to {target}, a folder above it: the listing goes round it and reads '
                            'the same images again and again under the wrong class; remove the link')
    return None


def imagenet_hint(root: str) -> str:
    """A hint for ImageNet's flat validation folder read as an image folder (it has no class folders; its labels are
    in the devkit or Kaggle's CSV, which `imagenet:PATH` reads), else ''."""
    try:
        flat = any(n.startswith('ILSVRC2012_val_') for n in os.listdir(root))
    except OSError:
        return ''
    return ("; ImageNet's flat val/ is labelled by the devkit or Kaggle's LOC_val_solution.csv: pass "
            f'imagenet:{os.path.dirname(os.path.abspath(root))} (docs/data.md)') if flat else ''


def image_folder(root: str, **kwargs):
    """torchvision's ImageFolder (its classes, order and file list), passing over entries named '.…': a desktop, a
    notebook or a copy on a Mac leaves .DS_Store, .ipynb_checkpoints/, .Trash-1000/ and an AppleDouble '._NAME.jpg'
    (no image) beside every file; the empty hidden folder made the folder 'not an image folder' (a class without
    images), the AppleDouble files failed the header check, and the run stopped naming files that are no images."""
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    class VisibleImageFolder(ImageFolder):
        def find_classes(self, directory):
            classes = sorted(e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith('.'))
            if not classes:
                raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
            return classes, {c: i for i, c in enumerate(classes)}

        @staticmethod
        def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
            def visible_image(path: str) -> bool:
                parts = os.path.relpath(path, directory).split(os.sep)
                return path.lower().endswith(IMG_EXTENSIONS) and not any(p.startswith('.') for p in parts)
            return make_dataset(directory, class_to_idx, is_valid_file=visible_image, allow_empty=allow_empty)

    folder = VisibleImageFolder(root, **kwargs)
    folder.__class__ = ImageFolder             # picklable for loader workers (a class local to this function is not)
    return folder


def _image_folder(root: str, transform, spec: str, bad_images: str = 'error', check: str = 'header',
                  held_out: bool = False):
    try:
        loader = load_rgb if bad_images == 'skip' else NamingLoader(spec)     # skip: ReplaceUnreadable names it
        folder = image_folder(root, transform=transform, loader=loader)
    except FileNotFoundError as e:     # no class folders, or class folders without images
        raise FileNotFoundError(f'--data {spec!r}: {root!r} is not an image folder: expected '
                                f'{root}/<class name>/<image file> ({e}){imagenet_hint(root)}') from None
    loop = symlink_loop(root, folder.samples)
    if loop:
        raise UsageError(f'--data {spec!r}: {loop}')
    if len(folder.classes) < 2 and not held_out:     # one class trains to loss 0 and 100 %, which measures nothing
        raise UsageError(f'--data {spec!r}: {root!r} holds one class ({folder.classes[0]!r}); a classifier needs '
                         f'at least two class folders, {root}/<class name>/<image file>')
    folder.skipped_images = 0
    before = len(folder.samples)
    folder = _drop_unreadable(folder, spec, bad_images, check)
    folder.skipped_images = before - len(folder.samples)
    return folder


def val_targets(train_classes: Sequence[str], val_classes: Sequence[str], val_targets: Sequence[int], what: str,
                val_name: str) -> List[int]:
    """The targets of a validation folder (indices into its own sorted `val_classes`) as indices into train/'s
    classes. val/ may lack some of train/'s class folders (a class without held-out images): its folders are
    labelled by train/'s index, as imagenet:PATH labels its validation images (each folder's own sorted index was
    another class's; the folder form refused it). A class folder that train/ lacks has no output of the model:
    refused, naming it."""
    index = {c: i for i, c in enumerate(train_classes)}
    missing = [c for c in val_classes if c not in index]
    if missing:
        from .classes import nfc_key, normalisation_note
        note = normalisation_note(list(train_classes), list(val_classes))
        if note is None and any(nfc_key(c) in {nfc_key(t) for t in train_classes} for c in missing):
            note = normalisation_note([nfc_key(c) for c in missing], missing)
        if note:
            raise UsageError(f'{what}: train/ and {val_name}/ hold {note}')
        raise UsageError(f'{what}: {val_name}/ holds class folder {missing[0]!r}'
                         + (f' (and {len(missing) - 1} more)' if len(missing) > 1 else '')
                         + f', which train/ lacks: the model has no output for it; train/ holds {len(train_classes)} '
                         'class folders, and val/ may hold those or fewer of them')
    return [index[val_classes[t]] for t in val_targets]


def label_by_train_classes(folder, train_classes: Sequence[str], what: str, val_name: str) -> None:
    """A validation ImageFolder relabelled in place by train/'s class index (val_targets)."""
    if list(folder.classes) == list(train_classes):
        return
    targets = val_targets(train_classes, folder.classes, folder.targets, what, val_name)
    folder.samples = [(path, t) for (path, _), t in zip(folder.samples, targets)]
    folder.imgs, folder.targets = folder.samples, targets
    folder.classes = list(train_classes)
    folder.class_to_idx = {c: i for i, c in enumerate(train_classes)}


# the validation folder beside train/: timm's split search names (val, valid, validation), then test/. validation/
# (timm's, Hugging Face's and our shards' name) and valid/ (Kaggle's train/valid/test) were not split folders, so
# train/ + validation/ was read as two classes named 'train' and 'validation'; valid/ is taken before test/
VAL_FOLDERS = ('val', 'valid', 'validation', 'test')


def split_folders(root: str) -> Tuple[Optional[str], Optional[str]]:
    """(train folder, val folder) of an image folder split into `train/` and one of VAL_FOLDERS, else (None, None):
    the folder itself holds the class folders. `train/` without one of them is the training split when it is
    the only folder there and holds folders and no image of its own (it was read as one class named 'train', every
    image in it; a class folder named 'train', e.g. of vehicles, holds images or has other classes beside it)."""
    val = next((os.path.join(root, d) for d in VAL_FOLDERS if os.path.isdir(os.path.join(root, d))), None)
    train = os.path.join(root, 'train')
    if not os.path.isdir(train):
        return None, None
    if val:
        return train, val
    from torchvision.datasets.folder import IMG_EXTENSIONS     # the files torchvision's ImageFolder reads
    entries = list(os.scandir(train))
    beside = [e.name for e in os.scandir(root) if e.is_dir() and e.name != 'train' and not e.name.startswith('.')]
    split = not beside and any(e.is_dir() and not e.name.startswith('.') for e in entries) and not any(
        e.is_file() and e.name.lower().endswith(IMG_EXTENSIONS) and not e.name.startswith('.') for e in entries)
    return (train, None) if split else (None, None)


def build_imagefolder(path, *, spec, seed, val_fraction, train_transform, eval_transform, augmentation=None,
                      **options):
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    opts = resolve_options('imagefolder', OPTIONS, options)
    train_tf, eval_tf, applied = image_transforms(spec, opts, augmentation, train_transform, eval_transform)
    root = check_folder(path, spec)
    check = opts['check']
    train_dir, val_dir = split_folders(root)
    if val_dir:
        train = _image_folder(os.path.join(root, 'train'), train_tf, spec, opts['bad_images'], check)
        val = _image_folder(val_dir, eval_tf, spec, opts['bad_images'], check, held_out=True)
        label_by_train_classes(val, train.classes, f'--data {spec!r}', os.path.basename(val_dir))
        classes = train.classes
        split = f'train/ ({len(train)}) train, {os.path.basename(val_dir)}/ ({len(val)}) val'
        skipped = train.skipped_images + val.skipped_images
    else:
        base = _image_folder(train_dir or root, train_tf, spec, opts['bad_images'], check)
        skipped = base.skipped_images
        train_idx, val_idx = stratified_split(np.asarray(base.targets), val_fraction, seed)
        val_base = copy.copy(base)            # same file list, its own transform
        val_base.transform = eval_tf
        train, val = Subset(base, train_idx.tolist()), Subset(val_base, val_idx.tolist())
        classes = base.classes
        split = (f'stratified split {len(train)} train / {len(val)} val (val_fraction={val_fraction}, seed={seed})'
                 + (' of train/' if train_dir else ''))
    info = DatasetInfo(
        name='imagefolder', num_classes=len(classes), in_chans=3, img_size=opts['img_size'],
        train_size=len(train), val_size=len(val),
        description=f'image folder {root}: {len(classes)} classes, {split}, images at {opts["img_size"]}px',
        extra={'path': root, 'classes': list(classes), 'class_order': FOLDER_CLASS_ORDER,
               'mean': list(IMAGENET_DEFAULT_MEAN),
               'std': list(IMAGENET_DEFAULT_STD), 'split': split, 'augment': opts['augment'],
               'skipped_images': skipped, 'augmentation': applied, 'check': check})
    if opts['bad_images'] == 'skip':
        train, val = ReplaceUnreadable(train, spec), ReplaceUnreadable(val, spec, held_out=True)
    return train, val, info
