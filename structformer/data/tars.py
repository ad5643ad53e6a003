"""webdataset tar shards, read: names and patterns, `_info.json`, samples streamed or found by seek, and damage.

A shard is a tar whose members are grouped into samples by name (webdataset's convention: `KEY.jpg`,
`KEY.cls`); the class is the ASCII integer of `.cls`, the image any of `.jpg .jpeg .png .webp ...`.
Patterns are brace-expanded as webdataset does (`train-{000000..000146}.tar`, `::` joins lists).
The `webdataset` package gives the name expansion, the opening of remote shards (`pipe:`, http) and the
key/extension split; the reading is Python's tarfile, for two reasons:

- damage: tarfile ends an archive silently at the first block that is not a header (a garbage block
  half-way, a file cut at a block boundary), so a damaged shard reads as a shorter one. Every read here
  records why tarfile stopped and raises ShardError naming the shard unless it stopped at tar's
  end-of-archive block (`_Watched`);
- skipping: a sample that is not wanted (another worker's, held out) is passed over without reading its
  bytes; for a local shard tarfile seeks over them.

The training stream is shards.py; the map-style validation index is `IndexedShards` below.
"""
import glob
import io
import json
import os
import random
import re
import tarfile
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import UsageError

IMAGE_KEYS = ('jpg', 'jpeg', 'png', 'webp', 'ppm', 'bmp', 'tif', 'tiff')
LABEL_KEYS = ('cls', 'cls2', 'class', 'label')
INFO_NAMES = ('_info.json', 'info.json')
TAR_BLOCK = 512


class ShardError(UsageError):
    """A shard that cannot be read as image + class samples."""


def webdataset():
    try:
        import webdataset as wds
    except ImportError:
        raise UsageError("--data wds: needs the 'webdataset' package: pip install 'structformer[wds]'") from None
    return wds


# ----------------------------------------------------------------------------- patterns and metadata

def split_patterns(text: str) -> Tuple[str, Optional[str]]:
    """'a-{0..3}.tar,b.tar' -> ('a-{0..3}.tar', 'b.tar'): the comma outside braces separates train and val."""
    depth, cut = 0, None
    for i, ch in enumerate(text):
        depth += ch == '{'
        depth -= ch == '}'
        if ch == ',' and depth == 0:
            if cut is not None:
                raise UsageError(f'--data wds:{text}: expected TRAIN_PATTERN[,VAL_PATTERN]; got more than one comma '
                                 'outside braces')
            cut = i
    if cut is None:
        return text.strip(), None
    return text[:cut].strip(), text[cut + 1:].strip() or None


def absolute_patterns(text: str) -> str:
    """TRAIN[,VAL] with every local part (between ',' and '::') made absolute, URLs as they are; for the run's
    record, so eval and --resume read the same shards from any folder."""
    def fix(pattern: str) -> str:
        parts = pattern.split('::')
        return '::'.join(os.path.abspath(os.path.expanduser(p)) if p and is_local(p) else p for p in parts)
    train, val = split_patterns(text)
    return fix(train) + (',' + fix(val) if val else '')


def is_local(url: str) -> bool:
    return ':' not in url.split('/')[0] or url.startswith('file:')


def _local(url: str) -> str:
    return url[5:] if url.startswith('file:') else url


def expand_shards(pattern: str, spec: str, role: str) -> List[str]:
    """The shard names of a pattern (braces, '::', or a shell glob for local files); each local one must exist."""
    wds = webdataset()
    urls: List[str] = []
    for url in wds.shardlists.expand_urls(os.path.expanduser(pattern)):
        if is_local(url) and any(ch in url for ch in '*?['):
            urls.extend(sorted(glob.glob(_local(url))))
        else:
            urls.append(url)
    if not urls or not pattern:
        raise UsageError(f'--data {spec!r}: the {role} pattern {pattern!r} names no shard')
    missing = [u for u in urls if is_local(u) and not os.path.isfile(_local(u))]
    if missing:
        raise UsageError(f'--data {spec!r}: {len(missing)} of {len(urls)} {role} shards do not exist, e.g. {missing[0]}')
    return urls


def read_info(urls: Sequence[str]) -> Dict:
    """`_info.json` beside the (local) shards, timm's format: {'classes': [...], 'splits': {name: {'filenames',
    'shard_lengths', 'num_samples'}}}; {} when there is none."""
    if not urls or not is_local(urls[0]):
        return {}
    folder = os.path.dirname(os.path.abspath(_local(urls[0])))
    for name in INFO_NAMES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    return json.load(f)
            except (OSError, ValueError) as e:
                raise UsageError(f'{path}: not a readable shard info file ({e})') from None
    return {}


def known_lengths(urls: Sequence[str], info: Optional[Dict] = None) -> Optional[List[int]]:
    """Samples per shard from the info file's splits, matched by file name; None if any shard is not listed.
    `info` None: each shard's own folder's _info.json (the names are matched within a folder: train/shard-0000.tar
    and val/shard-0000.tar, each folder with its _info.json, were both given the first folder's length)."""
    if info is None:
        by_folder: Dict[str, Dict] = {}
        out = []
        for u in urls:
            folder = os.path.dirname(os.path.abspath(_local(u))) if is_local(u) else ''
            if folder not in by_folder:
                by_folder[folder] = read_info([u])
            found = known_lengths([u], by_folder[folder])
            out.append(found[0] if found else None)
        return None if any(n is None for n in out) else out
    lengths = {}
    for split in info.get('splits', {}).values():
        lengths.update(zip(split.get('filenames', ()), split.get('shard_lengths', ())))
    out = [lengths.get(os.path.basename(_local(u))) for u in urls]
    return None if any(n is None for n in out) else [int(n) for n in out]


# ----------------------------------------------------------------------------- reading

class _Watched(tarfile.TarInfo):
    """tarfile's header parser, recording on the TarFile why it stopped (tarfile turns a header that does not parse
    into a silent end of the archive once past the first member)."""

    @classmethod
    def fromtarfile(cls, tar):
        try:
            return super().fromtarfile(tar)
        except tarfile.HeaderError as e:
            tar.stopped_by = e
            raise


def end_problem(tar: tarfile.TarFile) -> Optional[str]:
    """None if `tar` (iterated to its end) stopped at tar's end-of-archive block, else what stopped it, in words."""
    stop = getattr(tar, 'stopped_by', None)
    if stop is None or isinstance(stop, tarfile.EOFHeaderError):
        return None
    if isinstance(stop, tarfile.InvalidHeaderError):
        return f'is damaged: the block at byte {tar.offset} is not a tar header ({stop})'
    return f'ends early, at byte {tar.offset}, without the end-of-archive blocks (cut short?)'


@contextmanager
def open_tar(url: str, local_mode: str = 'r:*'):
    """A TarFile over a shard that records why it stops: a local file opened for seeking (members passed over are
    not read), anything else (`pipe:`, http) streamed through webdataset's gopen."""
    if is_local(url):
        with tarfile.open(_local(url), local_mode, tarinfo=_Watched) as tar:
            yield tar
        return
    with webdataset().gopen(url, 'rb') as stream, tarfile.open(fileobj=stream, mode='r|*', tarinfo=_Watched) as tar:
        yield tar


def parse_label(data: bytes, url: str, key: str) -> int:
    try:
        return int(data.decode('ascii').strip())
    except (UnicodeDecodeError, ValueError):
        raise ShardError(f'shard {url}: sample {key!r} has a class {data[:20]!r}, not an integer') from None


def _roles(sample: Dict, url: str) -> Tuple[str, str]:
    """The image and the label member names of a grouped sample; ShardError naming what is missing."""
    image = next((k for k in IMAGE_KEYS if k in sample), None)
    label = next((k for k in LABEL_KEYS if k in sample), None)
    if image is None or label is None:
        wanted = ('an image member (' + '/'.join(IMAGE_KEYS) + ')' if image is None
                  else 'a class member (' + '/'.join(LABEL_KEYS) + ')')
        keys = sorted(k for k in sample if not k.startswith('__'))
        raise ShardError(f'shard {url}: sample {sample.get("__key__")!r} lacks {wanted}; it has {keys}')
    return image, label


def _is_meta(name: str) -> bool:
    """webdataset's rule: members named __...__ (or under such a folder) are metadata, not samples."""
    return re.match(r'__[^/]*__($|/)', name) is not None


def _sample_members(tar) -> Iterator[Tuple[str, str, tarfile.TarInfo]]:
    """(sample key, lower-case extension, member) for each member of `tar` that belongs to a sample, in member
    order: regular files, not metadata, with a key (webdataset's base_plus_ext split)."""
    from webdataset.tariterators import base_plus_ext
    for member in tar:
        if not member.isreg() or _is_meta(member.name):
            continue
        key, ext = base_plus_ext(member.name)
        if key is not None:
            yield key, ext.lower(), member


def read_shard(url: str, wanted=None) -> Iterator[Tuple[int, str, Optional[str], Optional[bytes], Optional[int]]]:
    """(position, key, image extension, image bytes, label) for each sample of a shard, in member order.

    `wanted(position)` is asked when a sample starts: True reads it; False passes over it without reading its
    bytes (extension, bytes and label are then None); None stops the read there. A read that goes to the end
    raises ShardError naming the shard if tar stopped anywhere but at its end-of-archive block (damage)."""
    position, sample, reading, stopped = -1, None, False, False

    def finish(sample):
        image, label = _roles(sample, url)
        return sample[image][0], sample[image][1], parse_label(sample[label][1], url, sample['__key__'])
    try:
        with open_tar(url) as tar:
            for key, ext, member in _sample_members(tar):
                if sample is None or key != sample['__key__']:
                    if sample is not None:
                        yield (position, sample['__key__'], *finish(sample)) if reading else \
                            (position, sample['__key__'], None, None, None)
                    position += 1
                    choice = True if wanted is None else wanted(position)
                    if choice is None:
                        stopped, sample = True, None
                        break
                    sample, reading = {'__key__': key}, bool(choice)
                if ext in sample:
                    raise ShardError(f'shard {url}: sample {key!r} has two {ext!r} members')
                sample[ext] = (ext, tar.extractfile(member).read()) if reading else (ext, None)
            problem = None if stopped else end_problem(tar)
        if sample is not None:
            yield (position, sample['__key__'], *finish(sample)) if reading else \
                (position, sample['__key__'], None, None, None)
        if problem:
            raise ShardError(f'shard {url} {problem}, after {position + 1} samples')
    except ShardError:
        raise
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise ShardError(f'shard {url} is not a readable tar ({type(e).__name__}: {str(e).splitlines()[0][:200]})') from None


def iter_shard(url: str) -> Iterator[Tuple[str, str, bytes, int]]:
    """(key, image extension, image bytes, label) for each sample of one shard, read to its end."""
    for _, key, ext, data, label in read_shard(url):
        yield key, ext, data, label


# a tar starts with its first member's name, so a magic must be one no file name starts with: bzip2's 'BZh' is
# taken with its level digit and its block magic '1AY&SY'
_MAGIC = {b'\x1f\x8b': 'gzip', b'\xfd7zXZ\x00': 'xz', b'\x28\xb5\x2f\xfd': 'zstd'}
_UNPACK = {'gzip': 'gunzip', 'bzip2': 'bunzip2', 'xz': 'unxz', 'zstd': 'unzstd'}


def compression(head: bytes) -> Optional[str]:
    """The compression a file's first bytes announce, or None."""
    if head[:3] == b'BZh' and head[3:4] in b'123456789' and head[4:10] == b'1AY&SY':
        return 'bzip2'
    return next((name for magic, name in _MAGIC.items() if head.startswith(magic)), None)


def check_shard(url: str, spec: str) -> None:
    """Cheap up-front check of a local shard: whole tar blocks and a first sample with image and class."""
    if not is_local(url):
        return
    size = os.path.getsize(_local(url))
    with open(_local(url), 'rb') as f:
        packed = compression(f.read(10))
    if packed:
        # webdataset's ShardWriter writes NAME.tar.gz when asked; such a shard was 'truncated or not a tar'
        raise ShardError(f'--data {spec!r}: shard {url} is {packed}-compressed; local shards are read by seeking '
                         f'(the validation index, passing over other workers\' samples), which a compressed tar does '
                         f'not allow: decompress them ({_UNPACK[packed]} each shard) and give the .tar files')
    if size == 0 or size % TAR_BLOCK:
        raise ShardError(f'--data {spec!r}: shard {url} is truncated or not a tar ({size} bytes, not a '
                         f'multiple of {TAR_BLOCK})')
    try:
        next(read_shard(url, lambda position: True if position == 0 else None))
    except StopIteration:
        raise ShardError(f'--data {spec!r}: shard {url} holds no sample') from None
    except ShardError as e:
        raise ShardError(f'--data {spec!r}: {e}') from None


def scan_shard(url: str) -> List[Tuple[int, int, int]]:
    """[(image offset, image size, label)] of a local shard from its tar headers (a seek per member: the image
    bytes are not read), in member order; ShardError if the shard is damaged (end_problem)."""
    samples: List[Dict] = []
    try:
        with open_tar(url, 'r:') as tar:          # uncompressed: the offsets are the file's, for IndexedShards' seeks
            for key, ext, member in _sample_members(tar):
                if not samples or samples[-1]['__key__'] != key:
                    samples.append({'__key__': key})
                samples[-1][ext] = member
            problem = end_problem(tar)
            if problem:
                raise ShardError(f'shard {url} {problem}, after {len(samples)} samples')
            out = []
            for sample in samples:
                image, label = _roles(sample, url)
                value = parse_label(tar.extractfile(sample[label]).read(), url, sample['__key__'])
                out.append((sample[image].offset_data, sample[image].size, value))
    except ShardError:
        raise
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise ShardError(f'shard {url} is not a readable tar ({type(e).__name__}: {e})') from None
    return out


def decode_rgb(data: bytes, name: str):
    """PIL RGB image from encoded bytes; UnreadableImage naming the sample if it does not decode."""
    from PIL import Image

    from .imagefolder import UnreadableImage, as_rgb
    try:
        return as_rgb(Image.open(io.BytesIO(data)))
    except Exception as e:           # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
        raise UnreadableImage(f'image {name} cannot be read: {e}') from None


@contextmanager
def seeded(value: int):
    """Python's, numpy's and torch's global RNGs seeded with `value` inside, restored after (data/seeding.py)."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(value)
    np.random.seed(value % 2 ** 32)
    torch.random.default_generator.manual_seed(value)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def _seed(*keys: int) -> int:
    from .seeding import sample_seed
    return sample_seed(*keys)


# ----------------------------------------------------------------------------- validation index

class IndexedShards(Dataset):
    """Map-style samples of local shards: [(url, offset, size, label)], read by seek (no streaming)."""

    def __init__(self, entries: List[Tuple[str, int, int, int]], transform, spec: str):
        self.entries, self.transform, self.spec = entries, transform, spec

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def targets(self) -> List[int]:
        return [e[3] for e in self.entries]

    def raw(self, index: int) -> bytes:
        url, offset, size, _ = self.entries[index]
        with open(_local(url), 'rb') as f:
            f.seek(offset)
            return f.read(size)

    def __getitem__(self, index: int):
        url, offset, _, label = self.entries[index]
        image = decode_rgb(self.raw(index), f'{url}@{offset}')     # bad_images=skip: ReplaceUnreadable wraps this
        return (self.transform(image) if self.transform else image), label
