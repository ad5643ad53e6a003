"""`--data wds:TRAIN_PATTERN[,VAL_PATTERN]` (or `wds:FOLDER` holding `_info.json`): the training stream
(shards.py), the validation index (tars.py) and the hold-out. The writer is shard_writer.py; docs/data.md."""
import os
from typing import List, Optional

from ..errors import UsageError
from .imagefolder import CROP_MODE, CROP_PCT, INTERPOLATION, ReplaceUnreadable, image_transforms
from .process0 import on_process_0
from .shards import ShardStream
from .tars import (IndexedShards, ShardError, _local, _seed, check_shard, expand_shards, is_local, known_lengths,
                   read_info, scan_shard, split_patterns)
from .spec import DatasetInfo, Option, resolve_options

OPTIONS = {
    'img_size': Option(int, 224, "an integer >= 8 (default: the model's input size)", lambda v: v >= 8),
    'augment': Option(bool, True, 'true or false'),
    'crop_pct': CROP_PCT,
    'interpolation': INTERPOLATION,
    'crop_mode': CROP_MODE,
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


def _info_validation(urls: List[str], info, spec: str):
    """(validation shards, how chosen) named by the _info.json beside the training shards (a glob over `data shard`
    output, wds:OUT/train-*.tar), else (None, ''). Holding out the last training shards there trained on ~10 %
    fewer images and scored on training ones while the folder holds its validation split. Only when every one of
    those shards exists and none is among the training shards (`_without_held_out_splits` has taken them out of a
    glob over all of OUT; one over nothing but them keeps the hold-out)."""
    if not is_local(urls[0]):
        return None, ''
    folder = os.path.dirname(os.path.abspath(_local(urls[0])))
    name = next((s for s in VAL_SPLITS if s in info.get('splits', {})), None)
    names = info['splits'][name].get('filenames') if name else None
    if not names:
        return None, ''
    val_urls = [os.path.join(folder, f) for f in names]
    training = {os.path.abspath(_local(u)) for u in urls}
    if not all(os.path.isfile(u) for u in val_urls) or any(u in training for u in val_urls):
        return None, ''
    holdout = (f'no validation pattern: the {name} split of _info.json in {folder} ({_abbreviate(val_urls)}, '
               f'{sum(info["splits"][name].get("shard_lengths") or [0])} samples) is the validation')
    print(f'--data {spec}: {holdout}', flush=True)
    return val_urls, holdout


def _without_held_out_splits(urls: List[str], info, spec: str) -> List[str]:
    """The training shards less those the _info.json beside them names as a held-out split (validation, val, test):
    a pattern over all of `data shard`'s output (wds:OUT/*.tar) trained on the validation shards too, and scored on
    some of them. Said in one line. A pattern over nothing but such shards is taken as given (named on purpose)."""
    if not urls or not is_local(urls[0]):
        return urls
    folder = os.path.dirname(os.path.abspath(_local(urls[0])))
    held = {os.path.join(folder, f): name for name in VAL_SPLITS
            for f in (info.get('splits', {}).get(name) or {}).get('filenames') or ()}
    split_of = {u: held.get(os.path.abspath(_local(u))) if is_local(u) else None for u in urls}
    kept = [u for u in urls if split_of[u] is None]
    if not kept or len(kept) == len(urls):
        return urls
    dropped = [u for u in urls if split_of[u] is not None]
    splits = sorted({split_of[u] for u in dropped})
    print(f"--data {spec}: the training pattern also matches the {' and '.join(splits)} split of _info.json in "
          f"{folder} ({_abbreviate(dropped)}): left out of training", flush=True)
    return kept


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
    info = read_info(urls)
    urls = _without_held_out_splits(urls, info, spec)     # every process alike: file names and _info.json only
    held_out, holdout = None, 'validation pattern'
    if val_urls is None and opts['holdout'] == 'auto':
        val_urls, holdout = _info_validation(urls, info, spec)
    # under torchrun process 0 alone opens the shards before training (check, index, count), the others take its
    # result: each process did it all, P times the reads of one at once on one disk (data/process0.py)
    on_process_0(lambda: [check_shard(url, spec) for url in urls + (val_urls or [])])
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
    n_train = opts['train_samples']
    lengths, lengths_from = (known_lengths(urls), '_info.json') if held_out is None else (None, '')
    stated_val = known_lengths(val_urls) if val_urls else None
    entries, labels, scanned = on_process_0(lambda: _index(val_urls or urls, stated_val, held_out, spec,
                                                           opts['bad_images']))
    if held_out is not None:           # the scan above read every training shard's headers already
        lengths, lengths_from = scanned, 'the header scan'
    if not n_train and lengths is not None:
        n_train = sum(lengths)
    if not n_train:
        if not all(is_local(u) for u in urls):
            raise UsageError(f'--data {spec!r}: remote training shards need --data-kwargs train_samples=N '
                             '(samples per epoch) or an _info.json beside them')
        lengths, train_labels = on_process_0(lambda: _count(urls, spec, opts['bad_images']))
        lengths_from, n_train = 'the header scan', sum(lengths)
        labels += train_labels
        print(f'--data {spec}: counted {n_train} training samples in the headers of {len(urls)} shards (pass '
              '--data-kwargs train_samples=N, or keep an _info.json beside the shards, to skip this)', flush=True)
    classes = info.get('classes')
    if val_urls:
        _check_val_classes(spec, urls, val_urls, info)
    _check_num_classes(spec, opts['num_classes'], classes, info.get('num_classes'))
    num_classes = opts['num_classes'] or (len(classes) if classes else 0) or int(info.get('num_classes', 0)) \
        or (max(labels) + 1 if labels else 0)
    if labels and (max(labels) >= num_classes or min(labels) < 0):    # -1: an unlabelled split (was scored)
        wrong = max(labels) if max(labels) >= num_classes else min(labels)
        raise UsageError(f'--data {spec!r}: a label {wrong} is outside the {num_classes} classes [0, {num_classes - 1}]'
                         ' (shards of an unlabelled split hold -1)')
    if not entries:
        raise UsageError(f'--data {spec!r}: the validation split holds no sample')
    if n_train < 1:
        raise UsageError(f'--data {spec!r}: the training split holds no sample')
    train = ShardStream(urls, n_train, train_tf, seed, spec, opts['shuffle_buffer'], opts['bad_images'], held_out,
                        lengths=lengths, lengths_from=lengths_from, num_classes=num_classes)
    val = IndexedShards(entries, eval_tf, spec)
    if opts['bad_images'] == 'skip':
        val = ReplaceUnreadable(val, spec, held_out=True)
    split = f'{len(urls)} training shards ({n_train} samples an epoch), {len(val)} validation samples; {holdout}'
    return train, val, DatasetInfo(
        name='wds', num_classes=num_classes, in_chans=3, img_size=opts['img_size'], train_size=n_train,
        val_size=len(val), description=f'webdataset shards {path}: {num_classes} classes, {split}, '
                                       f'images at {opts["img_size"]}px',
        extra={'path': path, 'classes': list(classes) if classes else None, 'class_order': info.get('class_order'),
               'class_descriptions': info.get('class_descriptions'), 'mean': list(IMAGENET_DEFAULT_MEAN),
               'std': list(IMAGENET_DEFAULT_STD), 'split': split, 'augment': opts['augment'],
               'augmentation': applied, 'train_shards': len(urls), 'holdout': holdout,
               'shuffle_buffer': opts['shuffle_buffer']})


def _check_num_classes(spec: str, given: int, classes, stated) -> None:
    """num_classes=N given beside an _info.json that names its classes (or states their number) must agree with
    it: a different N would silently build a head whose outputs no longer match the class names."""
    if not given:
        return
    if classes and given != len(classes):
        raise UsageError(f'--data {spec!r}: num_classes={given} but the shards\' _info.json names {len(classes)} '
                         f'classes; give num_classes={len(classes)} or leave it out')
    if not classes and stated and given != int(stated):
        raise UsageError(f'--data {spec!r}: num_classes={given} but the shards\' _info.json says num_classes='
                         f'{int(stated)}; give num_classes={int(stated)} or leave it out')


def _check_val_classes(spec: str, urls: List[str], val_urls: List[str], info) -> None:
    """Validation shards in another folder, whose own _info.json names other classes than the training folder's (or
    states another number of them): one line naming both folders and the first difference. The classes come from
    the training folder; the validation labels were read by that index without a word (shards of another data
    set, or the same names in another order)."""
    if not is_local(urls[0]) or not is_local(val_urls[0]):
        return
    train_dir = os.path.dirname(os.path.abspath(_local(urls[0])))
    val_dir = os.path.dirname(os.path.abspath(_local(val_urls[0])))
    if train_dir == val_dir:
        return
    val_info = read_info(val_urls)
    ours, theirs = info.get('classes'), val_info.get('classes')
    if ours and theirs:
        ours, theirs = list(ours), list(theirs)
        if ours == theirs:
            return
        k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)    # None: one extends the other
        if len(ours) == len(theirs):
            difference = f'class {k} is {ours[k]!r} in {train_dir}, {theirs[k]!r} in {val_dir}'
        else:
            first = f'; class {k} is {ours[k]!r} there, {theirs[k]!r} here' if k is not None else ''
            difference = f'{len(ours)} classes in {train_dir}, {len(theirs)} in {val_dir}{first}'
    else:
        a, b = info.get('num_classes'), val_info.get('num_classes')
        a = len(ours) if ours else a
        b = len(theirs) if theirs else b
        if a is None or b is None or int(a) == int(b):
            return
        difference = f'{int(a)} classes in {train_dir}, {int(b)} in {val_dir}'
    raise UsageError(f'--data {spec!r}: the _info.json of the training shards and of the validation shards name '
                     f'other classes: {difference}; give validation shards of the same data set and class list')


def _index(urls: List[str], stated: Optional[List[int]], held_out, spec: str, bad_images: str):
    """(validation entries (url, offset, size, label), the labels the run reads before training, the training
    shards' lengths after the held-out samples or None) from the tar headers of `urls`: the validation shards, or
    (`held_out`, samples held out) the training ones. Each shard's stated length is its own folder's _info.json's:
    looked up in the training folder's by file name, a val/shard-0000.tar was held to train/shard-0000.tar's length
    and refused as damaged."""
    entries, train_labels, lengths = [], [], []
    for shard, url in enumerate(urls):
        scan = _scan(url, spec, bad_images, 'validation')         # None: damaged, passed over (named in the log)
        if stated and scan is not None and len(scan) != stated[shard]:
            _damaged(spec, bad_images, f'validation shard {url} holds {len(scan)} samples; _info.json says '
                                       f'{stated[shard]}')
        kept = 0
        for j, (offset, size, label) in enumerate(scan or ()):
            if held_out is None or held_out(shard, j):
                entries.append((url, offset, size, label))
            else:
                train_labels.append(label)
                kept += 1
        lengths.append(kept)
    labels = [e[3] for e in entries] + train_labels
    return entries, labels, (lengths if held_out is not None else None)


def _count(urls: List[str], spec: str, bad_images: str):
    """(samples of each training shard, their labels) from the tar headers: shards without _info.json."""
    scans = [_scan(u, spec, bad_images, 'training') or [] for u in urls]
    return [len(s) for s in scans], [e[2] for s in scans for e in s]


def _damaged(spec: str, bad_images: str, problem: str) -> None:
    """A damaged shard found before training: one line (exit 2), or under bad_images=skip a line in the log."""
    if bad_images != 'skip':
        raise ShardError(f'--data {spec!r}: {problem}; pass --data-kwargs bad_images=skip to go on without what '
                         'it lacks')
    print(f'--data {spec}: {problem}; bad_images=skip: going on without what it lacks', flush=True)


def _scan(url: str, spec: str, bad_images: str, role: str):
    """scan_shard, or None for a damaged shard under bad_images=skip (named in the log)."""
    try:
        return scan_shard(url)
    except ShardError as e:
        _damaged(spec, bad_images, f'{role} {e}')
        return None


class _HeldOut:
    """Sample j of shard s is held out for validation when its seeded hash falls below val_fraction (picklable
    for loader workers)."""

    def __init__(self, seed: int, threshold: int):
        self.seed, self.threshold = seed, threshold

    def __call__(self, shard: int, j: int) -> bool:
        return _seed(self.seed, 1 << 30, shard, j) < self.threshold
