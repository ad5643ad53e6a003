"""Byte-level language modelling on text that is already on this machine (seed 004's LM, offline).

`--data pysource`: the Python standard library's own top-level `.py` files (`sysconfig`'s stdlib folder,
e.g. 168 files, 4.7 MB for CPython 3.11), which ship with every Python, so nothing is downloaded. The
text therefore depends on the Python version: the dataset's description names it.
`--data text:PATH`: one text file, or every `*.txt`, `*.md`, `*.rst` and `*.py` file under a folder, or with
`--data-kwargs files=GLOB` the folder's files that GLOB matches (LM1B's shards: files='news.en-*').

Files are put in a seeded random order and whole files go to the validation split while it holds at most
`val_fraction` of the bytes, so no file is split between the two. Each split is one byte stream (files
joined by a blank line) cut into non-overlapping windows of `seq_len + 1` bytes; an example is
(x = window[:-1], y = window[1:]), both int64 [seq_len], vocabulary 256. Options:
`seq_len` (128; `structformer train` reads the text at the language model's context instead, data/sizing.py), `max_bytes` (2,000,000; 0 = all: files of the seeded order that fit within that size).

For the model factory the data's facts read as a classifier's: num_classes = 256 (the vocabulary),
img_size = seq_len (the context), in_chans = 1.
"""
import random
import sys
import sysconfig
from pathlib import Path
from typing import List, Tuple

import torch
from torch.utils.data import Dataset

from .augment import refuse_augmentation
from .spec import DatasetInfo, Option, resolve_options

__all__ = ['ByteWindows', 'build_pysource', 'build_text', 'stdlib_sources', 'TEXT_SUFFIXES']

TEXT_SUFFIXES = ('.txt', '.md', '.rst', '.py')
OPTIONS = {
    'seq_len': Option(int, 128, 'an integer >= 2', lambda v: v >= 2),
    'max_bytes': Option(int, 2_000_000, 'an integer >= 0 (0 = all)', lambda v: v >= 0),
}
# text:FOLDER only: which files to read, for text without a text suffix (LM1B's shards are news.en-00001-of-00100)
TEXT_OPTIONS = {**OPTIONS, 'files': Option(str, '', "a glob pattern over the folder's files, e.g. 'news.en-*'",
                                           lambda v: isinstance(v, str))}


class ByteWindows(Dataset):
    """Non-overlapping (x, y) windows of a byte stream: y is x shifted by one byte."""

    def __init__(self, data: bytes, seq_len: int):
        # one byte per byte: windows become int64 as they are read (the whole stream in int64 was 8 bytes per byte,
        # 32 GB per process for the LM1B recipes' 4 GB of text). frombuffer refuses an empty buffer; an empty
        # split is reported by the caller, naming --data
        self.tokens = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                       else torch.zeros(0, dtype=torch.uint8))
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1].long()
        return window[:-1], window[1:]


def stdlib_sources() -> List[Path]:
    """The standard library's top-level .py files, sorted (no site-packages, no sub-packages)."""
    return sorted(Path(sysconfig.get_paths()['stdlib']).glob('*.py'))


def _text_files(path: Path, spec: str, pattern: str = '') -> List[Path]:
    """The files of `text:PATH`: the file itself, or a folder's files with a text suffix, or those `pattern` (the
    `files` option, a glob) matches."""
    if not path.exists():
        raise FileNotFoundError(f"--data {spec!r}: path {str(path)!r} does not exist")
    if path.is_file():
        if pattern:
            raise ValueError(f"--data-kwargs files={pattern!r}: chooses files in a folder; --data {spec!r} is one file")
        return [path]
    if pattern:
        files = sorted(p for p in path.rglob(pattern) if p.is_file())
        if not files:
            raise ValueError(f"--data {spec!r}: no file under {str(path)!r} matches --data-kwargs files={pattern!r}")
        return files
    files = sorted(p for p in path.rglob('*') if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"--data {spec!r}: no text files ({', '.join(TEXT_SUFFIXES)}) under {str(path)!r}; "
                         "other files: --data-kwargs files=PATTERN (a glob, e.g. 'news.en-*')")
    return files


def _hold_out(texts: List[Tuple[Path, bytes]], target: float):
    """(val, train): whole files, in the seeded order, go to val while they keep it within `target` bytes; a
    file that would overshoot stays in train and a smaller one later may still fit. Taking files until the
    target was passed let one large file hold most of the text out (max_bytes=100000: 97 % of it held out, 23
    training windows). Where no file fits, the one closest to the target is held out alone; train keeps one."""
    val, val_bytes = [], 0
    for item in texts:
        if val_bytes + len(item[1]) <= target:
            val.append(item)
            val_bytes += len(item[1])
    if not val and len(texts) > 1:
        val = [min(texts, key=lambda item: abs(len(item[1]) - target))]
    if len(val) == len(texts):                   # target >= everything (val_fraction near 1): train keeps one
        val = val[:-1]
    held = {id(item) for item in val}
    return val, [item for item in texts if id(item) not in held]


def _split(files: List[Path], seed: int, val_fraction: float, max_bytes: int, spec: str):
    order = list(files)
    random.Random(seed).shuffle(order)
    texts, total = [], 0
    for f in order:
        data = f.read_bytes()
        if max_bytes and total + len(data) > max_bytes and texts:
            continue                             # too big for what is left: a smaller file may fit
        texts.append((f, data[:max_bytes] if max_bytes else data))
        total += len(texts[-1][1])
    if total == 0:
        raise ValueError(f"--data {spec!r}: the text is empty ({len(files)} file(s), 0 bytes)")
    if len(texts) == 1:                      # one file: hold out its end instead
        (f, data), = texts
        cut = int(len(data) * (1 - val_fraction))
        return data[:cut], data[cut:], 1, 1
    val, train = _hold_out(texts, val_fraction * total)
    if not val or not train:
        raise ValueError(f"--data {spec!r}: needs at least two files (or a larger max_bytes) to hold out "
                         f"val_fraction={val_fraction} of the text by whole files")
    join = lambda part: b'\n\n'.join(data for _, data in part)        # noqa: E731
    return join(train), join(val), len(train), len(val)


def _build(files, name, spec, source, *, seed, val_fraction, train_transform=None, eval_transform=None,
           augmentation=None, **opts):
    refuse_augmentation(augmentation, spec)
    if train_transform is not None or eval_transform is not None:
        raise ValueError(f"--data {spec}: text data takes no image transforms")
    train_bytes, val_bytes, n_train, n_val = _split(files, seed, val_fraction, opts['max_bytes'], spec)
    seq_len = opts['seq_len']
    train, val = ByteWindows(train_bytes, seq_len), ByteWindows(val_bytes, seq_len)
    if len(train) == 0 or len(val) == 0:
        raise ValueError(f"--data-kwargs seq_len={seq_len}: longer than a split's text "
                         f"({len(train_bytes)} / {len(val_bytes)} bytes)")
    info = DatasetInfo(
        name=name, num_classes=256, in_chans=1, img_size=seq_len, train_size=len(train), val_size=len(val),
        description=(f"{source}: byte-level LM, {len(train_bytes):,} train bytes ({n_train} files) / "
                     f"{len(val_bytes):,} val bytes ({n_val} files), windows of {seq_len} (seed {seed})"),
        extra={'task': 'lm', 'seq_len': seq_len, 'train_bytes': len(train_bytes), 'val_bytes': len(val_bytes),
               'max_bytes': opts['max_bytes'], 'seed': seed})
    return train, val, info


def build_pysource(*, seed, val_fraction, **kwargs):
    """The standard library's sources as a byte-level LM dataset (see the module docstring)."""
    files = stdlib_sources()
    version = '.'.join(map(str, sys.version_info[:3]))
    options, rest = _options('pysource', OPTIONS, kwargs)
    return _build(files, 'pysource', 'pysource', f"Python {version} standard library ({len(files)} .py files)",
                  seed=seed, val_fraction=val_fraction, **rest, **options)


def _options(name, schema, kwargs):
    """(the dataset options of `kwargs`, checked against `schema`; the builder's other arguments)"""
    builder = {'train_transform', 'eval_transform', 'augmentation'}
    options = resolve_options(name, schema, {k: v for k, v in kwargs.items() if k not in builder})
    return options, {k: v for k, v in kwargs.items() if k in builder}


def build_text(path, *, spec, seed, val_fraction, **kwargs):
    """Local text files as a byte-level LM dataset (see the module docstring)."""
    options, rest = _options('text', TEXT_OPTIONS, kwargs)
    files = _text_files(Path(path), spec, options.pop('files'))
    return _build(files, 'text', spec, f"{path} ({len(files)} files)", seed=seed, val_fraction=val_fraction, **rest,
                  **options)
