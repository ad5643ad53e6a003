"""The training stream of `--data wds:...`: every sample once per epoch, over any number of processes and workers.

Reading a shard is tars.py (damage, skipping); the choices here (docs/data.md):

- an epoch is a stated number of samples N (`_info.json`'s shard lengths, else `train_samples=`, else a
  header scan); each of P processes takes N // P (the N % P left over are cut from that epoch at a seeded
  place, a different few each epoch, and the log says so), split over its W workers as evenly as whole samples allow, so every
  process takes the same number of steps (DDP needs that);
- samples, not shards, are dealt: the shards are permuted per epoch from (seed, epoch) and laid end to end,
  and each (process, worker) slot reads its own contiguous run of that sequence, starting and ending
  mid-shard where the counts do not divide; every sample is then read once per epoch for any shard count
  and any P x W (where the shard lengths are known). A slot passes over the samples before its run without
  reading their bytes. When the lengths are not known (remote shards with `train_samples=N` and no
  `_info.json`), whole shards are dealt instead: exact only for equal shards whose count P x W divides;
- a shard that holds a different number of samples than stated, or is damaged, stops the run naming it;
  under `bad_images=skip` it is named and counted in the log and the next samples of the sequence stand in;
- each slot's shuffle buffer is seeded by (seed, epoch, slot), every sample's augmentation by (seed, epoch,
  shard, position in shard): an epoch depends on (seed, epoch, P, W) alone, so resuming is exact.
"""
import random
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..errors import UsageError
from .tars import (IMAGE_KEYS, LABEL_KEYS, IndexedShards, ShardError, _local, _seed, absolute_patterns,  # noqa: F401
                   check_shard, decode_rgb, expand_shards, is_local, iter_shard, read_shard, scan_shard, seeded)

_REPEAT_ROUND = 1 << 21          # seed key of the shard order of a round after the first (the quota wraps around)


class ShardStream(IterableDataset):
    """The training split: samples streamed from `urls`, `num_samples` an epoch over all processes.

    `lengths[k]`: the samples shard k gives the stream (after any held-out ones), or None when unknown;
    `lengths_from` says where they came from (for the message when a shard disagrees).
    `set_epoch` writes a shared counter that persistent workers read when the loader restarts them.
    `held_out(shard, j)`, if given, drops samples that the validation split holds.
    `num_classes` (0: unchecked): a sample whose class is outside [0, num_classes) stops the run naming it.
    """
    streaming = True

    def __init__(self, urls: Sequence[str], num_samples: int, transform, seed: int, spec: str,
                 shuffle_buffer: int = 2048, bad_images: str = 'error', held_out=None, shard_ids=None,
                 lengths: Optional[Sequence[int]] = None, lengths_from: str = '_info.json', num_classes: int = 0):
        from timm.data.readers.shared_count import SharedCount
        self.urls, self.num_samples, self.transform = list(urls), int(num_samples), transform
        self.seed, self.spec, self.shuffle_buffer, self.bad_images = seed, spec, shuffle_buffer, bad_images
        self.held_out = held_out
        self.shard_ids = list(shard_ids) if shard_ids is not None else list(range(len(self.urls)))
        self.lengths = [int(n) for n in lengths] if lengths is not None else None
        self.lengths_from, self.num_classes = lengths_from, int(num_classes)
        self.epoch = SharedCount()
        self.resumed_batches = SharedCount()       # batches of this epoch taken before a resume mid-epoch
        self.rank, self.world_size, self.limit, self.batch_size, self.drop_last = 0, 1, 0, 1, False
        self.bad_seen: List[str] = []

    def __len__(self) -> int:
        return self.num_samples

    def configure(self, rank: int, world_size: int, limit: int = 0, batch_size: int = 1,
                  drop_last: bool = False) -> None:
        """This process's place (and --limit-train-batches in samples, the loader's batching); called before the
        loader starts."""
        self.rank, self.world_size, self.limit = rank, world_size, limit
        self.batch_size, self.drop_last = batch_size, drop_last

    def worker_batches(self, worker: int, workers: int) -> int:
        n = self.quota(worker, workers)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def resume_plan(self, workers: int, batches: int) -> Tuple[List[int], int]:
        """(samples each worker gave, the worker asked next) after the first `batches` batches of an epoch: a
        DataLoader over an iterable data set takes a batch from each worker in turn, passing over those done."""
        left = [self.worker_batches(w, workers) for w in range(workers)]
        taken, turn = [0] * workers, 0
        while batches > 0 and any(left):
            if left[turn]:
                left[turn] -= 1
                taken[turn] += 1
                batches -= 1
            turn = (turn + 1) % workers
        return [min(t * self.batch_size, self.quota(w, workers)) for w, t in enumerate(taken)], turn

    def set_epoch(self, epoch: int) -> None:
        self.epoch.value = epoch

    @property
    def deals_samples(self) -> bool:
        return self.lengths is not None and sum(self.lengths) > 0

    def per_process(self, limited: bool = True) -> int:
        n = self.num_samples // self.world_size
        return min(n, self.limit) if self.limit and limited else n

    def quota(self, worker: int, workers: int, limited: bool = True) -> int:
        n = self.per_process(limited)
        return n // workers + (worker < n % workers)

    def slot_range(self, worker: int, workers: int) -> Tuple[int, int]:
        """[start, stop) of this process's `worker` in the epoch's sequence of samples (before --limit-train-batches)."""
        start = self.rank * self.per_process(False) + sum(self.quota(w, workers, False) for w in range(worker))
        return start, start + self.quota(worker, workers, False)

    def shard_order(self, epoch: int, round_: int = 0) -> List[int]:
        """The shards laid end to end in round `round_` of an epoch: a permutation from (seed, epoch[, round])."""
        key = _seed(self.seed, epoch, 0, 0) if round_ == 0 else _seed(self.seed, epoch, _REPEAT_ROUND, round_)
        return np.random.default_rng(key).permutation(len(self.urls)).tolist()

    def segments(self, epoch: int, start: int, stop: int) -> Iterator[Tuple[int, int, int]]:
        """(shard k, first, last): the pieces of positions [start, stop) of the epoch's sequence; past the end of
        all shards the sequence goes on with the next round's order."""
        total, round_ = sum(self.lengths), start // sum(self.lengths)
        at = round_ * total
        while at < stop:
            for k in self.shard_order(epoch, round_):
                lo, hi = max(start, at), min(stop, at + self.lengths[k])
                if lo < hi:
                    yield k, lo - at, hi - at
                at += self.lengths[k]
                if at >= stop:
                    return
            round_ += 1

    def slot_shards(self, epoch: int, slot: int, slots: int) -> List[int]:
        """Whole shards dealt to `slot` (the fallback when lengths are unknown): one permutation from (seed, epoch)."""
        return self.shard_order(epoch)[slot::slots]

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # resumed mid-epoch: the loader asks its workers in turn from worker 0, so the worker the straight epoch
        # would ask next plays worker 0's part; each replays what it gave through its shuffle buffer (so the rest
        # comes in the same order) without decoding or transforming it, unless a decode may fail (bad_images=skip)
        taken, turn = self.resume_plan(workers, int(self.resumed_batches.value))
        worker = (worker + turn) % workers
        replay = taken[worker]
        epoch, slots, slot = int(self.epoch.value), self.world_size * workers, self.rank * workers + worker
        quota = self.quota(worker, workers)
        rng = random.Random(_seed(self.seed, epoch, 1 << 20, slot))
        given = [0]
        passes = self._sample_passes(epoch, worker, workers, lambda: quota - given[0]) if self.deals_samples else \
            self._shard_passes(epoch, slot, slots, workers)
        for items in passes:
            before = given[0]
            for item in self._shuffled(items, rng):     # the buffer drains at the end of each pass
                if given[0] >= quota:
                    return
                if given[0] < replay and self.bad_images != 'skip':
                    given[0] += 1
                    continue
                sample = self._load(item, epoch)
                if sample is not None and given[0] < replay:
                    given[0] += 1
                    continue
                if sample is not None:      # None: undecodable under bad_images=skip, the next sample stands in
                    given[0] += 1
                    yield sample
            if given[0] >= quota or (given[0] == before and not self.deals_samples):
                return                      # done; or (whole shards) shards without a readable sample

    def _sample_passes(self, epoch: int, worker: int, workers: int, remaining):
        """This slot's run of the sequence; then (bad_images=skip only) as many samples after it as were missing,
        until the quota is met or a whole round of the shards gave nothing."""
        start, stop = self.slot_range(worker, workers)
        yield self._read(epoch, start, stop)
        passed_over = 0
        while remaining() > 0:
            need = remaining()
            before = need
            yield self._read(epoch, stop, stop + need)
            stop += need
            passed_over = passed_over + need if remaining() == before else 0
            if passed_over > sum(self.lengths):
                raise UsageError(f'--data {self.spec!r}: no readable sample in a whole round of the training shards')

    def _shard_passes(self, epoch: int, slot: int, slots: int, workers: int):
        if len(self.urls) < slots:
            raise UsageError(f'--data {self.spec!r}: {len(self.urls)} training shard(s) for {self.world_size} '
                             f'process(es) x {workers} worker(s), and no shard lengths to deal samples by (no '
                             '_info.json): need at least one shard per worker')
        mine = self.slot_shards(epoch, slot, slots)
        for round_ in range(1 << 30):
            order = mine if round_ == 0 else \
                np.random.default_rng(_seed(self.seed, epoch, slot, round_)).permutation(mine).tolist()
            yield (item for k in order for item in self._segment(k, 0, None))

    def left_out_at(self, epoch: int) -> int:
        """Where the N % P samples an epoch leaves out (so that every process takes N // P) start in its sequence:
        a seeded place in [0, N - N % P], so they are different ones each epoch even from one shard (at the end
        they were always the last samples of the epoch's last shard)."""
        gap = self.num_samples % self.world_size
        if not gap:
            return self.num_samples
        return int(np.random.default_rng(_seed(self.seed, epoch, 1 << 22, 0)).integers(0, self.num_samples - gap + 1))

    def _read(self, epoch: int, start: int, stop: int):
        """Positions [start, stop) of the samples the processes take, which skip the epoch's left-out ones."""
        cut, gap = self.left_out_at(epoch), self.num_samples % self.world_size
        pieces = [(start, min(stop, cut)), (max(start, cut) + gap, stop + gap)]
        for lo, hi in pieces:
            if lo < hi:
                for k, first, last in self.segments(epoch, lo, hi):
                    yield from self._segment(k, first, last)

    def _segment(self, k: int, first: int, last: Optional[int]):
        """(shard id, position in shard, name, image bytes, label) of samples first..last-1 of shard k (counted
        after held-out ones; last None: to the end). A read to the shard's end checks its stated length."""
        shard, url = self.shard_ids[k], self.urls[k]
        stated = self.lengths[k] if self.lengths is not None else None
        to_end = last is None or last == stated
        state = {'seen': 0, 'stopped': False}      # samples of this shard the stream sees, so far; stopped early

        def wanted(j: int):
            if self.held_out is not None and self.held_out(shard, j):
                return False
            i = state['seen']
            state['seen'] += 1
            if i < first:
                return False
            if last is None or i < last:
                return True
            if to_end:
                return False                # read on to the end (headers only) to check the length
            state['stopped'] = True
            return None
        try:
            for j, key, ext, data, label in read_shard(url, wanted):
                if data is not None:
                    yield shard, j, f'{url}:{key}.{ext}', data, label
            if stated is not None and not state['stopped'] and state['seen'] != stated:
                raise ShardError(f'shard {url} holds {state["seen"]} samples; {self.lengths_from} says {stated}')
        except ShardError as e:
            if self.bad_images != 'skip':
                raise ShardError(f'--data {self.spec!r}: {e}; pass --data-kwargs bad_images=skip to train past '
                                 'damaged shards (named and counted in the log)') from None
            seen = self.__dict__.setdefault('damaged_seen', [])
            if url not in seen:
                seen.append(url)
                print(f'--data {self.spec}: {e}; the samples it lacks are replaced by the next ones of the stream '
                      f'(bad_images=skip; {len(seen)} damaged shard(s) met by this loader process)', flush=True)

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
        if self.num_classes and not 0 <= label < self.num_classes:
            # the training labels are not read before the run (only the validation ones): a shard of another data
            # set, or an unlabelled split written with class -1, ended in the loss's IndexError mid-epoch
            raise ShardError(f'--data {self.spec!r}: sample {name} has class {label}, outside the {self.num_classes} '
                             f'classes [0, {self.num_classes - 1}] (shards of another data set, or of an unlabelled '
                             'split?)')
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

    def __init__(self, stream: ShardStream, loader=None):
        self.stream, self.loader = stream, loader

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def resume_at(self, batches: int, batch_size: int) -> None:
        """The next epoch starts after its first `batches` batches (see ShardStream.taken_before)."""
        self.stream.resumed_batches.value = batches
        if self.loader is not None:
            self.loader.skip = batches

    def __len__(self) -> int:
        return self.stream.per_process()


class LimitedLoader:
    """A DataLoader cut to `batches` per epoch (the iterator is dropped after; persistent workers restart)."""

    def __init__(self, loader: DataLoader, batches: int):
        self.loader, self.batches, self.skip = loader, batches, 0

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for i, batch in enumerate(self.loader, start=self.skip):
            if i >= self.batches:
                return
            yield batch


def worker_batches(samples: int, batch_size: int, workers: int, drop_last: bool) -> int:
    """Batches a process takes per epoch from a stream of `samples`: each of its workers batches its own share
    (split as evenly as whole samples allow), so partial batches come from every worker, not one."""
    w = max(1, workers)
    sizes = [samples // w + (i < samples % w) for i in range(w)]
    return sum(n // batch_size if drop_last else -(-n // batch_size) for n in sizes)


def stream_batches(stream: ShardStream, batch_size: int, workers: int, drop_last: bool) -> int:
    """Batches a process takes per epoch: each worker batches its own quota."""
    return worker_batches(stream.per_process(), batch_size, workers, drop_last)


def stream_loader(stream: ShardStream, *, batch_size: int, workers: int, rank: int, world_size: int,
                  drop_last: bool, limit_batches: int = 0, pin_memory: bool = False, seed: int = 0):
    """(loader, order, batches per epoch) for a ShardStream: the engine's counterpart of its sampler path. The
    loader has its own generator (the seed it gives its workers then never draws from torch's global RNG, which
    a resumed run restores: with persistent workers a straight run makes the iterator once, a resumed one again)."""
    stream.configure(rank, world_size, limit_batches * batch_size, batch_size, drop_last)
    slots = world_size * max(1, workers)
    if not stream.deals_samples and len(stream.urls) < slots:
        raise UsageError(f'--data {stream.spec!r}: {len(stream.urls)} training shard(s) for {world_size} process(es) '
                         f'x {max(1, workers)} loader worker(s), and no shard lengths (_info.json) to deal samples by; '
                         'give at least one shard per worker (--workers, or write smaller shards: structformer data '
                         'shard --shard-size)')
    if rank == 0 and stream.num_samples % world_size:
        print(f'--data {stream.spec}: {stream.num_samples} samples an epoch over {world_size} processes: each takes '
              f'{stream.num_samples // world_size}; {stream.num_samples % world_size} are left out of each epoch '
              '(different ones each epoch)', flush=True)
    if not stream.deals_samples:
        print(f'--data {stream.spec}: the samples per shard are unknown (no _info.json): whole shards are dealt to '
              f'the {slots} loader slots, so an epoch covers every sample once only with equal shards whose count '
              f'{slots} divides', flush=True)
    loader = DataLoader(stream, batch_size=batch_size, num_workers=workers, pin_memory=pin_memory,
                        persistent_workers=workers > 0, drop_last=drop_last,
                        generator=torch.Generator().manual_seed(seed))
    batches = stream_batches(stream, batch_size, workers, drop_last)
    if limit_batches:
        batches = min(batches, limit_batches)
    limited = LimitedLoader(loader, batches)
    return limited, StreamOrder(stream, limited), batches
