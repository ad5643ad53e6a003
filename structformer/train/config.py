"""The resolved configuration of a training run: one dataclass, saved as YAML beside the outputs
and accepted back with `-c`."""
import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import UsageError
from .config_checks import (PHASE_SETTING_KEYS, SCHEDULES, SCHEDULES_ACCEPTED, validate_controls, validate_lowrank,
                            validate_paper_scale, validate_phase_settings, validate_schedule)
from .config_file import _KIND_WORDS, _coerce, _describe, _field_kind, flag_name, read_yaml_mapping



# the learning rate that the warm-up starts from and the cosine schedule ends at, unless given (at most lr)
DEFAULT_FLOOR_LR = 1e-6
DEFAULT_LABEL_SMOOTHING = 0.1      # timm train.py's --smoothing, for image classes (a language model's is 0)
FLOAT32_MAX = 3.4028234663852886e38
# timm.utils.dispatch_clip_grad's modes (--clip-mode)
CLIP_MODES = ('norm', 'value', 'agc')
# data-loader worker processes: more than this only forks processes that wait on each other (and a typo such
# as 100000 would fork until the machine stops); the ceiling grows with the machine
MAX_WORKERS = max(32, 2 * (os.cpu_count() or 1))


@dataclass
class TrainConfig:
    model: str = 'crate_digits'
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    # model transforms applied after construction, in order: [{'name': ..., 'kwargs': {...}}]
    # (structformer.models.transforms); recorded in every checkpoint so the run rebuilds exactly
    transforms: List[Dict[str, Any]] = field(default_factory=list)
    data: str = 'digits'
    data_kwargs: Dict[str, Any] = field(default_factory=dict)
    # `data` as typed where its path was relative (`data` itself is stored absolute, so the run opens from any
    # folder; train/data_paths.py), for the record only
    data_as_given: Optional[str] = None
    val_fraction: float = 0.2
    epochs: int = 30
    batch_size: int = 64
    eval_batch_size: int = 256
    opt: str = 'adamw'
    lr: float = 1e-3
    weight_decay: float = 0.05
    # False (timm's default): norms, biases and the model's no_weight_decay() set (cls/pos) are not decayed;
    # True decays every parameter, as the official CRATE recipe does
    decay_everything: bool = False
    momentum: float = 0.9
    # timm train.py's --opt-betas / --opt-eps (None: the optimiser's own defaults) and --layer-decay (layer-wise lr
    # decay over the model's group_matcher groups: timm's param_groups_layer_decay, lr x layer_decay^(depth - i))
    opt_betas: Optional[List[float]] = None
    opt_eps: Optional[float] = None
    layer_decay: Optional[float] = None
    # timm's schedulers (create_scheduler_v2), stepped per optimiser step: cosine, tanh, poly (power decay_rate),
    # step (x decay_rate every decay_epochs), multistep (x decay_rate at each of decay_milestones) or none
    # (constant); each after a linear warm-up of warmup_epochs from warmup_lr
    sched: str = 'cosine'
    decay_epochs: float = 90.0
    decay_milestones: List[int] = field(default_factory=lambda: [90, 180, 270])
    decay_rate: float = 0.1
    # timm train.py's restarts (cosine, tanh, poly: the schedule's epochs split into lr_cycle_limit cycles, each
    # lr_cycle_mul x as long as the one before, its peak x lr_cycle_decay; timm runs --epochs per cycle instead),
    # --lr-k-decay (cosine, poly) and --lr-noise (on / off points as fractions of a cycle) with its pct and std
    lr_cycle_mul: float = 1.0
    lr_cycle_decay: float = 0.5
    lr_cycle_limit: int = 1
    lr_k_decay: float = 1.0
    lr_noise: Optional[List[float]] = None
    lr_noise_pct: float = 0.67
    lr_noise_std: float = 1.0
    # the last cooldown_epochs of `epochs` at min_lr (timm train.py adds them after --epochs; here --epochs
    # counts them, so phases, checkpoints and resume see one epoch count)
    cooldown_epochs: int = 0
    # None: fitted to the run, min(2, epochs / 10), so a short run never fails on a default it did not set
    warmup_epochs: Optional[float] = None
    # None: 1e-6, or lr when that is lower (an explicit value above lr is refused)
    warmup_lr: Optional[float] = None
    # timm's --warmup-prefix: the warm-up comes before the schedule, which then runs over the epochs after it
    # (default: the warm-up overlaps the schedule's first epochs, timm's default)
    warmup_prefix: bool = False
    min_lr: Optional[float] = None
    # None: timm's 0.1 for image classes, 0 for a language model (text data or a model that takes token ids): the
    # seed's GPT-2 runs (SPEC §5) and LM training generally use none, and smoothing next-token targets moves the
    # training loss off the per-token NLL the perplexity is read from. Resolved by validate(), so the run records it
    label_smoothing: Optional[float] = None
    clip_grad: Optional[float] = None
    # timm's --clip-mode: what --clip-grad bounds: the global gradient norm ('norm'), each gradient element ('value')
    # or each unit's gradient relative to its weight's norm ('agc', adaptive clipping, the head excluded as timm does)
    clip_mode: str = 'norm'
    seed: int = 0
    output: Optional[str] = None
    keep_last: int = 2
    save_every: int = 0
    # also keep the checkpoint with the best val top-1 whatever keep_last says
    keep_best: bool = False
    # at the end, average the weights of the last N epochs' checkpoints (timm's avg_checkpoints idea) into
    # checkpoints/average_last_N, evaluated and recorded in summary.json; 0 = off
    avg_last: int = 0
    # a recovery point every N optimiser steps inside an epoch, the newest kept (train/recovery.py); 0: none
    recovery_interval: int = 0
    phases: List[Dict[str, Any]] = field(default_factory=list)
    # per-phase optimiser and schedule, by phase name (PHASE_SETTING_KEYS; --phase-settings NAME KEY=VALUE): a phase named here
    # gets a fresh optimiser and its own schedule over its own epochs, e.g. Sparsifiner's public stages
    # {predictor: {lr: 3.0e-4, min_lr: 2.0e-4, warmup_epochs: 3, warmup_lr: 0}, joint: {lr: 8.0e-5, ...}};
    # a phase's lr scales with the effective batch as --lr-base does
    phase_settings: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    limit_train_batches: int = 0
    # data-loader worker processes; None: one per core (at most 8) for images decoded from files, 0 in memory
    num_workers: Optional[int] = None
    # torch.compile backend for training and evaluation, None = eager (timm's train script: --torchcompile);
    # checkpoints hold the plain module's weights, loadable without compile
    compile: Optional[str] = None
    # inductor's mode for it (timm: --torchcompile-mode): None = inductor's default; 'reduce-overhead' replays CUDA
    # graphs, which is what launch-bound small models want on a GPU (docs/gpu.md: SOFT's attention forward at 8,192
    # tokens 7.1 ms eager, 0.60 ms replayed)
    compile_mode: Optional[str] = None
    # TF32 matmuls and convolutions and cudnn.benchmark on CUDA, as timm's train.py always sets them; off by default
    # (float32 is the reference the precision bands of the GPU suite are derived against; on an H200 TF32 trained
    # float32 ViT-T / CRATE-T / SOFT-T 1.4x faster with logits 1e-3 apart, docs/gpu.md). No effect off CUDA.
    tf32: bool = False
    # low-rank training (seed 004, models/factorize.py): factorise with `factorize_rank` (an int, or a fraction
    # of min(m, n)) after `factorize_at` epochs of dense pre-training (None or 0: from the start), by
    # `factorize_init`, over `factorize_include` (patterns or a preset; None: the paper's default)
    factorize_at: Optional[int] = None
    factorize_rank: Optional[Any] = None
    factorize_init: str = 'spectral'
    factorize_include: Optional[List[str]] = None
    # 'l2': the factors are in the optimiser's weight decay like any weight; 'frobenius': they leave it and
    # the loss gains weight_decay/2 * sum ||U V^T||_F^2 instead (Frobenius decay, §3.3)
    factor_decay: str = 'l2'
    # the lr multiplier while the network is factorised (seed 004 App. A.2 halves the base lr of factorised
    # transformer runs and again at the switch from dense pre-training: 0.5 in the LM recipes); 1 = unchanged
    factorize_lr_scale: float = 1.0
    # distillation from a dense teacher (Sparsifiner §4, structformer.train.distill): the teacher's run directory
    # or checkpoint (recorded as the resolved checkpoint); without `phases`, the paper's two stages with
    # `predictor_epochs` of stage 1 (None: about the paper's 5 of 45, 0 when the student has no predictor)
    teacher: Optional[str] = None
    predictor_epochs: Optional[int] = None
    # ---- paper scale (timm train.py's names and defaults unless said otherwise; docs/training.md)
    # regularisation passed to the model's constructor as timm's train.py does (None: the model's own default)
    drop: Optional[float] = None
    drop_path: Optional[float] = None
    # mixed precision (train/precision.py): autocast in `amp_dtype` (None: float16 on CUDA as timm, bfloat16 on a
    # CPU), a gradient scaler for float16; weights, optimiser state and checkpoints stay float32
    amp: bool = False
    amp_dtype: Optional[str] = None
    # where to train: auto (CUDA when present, the local rank's GPU under torchrun), cpu, cuda, cuda:N
    device: str = 'auto'
    channels_last: bool = False
    # activation checkpointing in the model's blocks (its set_grad_checkpointing), SyncBatchNorm under DDP
    grad_checkpointing: bool = False
    sync_bn: bool = False
    # timm's BinaryCrossEntropy in place of cross-entropy (with Mixup / CutMix's soft targets too), as timm's
    # --bce-loss; bce_target_thresh binarises soft targets at that threshold
    bce_loss: bool = False
    bce_target_thresh: Optional[float] = None
    # data augmentation (timm's transforms, data/augment.py); None leaves a dataset's own default
    aa: Optional[str] = None
    reprob: float = 0.0
    remode: str = 'pixel'
    recount: int = 1
    color_jitter: Optional[float] = None
    scale: Optional[List[float]] = None
    ratio: Optional[List[float]] = None
    hflip: Optional[float] = None
    # timm train.py's --train-interpolation: the random-resized crop's and the --aa policy's resampling ('random'
    # draws bilinear or bicubic per image, timm's train.py default; DeiT's main.py says 'bicubic'); None: bilinear
    train_interpolation: Optional[str] = None
    # DeiT's repeated augmentation: each image this many times per epoch (timm RepeatAugSampler); 0 = off
    aug_repeats: int = 0
    # Mixup / CutMix (timm.data.Mixup) with soft-target cross-entropy, label smoothing folded into the targets
    mixup: float = 0.0
    cutmix: float = 0.0
    cutmix_minmax: Optional[List[float]] = None
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = 'batch'
    mixup_off_epoch: int = 0
    # exponential moving average of the weights (timm.utils.ModelEmaV3), evaluated beside the model every epoch
    model_ema: bool = False
    model_ema_decay: float = 0.9998
    model_ema_warmup: bool = False
    # optimiser steps every N batches; the effective batch is batch_size * grad_accum_steps * processes
    grad_accum_steps: int = 1
    # timm's lr scaling: with lr_base set, lr = lr_base * effective batch / lr_base_size (sqrt for adaptive
    # optimisers unless lr_base_scale says 'linear'); --lr is then computed, not taken
    lr_base: Optional[float] = None
    lr_base_size: int = 256
    lr_base_scale: str = ''
    # a per-step log line (loss, lr, img/s) every N optimiser steps (0: epoch lines only)
    log_interval: int = 50
    log_tb: Optional[str] = None
    # BatchNorm running statistics across processes at the end of each epoch (timm's --dist-bn): 'reduce' averages
    # them, 'broadcast' takes rank 0's, '' leaves each process its own (the processes then evaluate differently)
    dist_bn: str = 'reduce'
    # a resumed run must keep its process count (the data order and the schedule depend on it) unless this is set;
    # then the schedule is recomputed for the new count
    allow_world_size_change: bool = False
    # fine-tuning: start from these weights (a run or checkpoint folder, .safetensors, or a weights-only .pth),
    # adapted to the model (classifier, input channels, position embedding), with a fresh optimiser and schedule
    initial_checkpoint: Optional[str] = None
    # start from pretrained weights: `pretrained` timm's for a model that has them (its pretrained_cfg; structformer
    # ships none), `pretrained_path` a weights file (safetensors or weights-only .pth / .bin) or a local-dir folder;
    # adapted as `initial_checkpoint` (structformer.weights.filters)
    pretrained: bool = False
    pretrained_path: Optional[str] = None
    # --teacher NAME: a registered model built with timm's pretrained weights (`teacher_pretrained`)
    teacher_pretrained: bool = False
    # what the run was started from (`structformer train --recipe NAME`), for the record
    recipe: Optional[str] = None
    # --recipe with a model that is neither the recipe's nor one its rows train (about.models) nor a registered
    # shrink of its family (train/recipes.py): refused unless this is set
    allow_other_model: bool = False
    # the data set's size where the data is not at hand (a recipe's dry run), e.g. ImageNet-1k's 1,281,167
    dataset_size: Optional[int] = None

    def resolved_warmup_epochs(self) -> float:
        """Warm-up length in epochs: as given, or fitted to the run's length when left unset."""
        return min(2.0, self.epochs / 10) if self.warmup_epochs is None else self.warmup_epochs

    def resolved_warmup_lr(self) -> float:
        """The learning rate the warm-up starts from: as given, or 1e-6 (at most lr) when left unset."""
        return min(DEFAULT_FLOOR_LR, self.lr) if self.warmup_lr is None else self.warmup_lr

    def resolved_min_lr(self) -> float:
        """The cosine schedule's floor: as given, or 1e-6 (at most lr) when left unset."""
        return min(DEFAULT_FLOOR_LR, self.lr) if self.min_lr is None else self.min_lr

    def check_ranges(self) -> 'TrainConfig':
        """The plain ranges and names of the settings (each on its own, or against epochs and lr), without torch or
        the model registry (timm only to parse an --aa policy): a command refuses a value out of range before its
        heavy imports. `validate` runs these first."""
        self._validate_numbers()
        from ..data.spec import check_data_kwargs
        check_data_kwargs(self.data_kwargs)
        checks = [
            ('epochs', self.epochs >= 1, '>= 1'),
            ('batch_size', self.batch_size >= 1, '>= 1'),
            ('eval_batch_size', self.eval_batch_size >= 1, '>= 1'),
            ('lr', self.lr > 0, '> 0'),
            ('weight_decay', self.weight_decay >= 0, '>= 0'),
            # with --lr-base the peak depends on the process count: the engine checks it against the floor
            ('warmup_lr', self.warmup_lr is None or 0 <= self.warmup_lr <= (self.lr if self.lr_base is None else
                                                                            float('inf')), f'in [0, lr={self.lr:g}]'),
            ('min_lr', self.min_lr is None or 0 <= self.min_lr <= (self.lr if self.lr_base is None else float('inf')),
             f'in [0, lr={self.lr:g}]'),
            ('momentum', 0 <= self.momentum < 1, 'in [0, 1)'),
            ('seed', 0 <= self.seed < 2 ** 32, 'in [0, 2**32)'),
            ('warmup_epochs', 0 <= self.resolved_warmup_epochs() < self.epochs, f'in [0, epochs={self.epochs})'),
            ('label_smoothing', self.label_smoothing is None or 0 <= self.label_smoothing < 1, 'in [0, 1)'),
            ('val_fraction', 0 < self.val_fraction < 1, 'in (0, 1)'),
            ('keep_last', self.keep_last >= 1, '>= 1'),
            ('save_every', self.save_every >= 0, '>= 0'),
            ('recovery_interval', self.recovery_interval >= 0, '>= 0 (optimiser steps; 0 = none)'),
            ('limit_train_batches', self.limit_train_batches >= 0, '>= 0 (0 = all)'),
            ('num_workers', self.num_workers is None or 0 <= self.num_workers <= MAX_WORKERS, f'in [0, {MAX_WORKERS}]'),
            ('sched', self.sched in SCHEDULES, SCHEDULES_ACCEPTED),
            ('keep_best', isinstance(self.keep_best, bool), 'true or false'),
            ('avg_last', 0 <= self.avg_last <= self.epochs, f'in [0, epochs={self.epochs}] (0 = off)'),
            # the settings of some runs only (factorised layers, a distilled student): in range even where unused
            ('factorize_lr_scale', not isinstance(self.factorize_lr_scale, bool)
             and isinstance(self.factorize_lr_scale, (int, float)) and 0 < self.factorize_lr_scale <= 1,
             'a factor in (0, 1]'),
            ('predictor_epochs', self.predictor_epochs is None or 0 <= self.predictor_epochs <= self.epochs,
             f'in [0, epochs={self.epochs}]'),
        ]
        for name, ok, accepted in checks:
            if not ok:
                raise UsageError(f"{flag_name(name)}={getattr(self, name)!r} is out of range: accepted {accepted}")
        self._validate_paper_scale()
        return self

    def validate(self) -> 'TrainConfig':
        self.check_ranges()
        if self.label_smoothing is None:           # after the plain ranges, which need no torch or timm
            from .config_checks import language_modelling
            self.label_smoothing = 0.0 if language_modelling(self) else DEFAULT_LABEL_SMOOTHING
        self._validate_optimizer()
        if self.avg_last > self.keep_last:
            raise UsageError(f"--avg-last {self.avg_last} averages the last {self.avg_last} epochs' checkpoints, but "
                             f"--keep-last {self.keep_last} keeps only {self.keep_last}: give --keep-last "
                             f"{self.avg_last} or more")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise UsageError(f"--clip-grad={self.clip_grad} is out of range: accepted > 0")
        if self.clip_mode not in CLIP_MODES:
            raise UsageError(f"--clip-mode={self.clip_mode!r}: accepted {', '.join(CLIP_MODES)}")
        if self.clip_mode != 'norm' and self.clip_grad is None:
            raise UsageError(f"--clip-mode {self.clip_mode} needs --clip-grad (the {self.clip_mode} clipping's "
                             "threshold); give both, or leave --clip-mode out")
        validate_lowrank(self)
        self._validate_distillation()
        self._validate_schedule(self.schedule_values(), '')
        self._validate_controls()
        self._validate_phase_settings()
        if self.compile is not None:
            import torch._dynamo        # only when asked: validating a config needs no torch otherwise
            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.compile not in backends:
                raise UsageError(f"--compile={self.compile!r} is not a torch.compile backend: accepted "
                                 f"{', '.join(backends)}")
        self._validate_compile_mode()
        return self

    def _validate_compile_mode(self) -> None:
        if self.compile_mode is None:
            return
        if self.compile != 'inductor':
            given = 'eager training' if self.compile is None else f'--compile={self.compile!r}'
            raise UsageError(f"--compile-mode={self.compile_mode!r} is a mode of the inductor backend: give it with "
                             f"--compile (inductor), not with {given}")
        import torch._inductor
        modes = sorted(torch._inductor.list_mode_options())
        if self.compile_mode not in modes:
            raise UsageError(f"--compile-mode={self.compile_mode!r} is not an inductor mode: accepted "
                             f"{', '.join(modes)}")

    def _validate_numbers(self) -> None:
        """Every real-valued setting finite and within float32's range: the optimiser and the schedule
        hand them to float32 tensors, where 1e300 overflows deep inside torch and inf turns the loss nan."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
                raise UsageError(f"{flag_name(f.name)}={value!r} is out of range: accepted a finite number "
                                 f"of magnitude at most {FLOAT32_MAX:.3g} (float32)")

    def _validate_optimizer(self) -> None:
        from timm.optim import list_optimizers     # only here: a config is read without timm elsewhere
        name = self.opt.lower()
        base = name[len('lookahead_'):] if name.startswith('lookahead_') else name
        known = list_optimizers()
        if base not in known:
            close = difflib.get_close_matches(base, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ''
            raise UsageError(f"--opt={self.opt!r} is not a timm optimiser: {hint}accepted any of timm.optim."
                             f"list_optimizers() (e.g. adamw, sgd, lion, lamb), optionally prefixed 'lookahead_'")

    def _validate_distillation(self) -> None:
        given = [flag for flag, value in (('--initial-checkpoint', self.initial_checkpoint), ('--pretrained', self.pretrained),
                                          ('--pretrained-path', self.pretrained_path), ('--teacher', self.teacher)) if value]
        if len(given) > 1 and self.teacher is None:
            raise UsageError(f"{' and '.join(given)} each give the model its starting weights; give one")
        if self.teacher_pretrained and self.teacher is None:
            raise UsageError("--teacher-pretrained needs --teacher NAME (a registered model name)")
        if self.teacher is not None and (self.pretrained or self.pretrained_path):
            raise UsageError(f"{given[0]} and --teacher both give the student its weights (a distilled student starts "
                             "from its teacher's); give one")
        if self.teacher is not None and self.initial_checkpoint is not None:
            raise UsageError("--initial-checkpoint and --teacher both give the student its weights (a distilled "
                             "student starts from its teacher's); give one")
        if self.teacher is not None and self.factorize_at:
            raise UsageError(f"--teacher cannot be combined with --factorize-at={self.factorize_at}: the student would "
                             "change its layers in the middle of the distillation; factorise from the start or not at all")
        if self.predictor_epochs is None:
            return
        if self.teacher is None:
            raise UsageError(f"--predictor-epochs={self.predictor_epochs} needs --teacher RUN_DIR")
        if self.phases:
            raise UsageError("--predictor-epochs and a config file's `phases` both set the stages; give one")

    def _validate_paper_scale(self) -> None:
        validate_paper_scale(self)

    def _validate_schedule(self, values: Dict[str, Any], where: str) -> None:
        validate_schedule(values, where)

    def _validate_controls(self) -> None:
        validate_controls(self)

    def _validate_phase_settings(self) -> None:
        validate_phase_settings(self)

    def schedule_values(self, phase: Optional[str] = None, epochs: Optional[int] = None) -> Dict[str, Any]:
        """The optimiser and schedule settings (PHASE_SETTING_KEYS, plus `epochs`) of the run, or of phase `phase`
        over its `epochs`: its `phase_settings` over the run's values. `lr` is as written (lr_base where the run
        gives that): the peak is lr x `lr_scale(world)`. Unset warm-up, warm-up start and floor are resolved as
        the run's are (min(2, epochs / 10) epochs; 1e-6, or lr if lower)."""
        own = dict(self.phase_settings.get(phase, {})) if phase is not None else {}
        values = {key: getattr(self, key) for key in PHASE_SETTING_KEYS}
        values['lr'] = self.lr if self.lr_base is None else self.lr_base
        values.update(own)
        values['epochs'] = self.epochs if epochs is None else epochs
        values['seed'] = self.seed                     # --lr-noise's seed, as timm's train.py passes --seed
        if values['warmup_epochs'] is None:
            values['warmup_epochs'] = min(2.0, values['epochs'] / 10)
        for key in ('warmup_lr', 'min_lr'):
            if values[key] is None:
                values[key] = min(DEFAULT_FLOOR_LR, values['lr'])
        return values

    def lr_scale(self, world_size: int = 1, opt: Optional[str] = None) -> float:
        """The factor --lr-base's scaling gives the written lr at this effective batch (1 without --lr-base): the
        run's peak is lr_base x it, a phase's written lr is scaled by it too, by the rule of the phase's own `opt`
        (timm's: square root for ada* / lamb) unless --lr-base-scale names one."""
        if self.lr_base is None:
            return 1.0
        return self.resolved_lr(world_size, opt) / self.lr_base

    def effective_batch(self, world_size: int = 1) -> int:
        """Images per optimiser step over every process: per-process batch x accumulation x processes."""
        return self.batch_size * self.grad_accum_steps * world_size

    def resolved_lr(self, world_size: int = 1, opt: Optional[str] = None) -> float:
        """The peak learning rate: --lr, or timm's scaling of --lr-base to the effective batch (linear for SGD-like
        optimisers, square root for Ada* and LAMB (timm's rule), unless --lr-base-scale names one); `opt`: another
        optimiser's rule than the run's (a phase's own)."""
        if self.lr_base is None:
            return self.lr
        ratio = self.effective_batch(world_size) / self.lr_base_size
        # timm train.py's rule: 'ada*' and 'lamb' optimisers scale by the square root
        name = (opt or self.opt).lower()
        scale = self.lr_base_scale or ('sqrt' if any(o in name for o in ('ada', 'lamb')) else 'linear')
        return self.lr_base * (ratio ** 0.5 if scale == 'sqrt' else ratio)

    def default_predictor_epochs(self) -> int:
        """Stage-1 epochs when not given: the paper's 5 of 45 epochs, at least one when there are two."""
        return max(1, round(self.epochs / 9)) if self.epochs >= 2 else 0

    def factorised_by_transform(self) -> bool:
        """Whether `transforms` factorises the model from the start (`--transform factorize ...`)."""
        return any((t.get('name') if isinstance(t, dict) else t) == 'factorize' for t in self.transforms or ())

    def factorises(self) -> bool:
        """Whether the run trains factorised layers: by --rank, or by --transform factorize."""
        return self.factorize_rank is not None or self.factorised_by_transform()

    def factorize_spec(self) -> Optional[Dict[str, Any]]:
        """The `factorize` transform this configuration asks for (None: no low-rank training)."""
        if self.factorize_rank is None:
            return None
        kwargs: Dict[str, Any] = {'rank': self.factorize_rank, 'init': self.factorize_init}
        if self.factorize_include:
            include = self.factorize_include
            kwargs['include'] = include[0] if len(include) == 1 and include[0] in ('vision', 'transformer', 'lm', 'all') \
                else list(include)
        return {'name': 'factorize', 'kwargs': kwargs}

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Dict[str, Any], source: str = 'configuration') -> 'TrainConfig':
        """A config from plain values (a YAML file, a checkpoint's state): unknown keys are refused with
        the closest valid name, values coerced to the field's type where that is unambiguous ('3' -> 3
        for an integer, 3 -> 3.0 for a float) and refused with the expected type otherwise. `source`
        starts every error message (e.g. '-c/--config run.yaml')."""
        return cls(**check_values(values, source))


def check_values(values: Dict[str, Any], source: str = 'configuration') -> Dict[str, Any]:
    """Keys and types of configuration `values` checked against TrainConfig; see `TrainConfig.from_dict`."""
    if not isinstance(values, dict):
        raise UsageError(f"{source}: expected a mapping of key: value; got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ''
            raise UsageError(f"{source}: unknown key {key!r}; {hint}accepted keys: {', '.join(sorted(fields))}")
        kind, optional = _field_kind(hints[key])
        if value is None and optional:
            out[key] = None
            continue
        try:
            out[key] = _coerce(value, kind)
        except (TypeError, ValueError, OverflowError):
            expected = _KIND_WORDS.get(kind, kind.__name__) + (' or null' if optional else '')
            raise UsageError(f"{source}: {_describe(key)} must be {expected}; got {value!r}") from None
    return out


# timm train.py's YAML keys (its argparse dest names) for settings a key of ours holds under another name: its -c file
# and ours take the same flags (--smoothing, --workers, --torchcompile, --torchcompile-mode), so the file takes both
TIMM_KEYS = {'smoothing': 'label_smoothing', 'workers': 'num_workers', 'torchcompile': 'compile',
             'torchcompile_mode': 'compile_mode'}


def load_config_file(path, hints: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The mapping in a YAML config file, keys and types checked (see `TrainConfig.from_dict`); every
    problem -- a missing, unreadable or non-file path, bad YAML, an unknown key, a wrong type -- is a
    UsageError naming -c/--config, the file and the key. timm train.py's own key for a setting of ours (TIMM_KEYS)
    is taken as ours; `hints` (key -> where its setting is here) says more than 'unknown' for timm's keys that have
    no counterpart key (the train command's hints for timm's flags)."""
    where = f"-c/--config {path}"
    values = read_yaml_mapping(path, where)
    renamed, given_as = {}, {}
    for key, value in values.items():
        ours = TIMM_KEYS.get(key, key)
        if ours in renamed:
            raise UsageError(f"{where}: keys {given_as[ours]!r} and {key!r} both set {ours} (timm's name and ours); "
                             "give one")
        if key in (hints or {}):
            raise UsageError(f"{where}: {key!r} is timm train.py's key, not one here: {hints[key]}")
        renamed[ours], given_as[ours] = value, key
    if 'lr' in renamed and renamed['lr'] is None:        # timm's `lr: null`: the peak is lr_base scaled to the batch
        if renamed.get('lr_base') is None:
            raise UsageError(f"{where}: lr: null leaves the peak lr to lr_base (timm train.py's rule, its default "
                             "lr_base 0.1), and the file gives no lr_base; give lr_base: X (and lr_base_size), or "
                             "lr a number")
        del renamed['lr']
    return check_values(renamed, where)


def save_config(config: TrainConfig, path) -> None:
    """`config` as YAML at `path`, atomically."""
    from pathlib import Path

    import yaml

    from ..atomic import write_text_atomically
    write_text_atomically(Path(path), yaml.safe_dump(config.to_dict(), sort_keys=False))
