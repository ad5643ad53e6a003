"""One training epoch (a mixin of `Trainer`): the step body with gradient accumulation, precision, the parts'
hooks and loss terms, and the module DDP wraps for it."""
import contextlib
import sys
import time
from typing import Dict

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from ..data.seeding import seed_training_draws
from ..functional import autotune
from .checkpoint import crash_point, resolve_checkpoint
from .distributed import all_reduce_sum
from .mixing import hard_labels, mixing_active
from .phases import LossContext
from .precision import clip_parameters, low_precision_failure
from .recovery import progress_state


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped without saving the bad state."""


class TrainStep:
    """`Trainer`'s epoch: reads the run built by `RunBuild` and `LoaderSetup`; advances `global_step`."""

    def _distribute_batch_norm(self) -> None:
        """DDP gives every process rank 0's buffers at the start of each forward, so after an epoch the BatchNorm
        running statistics differ by the last batch each process saw; timm's distribute_bn makes them one again
        (--dist-bn), before the shared evaluation and the checkpoint. The weight average too, as timm's train.py
        does: it averages each process's own statistics, and its evaluation is shared and its file is rank 0's."""
        if self.world_size > 1 and self.config.dist_bn:
            from timm.utils import distribute_bn
            for module in [self.model] + [m for part in self.parts for m in part.evaluated_modules()]:
                distribute_bn(module, self.world_size, reduce=self.config.dist_bn == 'reduce')

    def _wrap(self) -> torch.nn.Module:
        """The module the step runs: under torchrun, DDP over the parameters this phase trains (DDP registers
        the ones that require a gradient when it is made, so it is made again after each phase's freezing)."""
        if self.world_size == 1:
            return self.model
        ids = [self.device.index] if self.device.type == 'cuda' else None
        return DistributedDataParallel(self.model, device_ids=ids, find_unused_parameters=False)

    def _train_epoch(self, epoch: int, phase) -> Dict:
        cfg = self.config
        phase.apply(self.model)
        self._enter_phase(phase)              # phase_settings: the phase's own optimiser and schedule
        extras: Dict[str, object] = {'bce': self.bce} if self.bce is not None else {}
        for part in self.parts:
            part.before_phase(self, phase)
            extras.update(part.loss_extras())
        model = self._wrap()
        model.train()
        # resumed from a recovery point inside this epoch: its first `skip` batches were taken (train/recovery.py)
        within = getattr(self, 'resume_within', None)
        within = within if within is not None and within['epoch'] == epoch else None
        self.resume_within = None
        skip = within['batches'] if within else 0
        self.train_order.set_epoch(epoch)
        self.train_order.resume_at(skip, cfg.batch_size)
        if self.mixup is not None:
            self.mixup.mixup_enabled = mixing_active(self.mixup, cfg, epoch)
        bar = tqdm(total=self.batches_per_epoch, initial=skip, desc=f"epoch {epoch}/{cfg.epochs} [{phase.name}]",
                   disable=not (self.progress and self.is_main and sys.stderr.isatty()), leave=False,
                   file=sys.stderr)   # no carriage-return updates in redirected logs: the epoch line says it all
        self.steplog.start_epoch()
        self.optimizer.zero_grad(set_to_none=True)
        try:
            return self._epoch_steps(epoch, phase, model, extras, bar, within, skip)
        except (RuntimeError, NotImplementedError) as e:   # an op without a kernel in the autocast dtype: one line
            bar.close()
            low = low_precision_failure(e, self.precision)
            if low is None:
                raise
            raise low from None

    def _epoch_steps(self, epoch: int, phase, model, extras: Dict, bar, within, skip: int) -> Dict:
        cfg = self.config
        batches, accum = self.batches_per_epoch, cfg.grad_accum_steps
        totals: Dict[str, float] = dict(within['totals']) if within else {}
        seen, seen_targets, correct = (within['seen'], within['seen_targets'], within['correct']) if within else (0, 0, 0)
        if within and self.rank > 0:       # a recovery point holds the sums of every process so far: rank 0 has them
            totals, seen, seen_targets, correct = {}, 0, 0, 0
        start = time.perf_counter() - (within['elapsed'] if within else 0.0)
        # a second-order optimiser (timm's AdaHessian) differentiates the gradients again in its step: the backward
        # keeps its graph, and the forward takes paths autograd can differentiate twice (autotune.twice_differentiable)
        second_order = bool(getattr(self.optimizer, 'is_second_order', False))
        diverged = None                    # (this process's non-finite loss or None: another's, its step)
        # the step log's loss: the mean over the optimiser step's images, every accumulated batch of it (a recovery
        # point lies at a step's end, so a resumed epoch starts a group here too)
        step_loss, step_images = 0.0, 0
        for step, (images, targets) in enumerate(self.train_loader, start=skip):
            if self.world_size > 1:
                # one seed made one model on every process; the training draws (dropout, drop path, Mixup) are each
                # process's own, keyed by the batch, so a resume inside the epoch draws as the straight run did on
                # every process (a recovery point keeps rank 0's RNG state only)
                seed_training_draws(cfg.seed, epoch, self.rank, step)
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            n = targets.shape[0]
            if cfg.channels_last and images.dim() == 4:
                images = images.contiguous(memory_format=torch.channels_last)
            if self.mixup is not None:
                images, targets = self.mixup(images, targets)
            # accumulation: the optimiser steps after every `accum` batches and after the epoch's last one; each
            # batch's loss is divided by the size of its group, so a group's gradient is the mean over its images
            group = min(accum, batches - (step - step % accum))
            update = step % accum == group - 1
            with contextlib.nullcontext() if update or self.world_size == 1 else model.no_sync(), \
                    autotune.twice_differentiable() if second_order else contextlib.nullcontext():
                with self.precision.autocast():
                    for part in self.parts:          # the teacher sees the (mixed) batch first
                        part.before_batch(self, images)
                    logits = model(images)
                    terms = phase.loss(LossContext(self.model, images, targets, logits, cfg.label_smoothing, extras))
                for part in self.parts:          # regularisers of the weights: float32, outside autocast
                    terms.update(part.loss_terms(self))
                loss = sum(terms.values())
                finite = bool(torch.isfinite(loss))
                if not finite and diverged is None:
                    diverged = (loss.item(), step)
                step_loss += loss.item() * n if finite else 0.0
                step_images += n
                logged = step_loss / step_images if update else None
                if update and self.world_size > 1:
                    # before any process enters the gradient all-reduce: whether one of them diverged since the last
                    # optimiser step (each would otherwise stop alone, and leave the others a gloo / nccl error in
                    # the collective it left), and the step's loss averaged over their images for the step log;
                    # one all-reduce of three numbers per optimiser step, shared by both
                    bad, weighted, images_in_step = all_reduce_sum([float(diverged is not None), step_loss,
                                                                    float(step_images)])
                    if bad and diverged is None:
                        diverged = (None, step)
                    logged = weighted / max(images_in_step, 1.0)
                if update:
                    step_loss, step_images = 0.0, 0
                if diverged is not None and (update or self.world_size == 1):
                    bar.close()
                    raise TrainingDiverged(self._diverged_message(*diverged, epoch, batches))
                if diverged is None:
                    self.precision.backward(loss / group, create_graph=second_order)
            if update:
                self.precision.step(self.optimizer, clip_parameters(self.model, cfg.clip_mode), cfg.clip_grad,
                                    cfg.clip_mode)
                self.optimizer.zero_grad(set_to_none=True)
                self.global_step += 1
                if self.scheduler is not None:
                    self.scheduler.step_update(num_updates=self._schedule_step(self.global_step))
                for part in self.parts:
                    part.after_step(self)
                crash_point(f'epoch {epoch}:step {step // accum + 1}')
            seen += n
            seen_targets += hard_labels(targets).numel()           # tokens for a language model
            correct += (logits.argmax(-1) == hard_labels(targets)).sum().item()
            for name, value in terms.items():
                totals[name] = totals.get(name, 0.0) + value.item() * n
            totals['loss'] = totals.get('loss', 0.0) + loss.item() * n
            if update:
                self.steplog.step(epoch, step + 1, batches, self.global_step, logged, self._lr(),
                                  n * self.world_size)
            else:
                self.steplog.count(n * self.world_size)
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{self._lr():.2e}")
            bar.update()
            if update and cfg.recovery_interval and (step // accum + 1) % cfg.recovery_interval == 0 \
                    and step + 1 < batches:
                so_far = self._summed_over_processes(totals, seen, seen_targets, correct)    # every process
                apart = self._process_files()                                                # every process
                if self.is_main:
                    self._save_recovery(epoch, progress_state(step + 1, *so_far, time.perf_counter() - start), apart)
                    self._recovery_committed()
                    crash_point(f'epoch {epoch}:recovery {step // accum + 1}')
        bar.close()
        elapsed = time.perf_counter() - start
        # the epoch's training metrics over every process's batches (timm reduces its logged loss likewise)
        totals, seen, seen_targets, correct = self._summed_over_processes(totals, seen, seen_targets, correct)
        record = {'epoch': epoch, 'phase': phase.name, 'step': self.global_step, 'lr': self._lr(),
                  'train_top1': 100.0 * correct / max(seen_targets, 1), 'epoch_time_s': elapsed,
                  'train_img_per_s': seen / max(elapsed, 1e-9)}
        record.update({f'train_{k}': v / max(seen, 1) for k, v in totals.items()})
        return record

    def _diverged_message(self, value, step: int, epoch: int, batches: int) -> str:
        """TrainingDiverged's line: the non-finite `value` this process computed at batch index `step` (0-based), or
        (None) that another process's loss was not finite by the optimiser step at `step`; what was kept; what to
        try. The batch and the optimiser step are named as the step log names them (`batch b/B`, 1-based, and
        `step` the optimiser step: the one this batch was to make), where it said 'step' for the batch index."""
        kept = ("nothing of this new run was kept (it had not finished an epoch)" if self.uncommitted_new_run
                else f"the last good checkpoint is {resolve_checkpoint(self.ckpt_dir)}")
        # a resumed run keeps its lr and clipping (it trains on as it started): a new run from the last good weights
        # is where a lower lr can go
        advice = ("Try a lower --lr or --clip-grad" if getattr(self, 'resumed_state', None) is None else
                  "--resume keeps the run's --lr and --clip-grad: start a new run from that checkpoint "
                  "(--initial-checkpoint) with a lower --lr or a --clip-grad")
        # a process told by the others knows the optimiser step, not which of its accumulated batches it was
        where = f"epoch {epoch}, batch {step + 1}/{batches} (optimiser step {self.global_step + 1})"
        became = (f"loss became {value} at {where}" if value is not None else
                  f"loss became non-finite on another of the {self.world_size} processes by {where}")
        return f"{became} (lr={self._lr():.3g}); stopped without saving this state: {kept}. {advice}."

    def _summed_over_processes(self, totals: Dict[str, float], seen: int, seen_targets: int, correct: int):
        """(totals, seen, seen_targets, correct) summed over the processes (a collective: every process calls it)."""
        if self.world_size == 1:
            return dict(totals), seen, seen_targets, correct
        names = sorted(totals)
        sums = all_reduce_sum([totals[k] for k in names] + [seen, seen_targets, correct])
        return dict(zip(names, sums)), *sums[len(names):]

    def _lr(self) -> float:
        from .optim import lr_at
        return lr_at(self.optimizer)

