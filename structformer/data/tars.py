"""webdataset tar shards: `--data wds:TRAIN_PATTERN[,VAL_PATTERN]` (image + class, keys `jpg`/`cls`).

A shard is a tar whose members are grouped into samples by name (webdataset's convention: `KEY.jpg`,
`KEY.cls`); the class is the ASCII integer of `.cls`, the image any of `.jpg .jpeg .png .webp ...`.
Patterns are brace-expanded as webdataset does (`train-{000000..000146}.tar`, `::` joins lists).

What the package gives: shard-name expansion, opening (local files, `pipe:` and http URLs) and the
tar-to-samples grouping (`webdataset.tariterators`). What is ours, and why not timm's ReaderWds (which
uses the same package): timm seeds its sample shuffle once per worker, not per epoch, so a resumed run
shuffles differently; it skips a broken shard silently (`log_and_continue`); and `with_epoch` can repeat
some samples and miss others. Here (docs/data.md):

- an epoch is a stated number of samples N (`_info.json`'s shard lengths, else `train_samples=`, else a
  header scan); each of P processes takes N // P, split over its W workers as evenly as whole samples
  allow, so every process takes the same number of steps (DDP needs that);
- the shard list is permuted per epoch from (seed, epoch) and dealt to the P*W (process, worker) slots;
  with equal shards and N = all samples every sample is seen once per epoch; a slot that runs out of
  shards before its quota reads them again (a fresh order), as webdataset's resampling does;
- the sample shuffle buffer of each slot is seeded by (seed, epoch, slot), and every sample's
  augmentation by (seed, epoch, shard, position in shard): an epoch depends on (seed, epoch, P, W)
  alone, so resuming at an epoch boundary is exact;
- validation is a map-style index of the validation shards (member offsets from the tar headers), so
  evaluation splits over processes exactly as for folders.
"""
import glob
import io
import json
import os
import random
import tarfile
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

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


def known_lengths(urls: Sequence[str], info: Dict) -> Optional[List[int]]:
    """Samples per shard from the info file's splits, matched by file name; None if any shard is not listed."""
    lengths = {}
    for split in info.get('splits', {}).values():
        lengths.update(zip(split.get('filenames', ()), split.get('shard_lengths', ())))
    out = [lengths.get(os.path.basename(_local(u))) for u in urls]
    return None if any(n is None for n in out) else [int(n) for n in out]


# ----------------------------------------------------------------------------- reading

def parse_label(data: bytes, url: str, key: str) -> int:
    try:
        return int(data.decode('ascii').strip())
    except (UnicodeDecodeError, ValueError):
        raise ShardError(f'shard {url}: sample {key!r} has a class {data[:20]!r}, not an integer') from None


def pick(sample: Dict, url: str) -> Tuple[str, bytes, int]:
    """(image extension, image bytes, label) of a grouped sample; ShardError naming the missing key."""
    image = next((k for k in IMAGE_KEYS if k in sample), None)
    label = next((k for k in LABEL_KEYS if k in sample), None)
    if image is None or label is None:
        wanted = 'an image (' + '/'.join(IMAGE_KEYS) + ')' if image is None else 'a class (' + '/'.join(LABEL_KEYS) + ')'
        keys = sorted(k for k in sample if not k.startswith('__'))
        raise ShardError(f'shard {url}: sample {sample.get("__key__")!r} has no {wanted} member; it has {keys}')
    return image, sample[image], parse_label(sample[label], url, sample.get('__key__'))


def iter_shard(url: str) -> Iterator[Tuple[str, str, bytes, int]]:
    """(key, image extension, image bytes, label) for each sample of one shard, streamed."""
    wds = webdataset()
    from webdataset.tariterators import group_by_keys, tar_file_iterator
    try:
        with wds.gopen(url, 'rb') as stream:
            files = ({**f, '__url__': url} for f in tar_file_iterator(stream))
            for sample in group_by_keys(files):
                ext, data, label = pick(sample, url)
                yield sample['__key__'], ext, data, label
    except ShardError:
        raise
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:
        raise ShardError(f'shard {url} is not a readable tar ({type(e).__name__}: {str(e).splitlines()[0][:200]})') from None


def check_shard(url: str, spec: str) -> None:
    """Cheap up-front check of a local shard: whole tar blocks and a first sample with image and class."""
    if not is_local(url):
        return
    size = os.path.getsize(_local(url))
    if size == 0 or size % TAR_BLOCK:
        raise ShardError(f'--data {spec!r}: shard {url} is truncated or not a tar ({size} bytes, not a '
                         f'multiple of {TAR_BLOCK})')
    try:
        next(iter_shard(url))
    except StopIteration:
        raise ShardError(f'--data {spec!r}: shard {url} holds no sample') from None
    except ShardError as e:
        raise ShardError(f'--data {spec!r}: {e}') from None


def scan_shard(url: str) -> List[Tuple[int, int, int]]:
    """[(image offset, image size, label)] of a local shard from its tar headers (a seek per member: the image
    bytes are not read), in member order."""
    from webdataset.tariterators import base_plus_ext
    path, out, current = _local(url), [], {}
    try:
        with tarfile.open(path, 'r:') as tar:
            members = [m for m in tar.getmembers() if m.isreg()]
            samples: List[Dict] = []
            for m in members:
                key, ext = base_plus_ext(m.name)
                if key is None or os.path.basename(key).startswith('__'):
                    continue
                if not samples or samples[-1]['__key__'] != key:
                    samples.append({'__key__': key})
                samples[-1][ext.lower()] = m
            for sample in samples:
                image = next((k for k in IMAGE_KEYS if k in sample), None)
                label = next((k for k in LABEL_KEYS if k in sample), None)
                if image is None or label is None:
                    pick({k: b'' for k in sample} | {'__key__': sample['__key__']}, url)    # raises, naming the key
                tar.fileobj.seek(sample[label].offset_data)
                value = parse_label(tar.fileobj.read(sample[label].size), url, sample['__key__'])
                current = sample[image]
                out.append((current.offset_data, current.size, value))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ShardError(f'shard {url} is not a readable tar ({type(e).__name__}: {e})') from None
    return out


def decode_rgb(data: bytes, name: str):
    """PIL RGB image from encoded bytes; UnreadableImage naming the sample if it does not decode."""
    from PIL import Image

    from .imagefolder import UnreadableImage
    try:
        return Image.open(io.BytesIO(data)).convert('RGB')
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


# ----------------------------------------------------------------------------- training stream

class ShardStream(IterableDataset):
    """The training split: samples streamed from `urls`, `num_samples` an epoch over all processes.

    `set_epoch` writes a shared counter that persistent workers read when the loader restarts them.
    `held_out(shard, j)`, if given, drops samples that the validation split holds.
    """
    streaming = True

    def __init__(self, urls: Sequence[str], num_samples: int, transform, seed: int, spec: str,
                 shuffle_buffer: int = 2048, bad_images: str = 'error', held_out=None, shard_ids=None):
        from timm.data.readers.shared_count import SharedCount
        self.urls, self.num_samples, self.transform = list(urls), int(num_samples), transform
        self.seed, self.spec, self.shuffle_buffer, self.bad_images = seed, spec, shuffle_buffer, bad_images
        self.held_out = held_out
        self.shard_ids = list(shard_ids) if shard_ids is not None else list(range(len(self.urls)))
        self.epoch = SharedCount()
        self.rank, self.world_size, self.limit = 0, 1, 0
        self.bad_seen: List[str] = []

    def __len__(self) -> int:
        return self.num_samples

    def configure(self, rank: int, world_size: int, limit: int = 0) -> None:
        """This process's place (and --limit-train-batches in samples); called before the loader starts."""
        self.rank, self.world_size, self.limit = rank, world_size, limit

    def set_epoch(self, epoch: int) -> None:
        self.epoch.value = epoch

    def per_process(self) -> int:
        n = self.num_samples // self.world_size
        return min(n, self.limit) if self.limit else n

    def quota(self, worker: int, workers: int) -> int:
        n = self.per_process()
        return n // workers + (worker < n % workers)

    def slot_shards(self, epoch: int, slot: int, slots: int) -> List[int]:
        """Shard positions (into self.urls) dealt to `slot` this epoch: one permutation from (seed, epoch)."""
        order = np.random.default_rng(_seed(self.seed, epoch, 0, 0)).permutation(len(self.urls))
        return order[slot::slots].tolist()

    def _rounds(self, mine: List[int], epoch: int, slot: int):
        """Passes over this slot's shards, each an iterator of (shard id, position, name, bytes, label); a pass after
        the first (the quota needs more than the slot's shards hold) takes the shards in a fresh order."""
        for round_ in range(1 << 30):
            order = mine if round_ == 0 else np.random.default_rng(_seed(self.seed, epoch, slot, round_)).permutation(mine).tolist()
            yield self._pass(order)

    def _pass(self, order: List[int]):
        for k in order:
            shard = self.shard_ids[k]
            for j, (key, ext, data, label) in enumerate(iter_shard(self.urls[k])):
                if self.held_out is None or not self.held_out(shard, j):
                    yield shard, j, f'{self.urls[k]}:{key}.{ext}', data, label

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, slots, slot = int(self.epoch.value), self.world_size * workers, self.rank * workers + worker
        if len(self.urls) < slots:
            raise UsageError(f'--data {self.spec!r}: {len(self.urls)} training shard(s) for {self.world_size} '
                             f'process(es) x {workers} worker(s); need at least one shard per worker')
        quota = self.quota(worker, workers)
        rng = random.Random(_seed(self.seed, epoch, 1 << 20, slot))
        given = 0
        for items in self._rounds(self.slot_shards(epoch, slot, slots), epoch, slot):
            before = given
            for item in self._shuffled(items, rng):     # the buffer drains at the end of each pass
                if given >= quota:
                    return
                sample = self._load(item, epoch)
                if sample is not None:      # None: undecodable under bad_images=skip, the next sample stands in
                    given += 1
                    yield sample
            if given >= quota or given == before:      # done, or shards without a (readable) sample
                return

    def _shuffled(self, items, rng: random.Random):
        """webdataset's shuffle buffer, with our generator: fill `shuffle_buffer`, then yield a random slot and refill it."""
        buffer = []
        for item in items:
            if len(buffer) < self.shuffle_buffer:
                buffer.append(item)
                continue
            i = rng.randrange(len(buffer))
            buffer[i], item = item, buffer[i]
            yield item
        rng.shuffle(buffer)
        yield from buffer

    def _load(self, item, epoch: int):
        from .imagefolder import UnreadableImage, report_replaced
        shard, j, name, data, label = item
        try:
            image = decode_rgb(data, name)
        except UnreadableImage as e:
            if self.bad_images != 'skip':
                raise UnreadableImage(f'--data {self.spec!r}: {e}; pass --data-kwargs bad_images=skip to train '
                                      'past such images') from None
            report_replaced(self, name, str(e), 'the next sample of the stream')
            return None
        with seeded(_seed(self.seed, epoch, shard, j)):
            return (self.transform(image) if self.transform else image), label


class StreamOrder:
    """What the engine calls on its order object, for a stream: set_epoch, and len = samples per process."""

    def __init__(self, stream: ShardStream):
        self.stream = stream

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def __len__(self) -> int:
        return self.stream.per_process()


class LimitedLoader:
    """A DataLoader cut to `batches` per epoch (the iterator is dropped after; persistent workers restart)."""

    def __init__(self, loader: DataLoader, batches: int):
        self.loader, self.batches = loader, batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i >= self.batches:
                return
            yield batch


def stream_batches(stream: ShardStream, batch_size: int, workers: int, drop_last: bool) -> int:
    """Batches a process takes per epoch: each worker batches its own quota."""
    w = max(1, workers)
    sizes = [stream.quota(i, w) for i in range(w)]
    return sum(n // batch_size if drop_last else -(-n // batch_size) for n in sizes)


def stream_loader(stream: ShardStream, *, batch_size: int, workers: int, rank: int, world_size: int,
                  drop_last: bool, limit_batches: int = 0, pin_memory: bool = False):
    """(loader, order, batches per epoch) for a ShardStream: the engine's counterpart of its sampler path."""
    stream.configure(rank, world_size, limit_batches * batch_size)
    slots = world_size * max(1, workers)
    if len(stream.urls) < slots:
        raise UsageError(f'--data {stream.spec!r}: {len(stream.urls)} training shard(s) for {world_size} process(es) '
                         f'x {max(1, workers)} loader worker(s); give at least one shard per worker (--workers, '
                         'or write smaller shards: structformer data shard --shard-size)')
    loader = DataLoader(stream, batch_size=batch_size, num_workers=workers, pin_memory=pin_memory,
                        persistent_workers=workers > 0, drop_last=drop_last)
    batches = stream_batches(stream, batch_size, workers, drop_last)
    if limit_batches:
        batches = min(batches, limit_batches)
    return LimitedLoader(loader, batches), StreamOrder(stream), batches


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
