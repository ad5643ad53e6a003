"""Augmentation randomness that depends on (seed, epoch, rank, position) alone, not on worker processes.

timm's transforms draw from Python's `random`, random erasing and our in-memory augmentations from torch's
global RNG, Mixup from numpy's. A data-loader worker has its own copy of each, seeded when the worker starts
and carried from epoch to epoch when workers persist, so what a sample gets would depend on the number of
workers, on which worker loaded it and on whether the run was resumed. Here every sample is loaded with the
three global RNGs seeded from (seed, epoch, rank, its position in this process's epoch order) and restored
afterwards: the same sample at the same place of the same epoch gets the same augmentation with 0 or 8
workers, persistent or not, straight or resumed. The position (not the image index) is the key, so DeiT's
repeated augmentation gives each repeat of an image its own draw.
"""
import random
from typing import Iterator, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler


def sample_seed(seed: int, epoch: int, rank: int, position: int) -> int:
    """A 64-bit seed from the four keys (numpy's SeedSequence hashes them; nearby keys give unrelated seeds)."""
    words = np.random.SeedSequence([seed, epoch, rank, position]).generate_state(2, dtype=np.uint32)
    return int(words[0]) << 32 | int(words[1])


TRAINING_DRAWS = 1 << 40        # the position key of a process's training draws (no sample has this position)


def seed_training_draws(seed: int, epoch: int, rank: int, batch: int) -> None:
    """Seed Python's, numpy's and torch's global RNGs (dropout, drop path, Mixup) for one process's batch from
    (seed, epoch, rank, batch): under DDP each process draws its own masks and mixing, as timm's train.py has
    them (seed + rank), and the draws do not depend on which process's RNG state a checkpoint kept (rank 0's)."""
    value = sample_seed(seed, epoch, rank, TRAINING_DRAWS + batch)
    random.seed(value)
    np.random.seed(value % 2 ** 32)
    torch.manual_seed(value)


class EpochOrder(Sampler):
    """Yields (epoch, position, index) over an index sampler's order for the current epoch; `set_epoch` moves
    to the next one (and is passed on to a sampler that has it, e.g. DistributedSampler)."""

    def __init__(self, order: Sampler, limit: int = 0):
        self.order, self.epoch, self.limit, self.start = order, 0, limit, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.order, 'set_epoch'):
            self.order.set_epoch(epoch)

    def resume_at(self, batches: int, batch_size: int) -> None:
        """The next epoch starts after its first `batches` batches (a recovery point mid-epoch); 0: from the start.
        The order and every sample's augmentation are those of the whole epoch, so the rest is as it was."""
        self.start = batches * batch_size

    def __iter__(self) -> Iterator[Tuple[int, int, int]]:
        for position, index in enumerate(self.order):
            if self.limit and position >= self.limit:      # --limit-train-batches: no sample loaded in vain
                return
            if position >= self.start:
                yield self.epoch, position, int(index)

    def __len__(self) -> int:
        return min(len(self.order), self.limit) if self.limit else len(self.order)


class ShuffledOrder(Sampler):
    """One process's order: a permutation drawn from a generator seeded by (seed, epoch)."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self) -> int:
        return self.size


def repeat_aug_order(dataset, world_size: int, rank: int, repeats: int, seed: int) -> Sampler:
    """timm's RepeatAugSampler (DeiT's repeated augmentation) whose order follows --seed as well as the epoch:
    timm's seeds its permutation by the epoch alone, so every seed gave one order. At seed 0 it is timm's."""
    from timm.data.distributed_sampler import RepeatAugSampler

    class SeededRepeatAugSampler(RepeatAugSampler):
        def set_epoch(self, epoch: int) -> None:
            super().set_epoch(seed * 100_003 + epoch)     # ShuffledOrder's key: one formula for both orders

    order = SeededRepeatAugSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, num_repeats=repeats)
    order.set_epoch(0)
    return order


class SeededSamples(Dataset):
    """`dataset[index]` loaded with Python's, numpy's and torch's global RNGs seeded by `sample_seed` and put
    back afterwards (so, in the main process, dropout and Mixup draw as if no sample had been loaded)."""

    def __init__(self, dataset: Dataset, seed: int, rank: int = 0):
        self.dataset, self.seed, self.rank = dataset, seed, rank

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Tuple[int, int, int]):
        epoch, position, index = key
        value = sample_seed(self.seed, epoch, self.rank, position)
        # In a loader worker nothing but samples draws from the global RNGs, and every sample seeds them first,
        # so there is nothing to put back: saving and restoring cost ~130 µs a sample (~3 % of a JPEG's load).
        in_worker = torch.utils.data.get_worker_info() is not None
        saved = None if in_worker else (random.getstate(), np.random.get_state(), torch.get_rng_state())
        random.seed(value)
        np.random.seed(value % 2 ** 32)
        torch.random.default_generator.manual_seed(value)     # the CPU generator only: CUDA's drives dropout
        try:
            return self.dataset[index]
        finally:
            if saved is not None:
                random.setstate(saved[0])
                np.random.set_state(saved[1])
                torch.set_rng_state(saved[2])
