"""`--data wds:TRAIN_PATTERN[,VAL_PATTERN]` (or `wds:FOLDER` holding `_info.json`), and the shard writer
behind `structformer data shard IMAGEFOLDER OUT --shard-size N`. Reading: shards.py; docs/data.md."""
import json
import os
import shutil
import tarfile
import tempfile
from typing import Dict, List, Optional

import numpy as np

from ..errors import UsageError
from .imagefolder import ReplaceUnreadable, image_transforms
from .shards import (IMAGE_KEYS, IndexedShards, ShardStream, _local, _seed, check_shard, expand_shards, is_local,
                     known_lengths, read_info, scan_shard, split_patterns)
from .spec import DatasetInfo, Option, resolve_options

OPTIONS = {
    'img_size': Option(int, 224, "an integer >= 8 (default: the model's input size)", lambda v: v >= 8),
    'augment': Option(bool, True, 'true or false'),
    'bad_images': Option(str, 'error', "'error' (stop) or 'skip' (an undecodable image is replaced by the next "
                         "sample, named in the log)", lambda v: v in ('error', 'skip')),
    'train_samples': Option(int, 0, 'an integer >= 0 (samples per epoch; 0: from _info.json or a header scan)',
                            lambda v: v >= 0),
    'num_classes': Option(int, 0, 'an integer >= 0 (0: from _info.json or the labels)', lambda v: v >= 0),
    'shuffle_buffer': Option(int, 2048, 'an integer >= 1 (samples held per loader worker)', lambda v: v >= 1),
    'holdout': Option(str, 'auto', "'auto', 'shards' (the last shards) or 'samples' (a seeded val_fraction of "
                      "samples)", lambda v: v in ('auto', 'shards', 'samples')),
}
VAL_SPLITS = ('validation', 'val', 'test')


def _folder_patterns(folder: str, spec: str):
    """wds:FOLDER: the train and validation shard lists of its _info.json."""
    info = read_info([os.path.join(folder, 'x.tar')])
    splits = info.get('splits', {})
    if 'train' not in splits:
        raise UsageError(f'--data {spec!r}: folder {folder} has no _info.json with a "train" split; give shard '
                         'patterns, e.g. wds:DIR/train-{000000..000009}.tar,DIR/validation-000000.tar')
    val = next((splits[s] for s in VAL_SPLITS if s in splits), None)
    paths = [os.path.join(folder, f) for f in splits['train']['filenames']]
    val_paths = [os.path.join(folder, f) for f in val['filenames']] if val else None
    return '::'.join(paths), ('::'.join(val_paths) if val_paths else None)


def _abbreviate(urls: List[str]) -> str:
    names = [os.path.basename(_local(u)) for u in urls]
    return ', '.join(names) if len(names) <= 3 else f'{names[0]} .. {names[-1]} ({len(names)} shards)'


def build_wds(path, *, spec, seed, val_fraction, train_transform, eval_transform, augmentation=None, **options):
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    opts = resolve_options('wds', OPTIONS, options)
    train_tf, eval_tf, applied = image_transforms(spec, opts, augmentation, train_transform, eval_transform)
    train_pat, val_pat = split_patterns(path)
    if val_pat is None and os.path.isdir(os.path.expanduser(train_pat)):
        train_pat, val_pat = _folder_patterns(os.path.expanduser(train_pat), spec)
    urls = expand_shards(train_pat, spec, 'training')
    val_urls = expand_shards(val_pat, spec, 'validation') if val_pat else None
    for url in urls + (val_urls or []):
        check_shard(url, spec)
    info = read_info(urls)
    held_out, holdout = None, 'validation pattern'
    if val_urls is None:
        mode = opts['holdout'] if opts['holdout'] != 'auto' else ('shards' if len(urls) >= 2 else 'samples')
        if mode == 'shards':
            if len(urls) < 2:
                raise UsageError(f'--data {spec!r}: holdout=shards needs at least 2 training shards; there is '
                                 f'{len(urls)} (use holdout=samples or give a validation pattern)')
            k = min(len(urls) - 1, max(1, round(len(urls) * val_fraction)))
            urls, val_urls = urls[:-k], urls[-k:]
            holdout = f'held out the last {k} of {k + len(urls)} shards (val_fraction={val_fraction}): {_abbreviate(val_urls)}'
        else:
            threshold = int(val_fraction * 2 ** 64)
            held_out = _HeldOut(seed, threshold)
            holdout = (f'held out a seeded val_fraction={val_fraction} of the samples of every shard '
                       f'(seed={seed}; the training stream skips them)')
        print(f'--data {spec}: no validation pattern; {holdout}', flush=True)
    if any(not is_local(u) for u in (val_urls or urls)):
        raise UsageError(f'--data {spec!r}: validation shards must be local files (they are read by seeking)')
    entries = []
    for shard, url in enumerate(val_urls or urls):
        for j, (offset, size, label) in enumerate(scan_shard(url)):
            if held_out is None or held_out(shard, j):
                entries.append((url, offset, size, label))
    labels = [e[3] for e in entries]
    n_train = opts['train_samples']
    lengths = known_lengths(urls, info) if held_out is None else None
    if not n_train and lengths is not None:
        n_train = sum(lengths)
    if not n_train:
        if not all(is_local(u) for u in urls):
            raise UsageError(f'--data {spec!r}: remote training shards need --data-kwargs train_samples=N '
                             '(samples per epoch) or an _info.json beside them')
        scanned = [[e[2] for j, e in enumerate(scan_shard(u)) if held_out is None or not held_out(s, j)]
                   for s, u in enumerate(urls)]
        n_train = sum(len(s) for s in scanned)
        labels += [label for s in scanned for label in s]
        print(f'--data {spec}: counted {n_train} training samples in the headers of {len(urls)} shards (pass '
              '--data-kwargs train_samples=N, or keep an _info.json beside the shards, to skip this)', flush=True)
    classes = info.get('classes')
    num_classes = opts['num_classes'] or (len(classes) if classes else 0) or int(info.get('num_classes', 0)) \
        or (max(labels) + 1 if labels else 0)
    if labels and max(labels) >= num_classes:
        raise UsageError(f'--data {spec!r}: a label {max(labels)} is outside the {num_classes} classes')
    if not entries:
        raise UsageError(f'--data {spec!r}: the validation split holds no sample')
    if n_train < 1:
        raise UsageError(f'--data {spec!r}: the training split holds no sample')
    train = ShardStream(urls, n_train, train_tf, seed, spec, opts['shuffle_buffer'], opts['bad_images'], held_out)
    val = IndexedShards(entries, eval_tf, spec)
    if opts['bad_images'] == 'skip':
        val = ReplaceUnreadable(val, spec)
    split = f'{len(urls)} training shards ({n_train} samples an epoch), {len(val)} validation samples; {holdout}'
    return train, val, DatasetInfo(
        name='wds', num_classes=num_classes, in_chans=3, img_size=opts['img_size'], train_size=n_train,
        val_size=len(val), description=f'webdataset shards {path}: {num_classes} classes, {split}, '
                                       f'images at {opts["img_size"]}px',
        extra={'path': path, 'classes': list(classes) if classes else None, 'mean': list(IMAGENET_DEFAULT_MEAN),
               'std': list(IMAGENET_DEFAULT_STD), 'split': split, 'augment': opts['augment'],
               'augmentation': applied, 'train_shards': len(urls), 'holdout': holdout,
               'shuffle_buffer': opts['shuffle_buffer']})


class _HeldOut:
    """Sample j of shard s is held out for validation when its seeded hash falls below val_fraction (picklable
    for loader workers)."""

    def __init__(self, seed: int, threshold: int):
        self.seed, self.threshold = seed, threshold

    def __call__(self, shard: int, j: int) -> bool:
        return _seed(self.seed, 1 << 30, shard, j) < self.threshold


# ----------------------------------------------------------------------------- writing

def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """A regular file with fixed metadata, so the same folder gives the same bytes."""
    import io
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0o444, 0, 0, '', ''
    tar.addfile(info, io.BytesIO(data))


def _image_bytes(path: str):
    """(extension, bytes): the file as it is when its extension is an image key, else re-encoded as PNG."""
    ext = os.path.splitext(path)[1].lower().lstrip('.')
    if ext in IMAGE_KEYS:
        with open(path, 'rb') as f:
            return ext, f.read()
    import io

    from PIL import Image
    with Image.open(path) as im:
        out = io.BytesIO()
        im.convert('RGB').save(out, 'PNG')
    return 'png', out.getvalue()


def _key(position: int, path: str) -> str:
    stem = os.path.splitext(os.path.basename(path))[0]
    return f'{position:08d}_' + ''.join(c if c.isalnum() or c in '-_' else '_' for c in stem)


def write_shards(folder: str, out: str, shard_size: int, seed: int = 0, check: str = 'header') -> Dict:
    """Write the ImageFolder at `folder` as tar shards in `out` (which must not exist or be empty): a split per
    train/ and val/ (or test/) folder, else one 'train' split; samples in a seeded random order (a shard then
    holds many classes, which the stream's shard-level shuffle needs); images as their files' bytes; labels
    ImageFolder's class indices; `_info.json` (timm's format, plus 'classes'). All or nothing: written into a
    temporary sibling folder that is renamed at the end. Returns the info dict."""
    from torchvision.datasets import ImageFolder

    from .imagecheck import cached_check
    from .imagefolder import _name_files
    if not isinstance(shard_size, int) or shard_size < 1:
        raise UsageError(f'--shard-size {shard_size!r}: expected an integer >= 1')
    if not os.path.isdir(folder):
        raise UsageError(f'IMAGEFOLDER {folder}: not a folder')
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f'OUT {out}: exists and is not an empty folder; give a new folder')
    val_dir = next((d for d in ('val', 'test') if os.path.isdir(os.path.join(folder, d))), None)
    roots = ({'train': os.path.join(folder, 'train'), 'validation': os.path.join(folder, val_dir)}
             if val_dir and os.path.isdir(os.path.join(folder, 'train')) else {'train': folder})
    datasets = {}
    for split, root in roots.items():
        try:
            datasets[split] = ImageFolder(root)
        except FileNotFoundError as e:
            raise UsageError(f'IMAGEFOLDER {root}: not an image folder: expected {root}/<class>/<image> ({e})') from None
    classes = datasets['train'].classes
    for split, ds in datasets.items():
        if ds.classes != classes:
            raise UsageError(f'IMAGEFOLDER {folder}: train/ and {val_dir}/ hold different class folders')
        bad = cached_check([p for p, _ in ds.samples], check, f'IMAGEFOLDER {roots[split]}')
        if bad:
            raise UsageError(f'IMAGEFOLDER {roots[split]}: {len(bad)} of {len(ds.samples)} images cannot be read: '
                             f'{_name_files(bad)}; fix or remove them')
    from ..records import check_writable
    check_writable(out, 'OUT')
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix='.shards-', dir=parent)
    try:
        info = {'name': os.path.basename(os.path.abspath(folder)), 'classes': list(classes), 'splits': {}}
        for split, ds in datasets.items():
            order = np.random.default_rng(seed).permutation(len(ds.samples)) if split == 'train' \
                else np.arange(len(ds.samples))
            names, lengths = [], []
            for start in range(0, len(order), shard_size):
                name = f'{split}-{len(names):06d}.tar'
                with tarfile.open(os.path.join(tmp, name), 'w', format=tarfile.USTAR_FORMAT) as tar:
                    for position in order[start:start + shard_size]:
                        path, label = ds.samples[int(position)]
                        key = _key(int(position), path)
                        ext, data = _image_bytes(path)
                        _member(tar, f'{key}.{ext}', data)
                        _member(tar, f'{key}.cls', str(label).encode())
                names.append(name)
                lengths.append(len(order[start:start + shard_size]))
            info['splits'][split] = {'name': split, 'num_samples': len(order), 'filenames': names,
                                     'shard_lengths': lengths}
        with open(os.path.join(tmp, '_info.json'), 'w') as f:
            json.dump(info, f, indent=1)
        if os.path.isdir(out):
            os.rmdir(out)                   # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def shard_patterns(out: str, info: Dict) -> str:
    """The --data argument that reads what write_shards wrote."""
    def pattern(split: Optional[Dict]):
        n = len(split['filenames'])
        name = split['name']
        return os.path.join(out, f'{name}-000000.tar' if n == 1 else f'{name}-{{000000..{n - 1:06d}}}.tar')
    val = next((info['splits'][s] for s in VAL_SPLITS if s in info['splits']), None)
    return 'wds:' + pattern(info['splits']['train']) + (',' + pattern(val) if val else '')
