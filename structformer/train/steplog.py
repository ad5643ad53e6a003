"""Per-step log lines (`--log-interval N`: loss, lr, images/s every N optimiser steps) and TensorBoard scalars
(`--log-tb DIR`, the optional `tensorboard` package), written by the main process only."""
import sys
import time
from typing import Dict, Optional

from ..errors import UsageError


class StepLog:
    def __init__(self, config, is_main: bool):
        self.interval = config.log_interval if is_main else 0
        self.epochs = config.epochs
        self.writer = None
        if is_main and config.log_tb:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UsageError(f"--log-tb {config.log_tb}: needs the tensorboard package "
                                 "(pip install 'structformer[tb]' or pip install tensorboard)") from None
            self.writer = SummaryWriter(config.log_tb)
        self.start_epoch()

    def start_epoch(self) -> None:
        self._since, self._images = time.perf_counter(), 0

    def count(self, images: int) -> None:
        """Images of a batch that did not end an optimiser step (gradient accumulation)."""
        self._images += images

    def step(self, epoch: int, batch: int, batches: int, global_step: int, loss: float, lr: float,
             images: int) -> None:
        self._images += images
        if self.writer is not None:
            self.writer.add_scalar('train/loss', loss, global_step)
            self.writer.add_scalar('train/lr', lr, global_step)
        if not self.interval or global_step % self.interval:
            return
        now = time.perf_counter()
        rate = self._images / max(now - self._since, 1e-9)
        print(f"  epoch {epoch}/{self.epochs}  batch {batch}/{batches}  step {global_step}  loss {loss:.4f}  "
              f"lr {lr:.3e}  {rate:.1f} img/s", file=sys.stdout, flush=True)
        self._since, self._images = now, 0

    def epoch(self, record: Dict) -> None:
        if self.writer is None:
            return
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ('epoch', 'step'):
                self.writer.add_scalar(f"epoch/{key}", value, record['epoch'])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
