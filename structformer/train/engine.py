"""The training engine: one loop for every model and dataset, one process or many (DDP).

Determinism: data order comes from a generator seeded by (seed, epoch), independent of the
global RNG; augmentation and dropout draw from the global RNGs, which every checkpoint saves and
`resume` restores. So a run stopped after any epoch and resumed gives the same weights as an
uninterrupted run, bit for bit, on the same machine and thread count.
"""
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
from torch.utils.data import DataLoader, DistributedSampler
from tqdm.auto import tqdm

from ..atomic import write_text_atomically
from ..models.factory import ModelRecipe, build_model, rebuild
from ..models.transforms import TransformContext, apply_transforms, normalize_transforms
from .checkpoint import (CheckpointError, crash_point, describe_mismatch, load_checkpoint,
                         mark_latest, optimizer_state_from, resolve_checkpoint, restore_rng, save_checkpoint)
from .config import TrainConfig, save_config
from .distributed import barrier, cleanup_distributed, init_distributed
from .phases import LossContext, build_phases, phase_for_epoch
from . import distill
from ..lowrank import regularizers as lowrank_regularizers   # registers the frobenius_decay / factor_l2 terms
from .run_dir import (RunLock, committed_checkpoints, discard_aside, move_aside, read_metrics, reconcile,
                      undo_new_run)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped without saving the bad state."""


def check_writable(path: Path, flag: str) -> None:
    """Raise ValueError naming `flag` unless `path` (or the nearest folder that exists above it) can be
    written: checked before any work, so a long run never dies at its first checkpoint."""
    probe = Path(path).absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{flag} {path}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {probe} is not writable (read-only file system or no permission)")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device) -> Dict[str, float]:
    """Mean cross-entropy, top-1 and top-5 accuracy (%) over a loader; for a language model (logits
    [B, T, V]) per token, with the perplexity exp(loss) added."""
    model.eval()
    total, loss_sum, top1_hits, top5_hits, lm = 0, 0.0, 0, 0, False
    for images, targets in loader:
        images, targets = images.to(device), targets.to(device)
        logits = model(images)
        if logits.dim() == 3:                        # next-token prediction: every position is a sample
            lm, logits, targets = True, logits.flatten(0, 1), targets.flatten()
        # whole counts, not per-batch float32 percentages: the result does not depend on the batch size
        hits = logits.topk(min(5, logits.shape[-1]), dim=-1).indices == targets[:, None]
        top1_hits += int(hits[:, 0].sum())
        top5_hits += int(hits.any(dim=-1).sum())
        loss_sum += F.cross_entropy(logits, targets, reduction='sum').item()
        total += targets.shape[0]
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
        self.rank, self.world_size, self.device = init_distributed()
        self.is_main = self.rank == 0
        if config.output is None:
            config.output = f"outputs/{config.model}_{config.data.split(':')[0]}"
        self.output = Path(config.output)
        self.ckpt_dir = self.output / 'checkpoints'
        self._prepare_output(overwrite)

    # ----------------------------------------------------------------- setup
    def _prepare_output(self, overwrite: bool) -> None:
        """Check, but do not yet change, the output folder: nothing is written before the data and the
        model have been built, so a bad argument never costs an old run or leaves an empty folder."""
        self.overwrite = overwrite and not self.resume
        self._check_no_run_here()
        check_writable(self.output, '--output')

    def _check_no_run_here(self, since: str = '') -> None:
        """Refuse a new run (not --resume, not --overwrite) into a folder that holds one. Checked before the
        build and again under the run lock (`since` says so): another process may have started and
        finished a run here while this one was building its data and model."""
        has_run = self.ckpt_dir.is_dir() and any(self.ckpt_dir.iterdir())
        if has_run and not self.resume and not self.overwrite:
            raise FileExistsError(f"--output {self.output} already holds a run{since}; pass --resume to continue "
                                  "it or --overwrite to replace it")

    def _start_output(self) -> Optional[Path]:
        """Create the run folder; with --overwrite move the old run aside (returned), to be discarded once
        the new run's first trained epoch has committed and put back if anything fails before that."""
        aside = None
        if self.is_main:
            self.output.mkdir(parents=True, exist_ok=True)
            reconcile(self.output)
            if self.overwrite:
                aside = move_aside(self.output)
        barrier()
        return aside

    def _build(self) -> None:
        from ..data import build_datasets
        cfg = self.config
        seed_everything(cfg.seed)
        self.train_ds, self.val_ds, self.info = build_datasets(
            cfg.data, seed=cfg.seed, val_fraction=cfg.val_fraction, **cfg.data_kwargs)
        if self.resume:                    # the recorded recipe: what was trained, whatever the config says now
            _, state, _ = load_checkpoint(self._resume_source())
            self.recipe = ModelRecipe.from_state(state)
            self.model = rebuild(self.recipe)
        else:
            transforms = list(cfg.transforms)
            if cfg.factorize_spec() and not cfg.factorize_at:        # low-rank from the start
                transforms.append(cfg.factorize_spec())
            self.model, self.recipe = build_model(cfg.model, cfg.model_kwargs, self.info, transforms)
        self._check_planned_factorization()
        self._check_input_shapes()
        self.distiller = self._make_distiller()
        self.model.to(self.device)
        if cfg.compile:
            # in place (nn.Module.compile): parameter names and state_dict keys stay those of the plain
            # model, so checkpoints load without compile, and DDP / phases wrap the same module
            self.model.compile(backend=cfg.compile)
        self.phases = build_phases(self._phase_specs(), cfg.epochs)
        for phase in self.phases:
            used = [t for t in phase.losses if t in distill.DISTILL_TERMS and phase.losses[t]]
            if used and self.distiller is None:
                raise ValueError(f"phase {phase.name!r} uses {', '.join(used)}, which need --teacher RUN_DIR")
            if self.distiller is not None:
                self.distiller.check_phase_terms(used)
        if self.world_size > 1:
            self.sampler = DistributedSampler(self.train_ds, self.world_size, self.rank, shuffle=True, seed=cfg.seed)
        else:
            self.sampler = None
        self.eval_loader = DataLoader(self.val_ds, batch_size=cfg.eval_batch_size, shuffle=False,
                                      num_workers=cfg.num_workers)
        # the schedule counts the steps actually taken: --limit-train-batches shortens every epoch
        self.steps_per_epoch = min(len(self._train_loader(1)), cfg.limit_train_batches or float('inf'))
        self.optimizer = self._make_optimizer()
        self.scheduler = self._make_scheduler()
        self.factorized_metrics: Dict[str, float] = {}

    def _check_planned_factorization(self) -> None:
        """With --factorize-at K > 0: refuse a factorisation that `factorize` would refuse now, before the K
        dense epochs (and their checkpoints) rather than after them."""
        spec = self.config.factorize_spec()
        if spec is None or not self.config.factorize_at or any(t['name'] == 'factorize' for t in self.recipe.transforms):
            return
        from ..lowrank.transform import check_factorization
        kwargs = spec['kwargs']
        check_factorization(self.model, kwargs['rank'], kwargs['init'], kwargs.get('include'))

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
                self.model(batch)
        except ValueError:
            raise
        except RuntimeError as e:         # a shape torch found wrong: name the data and the model
            raise ValueError(f"--model {self.config.model} cannot take a batch of --data {self.config.data} "
                             f"(shape {list(batch.shape)}): {str(e).splitlines()[0]}") from None
        finally:
            self.model.train(was_training)

    def _make_distiller(self) -> Optional['distill.Distiller']:
        """With --teacher: load and check the dense teacher, start a new student from its weights (a
        resumed one has its own), and record the teacher as the exact checkpoint it was read from."""
        cfg = self.config
        if not cfg.teacher:
            return None
        teacher = distill.load_teacher(cfg.teacher, self.info)
        if self.resume:
            distill.check_compatible(self.model, teacher)
        else:
            distill.init_from_teacher(self.model, teacher)
        cfg.teacher = str(resolve_checkpoint(cfg.teacher))
        return distill.Distiller(self.model, teacher.to(self.device))

    def _phase_specs(self) -> List[dict]:
        cfg = self.config
        if cfg.phases or self.distiller is None:
            return cfg.phases
        stage1 = cfg.predictor_epochs
        if stage1 is None:
            stage1 = cfg.default_predictor_epochs() if self.distiller.sparse_layers else 0
        return distill.distillation_phases(cfg.epochs, stage1)

    def _make_optimizer(self):
        cfg = self.config
        # given the model, timm exempts 1-d parameters and model.no_weight_decay(); given a plain parameter
        # list it decays everything (the official CRATE recipe)
        params = list(self.model.parameters()) if cfg.decay_everything else self.model
        factors = set(lowrank_regularizers.factor_parameter_names(self.model)) if cfg.factor_decay == 'frobenius' else set()
        # Frobenius decay (seed 004 §3.3) replaces the optimiser's decay of U and V by a loss term on U Vᵀ
        self.frobenius_weight = cfg.weight_decay if factors else 0.0
        if factors:
            params = self._param_groups_without(factors)
        return create_optimizer_v2(params, opt=cfg.opt, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                   momentum=cfg.momentum)

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

    # ----------------------------------------------------------------- pre-train, then factorise
    def _factorize_due(self, epoch: int) -> bool:
        """True before the first epoch after `factorize_at` epochs of dense training, unless the recipe
        (a resumed run's included) already holds the factorisation."""
        cfg = self.config
        return (bool(cfg.factorize_at) and cfg.factorize_spec() is not None and epoch == cfg.factorize_at + 1
                and not any(t['name'] == 'factorize' for t in self.recipe.transforms))

    def _factorize_now(self) -> None:
        """Factorise the trained dense model by truncated SVD (seed 004 §4.3), record the transform in the
        recipe (so checkpoints from here on rebuild factorised), and rebuild the optimiser and schedule;
        parameters that survive keep their optimiser state, the schedule continues at the same step."""
        spec = normalize_transforms([self.config.factorize_spec()])[0]
        for param in self.model.parameters():        # the next phase sets requires_grad again
            param.requires_grad_(True)
        old = self.optimizer
        self.model = apply_transforms(self.model, [spec], TransformContext(input_size=self.recipe.input_size))
        self.model.to(self.device)
        self.recipe.transforms.append(spec)
        self.optimizer = self._make_optimizer()
        for group in self.optimizer.param_groups:
            for param in group['params']:
                if param in old.state:
                    self.optimizer.state[param] = old.state[param]
        self.scheduler = self._make_scheduler()
        if self.scheduler is not None:
            self.scheduler.step_update(num_updates=self.global_step)
        if self.is_main:                              # what the switch cost, before any factorised step
            after = evaluate(self.model, self.eval_loader, self.device)
            self.factorized_metrics = {f'factorized_val_{k}': v for k, v in after.items()}

    def _spectra_record(self) -> Dict:
        """Per-layer effective rank ‖W‖_*/‖W‖_op and singular values (seed 004 Table 1) for runs that
        factorise: every linear / conv layer, dense or factorised."""
        from ..lowrank.spectra import effective_rank, layer_spectra
        spectra = layer_spectra(self.model)
        ranks = {name: effective_rank(s) for name, s in spectra.items()}
        factored = [ranks[n] for n, m in self.model.named_modules() if n in ranks and hasattr(m, 'factors')]
        return {'effective_rank_mean': float(np.mean(factored)) if factored else None,
                'effective_rank': ranks,
                'singular_values': {n: [float(f'{v:.5g}') for v in s.tolist()] for n, s in spectra.items()}}

    def _train_loader(self, epoch: int) -> DataLoader:
        cfg = self.config
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            return DataLoader(self.train_ds, batch_size=cfg.batch_size, sampler=self.sampler,
                              num_workers=cfg.num_workers, drop_last=False)
        generator = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)
        return DataLoader(self.train_ds, batch_size=cfg.batch_size, shuffle=True, generator=generator,
                          num_workers=cfg.num_workers, drop_last=False)

    def _state(self, epoch: int, metrics: Dict) -> Dict:
        return {'model': self.recipe.name, 'model_kwargs': self.recipe.kwargs, 'recipe': self.recipe.to_dict(),
                'epoch': epoch,
                'global_step': self.global_step, 'config': self.config.to_dict(), 'metrics': metrics,
                'data_info': {'name': self.info.name, 'num_classes': self.info.num_classes,
                              'in_chans': self.info.in_chans, 'img_size': self.info.img_size}}

    def _save(self, epoch: int, metrics: Dict) -> Path:
        path = save_checkpoint(self.ckpt_dir / f'epoch_{epoch:04d}', self.model, self._state(epoch, metrics),
                               optimizer=self.optimizer)
        mark_latest(self.ckpt_dir, path)
        self._prune(epoch)
        return path

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
        weights, state, train_tensors = load_checkpoint(self._resume_source(), with_train_state=True)
        mismatch = describe_mismatch(self.model.state_dict(), weights)
        if mismatch:
            raise CheckpointError(f"--resume: {resolve_checkpoint(self._resume_source())} is not a checkpoint of "
                                  f"{self.recipe.name!r} as configured: {mismatch}")
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(optimizer_state_from(train_tensors, state))
        self.global_step = state['global_step']
        if self.scheduler is not None:
            self.scheduler.step_update(num_updates=self.global_step)
        restore_rng(train_tensors, state['rng'])
        return state['epoch']

    # ----------------------------------------------------------------- loop
    def fit(self) -> TrainResult:
        self._build()                            # data and model first: bad input fails before any write
        self.global_step = 0
        start_epoch = 0
        with RunLock(self.output if self.is_main else None) as lock:
            if self.is_main:
                self._check_no_run_here(' (written by another process while this one started)')
            aside = self._start_output()
            # a new run that fails before its first trained epoch commits leaves nothing behind (and an
            # --overwrite'n run comes back): the command was refused, so a retry must not meet a half run
            self.uncommitted_new_run = not self.resume
            try:
                return self._fit(start_epoch, aside)
            except Exception:
                if self.is_main and self.uncommitted_new_run:
                    undo_new_run(self.output, aside, lock)
                raise

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
        history: List[Dict] = []
        last_path = None
        if self.is_main:                  # `--resume PATH` into a fresh --output: nothing committed here yet
            last_path = resolve_checkpoint(self.ckpt_dir if committed_checkpoints(self.ckpt_dir) else self._resume_source())
        epochs_this_run = 0
        try:
            for epoch in range(start_epoch + 1, cfg.epochs + 1):
                phase = phase_for_epoch(self.phases, epoch)
                if self._factorize_due(epoch):
                    self._factorize_now()
                record = self._train_epoch(epoch, phase)
                record.update(self.factorized_metrics)
                self.factorized_metrics = {}
                if self.is_main:
                    record.update({f'val_{k}': v for k, v in evaluate(self.model, self.eval_loader, self.device).items()})
                    if self.config.factorize_spec() or lowrank_regularizers.factor_parameter_names(self.model):
                        record.update(self._spectra_record())
                    last_path = self._save(epoch, record)     # the checkpoint first: it carries the record too
                    if self.uncommitted_new_run:                # a trained epoch: the old run can go now
                        self.uncommitted_new_run = False
                        discard_aside(aside)
                    with open(self.output / 'metrics.jsonl', 'a') as f:
                        f.write(json.dumps(record) + '\n')
                    crash_point(f'epoch {epoch}:metrics')
                    self._print_epoch(record)
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
            if self.distiller is not None:
                self.distiller.stop()
            cleanup_distributed()
        final = history[-1] if history else {}
        if self.is_main:
            self._print_summary(history)     # also on resuming a finished run: a kill may have cost its summary
        return TrainResult(self.output, last_path, history, final)

    def _train_epoch(self, epoch: int, phase) -> Dict:
        cfg = self.config
        phase.apply(self.model)
        model = self.model
        if self.distiller is not None:
            self.distiller.start_phase(phase)
        if self.world_size > 1:
            model = DistributedDataParallel(self.model, find_unused_parameters=False)
        model.train()
        loader = self._train_loader(epoch)
        limit = cfg.limit_train_batches or len(loader)
        bar = tqdm(total=min(limit, len(loader)), desc=f"epoch {epoch}/{cfg.epochs} [{phase.name}]",
                   disable=not (self.progress and self.is_main and sys.stderr.isatty()), leave=False,
                   file=sys.stderr)   # no carriage-return updates in redirected logs: the epoch line says it all
        totals: Dict[str, float] = {}
        seen, seen_targets, correct, start = 0, 0, 0, time.perf_counter()
        for step, (images, targets) in enumerate(loader):
            if step >= limit:
                break
            images, targets = images.to(self.device), targets.to(self.device)
            if self.distiller is not None:
                self.distiller.start_batch(images)
            logits = model(images)
            extras = {'distiller': self.distiller} if self.distiller is not None else {}
            terms = phase.loss(LossContext(self.model, images, targets, logits, cfg.label_smoothing, extras))
            if self.frobenius_weight:
                terms['frobenius_decay'] = self.frobenius_weight * lowrank_regularizers.frobenius_decay(self.model)
            loss = sum(terms.values())
            if not torch.isfinite(loss):
                bar.close()
                kept = ("nothing of this new run was kept (it had not finished an epoch)" if self.uncommitted_new_run
                        else f"the last good checkpoint is {resolve_checkpoint(self.ckpt_dir)}")
                raise TrainingDiverged(
                    f"loss became {loss.item()} at epoch {epoch}, step {step} (lr={self._lr():.3g}); stopped "
                    f"without saving this state: {kept}. Try a lower --lr or --clip-grad.")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.clip_grad:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
            self.optimizer.step()
            self.global_step += 1
            if self.scheduler is not None:
                self.scheduler.step_update(num_updates=self.global_step)
            n = targets.shape[0]
            seen += n
            seen_targets += targets.numel()                  # tokens for a language model
            correct += (logits.argmax(-1) == targets).sum().item()
            for name, value in terms.items():
                totals[name] = totals.get(name, 0.0) + value.item() * n
            totals['loss'] = totals.get('loss', 0.0) + loss.item() * n
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
        print(f"epoch {r['epoch']:>3}/{self.config.epochs}  {phase}train loss {r['train_loss']:.4f}  "
              f"val loss {r['val_loss']:.4f}  val top1 {r['val_top1']:6.2f}%  top5 {r['val_top5']:6.2f}%  "
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
                   'best_epoch': best['epoch'],
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
