"""The training engine: one loop for every model and dataset, one process or many (DDP).

The loop is generic; what a configuration adds plugs in as parts it calls (train/parts.py: distillation
from a teacher, low-rank factorisation and Frobenius decay, the weight average), precision
(train/precision.py) and Mixup / CutMix (train/mixing.py).

Determinism: data order comes from a generator seeded by (seed, epoch), independent of the global RNG;
every sample's augmentation draws from RNGs seeded by (seed, epoch, rank, position) (data/seeding.py), so
it does not depend on the loader's workers; dropout, drop path and Mixup draw from the training process's
global RNGs, which every checkpoint saves and `resume` restores. So a run stopped after any epoch and resumed
gives the same weights as an uninterrupted run, bit for bit, on the same machine and thread count.
"""
import contextlib
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm.auto import tqdm

from ..atomic import write_text_atomically
from ..records import check_writable
from ..models.factory import ModelRecipe, build_model, rebuild
from ..models.transforms import TransformContext, apply_transforms, normalize_transforms
from .checkpoint import (CheckpointError, crash_point, describe_mismatch, load_checkpoint,
                         mark_latest, optimizer_state_from, resolve_checkpoint, restore_rng, save_checkpoint)
from .config import TrainConfig, save_config
from .data_paths import absolute_data, check_stored_data
from .distributed import all_reduce_sum, barrier, cleanup_distributed, init_distributed
from .mixing import build_mixup, hard_labels, mixing_active
from .parts import LowRankPart, build_parts
from .phases import LossContext, build_phases, phase_for_epoch
from .precision import Precision, cpu_bfloat16_native
from ..data.seeding import EpochOrder, SeededSamples, ShuffledOrder
from .steplog import StepLog
from ..errors import UsageError
from .run_dir import (RunLock, committed_checkpoints, discard_aside, disk_full, holds_run, move_aside,
                      read_metrics, reconcile, signals_deferred, sigterm_as_interrupt, undo_new_run)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped without saving the bad state."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device, precision: Optional[Precision] = None,
             distributed: bool = False) -> Dict[str, float]:
    """Mean cross-entropy, top-1 and top-5 accuracy (%) over a loader; for a language model (logits
    [B, T, V]) per token, with the perplexity exp(loss) added. `precision`: evaluate under the run's
    autocast (as timm's validate does); `distributed`: each process holds a disjoint part of the data and the
    counts are summed over all of them, so every process returns the exact global metrics."""
    model.eval()
    total, loss_sum, top1_hits, top5_hits, lm = 0, 0.0, 0, 0, False
    for images, targets in loader:
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with precision.autocast() if precision is not None else contextlib.nullcontext():
            logits = model(images)
        logits = logits.float()
        if logits.dim() == 3:                        # next-token prediction: every position is a sample
            lm, logits, targets = True, logits.flatten(0, 1), targets.flatten()
        # whole counts, not per-batch float32 percentages: the result does not depend on the batch size
        hits = logits.topk(min(5, logits.shape[-1]), dim=-1).indices == targets[:, None]
        top1_hits += int(hits[:, 0].sum())
        top5_hits += int(hits.any(dim=-1).sum())
        loss_sum += F.cross_entropy(logits, targets, reduction='sum').item()
        total += targets.shape[0]
    if distributed:
        total, top1_hits, top5_hits, loss_sum, lm = all_reduce_sum([total, top1_hits, top5_hits, loss_sum, int(lm)])
        lm = bool(lm)
    metrics = {'loss': loss_sum / total, 'top1': 100.0 * top1_hits / total, 'top5': 100.0 * top5_hits / total}
    if lm:
        metrics['perplexity'] = math.exp(min(metrics['loss'], 700.0))
    return metrics


def parameter_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class TrainResult:
    output: Path
    last_checkpoint: Path
    history: List[Dict]
    final: Dict[str, float]


class Trainer:
    """Runs a `TrainConfig`. `callbacks` are called as fn(trainer, epoch, metrics) after each epoch."""

    def __init__(self, config: TrainConfig, resume: Optional[str] = None, stop_after: Optional[int] = None,
                 overwrite: bool = False, progress: bool = True, callbacks: Optional[List[Callable]] = None):
        self.config = config.validate()
        self.resume = resume
        self.stop_after = stop_after
        self.progress = progress
        self.callbacks = callbacks or []
        self.rank, self.world_size, self.device = init_distributed(config.device)
        self.is_main = self.rank == 0
        if config.output is None:
            config.output = f"outputs/{config.model}_{config.data.split(':')[0]}"
        if resume:       # the run's own data: refused by name, with the flag that moves it, if it is gone
            check_stored_data(config.data, config.data_as_given, "the run's", '--data with --resume')
        else:            # stored absolute: eval, --resume and -c config.yaml work from any folder
            config.data, as_given = absolute_data(config.data)
            config.data_as_given = as_given or config.data_as_given
        self.output = Path(config.output)
        self.ckpt_dir = self.output / 'checkpoints'
        self._prepare_output(overwrite)

    # ----------------------------------------------------------------- setup
    def _prepare_output(self, overwrite: bool) -> None:
        """Check, but do not yet change, the output folder: nothing is written before the data and the
        model have been built, so a bad argument never costs an old run or leaves an empty folder."""
        if overwrite and self.resume:
            raise UsageError("--resume and --overwrite together: --resume continues the run in --output, --overwrite "
                             "replaces it with a new one; give one of them")
        self.overwrite = overwrite
        self._check_no_run_here()
        self._check_resume_into_own_run()
        check_writable(self.output, '--output')

    def _check_resume_into_own_run(self) -> None:
        """`--resume CHECKPOINT` continues that run in --output: a folder that is new or empty, or the checkpoint's
        own run. Into a folder that holds another run it would mix the two runs' epochs and records."""
        if not isinstance(self.resume, str) or self.resume in ('latest', '') or not holds_run(self.output):
            return
        source = resolve_checkpoint(self.resume).resolve()
        if not source.is_relative_to(self.output.resolve()):
            raise UsageError(f"--output {self.output} already holds another run than --resume {self.resume}; "
                             "continue a run from its checkpoint into a new (or empty) --output, or into its own "
                             "run folder")

    def _check_no_run_here(self, since: str = '') -> None:
        """Refuse a new run (not --resume, not --overwrite) into a folder that holds one. Checked before the
        build and again under the run lock (`since` says so): another process may have started and
        finished a run here while this one was building its data and model."""
        has_run = self.ckpt_dir.is_dir() and any(self.ckpt_dir.iterdir())
        if has_run and not self.resume and not self.overwrite:
            raise FileExistsError(f"--output {self.output} already holds a run{since}; pass --resume to continue "
                                  "it or --overwrite to replace it")

    def _start_output(self) -> None:
        """Create the run folder; with --overwrite move the old run aside (`self.aside`), to be discarded once
        the new run's first trained epoch has committed and put back if anything fails before that.
        `self.started`: from here on the folder's run files are the new run's (or absent), so a failure may
        remove them; a signal cannot fall between the move and the flag."""
        if self.is_main:
            self.output.mkdir(parents=True, exist_ok=True)
            reconcile(self.output)
            with signals_deferred():
                self.aside = move_aside(self.output) if self.overwrite else None
                self.started = True
        barrier()

    def _build(self) -> None:
        from ..data import build_datasets
        from ..data.augment import Augmentation
        cfg = self.config
        seed_everything(cfg.seed)
        augmentation = Augmentation.from_config(cfg)
        extra = {'augmentation': augmentation} if augmentation.requested() else {}
        self.train_ds, self.val_ds, self.info = build_datasets(
            cfg.data, seed=cfg.seed, val_fraction=cfg.val_fraction, model=cfg.model, model_kwargs=cfg.model_kwargs,
            **extra, **cfg.data_kwargs)
        if self.info.img_size and 'img_size' not in cfg.data_kwargs and self.info.name in ('imagefolder', 'wds', 'hfds',
                                                                                             'cifar10'):
            cfg.data_kwargs['img_size'] = self.info.img_size     # it followed the model: recorded for eval and resume
        self.resumed_state = None
        if self.resume:                    # the recorded recipe: what was trained, whatever the config says now
            _, self.resumed_state, _ = load_checkpoint(self._resume_source())
            self._check_world_size(self.resumed_state)
            self.recipe = ModelRecipe.from_state(self.resumed_state)
            self.model = rebuild(self.recipe)
        else:
            transforms = list(cfg.transforms)
            factorize_now = cfg.factorize_spec() is not None and not cfg.factorize_at   # low-rank from the start
            starting_weights = cfg.initial_checkpoint or cfg.pretrained or cfg.pretrained_path
            if factorize_now and not starting_weights:
                transforms.append(cfg.factorize_spec())
            self.model, self.recipe = build_model(cfg.model, self._model_kwargs(), self.info, transforms)
            if starting_weights:
                self._load_initial_weights(factorize_now)
        self._check_planned_factorization()
        self._check_input_shapes()
        self._check_lr_floor()
        self.precision = Precision.create(cfg.amp, cfg.amp_dtype, self.device)
        self.mixup = build_mixup(cfg, self.info.num_classes, language_model=self.info.name in ('pysource', 'text'))
        self.model.to(self.device)
        if cfg.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.parts = build_parts(self)          # before compile: the weight average copies the plain module
        self.lowrank = next(p for p in self.parts if isinstance(p, LowRankPart))
        if cfg.compile:
            # in place (nn.Module.compile): parameter names and state_dict keys stay those of the plain
            # model, so checkpoints load without compile, and DDP / phases wrap the same module
            self.model.compile(backend=cfg.compile)
        self.phases = build_phases(self._phase_specs(), cfg.epochs)
        self._check_phases()
        self._make_loaders()
        self.optimizer = self._make_optimizer()
        self.scheduler = self._make_scheduler()
        self.steplog = StepLog(cfg, self.is_main)

    def _load_initial_weights(self, then_factorize: bool) -> None:
        """--initial-checkpoint / --pretrained-path / --pretrained: the dense weights first (adapted by the family's
        filter, structformer.weights.filters), then (low-rank from the start) the factorisation of them by truncated
        SVD, as after dense pre-training."""
        from ..models.transforms import TransformContext, apply_transforms, normalize_transforms
        from .initial_weights import load_initial_weights, load_timm_pretrained
        cfg = self.config
        taken: List[str] = []
        if cfg.pretrained:
            source, done = load_timm_pretrained(self.model, cfg.model)
        else:
            flag = '--initial-checkpoint' if cfg.initial_checkpoint else '--pretrained-path'
            # `taken`: which weights of a trainer's checkpoint were read (its model's or their EMA)
            done = load_initial_weights(self.model, cfg.initial_checkpoint or cfg.pretrained_path, flag, taken)
            path = str(Path(cfg.initial_checkpoint or cfg.pretrained_path).absolute())   # the record holds where it was read
            if cfg.initial_checkpoint:
                cfg.initial_checkpoint = path
            else:
                cfg.pretrained_path = path
            source = f"{flag} {path}"
        if self.is_main:
            print(f"{source}: weights loaded" + ''.join(f"\n  {line}" for line in taken)
                  + ''.join(f"\n  adapted {line}" for line in done), flush=True)
        if then_factorize:
            spec = normalize_transforms([cfg.factorize_spec()])[0]
            self.model = apply_transforms(self.model, [spec], TransformContext(input_size=self.recipe.input_size))
            self.recipe.transforms.append(spec)

    def _model_kwargs(self) -> Dict:
        """The model's constructor arguments: --model-kwargs, with --drop / --drop-path passed as timm's train.py
        passes them (drop_rate, drop_path_rate)."""
        kwargs = dict(self.config.model_kwargs)
        for flag, key in (('drop', 'drop_rate'), ('drop_path', 'drop_path_rate')):
            value = getattr(self.config, flag)
            if value is not None:
                if key in kwargs and kwargs[key] != value:
                    raise UsageError(f"--{flag.replace('_', '-')} {value} and --model-kwargs {key}={kwargs[key]} "
                                     "disagree; give one")
                kwargs[key] = value
        return kwargs

    def _check_lr_floor(self) -> None:
        """--warmup-lr and --min-lr must not exceed the peak: with --lr-base the peak follows the effective batch,
        so a recipe sized for 8 processes can put its floor above the peak on one."""
        cfg = self.config
        peak = cfg.resolved_lr(self.world_size)
        for key in ('warmup_lr', 'min_lr'):
            value = getattr(cfg, key)
            if value is not None and value > peak:
                raise UsageError(f"--{key.replace('_', '-')} {value:g} is above the peak learning rate {peak:.3g} "
                                 f"(--lr-base {cfg.lr_base:g} scaled to the effective batch {self.effective_batch()}); "
                                 f"lower it or raise the batch (--grad-accum-steps)")

    def _check_world_size(self, state: Dict) -> None:
        """A resumed run keeps its process count: the data each process sees and the steps per epoch depend on
        it. --allow-world-size-change continues anyway, with the schedule recomputed for the new count."""
        saved = int(state.get('world_size', 1))
        if saved != self.world_size and not self.config.allow_world_size_change:
            raise UsageError(f"--resume: the run was trained on {saved} process(es), this is {self.world_size}; "
                             f"resume with {saved} (torchrun --nproc_per_node {saved}) or pass "
                             "--allow-world-size-change to continue with the schedule recomputed")

    def _check_planned_factorization(self) -> None:
        """With --factorize-at K > 0: refuse a factorisation that `factorize` would refuse now, before the K
        dense epochs (and their checkpoints) rather than after them."""
        spec = self.config.factorize_spec()
        if spec is None or not self.config.factorize_at or any(t['name'] == 'factorize' for t in self.recipe.transforms):
            return
        from ..models.factorize import check_factorization
        kwargs = spec['kwargs']
        check_factorization(self.model, kwargs['rank'], kwargs['init'], kwargs.get('include'))

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
                drop_last=self.mixup is not None, limit_batches=cfg.limit_train_batches, pin_memory=pin)
            order = None
        elif cfg.aug_repeats:
            from timm.data.distributed_sampler import RepeatAugSampler
            order = RepeatAugSampler(self.train_ds, num_replicas=self.world_size, rank=self.rank, shuffle=True,
                                     num_repeats=cfg.aug_repeats)
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
        if self.batches_per_epoch == 0:
            raise UsageError(f"-b/--batch-size {cfg.batch_size} leaves no training batch: this process has "
                             f"{len(self.train_order)} training samples" + (" and --mixup drops a partial batch"
                                                                              if self.mixup is not None else ''))
        # the schedule counts optimiser steps: --limit-train-batches shortens every epoch, accumulation divides it
        self.steps_per_epoch = math.ceil(self.batches_per_epoch / cfg.grad_accum_steps)
        val = self.val_ds if self.world_size == 1 else Subset(self.val_ds, range(self.rank, len(self.val_ds),
                                                                                 self.world_size))
        self.eval_loader = DataLoader(val, batch_size=cfg.eval_batch_size, shuffle=False, **loader_options)

    def _workers(self) -> int:
        """--workers, or a default by where the data lives: images decoded from files want worker processes
        (one per core, at most 8), in-memory tensors none (a worker would only copy them)."""
        if self.config.num_workers is not None:
            return self.config.num_workers
        if self.info.name in ('imagefolder', 'wds', 'hfds'):
            default = min(8, max(1, (os.cpu_count() or 1) // max(1, self.world_size)))
            if getattr(self.train_ds, 'streaming', False):          # a stream needs a shard per worker
                default = min(default, len(self.train_ds.urls) // self.world_size)
            return default
        return 0

    def effective_batch(self) -> int:
        return self.config.effective_batch(self.world_size)

    def _check_input_shapes(self) -> None:
        """One forward of two validation samples, in eval mode and without gradients, before anything is
        written: a model built for other images (img_size=, in_chans=) or other data (images into a
        language model) is refused by its own check here, not after the run folder exists. The RNG state
        is restored afterwards, so the run itself is unchanged."""
        from torch.utils.data import default_collate      # not a DataLoader: its iterator draws a seed
        if len(self.val_ds) == 0:
            return
        batch = default_collate([self.val_ds[i] for i in range(min(2, len(self.val_ds)))])[0]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):  # and if a layer did draw: undone
                logits = self.model(batch)
        except ValueError:
            raise
        except RuntimeError as e:         # a shape torch found wrong: name the data and the model
            raise ValueError(f"--model {self.config.model} cannot take a batch of --data {self.config.data} "
                             f"(shape {list(batch.shape)}): {str(e).splitlines()[0]}") from None
        finally:
            self.model.train(was_training)
        predicts = logits.shape[-1] if torch.is_tensor(logits) else None
        if predicts is not None and predicts != self.info.num_classes:   # else: cross-entropy's IndexError later
            given = self.config.model_kwargs.get('num_classes')
            what = f"--model-kwargs num_classes={given}" if given is not None else f"--model {self.config.model}"
            raise UsageError(f"{what}: the model predicts {predicts} classes but --data {self.config.data} has "
                             f"{self.info.num_classes}; leave num_classes out (it follows the data) or give "
                             f"num_classes={self.info.num_classes}")

    def _phase_specs(self) -> List[dict]:
        """The configuration's phases, else the first default a part gives (distillation's two stages), else one."""
        if self.config.phases:
            return self.config.phases
        for part in self.parts:
            specs = part.phase_specs(self)
            if specs is not None:
                return specs
        return []

    def _check_phases(self) -> None:
        from .distill import DISTILL_TERMS
        extras = {}
        for part in self.parts:
            extras.update(part.loss_extras())
            part.check_phases(self.phases)
        for phase in self.phases:
            used = [t for t in phase.losses if t in DISTILL_TERMS and phase.losses[t]]
            if used and 'distiller' not in extras:
                raise ValueError(f"phase {phase.name!r} uses {', '.join(used)}, which need --teacher RUN_DIR")

    def _make_optimizer(self):
        cfg = self.config
        # given the model, timm exempts 1-d parameters and model.no_weight_decay(); given a plain parameter
        # list it decays everything (the official CRATE recipe)
        params = list(self.model.parameters()) if cfg.decay_everything else self.model
        factors = self.lowrank.optimizer_exemptions(self.model)
        # Frobenius decay (seed 004 §3.3) replaces the optimiser's decay of U and V by a loss term on U Vᵀ
        self.frobenius_weight = cfg.weight_decay if factors else 0.0
        if factors:
            params = self._param_groups_without(factors)
        # --factorize-lr-scale while the network is factorised (seed 004 App. A.2): the schedule is rebuilt from
        # this lr at the switch (`replace_model`) and on resume, so it holds from the switch on
        factorised = any(hasattr(m, 'factors') for m in self.model.modules())
        lr = cfg.resolved_lr(self.world_size) * (cfg.factorize_lr_scale if factorised else 1.0)
        return create_optimizer_v2(params, opt=cfg.opt, lr=lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)

    def _param_groups_without(self, names) -> List[Dict]:
        """The optimiser's parameter groups as timm makes them, with the parameters `names` moved to the
        group without weight decay."""
        from timm.optim._param_groups import param_groups_weight_decay
        cfg = self.config
        if cfg.decay_everything:
            named = list(self.model.named_parameters())
            return [{'params': [p for n, p in named if n not in names]},
                    {'params': [p for n, p in named if n in names], 'weight_decay': 0.0}]
        exempt = set(self.model.no_weight_decay()) if hasattr(self.model, 'no_weight_decay') else set()
        return param_groups_weight_decay(self.model, cfg.weight_decay, no_weight_decay_list=exempt | set(names))

    def _make_scheduler(self):
        cfg = self.config
        if cfg.sched != 'cosine':
            return None
        scheduler, _ = create_scheduler_v2(
            self.optimizer, sched='cosine', num_epochs=cfg.epochs, warmup_epochs=cfg.resolved_warmup_epochs(),
            warmup_lr=cfg.resolved_warmup_lr(), min_lr=cfg.resolved_min_lr(), step_on_epochs=False,
            updates_per_epoch=self.steps_per_epoch)
        return scheduler

    # ----------------------------------------------------------------- what parts call
    def replace_model(self, model: torch.nn.Module) -> None:
        """Continue with another network (factorised mid-run): the optimiser is rebuilt, parameters that
        survive keep their optimiser state, and the schedule continues at the same step."""
        self.model = model.to(self.device)
        if self.config.channels_last:
            self.model.to(memory_format=torch.channels_last)
        old = self.optimizer
        self.optimizer = self._make_optimizer()
        for group in self.optimizer.param_groups:
            for param in group['params']:
                if param in old.state:
                    self.optimizer.state[param] = old.state[param]
        self.scheduler = self._make_scheduler()
        if self.scheduler is not None:
            self.scheduler.step_update(num_updates=self.global_step)
        for part in self.parts:
            part.model_replaced(self)

    def evaluate_model(self, model: torch.nn.Module) -> Dict[str, float]:
        """Held-out metrics of `model` (the trained one or its weight average), on every process together."""
        return evaluate(model, self.eval_loader, self.device, self.precision, distributed=self.world_size > 1)

    # ----------------------------------------------------------------- checkpoints
    def _state(self, epoch: int, metrics: Dict) -> Dict:
        return {'model': self.recipe.name, 'model_kwargs': self.recipe.kwargs, 'recipe': self.recipe.to_dict(),
                'epoch': epoch, 'global_step': self.global_step, 'world_size': self.world_size,
                'effective_batch_size': self.effective_batch(), 'precision': self.precision.name,
                'grad_scaler': self.precision.state(),
                'config': self.config.to_dict(), 'metrics': metrics,
                'data_info': {'name': self.info.name, 'num_classes': self.info.num_classes,
                              'in_chans': self.info.in_chans, 'img_size': self.info.img_size}}

    def _save(self, epoch: int, metrics: Dict) -> Path:
        files = {}
        for part in self.parts:
            files.update(part.checkpoint_files())
        try:
            path = save_checkpoint(self.ckpt_dir / f'epoch_{epoch:04d}', self.model, self._state(epoch, metrics),
                                   optimizer=self.optimizer, extra_files=files)
            mark_latest(self.ckpt_dir, path)
        except Exception as e:          # safetensors reports a full disk as SafetensorError, not OSError
            if not disk_full(e):
                raise
            raise self._out_of_space(e, f'checkpoint epoch_{epoch:04d}') from None
        self._prune(epoch)
        return path

    def _out_of_space(self, error: Exception, writing: str) -> CheckpointError:
        """A full disk while committing an epoch, as one line: what is intact and how to go on. A checkpoint is
        committed by rename, so a failed write leaves the previous ones as they were."""
        reason = error.strerror if isinstance(error, OSError) and error.strerror else 'no space left on device'
        if self.uncommitted_new_run:
            kept = "nothing of this new run was kept (it had not finished an epoch); free space and start it again"
        else:
            last = committed_checkpoints(self.ckpt_dir)[-1]
            kept = (f"the last intact checkpoint is epoch {int(last.name.split('_')[1])} ({last}); free space, then "
                    f"continue with `structformer train --output {self.output} --resume`")
        return CheckpointError(f"--output {self.output}: the disk is full ({reason}) while writing {writing}; {kept}")

    def _prune(self, epoch: int) -> None:
        cfg = self.config
        for path in sorted(self.ckpt_dir.glob('epoch_[0-9][0-9][0-9][0-9]')):
            e = int(path.name.split('_')[1])
            keep = e == 0 or e > epoch - cfg.keep_last or (cfg.save_every and e % cfg.save_every == 0)
            if not keep:
                shutil.rmtree(path, ignore_errors=True)

    def _resume_source(self):
        """`--resume` alone continues this run's latest checkpoint; `--resume PATH` a given one."""
        return self.ckpt_dir if self.resume in (True, 'latest', '') else self.resume

    def _restore(self) -> int:
        source = resolve_checkpoint(self._resume_source())
        weights, state, train_tensors = load_checkpoint(source, with_train_state=True)
        mismatch = describe_mismatch(self.model.state_dict(), weights)
        if mismatch:
            raise CheckpointError(f"--resume: {source} is not a checkpoint of "
                                  f"{self.recipe.name!r} as configured: {mismatch}")
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(optimizer_state_from(train_tensors, state))
        self.precision.load_state(state.get('grad_scaler'))
        for part in self.parts:
            part.restore(source)
        self.global_step = state['global_step']
        if int(state.get('world_size', 1)) != self.world_size:     # allowed: the schedule follows the new count
            self.global_step = state['epoch'] * self.steps_per_epoch
        if self.scheduler is not None:
            self.scheduler.step_update(num_updates=self.global_step)
        restore_rng(train_tensors, state['rng'])
        return state['epoch']

    # ----------------------------------------------------------------- loop
    def fit(self) -> TrainResult:
        self._build()                            # data and model first: bad input fails before any write
        self.global_step = 0
        start_epoch = 0
        # SIGTERM as an interrupt on the process that owns the folder; other DDP processes keep the default end
        with RunLock(self.output if self.is_main else None) as lock, \
                sigterm_as_interrupt() if self.is_main else contextlib.nullcontext():
            if self.is_main:
                self._check_no_run_here(' (written by another process while this one started)')
            # a new run that fails or is stopped (Ctrl-C, SIGTERM) before its first trained epoch commits leaves
            # nothing behind, and an --overwrite'n run comes back as it was: a retry must not meet a half run
            self.uncommitted_new_run = not self.resume
            self.aside, self.started = None, False
            try:
                self._start_output()
                return self._fit(start_epoch, self.aside)
            except BaseException:
                if self.is_main and self.uncommitted_new_run and self.started:
                    with signals_deferred():
                        undo_new_run(self.output, self.aside, lock)
                    if self.aside is not None:
                        print(f"--overwrite stopped before the new run's first epoch: the run it was replacing is "
                              f"back in {self.output} as it was", file=sys.stderr, flush=True)
                raise

    def _describe_plan(self) -> str:
        cfg = self.config
        accum = f" x {cfg.grad_accum_steps} accumulated" if cfg.grad_accum_steps > 1 else ''
        procs = f" x {self.world_size} processes" if self.world_size > 1 else ''
        emulated = (self.device.type == 'cpu' and self.precision.name == 'bfloat16' and not cpu_bfloat16_native())
        return (f"{cfg.model} on {self.device}, {self.precision.name}"
                + (' autocast' if self.precision.dtype is not None else '')
                + (' (this CPU has no bfloat16 dot products, AVX512-BF16 or AMX: expect no speed-up)' if emulated else '')
                + f"; effective batch {self.effective_batch()} ({cfg.batch_size} per process{accum}{procs}), "
                f"{self.steps_per_epoch} optimiser steps per epoch, peak lr {cfg.resolved_lr(self.world_size):.3g}"
                + (f" (x {cfg.factorize_lr_scale:g} while factorised)" if cfg.factorize_rank is not None
                   and cfg.factorize_lr_scale != 1 else ''))

    def _fit(self, start_epoch: int, aside: Optional[Path]) -> TrainResult:
        cfg = self.config
        if self.resume:
            start_epoch = self._restore()
            if self.is_main:
                save_config(cfg, self.output / 'config.yaml')     # --epochs may have extended the run
                print(f"resumed from epoch {start_epoch} of {cfg.epochs} ({resolve_checkpoint(self._resume_source())})")
        elif self.is_main:
            save_config(cfg, self.output / 'config.yaml')
            self._save(0, {})                    # the random init, for white-box comparisons
        if self.is_main:
            print(self._describe_plan(), flush=True)
        history: List[Dict] = []
        last_path = None
        if self.is_main:                  # `--resume PATH` into a fresh --output: nothing committed here yet
            here = committed_checkpoints(self.ckpt_dir)         # this run's own (an aside is not read here)
            last_path = here[-1] if here else resolve_checkpoint(self._resume_source())
        epochs_this_run = 0
        try:
            for epoch in range(start_epoch + 1, cfg.epochs + 1):
                phase = phase_for_epoch(self.phases, epoch)
                for part in self.parts:
                    part.before_epoch(self, epoch)
                record = self._train_epoch(epoch, phase)
                self._distribute_batch_norm()
                record.update({f'val_{k}': v for k, v in self.evaluate_model(self.model).items()})
                for part in self.parts:          # every process: evaluation is shared
                    record.update(part.epoch_metrics(self, epoch))
                if self.is_main:
                    last_path = self._save(epoch, record)     # the checkpoint first: it carries the record too
                    if self.uncommitted_new_run:                # a trained epoch: the old run can go now
                        self.uncommitted_new_run = False
                        discard_aside(aside)
                    try:
                        with open(self.output / 'metrics.jsonl', 'a') as f:
                            f.write(json.dumps(record) + '\n')
                    except OSError as e:    # the checkpoint holds the record: the next start restores the line
                        raise self._out_of_space(e, 'metrics.jsonl') if disk_full(e) else e
                    crash_point(f'epoch {epoch}:metrics')
                    self._print_epoch(record)
                    self.steplog.epoch(record)
                barrier()
                history.append(record)
                for callback in self.callbacks:
                    callback(self, epoch, record)
                epochs_this_run += 1
                if self.stop_after and epochs_this_run >= self.stop_after and epoch < cfg.epochs:
                    if self.is_main:
                        print(f"stopping after {epochs_this_run} epoch(s) as asked (--stop-after); "
                              f"continue with --resume")
                    break
            self._write_digest()
        finally:
            for part in self.parts:
                part.finish()
            self.steplog.close()
            cleanup_distributed()
        final = history[-1] if history else {}
        if self.is_main:
            self._print_summary(history)     # also on resuming a finished run: a kill may have cost its summary
        return TrainResult(self.output, last_path, history, final)

    def _distribute_batch_norm(self) -> None:
        """DDP gives every process rank 0's buffers at the start of each forward, so after an epoch the BatchNorm
        running statistics differ by the last batch each process saw; timm's distribute_bn makes them one again
        (--dist-bn), before the shared evaluation and the checkpoint."""
        if self.world_size > 1 and self.config.dist_bn:
            from timm.utils import distribute_bn
            distribute_bn(self.model, self.world_size, reduce=self.config.dist_bn == 'reduce')

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
        extras: Dict[str, object] = {}
        for part in self.parts:
            part.before_phase(self, phase)
            extras.update(part.loss_extras())
        model = self._wrap()
        model.train()
        self.train_order.set_epoch(epoch)
        if self.mixup is not None:
            self.mixup.mixup_enabled = mixing_active(self.mixup, cfg, epoch)
        batches, accum = self.batches_per_epoch, cfg.grad_accum_steps
        bar = tqdm(total=batches, desc=f"epoch {epoch}/{cfg.epochs} [{phase.name}]",
                   disable=not (self.progress and self.is_main and sys.stderr.isatty()), leave=False,
                   file=sys.stderr)   # no carriage-return updates in redirected logs: the epoch line says it all
        totals: Dict[str, float] = {}
        seen, seen_targets, correct, start = 0, 0, 0, time.perf_counter()
        self.steplog.start_epoch()
        self.optimizer.zero_grad(set_to_none=True)
        for step, (images, targets) in enumerate(self.train_loader):
            images = images.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            if cfg.channels_last and images.dim() == 4:
                images = images.contiguous(memory_format=torch.channels_last)
            if self.mixup is not None:
                images, targets = self.mixup(images, targets)
            # accumulation: the optimiser steps after every `accum` batches and after the epoch's last one; each
            # batch's loss is divided by the size of its group, so a group's gradient is the mean over its images
            group = min(accum, batches - (step - step % accum))
            update = step % accum == group - 1
            with contextlib.nullcontext() if update or self.world_size == 1 else model.no_sync():
                with self.precision.autocast():
                    for part in self.parts:          # the teacher sees the (mixed) batch first
                        part.before_batch(self, images)
                    logits = model(images)
                    terms = phase.loss(LossContext(self.model, images, targets, logits, cfg.label_smoothing, extras))
                for part in self.parts:          # regularisers of the weights: float32, outside autocast
                    terms.update(part.loss_terms(self))
                loss = sum(terms.values())
                if not torch.isfinite(loss):
                    bar.close()
                    kept = ("nothing of this new run was kept (it had not finished an epoch)" if self.uncommitted_new_run
                            else f"the last good checkpoint is {resolve_checkpoint(self.ckpt_dir)}")
                    raise TrainingDiverged(
                        f"loss became {loss.item()} at epoch {epoch}, step {step} (lr={self._lr():.3g}); stopped "
                        f"without saving this state: {kept}. Try a lower --lr or --clip-grad.")
                self.precision.backward(loss / group)
            if update:
                self.precision.step(self.optimizer, self.model.parameters(), cfg.clip_grad)
                self.optimizer.zero_grad(set_to_none=True)
                self.global_step += 1
                if self.scheduler is not None:
                    self.scheduler.step_update(num_updates=self.global_step)
                for part in self.parts:
                    part.after_step(self)
                crash_point(f'epoch {epoch}:step {step // accum + 1}')
            n = targets.shape[0]
            seen += n
            seen_targets += hard_labels(targets).numel()           # tokens for a language model
            correct += (logits.argmax(-1) == hard_labels(targets)).sum().item()
            for name, value in terms.items():
                totals[name] = totals.get(name, 0.0) + value.item() * n
            totals['loss'] = totals.get('loss', 0.0) + loss.item() * n
            if update:
                self.steplog.step(epoch, step + 1, batches, self.global_step, loss.item(), self._lr(),
                                  n * self.world_size)
            else:
                self.steplog.count(n * self.world_size)
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{self._lr():.2e}")
            bar.update()
        bar.close()
        elapsed = time.perf_counter() - start
        record = {'epoch': epoch, 'phase': phase.name, 'step': self.global_step, 'lr': self._lr(),
                  'train_top1': 100.0 * correct / max(seen_targets, 1), 'epoch_time_s': elapsed,
                  'train_img_per_s': seen * self.world_size / max(elapsed, 1e-9)}
        record.update({f'train_{k}': v / max(seen, 1) for k, v in totals.items()})
        return record

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]['lr']

    def _write_digest(self) -> None:
        if self.world_size > 1 or os.environ.get('STRUCTFORMER_WRITE_DIGEST'):
            (self.output / f'final_params_rank{self.rank}.sha256').write_text(parameter_digest(self.model) + '\n')

    def _print_epoch(self, r: Dict) -> None:
        phase = f"[{r['phase']}]  " if len(self.phases) > 1 else ''
        ema = f"ema top1 {r['ema_val_top1']:6.2f}%  " if 'ema_val_top1' in r else ''
        print(f"epoch {r['epoch']:>3}/{self.config.epochs}  {phase}train loss {r['train_loss']:.4f}  "
              f"val loss {r['val_loss']:.4f}  val top1 {r['val_top1']:6.2f}%  top5 {r['val_top5']:6.2f}%  {ema}"
              + (f"ppl {r['val_perplexity']:.2f}  " if 'val_perplexity' in r else '') +
              f"lr {r['lr']:.2e}  {_rate(r['train_img_per_s'])} img/s", flush=True)

    def _print_summary(self, history: List[Dict]) -> None:
        history = read_metrics(self.output / 'metrics.jsonl') or history    # every epoch, resumed or not
        if not history:
            return
        best = max(history, key=lambda r: r['val_top1'])
        last = history[-1]
        summary = {'model': self.config.model, 'data': self.config.data, 'epochs': last['epoch'],
                   'final_val_top1': last['val_top1'], 'final_val_top5': last['val_top5'],
                   'final_val_loss': last['val_loss'], 'best_val_top1': best['val_top1'],
                   **({'final_val_perplexity': last['val_perplexity']} if 'val_perplexity' in last else {}),
                   **({'final_ema_val_top1': last['ema_val_top1']} if 'ema_val_top1' in last else {}),
                   'best_epoch': best['epoch'],
                   'effective_batch_size': self.effective_batch(), 'world_size': self.world_size,
                   'precision': self.precision.name,
                   'parameters': sum(p.numel() for p in self.model.parameters())}
        write_text_atomically(self.output / 'summary.json', json.dumps(summary, indent=1))
        width = max(len(k) for k in summary)
        print('\n' + '\n'.join(f"{k:<{width}}  {v:.2f}" if isinstance(v, float) else f"{k:<{width}}  {v}"
                               for k, v in summary.items()))


def _rate(per_second: float) -> str:
    """Three significant figures below 100 (a slow run's 0.077 img/s is not '0'), whole numbers above."""
    return f"{per_second:.0f}" if per_second >= 100 else f"{per_second:.3g}"


def train(config: TrainConfig, **kwargs) -> TrainResult:
    """Train `config` (see `Trainer` for keyword arguments)."""
    return Trainer(config, **kwargs).fit()
