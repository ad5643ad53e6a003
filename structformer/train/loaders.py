"""The engine's data loaders (a mixin of `Trainer`): the training loader, made once per run, and the evaluation
loader split over the processes."""
import math
import os

import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ..data.seeding import EpochOrder, SeededSamples, ShuffledOrder, repeat_aug_order
from ..errors import UsageError


def no_training_batch(batch_size: int, samples: int, mixing: bool) -> UsageError:
    """The refusal of a batch larger than a process's share of the data when mixing drops the partial batch (also
    the plan's, train/plan.py, so --dry-run refuses what training refuses)."""
    return UsageError(f"-b/--batch-size {batch_size} leaves no training batch: this process has {samples} training "
                      "samples" + (" and --mixup drops a partial batch" if mixing else ''))


class LoaderSetup:
    """`Trainer`'s loaders: reads `config`, `train_ds`, `val_ds`, `info`, `mixup`, `rank`, `world_size`, `device`;
    sets `train_loader`, `train_order`, `batches_per_epoch`, `steps_per_epoch`, `eval_loader`."""

    def _make_loaders(self) -> None:
        """The training loader, made once for the run (persistent workers stay between epochs): an order per
        epoch (shuffled; DistributedSampler over processes; timm's RepeatAugSampler for --aug-repeats) whose
        samples load with seeded augmentation (data/seeding.py). Evaluation splits the held-out set over the
        processes without padding, so the summed counts are exact."""
        cfg = self.config
        workers = self._workers()
        pin = self.device.type == 'cuda'
        if getattr(self.train_ds, 'streaming', False):      # shards: the stream splits itself (data/shards.py)
            from ..data.shards import stream_loader
            if cfg.aug_repeats:
                raise UsageError(f"--aug-repeats needs random access to the data; --data {cfg.data} is streamed")
            self.train_loader, self.train_order, self.batches_per_epoch = stream_loader(
                self.train_ds, batch_size=cfg.batch_size, workers=workers, rank=self.rank, world_size=self.world_size,
                drop_last=self.mixup is not None, limit_batches=cfg.limit_train_batches, pin_memory=pin, seed=cfg.seed)
            order = None
        elif cfg.aug_repeats:
            order = repeat_aug_order(self.train_ds, self.world_size, self.rank, cfg.aug_repeats, cfg.seed)
        elif self.world_size > 1:
            order = DistributedSampler(self.train_ds, self.world_size, self.rank, shuffle=True, seed=cfg.seed)
        else:
            order = ShuffledOrder(len(self.train_ds), cfg.seed)
        loader_options = dict(num_workers=workers, pin_memory=pin, persistent_workers=workers > 0)
        if order is not None:
            limit = cfg.limit_train_batches * cfg.batch_size
            self.train_order = EpochOrder(order, limit)
            # mixing pairs images, so timm drops an epoch's last, smaller batch when it mixes; so do we
            self.train_loader = DataLoader(SeededSamples(self.train_ds, cfg.seed, self.rank), batch_size=cfg.batch_size,
                                           sampler=self.train_order, drop_last=self.mixup is not None,
                                           generator=torch.Generator().manual_seed(cfg.seed), **loader_options)
            self.batches_per_epoch = len(self.train_loader)
        if self.batches_per_epoch == 0 and getattr(self.train_ds, 'empty_because', None):
            raise UsageError(self.train_ds.empty_because)     # e.g. ImageNet's validation images alone
        if self.batches_per_epoch == 0:
            raise no_training_batch(cfg.batch_size, len(self.train_order), self.mixup is not None)
        # the schedule counts optimiser steps: --limit-train-batches shortens every epoch, accumulation divides it
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / cfg.grad_accum_steps)
        val = self.val_ds if self.world_size == 1 else Subset(self.val_ds, range(self.rank, len(self.val_ds),
                                                                                 self.world_size))
        # its own generator too: making its iterator draws the workers' base seed, and from torch's global RNG
        # without one; persistent workers make that iterator once in a straight run but again after a resume,
        # which then drew one more number from the RNG that dropout, drop path and Mixup share
        self.eval_loader = DataLoader(val, batch_size=cfg.eval_batch_size, shuffle=False,
                                      generator=torch.Generator().manual_seed(cfg.seed), **loader_options)

    def _workers(self) -> int:
        """--workers, or a default by where the data lives: images decoded from files want worker processes
        (one per core, at most 8), in-memory tensors none (a worker would only copy them)."""
        if self.config.num_workers is not None:
            return self.config.num_workers
        if self.info.name in ('imagefolder', 'wds', 'hfds', 'imagenet'):
            # the cores of this machine are shared by the processes on it (torchrun's LOCAL_WORLD_SIZE), not by
            # every process of a run over several machines
            local = int(os.environ.get('LOCAL_WORLD_SIZE', self.world_size))
            default = min(8, max(1, (os.cpu_count() or 1) // max(1, local)))
            if getattr(self.train_ds, 'streaming', False) and not self.train_ds.deals_samples:
                default = min(default, len(self.train_ds.urls) // self.world_size)    # whole shards: one per worker
            return default
        return 0

