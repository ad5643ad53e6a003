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
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from ..atomic import write_text_atomically
from ..data.classes import class_record
from ..records import check_writable
from .build import RunBuild, seed_everything  # noqa: F401  (seed_everything: re-exported)
from .checkpoint import checkpoint_epoch, crash_point, resolve_checkpoint
from .config import TrainConfig, save_config
from .data_paths import absolute_data, check_output_outside_data, check_stored_data
from .distributed import barrier, broadcast_module, cleanup_distributed, init_distributed
from .evaluation import evaluate, parameter_digest
from .loaders import LoaderSetup
from .phases import phase_for_epoch
from .precision import cpu_bfloat16_note, tf32_switches
from .recovery import prune as prune_recovery
from .save_resume import CheckpointGlue
from .step import TrainStep, TrainingDiverged  # noqa: F401  (TrainingDiverged: re-exported)
from ..errors import UsageError
from .run_dir import (RunLock, committed_checkpoints, discard_aside, disk_full, holds_run, holds_trained_commit,
                      move_aside, read_metrics, reconcile, signals_deferred, sigterm_as_interrupt, undo_new_run)


@dataclass
class TrainResult:
    output: Path
    last_checkpoint: Path
    history: List[Dict]
    final: Dict[str, float]


class Trainer(RunBuild, LoaderSetup, TrainStep, CheckpointGlue):
    """Runs a `TrainConfig`. `callbacks` are called as fn(trainer, epoch, metrics) after each epoch.

    The loop is here; building the run is `RunBuild` (train/build.py), its loaders `LoaderSetup`
    (train/loaders.py), an epoch's steps `TrainStep` (train/step.py), checkpoints `CheckpointGlue`
    (train/save_resume.py), held-out metrics `evaluate` (train/evaluation.py)."""

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
        check_output_outside_data(self.config.output, self.config.data)
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
        # an older checkpoint of this run: the epochs after it are another timeline (their checkpoints, their
        # metrics lines); continued here, metrics.jsonl held the next epoch twice and an early stop left the old
        # epochs as the newest checkpoint
        newest = committed_checkpoints(self.ckpt_dir)
        try:
            epoch = int(json.loads((source / 'state.json').read_text()).get('epoch', 0))
        except (OSError, ValueError, TypeError, AttributeError):
            return                                           # load_checkpoint names a broken checkpoint
        trained = checkpoint_epoch(newest[-1]) if newest else 0
        if trained > epoch:
            raise UsageError(f"--resume {self.resume}: the run in --output {self.output} has trained to epoch "
                             f"{trained} since that checkpoint (epoch {epoch}); continue from it into a new --output "
                             "(its records start there), or --resume the run itself")

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

    def effective_batch(self) -> int:
        return self.config.effective_batch(self.world_size)

    # ----------------------------------------------------------------- what parts call
    def replace_model(self, model: torch.nn.Module) -> None:
        """Continue with another network (factorised mid-run): the optimiser is rebuilt, parameters that
        survive keep their optimiser state, and the schedule continues at the same step."""
        self.model = model.to(self.device)
        if self.config.channels_last:
            self.model.to(memory_format=torch.channels_last)
        if self.world_size > 1:        # each process drew its own numbers (train/step.py seeds them per rank)
            broadcast_module(self.model)
        old = self.optimizer
        self.optimizer = self._make_optimizer()
        for group in self.optimizer.param_groups:
            for param in group['params']:
                if param in old.state:
                    self.optimizer.state[param] = old.state[param]
        self.scheduler = self._make_scheduler()          # at the step the run (or its phase) has reached
        for part in self.parts:
            part.model_replaced(self)

    def evaluate_model(self, model: torch.nn.Module) -> Dict[str, float]:
        """Held-out metrics of `model` (the trained one or its weight average), on every process together."""
        return evaluate(model, self.eval_loader, self.device, self.precision, distributed=self.world_size > 1)

    # ----------------------------------------------------------------- checkpoints
    # ----------------------------------------------------------------- loop
    def fit(self) -> TrainResult:
        with tf32_switches(self.device, self.config.tf32):      # --tf32: for the run, restored after it
            return self._fit_here()

    def _fit_here(self) -> TrainResult:
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
                if self.is_main and self.uncommitted_new_run and self.started and holds_trained_commit(self.ckpt_dir):
                    # stopped between a trained commit's rename and its flag: the disk, not the flag, decides (as
                    # `reconcile` does); the epoch is kept and the run's records (latest.json, metrics.jsonl) are
                    # brought to it as the next start would
                    with signals_deferred():
                        self._recovery_committed()
                        with contextlib.suppress(OSError):      # a full disk: the next start reconciles
                            reconcile(self.output)
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
        emulated = cpu_bfloat16_note() if self.device.type == 'cpu' and self.precision.name == 'bfloat16' else ''
        return (f"{cfg.model} on {self.device}, {self.precision.name}"
                + (' autocast' if self.precision.dtype is not None else '')
                + (f' ({emulated})' if emulated else '')
                + ((', TF32 matmuls' if self.device.type == 'cuda' else ', --tf32 ignored (a CUDA switch)')
                   if cfg.tf32 else '')
                + f"; effective batch {self.effective_batch()} ({cfg.batch_size} per process{accum}{procs}), "
                f"{self.steps_per_epoch} optimiser steps per epoch, peak lr {cfg.resolved_lr(self.world_size):.3g}"
                + (f" (x {cfg.factorize_lr_scale:g} while factorised)" if cfg.factorises()
                   and cfg.factorize_lr_scale != 1 else ''))

    def _schedule_warnings(self) -> List[str]:
        """A step / multistep schedule that never decays within the run, or within a phase with its own schedule
        (optim.never_decays): timm's train.py trains on at the peak without a word."""
        from .optim import never_decays
        if not self.config.phase_settings:
            return [w for w in [never_decays(self.config.schedule_values(), self.steps_per_epoch)] if w]
        found = (never_decays(self.config.schedule_values(p.name, p.epochs), self.steps_per_epoch,
                              f"phase_settings.{p.name}.") for p in self.phases)
        return [w for w in found if w]

    def _fit(self, start_epoch: int, aside: Optional[Path]) -> TrainResult:
        cfg = self.config
        if self.resume:
            start_epoch = self._restore()
            if self.is_main:
                save_config(cfg, self.output / 'config.yaml')     # --epochs may have extended the run
                source = resolve_checkpoint(self._resume_source())
                within = self.resume_within
                print(f"resumed inside epoch {within['epoch']} of {cfg.epochs}, after {within['batches']} of its "
                      f"{self.batches_per_epoch} batches ({source})" if within else
                      f"resumed from epoch {start_epoch} of {cfg.epochs} ({source})")
        elif self.is_main:
            save_config(cfg, self.output / 'config.yaml')
            self._write_classes()
            self._save(0, {})                    # the random init, for white-box comparisons
        if self.is_main:
            print(self._describe_plan(), flush=True)
            for warning in self._schedule_warnings():
                print(warning, file=sys.stderr, flush=True)
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
                apart = self._process_files()         # every process: what differs between them
                if self.is_main:
                    last_path = self._save(epoch, record, apart)     # the checkpoint first: it carries the record too
                    prune_recovery(self.ckpt_dir, completed_epochs=epoch)     # overtaken by the epoch's checkpoint
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
            # a resumed run whose last epoch had committed is finished too: a kill between that checkpoint and the
            # average cost the average, which the next start makes (it wrote a summary without it, for good)
            finished = (history[-1]['epoch'] if history else start_epoch) == cfg.epochs
            self.average_metrics = self._average_last() if cfg.avg_last and finished else {}
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

    def _recovery_committed(self) -> None:
        """A recovery point is a trained commit: from here an interrupted new run keeps its folder (to resume
        from), and an --overwrite'n run's old records can go."""
        if self.uncommitted_new_run:
            self.uncommitted_new_run = False
            discard_aside(self.aside)

    def _write_classes(self) -> None:
        """RUN/classes.json: the class names of the data, in the order of the model's outputs, and which order
        that is (also in every checkpoint's state.json; `eval` and `--resume` check data against it)."""
        record = dict(class_record(self.info.extra), num_classes=self.info.num_classes)
        if record['classes']:
            write_text_atomically(self.output / 'classes.json', json.dumps(record, indent=1))

    def _write_digest(self) -> None:
        """final_params_rankR.sha256: each process's digest of the weights it ends with (under torchrun). Those of
        an earlier part of the run on more processes (or on several, resumed on one) go: they describe other weights."""
        writing = self.world_size > 1 or os.environ.get('STRUCTFORMER_WRITE_DIGEST')
        if self.is_main:
            for old in self.output.glob('final_params_rank*.sha256'):
                rank = old.name[len('final_params_rank'):-len('.sha256')]
                if not (writing and rank.isdigit() and int(rank) < self.world_size):
                    old.unlink(missing_ok=True)
        if writing:
            write_text_atomically(self.output / f'final_params_rank{self.rank}.sha256',
                                  parameter_digest(self.model) + '\n')

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
                   'parameters': sum(p.numel() for p in self.model.parameters()),
                   **getattr(self, 'average_metrics', {})}
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
