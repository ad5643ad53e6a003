"""Checkpoint save and resume glue (a mixin of `Trainer`): what a checkpoint of the run holds, writing it with
the parts' files, keeping the last ones, a full disk as one line, and restoring a run from one."""
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .checkpoint import (CheckpointError, checkpoint_folders, checkpoint_name, describe_mismatch, load_checkpoint,
                         mark_latest, optimizer_state_from, resolve_checkpoint, restore_rng, save_checkpoint)
from ..data.classes import class_mismatch, class_record
from ..errors import UsageError
from .distributed import all_reduce_sum, broadcast_module
from .recovery import prune, recovery_name, resume_source
from .run_dir import checkpoint_epoch, committed_checkpoints, disk_full, read_metrics


class CheckpointGlue:
    """`Trainer`'s checkpoints: `_save` after each epoch, `_save_recovery` inside one (--recovery-interval),
    `_restore` on --resume."""

    def _state(self, epoch: int, metrics: Dict) -> Dict:
        return {'model': self.recipe.name, 'model_kwargs': self.recipe.kwargs, 'recipe': self.recipe.to_dict(),
                'epoch': epoch, 'global_step': self.global_step, 'world_size': self.world_size,
                'effective_batch_size': self.effective_batch(), 'precision': self.precision.name,
                'grad_scaler': self.precision.state(),
                'config': self.config.to_dict(), 'metrics': metrics,
                'data_info': {'name': self.info.name, 'num_classes': self.info.num_classes,
                              'in_chans': self.info.in_chans, 'img_size': self.info.img_size,
                              **class_record(self.info.extra), **self._eval_crop()}}

    def _eval_crop(self) -> Dict:
        """--data-kwargs crop_pct / interpolation / crop_mode where given: the held-out images' geometry (export's
        pretrained_cfg)."""
        given = self.config.data_kwargs or {}
        return {key: kind(given[key]) for key, kind in (('crop_pct', float), ('interpolation', str),
                                                        ('crop_mode', str)) if given.get(key) is not None}

    def _process_files(self) -> Dict[str, Dict]:
        """The parts' files of what differs between the processes (a collective: every process calls it before
        rank 0 writes a checkpoint, and passes it to `_save` / `_save_recovery`)."""
        files = {}
        for part in self.parts:
            files.update(part.process_files(self))
        return files

    def _save(self, epoch: int, metrics: Dict, process_files: Optional[Dict] = None) -> Path:
        files = dict(process_files or {})
        for part in self.parts:
            files.update(part.checkpoint_files())
        try:
            path = save_checkpoint(self.ckpt_dir / checkpoint_name(epoch), self.model, self._state(epoch, metrics),
                                   optimizer=self.optimizer, extra_files=files)
            mark_latest(self.ckpt_dir, path)
        except Exception as e:          # safetensors reports a full disk as SafetensorError, not OSError
            if not disk_full(e):
                raise
            raise self._out_of_space(e, f'checkpoint epoch_{epoch:04d}') from None
        self._prune(epoch, metrics)
        return path

    def _save_recovery(self, epoch: int, progress: Dict, process_files: Optional[Dict] = None) -> Path:
        """A recovery point inside `epoch` (train/recovery.py): the full state, and where the epoch stands; the
        older points are removed once it has committed."""
        files = dict(process_files or {})
        for part in self.parts:
            files.update(part.checkpoint_files())
        pending = {type(part).__name__: part.pending_metrics() for part in self.parts}
        state = dict(self._state(epoch - 1, {}), recovery=dict(progress, epoch=epoch, workers=self._workers(),
                                                               batches_per_epoch=self.batches_per_epoch,
                                                               pending_metrics={k: v for k, v in pending.items()
                                                                                if v}))
        try:
            path = save_checkpoint(self.ckpt_dir / recovery_name(epoch, self.global_step), self.model, state,
                                   optimizer=self.optimizer, extra_files=files)
        except Exception as e:
            if not disk_full(e):
                raise
            raise self._out_of_space(e, f'a recovery point of epoch {epoch}') from None
        prune(self.ckpt_dir, keep=path)
        return path

    def _out_of_space(self, error: Exception, writing: str) -> CheckpointError:
        """A full disk while committing an epoch, as one line: what is intact and how to go on. A checkpoint is
        committed by rename, so a failed write leaves the previous ones as they were."""
        reason = error.strerror if isinstance(error, OSError) and error.strerror else 'no space left on device'
        if self.uncommitted_new_run:
            kept = "nothing of this new run was kept (it had not finished an epoch); free space and start it again"
        else:
            last = committed_checkpoints(self.ckpt_dir)[-1]
            kept = (f"the last intact checkpoint is epoch {checkpoint_epoch(last)} ({last}); free space, then "
                    f"continue with `structformer train --output {self.output} --resume`")
        return CheckpointError(f"--output {self.output}: the disk is full ({reason}) while writing {writing}; {kept}")

    def _prune(self, epoch: int, metrics: Optional[Dict] = None) -> None:
        cfg = self.config
        best = self._best_epoch(metrics) if cfg.keep_best else None
        for path in checkpoint_folders(self.ckpt_dir):
            e = checkpoint_epoch(path)
            keep = (e == 0 or e > epoch - cfg.keep_last or (cfg.save_every and e % cfg.save_every == 0)
                    or e == best)
            if not keep:
                shutil.rmtree(path, ignore_errors=True)

    def _best_epoch(self, metrics: Optional[Dict]) -> Optional[int]:
        """--keep-best: the epoch of the best val top-1 so far (the first of equals, as summary.json's best_epoch),
        from metrics.jsonl and the epoch being committed (its line is appended after the checkpoint)."""
        history = [r for r in read_metrics(self.output / 'metrics.jsonl') if 'val_top1' in r]
        if metrics and 'val_top1' in metrics:
            history = [r for r in history if r['epoch'] < metrics['epoch']] + [metrics]
        return max(history, key=lambda r: r['val_top1'])['epoch'] if history else None

    def _average_of_last(self, n: int) -> Tuple[Optional[Dict], List[Path]]:
        """(the averaged state of the last n trained epochs' checkpoints, those checkpoints), or (None, [])
        (said) where there is none."""
        epochs = [p for p in committed_checkpoints(self.ckpt_dir) if checkpoint_epoch(p) > 0][-n:]
        if len(epochs) < n:
            print(f"note: --avg-last {n}: only {len(epochs)} trained epoch checkpoint(s) here; no average", flush=True)
            return None, []
        states = [load_checkpoint(p)[0] for p in epochs]
        shapes = [{k: v.shape for k, v in s.items()} for s in states]
        if any(s != shapes[-1] for s in shapes):    # another network (factorised since): no average of the two
            print(f"note: --avg-last {n}: the last {n} checkpoints do not hold the same network "
                  f"({', '.join(p.name for p in epochs)}); no average", flush=True)
            return None, []
        averaged = {}
        for key, newest in states[-1].items():
            if newest.is_floating_point():
                averaged[key] = (sum(s[key].double() for s in states) / n).to(newest.dtype)
            else:
                averaged[key] = newest
        return averaged, epochs

    def _average_last(self) -> Dict:
        """--avg-last N: the mean of the last N epochs' weights (timm's avg_checkpoints.py: parameters and float
        buffers averaged in float64, integer buffers from the newest), saved as checkpoints/average_last_N,
        evaluated; its metrics for summary.json. The main process reads the checkpoints it wrote and gives the
        others the average (on another machine, or behind a network file system's cached listing, they may not
        see those files yet: a process that saw none would skip the shared evaluation the others wait in)."""
        n = self.config.avg_last
        if not n:
            return {}
        import copy
        averaged, epochs = self._average_of_last(n) if self.is_main else (None, [])
        if self.world_size > 1:
            if not all_reduce_sum([int(averaged is not None)])[0]:
                return {}
        elif averaged is None:
            return {}
        model = copy.deepcopy(getattr(self.model, '_orig_mod', self.model))
        if self.is_main:
            model.load_state_dict({k: v.to(self.device) for k, v in averaged.items()})
        if self.world_size > 1:
            broadcast_module(model)
        metrics = {f'average_last_{n}_val_{k}': v for k, v in self.evaluate_model(model).items()}
        if self.is_main:
            last = load_checkpoint(epochs[-1])[1]
            state = dict(self._state(int(last['epoch']), metrics), averaged_epochs=[checkpoint_epoch(p)
                                                                                     for p in epochs])
            path = save_checkpoint(self.ckpt_dir / f'average_last_{n}', model, state, with_rng=False)
            print(f"average of epochs {state['averaged_epochs'][0]}-{state['averaged_epochs'][-1]}: val top1 "
                  f"{metrics[f'average_last_{n}_val_top1']:.2f}% ({path})", flush=True)
        return metrics

    def _resume_phase_optimizer(self, done: int, recovering: bool = False) -> bool:
        """With phase_settings, the optimiser and schedule of the phase the next epoch trains, made as it is made
        at that phase's start; True when the checkpoint's optimiser state is that phase's (its epoch `done` lies in
        the same phase, or it is a recovery point inside the next epoch), False at a phase boundary, where the
        uninterrupted run starts a fresh optimiser too."""
        if not self.config.phase_settings:
            return True
        from .phases import phase_for_epoch
        following = phase_for_epoch(self.phases, min(done + 1, self.config.epochs))
        same = recovering or (done >= 1 and phase_for_epoch(self.phases, done) is following)
        following.apply(self.model)
        self.optim_phase = following
        self.optimizer = self._make_optimizer()
        self.scheduler = self._make_scheduler()
        return same or (done == 0 and following is self.phases[0])

    def _resume_source(self):
        """`--resume` alone continues this run's latest checkpoint, or a recovery point inside the epoch after it;
        `--resume PATH` a given one."""
        return resume_source(self.resume, self.ckpt_dir)

    def _restore(self) -> int:
        source = resolve_checkpoint(self._resume_source())
        weights, state, train_tensors = load_checkpoint(source, with_train_state=True)
        if 'rng' not in state or 'optimizer' not in state:     # average_last_N, an exported or weights-only save
            raise CheckpointError(f"--resume: {source} holds weights only (no optimiser or RNG state), so a run "
                                  "cannot continue from it; start a new run from its weights with "
                                  f"--initial-checkpoint {source}")
        mismatch = describe_mismatch(self.model.state_dict(), weights)
        if mismatch:
            raise CheckpointError(f"--resume: {source} is not a checkpoint of "
                                  f"{self.recipe.name!r} as configured: {mismatch}")
        self.model.load_state_dict(weights)
        self.global_step = state['global_step']
        if int(state.get('world_size', 1)) != self.world_size:     # allowed: the schedule follows the new count
            self.global_step = state['epoch'] * self.steps_per_epoch
            self._note_world_size_change(state)
        if self._resume_phase_optimizer(int(state['epoch']), recovering=bool(state.get('recovery'))):
            self.optimizer.load_state_dict(optimizer_state_from(train_tensors, state))
        self.precision.load_state(state.get('grad_scaler'))
        pending = (state.get('recovery') or {}).get('pending_metrics') or {}
        for part in self.parts:
            part.restore(source)
            part.resume_pending(pending.get(type(part).__name__, {}))
        if self.scheduler is not None:
            self.scheduler.step_update(num_updates=self._schedule_step(self.global_step))
        restore_rng(train_tensors, state['rng'])
        self.resume_within = self._recovery_of(state)
        return state['epoch']

    def _note_world_size_change(self, state: Dict) -> None:
        """--allow-world-size-change: say what the resumed run changes (it went on with another effective batch and
        a recomputed schedule step without a word)."""
        if not self.is_main:
            return
        cfg = self.config
        before, saved = state.get('effective_batch_size'), int(state.get('world_size', 1))
        # with phase_settings each phase has its own peak lr: not named here
        lr = '' if cfg.phase_settings else (f", peak lr {cfg.resolved_lr(saved):.3g} -> "
                                            f"{cfg.resolved_lr(self.world_size):.3g}")
        print(f"note: --allow-world-size-change: trained on {saved} process(es), continuing on "
              f"{self.world_size}: effective batch {before if before is not None else '?'} -> {self.effective_batch()}"
              f"{lr}; the schedule continues at optimiser step {self.global_step} "
              f"({state['epoch']} epoch(s) x {self.steps_per_epoch} steps on this count; it had made "
              f"{state['global_step']})", flush=True)

    def _check_classes(self, state: Dict, source) -> None:
        """The data's class names (in its order) must be the run's: output k means the run's class k."""
        stored = (state.get('data_info') or {}).get('classes')
        problem = class_mismatch(stored, self.info.extra.get('classes'),
                                 (state.get('data_info') or {}).get('class_descriptions'),
                                 self.info.extra.get('class_descriptions'))
        if problem:
            order = (state.get('data_info') or {}).get('class_order')
            raise UsageError(f"--resume: --data {self.config.data} does not name the classes of the run in {source}: "
                             f"{problem}" + (f" (the run's order: {order})" if order else ''))

    def _recovery_of(self, state: Dict):
        """Where the epoch stood at a recovery point (None for an epoch checkpoint); refused where the rest of the
        epoch could not be the same batches."""
        recovery = state.get('recovery')
        if not recovery:
            return None
        saved = int(state.get('world_size', 1))
        if saved != self.world_size:
            raise UsageError(f"--resume: {state['path']} is a recovery point inside epoch {recovery['epoch']} on "
                             f"{saved} process(es); resume it on {saved} (the epoch's split depends on the count), or "
                             "resume from the epoch checkpoint before it")
        if getattr(self.train_ds, 'streaming', False) and recovery.get('workers') != self._workers():
            raise UsageError(f"--workers {self._workers()}: {state['path']} is a recovery point inside an epoch of "
                             f"shards read by {recovery.get('workers')} loader workers per process; resume it with "
                             f"--workers {recovery.get('workers')} (a stream's epoch is dealt to its workers)")
        if recovery.get('batches_per_epoch') not in (None, self.batches_per_epoch):
            raise UsageError(f"--resume: {state['path']} is a recovery point of an epoch of "
                             f"{recovery['batches_per_epoch']} batches; this run has {self.batches_per_epoch} "
                             "(another --limit-train-batches or data?)")
        return recovery

