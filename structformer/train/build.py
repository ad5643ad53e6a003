"""Building a run (a mixin of `Trainer`): data, model (new, resumed or from initial weights), the checks made
before anything is written, precision, Mixup, parts, phases, optimiser and schedule."""
import random
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

from ..errors import UsageError
from ..models.factory import ModelRecipe, build_model, rebuild
from .checkpoint import load_checkpoint
from .config_checks import floor_read
from .mixing import build_mixup
from .parts import LowRankPart, build_parts
from .phases import build_phases
from .precision import Precision
from .steplog import StepLog


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


class RunBuild:
    """`Trainer._build` and what it calls; the loaders are `LoaderSetup`'s."""

    def _build(self) -> None:
        from ..data import build_datasets
        from ..data.augment import Augmentation
        cfg = self.config
        seed_everything(cfg.seed)
        augmentation = Augmentation.from_config(cfg)
        extra = {'augmentation': augmentation} if augmentation.requested() else {}
        from ..data.sizing import TEXT_FOLLOWS_MODEL
        from ..data.text import OPTIONS as TEXT_OPTIONS
        options = dict(cfg.data_kwargs)
        if self.resume and str(cfg.data).partition(':')[0] in TEXT_FOLLOWS_MODEL:
            # a run records seq_len only where it differs from the default (it followed the model): an unrecorded
            # one trained at the default, also a run from before text followed the model, whose context was 128
            options.setdefault('seq_len', TEXT_OPTIONS['seq_len'].default)
        self.train_ds, self.val_ds, self.info = build_datasets(
            cfg.data, seed=cfg.seed, val_fraction=cfg.val_fraction, model=cfg.model, model_kwargs=cfg.model_kwargs,
            **extra, **options)
        from ..data.sizing import FOLLOWS_MODEL, check_batch_memory
        if self.info.img_size and self.info.name not in TEXT_FOLLOWS_MODEL:
            flag, largest = max(('--batch-size', cfg.batch_size), ('--eval-batch-size', cfg.eval_batch_size),
                                key=lambda pair: pair[1])
            check_batch_memory(flag, largest, self.info.in_chans, self.info.img_size)
        if self.info.img_size and 'img_size' not in cfg.data_kwargs and self.info.name in FOLLOWS_MODEL:
            cfg.data_kwargs['img_size'] = self.info.img_size     # it followed the model: recorded for eval and resume
        seq_len = (self.info.extra or {}).get('seq_len')
        if (self.info.name in TEXT_FOLLOWS_MODEL and 'seq_len' not in cfg.data_kwargs
                and seq_len not in (None, TEXT_OPTIONS['seq_len'].default)):
            cfg.data_kwargs['seq_len'] = seq_len              # the model's context: recorded for eval and resume
        self.resumed_state = None
        if self.resume:                    # the recorded recipe: what was trained, whatever the config says now
            _, self.resumed_state, _ = load_checkpoint(self._resume_source())
            self._check_world_size(self.resumed_state)
            self._check_classes(self.resumed_state, self.resumed_state['path'])
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
        # the precision and the device first: the input check runs where the run trains, under its autocast, so an op
        # without a kernel in its dtype fails there, before anything is written (a model left on the CPU under a CUDA
        # autocast checks nothing, and takes the CPU's paths: kernel choices timed, the CPU tile kernel compiled)
        self.precision = Precision.create(cfg.amp, cfg.amp_dtype, self.device)
        self.model.to(self.device)
        self._check_input_shapes()
        self._check_lr_floor()
        self.mixup = build_mixup(cfg, self.info.num_classes, language_model=self.info.name in ('pysource', 'text'))
        self.bce = self._make_bce()
        self._set_memory_options()
        self.model.to(self.device)
        if cfg.channels_last:
            self.model.to(memory_format=torch.channels_last)
        self.parts = build_parts(self)          # before compile: the weight average copies the plain module
        self.lowrank = next(p for p in self.parts if isinstance(p, LowRankPart))
        if cfg.compile:
            # in place (nn.Module.compile): parameter names and state_dict keys stay those of the plain
            # model, so checkpoints load without compile, and DDP / phases wrap the same module
            self.model.compile(backend=cfg.compile, mode=cfg.compile_mode)
        self.phases = build_phases(self._phase_specs(), cfg.epochs)
        self._check_phases()
        self._make_loaders()
        # one optimiser and schedule for the run, or (phase_settings) one per phase, made as each phase starts
        self.optim_phase = self.phases[0] if cfg.phase_settings else None
        if self.optim_phase is not None:     # a phase's optimiser holds the parameters it trains
            self.optim_phase.apply(self.model)
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
        taken: List[str] = []                 # which weights of a trainer's checkpoint were read (model or EMA)
        if cfg.pretrained:
            source, done = load_timm_pretrained(self.model, cfg.model)
        else:
            flag = '--initial-checkpoint' if cfg.initial_checkpoint else '--pretrained-path'
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
        run_values = cfg.schedule_values(None)
        for key in ('warmup_lr', 'min_lr'):
            value = getattr(cfg, key)
            if value is not None and value > peak and floor_read(run_values, key):   # a floor nothing reads is idle
                raise UsageError(f"--{key.replace('_', '-')} {value:g} is above the peak learning rate {peak:.3g} "
                                 f"(--lr-base {cfg.lr_base:g} scaled to the effective batch {self.effective_batch()}); "
                                 f"lower it or raise the batch (--grad-accum-steps)")
        for name, settings in cfg.phase_settings.items():     # a phase's lr scales the same way, its floors do not
            values = cfg.schedule_values(name)
            phase_peak = values['lr'] * cfg.lr_scale(self.world_size, values['opt'])
            for key in ('warmup_lr', 'min_lr'):
                if settings.get(key) is not None and settings[key] > phase_peak and floor_read(values, key):
                    raise UsageError(f"--phase-settings {name} {key}={settings[key]:g} is above the phase's peak "
                                     f"learning rate {phase_peak:.3g} at the effective batch {self.effective_batch()}; "
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

    def _check_input_shapes(self) -> None:
        """One forward of two validation samples, in eval mode and without gradients, before anything is
        written: a model built for other images (img_size=, in_chans=) or other data (images into a
        language model) is refused in one line naming both (scoring_data.check_model_input), not after the
        run folder exists. The RNG state is restored afterwards, so the run itself is unchanged."""
        from torch.utils.data import default_collate      # not a DataLoader: its iterator draws a seed

        from .scoring_data import check_model_input
        if len(self.val_ds) == 0:
            return
        def refuse_classes(predicts: int) -> None:
            if predicts != self.info.num_classes:       # else: cross-entropy's (or the embedding's) IndexError later
                given = self.config.model_kwargs.get('num_classes')
                what = f"--model-kwargs num_classes={given}" if given is not None else f"--model {self.config.model}"
                raise UsageError(f"{what}: the model predicts {predicts} classes but --data {self.config.data} has "
                                 f"{self.info.num_classes}; leave num_classes out (it follows the data) or give "
                                 f"num_classes={self.info.num_classes}")

        # a language model also reads the data's token ids through its vocabulary-sized embedding: a smaller
        # vocabulary fails inside the forward (an IndexError), so it is compared before the forward
        vocabulary = getattr(self.model, 'vocab_size', None)
        if isinstance(vocabulary, int) and not isinstance(vocabulary, bool):
            refuse_classes(vocabulary)
        batch = default_collate([self.val_ds[i] for i in range(min(2, len(self.val_ds)))])[0].to(self.device)
        logits = check_model_input(self.model, batch, self.precision,
                                   f"--model {self.config.model} cannot take a batch of --data {self.config.data}",
                                   lambda given, takes: f"give --model-kwargs in_chans={given}, or leave in_chans "
                                                        "out (the model follows the data)")
        if torch.is_tensor(logits):
            refuse_classes(logits.shape[-1])

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
        if self.config.phase_settings:
            from .plan import check_phase_settings
            check_phase_settings(self.config, [(p.name, p.epochs) for p in self.phases])

    def _schedule_values(self) -> Dict:
        """The optimiser and schedule settings now: the run's, or the current phase's own (`optim_phase`)."""
        phase = self.optim_phase
        return (self.config.schedule_values(phase.name, phase.epochs) if phase is not None
                else self.config.schedule_values())

    def _make_optimizer(self):
        """timm's optimiser over the parameters that train now (train/optim.py: weight decay groups, --layer-decay,
        --opt-betas / --opt-eps), at the peak lr of the run or of the current phase."""
        from .optim import make_optimizer
        cfg = self.config
        values = self._schedule_values()
        # Frobenius decay (seed 004 §3.3) replaces the optimiser's decay of U and V by a loss term on U Vᵀ
        factors = self.lowrank.optimizer_exemptions(self.model)
        self.frobenius_weight = values['weight_decay'] if factors else 0.0
        # --factorize-lr-scale while the network is factorised (seed 004 App. A.2): the schedule is rebuilt from
        # this lr at the switch (`replace_model`) and on resume, so it holds from the switch on
        factorised = any(hasattr(m, 'factors') for m in self.model.modules())
        lr = values['lr'] * cfg.lr_scale(self.world_size, values['opt']) * (cfg.factorize_lr_scale if factorised else 1.0)
        return make_optimizer(self.model, cfg, values, lr, exempt=factors)

    def _make_scheduler(self):
        """timm's scheduler for the run or the current phase (None for sched none), at the step it has reached."""
        from .optim import make_scheduler
        scheduler = make_scheduler(self.optimizer, self._schedule_values(), self.steps_per_epoch)
        if scheduler is not None:
            scheduler.step_update(num_updates=self._schedule_step(getattr(self, 'global_step', 0)))
        return scheduler

    def _schedule_step(self, global_step: int) -> int:
        """Optimiser steps into the current schedule: the run's, or (phase_settings) the current phase's."""
        if self.optim_phase is None:
            return global_step
        before = sum(p.epochs for p in self.phases[:self.phases.index(self.optim_phase)])
        return max(0, global_step - before * self.steps_per_epoch)

    def _enter_phase(self, phase) -> None:
        """With phase_settings, a phase gets a fresh optimiser over the parameters it trains and its own schedule,
        as the public Sparsifiner code gives each stage (called after the phase's freezing)."""
        if not self.config.phase_settings or phase is self.optim_phase:
            return
        self.optim_phase = phase
        self.optimizer = self._make_optimizer()
        self.scheduler = self._make_scheduler()

    def _make_bce(self):
        """--bce-loss: timm's BinaryCrossEntropy, smoothing the labels itself unless Mixup / CutMix already do
        (timm's train.py makes the same choice)."""
        if not self.config.bce_loss:
            return None
        from timm.loss import BinaryCrossEntropy
        smoothing = 0.0 if self.mixup is not None else self.config.label_smoothing
        return BinaryCrossEntropy(smoothing=smoothing, target_threshold=self.config.bce_target_thresh)

    def _set_memory_options(self) -> None:
        """--grad-checkpointing (the model's set_grad_checkpointing) and --sync-bn (SyncBatchNorm under DDP)."""
        cfg = self.config
        if cfg.grad_checkpointing:
            if not hasattr(self.model, 'set_grad_checkpointing'):
                raise UsageError(f"--grad-checkpointing: --model {cfg.model} has no set_grad_checkpointing (timm's "
                                 "activation-checkpointing switch); leave the flag out")
            self.model.set_grad_checkpointing(True)
        if cfg.sync_bn:
            if self.world_size == 1:
                if self.is_main:
                    print("note: --sync-bn with one process: there is nothing to synchronise", flush=True)
            elif self.device.type != 'cuda':
                raise UsageError("--sync-bn: SyncBatchNorm runs on CUDA devices only (NCCL); on CPUs --dist-bn "
                                 "reduce averages the statistics after each epoch instead")
            else:
                from timm.layers import convert_sync_batchnorm
                self.model = convert_sync_batchnorm(self.model)
