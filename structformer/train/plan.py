"""`structformer train --dry-run`: the resolved plan of a configuration, without training or writing anything.

What it prints: the recipe and its reported number (only for the recipe's own model: `recipes.check_recipe_model`),
the data (read when bundled or small and at hand; a path given with --data must exist, as training needs it; the
recipe's placeholder is named as such and not looked at), the model and its parameter count (built on the meta
device at the size training builds it: data_kwargs img_size, else model_kwargs img_size, else the model's own),
batch, accumulation, processes and steps, the optimiser and every learning rate that matters (timm's
create_scheduler_v2 as the trainer calls it, train/optim.py: each phase with its own settings, the low-rank
switch's scale), augmentation, precision and device (a device this machine lacks is refused, as training
refuses it), EMA, checkpoints, the starting weights (found or not), the teacher and stages, the factorisation.
"""
import contextlib
import io
import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

from ..errors import UsageError
from .config import TrainConfig
from .config_checks import floor_read
from .recipes import load_recipe, recipe_model_relation

# --data forms a dry run reads: bundled or small, in memory (imagefolder decodes every image once and text
# may be gigabytes: those are counted from `dataset_size`)
_READ_FORMS = ('digits', 'synthetic-subspaces', 'pysource', 'mnist', 'cifar10')
_TEXT_FORMS = ('pysource', 'text')


def _world_size() -> int:
    try:
        return max(1, int(os.environ.get('WORLD_SIZE', '1')))
    except ValueError:
        raise UsageError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} is not a process count") from None


def _count(n) -> str:
    return f"{n:,}"


def _human(n: int) -> str:
    for scale, unit in ((1e9, 'G'), (1e6, 'M'), (1e3, 'K')):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


class _StandIn:
    """What the model factory reads of a dataset, where the data is not read: the recipe's classes, the
    image size training would read the data at, channels by the data's form."""

    def __init__(self, num_classes, in_chans, img_size):
        self.num_classes, self.in_chans, self.img_size = num_classes, in_chans, img_size


def _stand_in(config: TrainConfig, about: Dict[str, Any], form: str):
    """The data as training would read it: text at data_kwargs seq_len; images at data_kwargs img_size, else
    the model's input size (model_kwargs img_size, else its pretrained config), as the image forms follow the
    model (data/sizing.py)."""
    from ..models.factory import default_input_size
    classes = about.get('classes')
    if classes is None:
        return None
    if form in _TEXT_FORMS:
        size = config.data_kwargs.get('seq_len', 256)
    else:
        native = default_input_size(config.model, config.model_kwargs)
        size = config.data_kwargs.get('img_size', native[-1] if native else 224)
    chans = 1 if form in _TEXT_FORMS or form == 'mnist' else 3
    return _StandIn(int(classes), chans, int(size))


def _read_data(config: TrainConfig, form: str, path: Optional[str]):
    """(train size, info) when the data is bundled or small and at hand; else None."""
    if form not in _READ_FORMS or (path is not None and not os.path.isdir(path)):
        return None
    from ..data import build_datasets
    train, _, info = build_datasets(config.data, seed=config.seed, val_fraction=config.val_fraction,
                                    model=config.model, model_kwargs=config.model_kwargs, **config.data_kwargs)
    return len(train), info


def _build_meta(config: TrainConfig, data, transforms: List[dict]):
    """The model on the meta device (no memory, no init cost; a 300M model builds in a second), with the
    engine's constructor arguments; what the transforms print (factorize's summary) is returned."""
    import torch

    from ..models.factory import build_model
    kwargs = dict(config.model_kwargs)
    for flag, key in (('drop', 'drop_rate'), ('drop_path', 'drop_path_rate')):
        if getattr(config, flag) is not None:
            kwargs.setdefault(key, getattr(config, flag))
    printed = io.StringIO()
    with torch.device('meta'), contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        model, recipe = build_model(config.model, kwargs, data, transforms)
    return model, recipe, [line for line in printed.getvalue().splitlines() if line.strip()]


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _per_process_samples(n: int, world: int, config: TrainConfig) -> int:
    """Samples one process draws per epoch, as the engine's sampler gives them: timm's RepeatAugSampler for
    --aug-repeats, DistributedSampler (padded to ceil(n / world)) over several processes, else all n."""
    if config.aug_repeats:
        from timm.data.distributed_sampler import RepeatAugSampler
        return len(RepeatAugSampler(range(n), num_replicas=world, rank=0, shuffle=False,
                                    num_repeats=config.aug_repeats))
    return math.ceil(n / world) if world > 1 else n


# ------------------------------------------------------------------------------------------- phases and lr
def phase_plan(config: TrainConfig) -> List[Tuple[str, int]]:
    """(name, epochs) of each phase as the trainer will run them: the config's phases, else Sparsifiner's two
    stages with a teacher, else one phase `main`."""
    if config.phases:
        return [(p.get('name', f'phase{i}'), int(p.get('epochs', 0))) for i, p in enumerate(config.phases)]
    if config.teacher:
        from .distill import distillation_phases
        stage1 = config.predictor_epochs if config.predictor_epochs is not None else config.default_predictor_epochs()
        return [(p['name'], p['epochs']) for p in distillation_phases(config.epochs, stage1)]
    return [('main', config.epochs)]


def check_phase_settings(config: TrainConfig, phases: List[Tuple[str, int]]) -> None:
    """Every `phase_settings` name is a phase of the run, and its schedule fits the phase's epochs."""
    names = [name for name, _ in phases]
    for name in config.phase_settings:
        if name not in names:
            raise UsageError(f"phase_settings.{name}: the run has no phase {name!r}; its phases are "
                             f"{', '.join(names)}")
    for name, epochs in phases:
        if name in config.phase_settings:
            config._validate_schedule(config.schedule_values(name, epochs), f"phase_settings.{name}.")


def _lr_lines(config: TrainConfig, world: int, steps: Optional[int]) -> List[str]:
    from .optim import never_decays, schedule_shape, scheduled_lr
    lines = []
    own = bool(config.phase_settings)
    phases = phase_plan(config) if own else [(None, config.epochs)]
    if own:
        lines.append("  every phase its own optimiser (fresh state) and schedule over its own epochs (phase_settings)")
    start = 0
    for name, epochs in phases:
        values = config.schedule_values(name, epochs if own else None)
        peak = values['lr'] * config.lr_scale(world, values['opt'])     # the rule of the phase's optimiser
        shape = schedule_shape(values)
        if own:
            lines.append(f"  phase {name} (epochs {start + 1}-{start + epochs}): {values['opt']}, weight decay "
                         f"{values['weight_decay']:g}, peak {peak:.4g}; {shape}")
            for key in ('warmup_lr', 'min_lr'):
                if floor_read(values, key) and values[key] > peak:
                    lines.append(f"    warning: {key} {values[key]:.3g} is above this phase's peak {peak:.4g} at this "
                                 "batch (its lr scales with the batch, not its floors): training refuses it; run with "
                                 f"the recipe's effective batch or --phase-settings {name} {key}=...")
        if steps:
            total = steps * epochs
            # timm's warm-up covers the steps t < warmup_epochs x steps (its own product): it ends at the first
            # whole step at or past that, not at the nearest one
            warm = math.ceil(values['warmup_epochs'] * steps) if values['sched'] != 'none' else 0
            points = [('end of warm-up' if warm else 'start (no warm-up)', warm), ('half-way', total // 2),
                      ('end', total)]
            shown = []
            for label, step in points:
                lr = peak * _factorised_scale(config, start * steps + step, steps)
                shown.append(f"{label} (step {_count(start * steps + step)}): "
                             f"{scheduled_lr(values, lr, steps, [step])[0]:.4g}")
            lines.append("  " + ("  " if own else '') + " | ".join(shown))
        never = never_decays(values, steps, f"phase_settings.{name}." if own else '--')
        if never:
            lines.append("  " + ("  " if own else '') + never)
        start += epochs
    return lines


def _factorised_scale(config: TrainConfig, step: int, steps_per_epoch: int) -> float:
    """--factorize-lr-scale from the switch on (the trainer rebuilds its schedule from the scaled lr there)."""
    if not config.factorises() or step < (config.factorize_at or 0) * steps_per_epoch:
        return 1.0
    return config.factorize_lr_scale


# ------------------------------------------------------------------------------------------ what is where
# where the data and the run are, not how it trains: a recipe's notes say nothing of them
_WHERE_NOT_HOW = ('output', 'data', 'data_as_given', 'dataset_size', 'recipe')


def _placeholder(config: TrainConfig, key: str, recipe_values: Dict[str, Any]) -> bool:
    """The value of `key` is the recipe's own placeholder (IMAGENET, TEACHER_RUN_DIR), not a path given."""
    return bool(config.recipe) and recipe_values.get(key) is not None and getattr(config, key) == recipe_values[key]


def _data_line(config: TrainConfig, form: str, path: Optional[str], recipe_values: Dict[str, Any]) -> str:
    """Where the data is: the recipe's placeholder (not looked at), a path given (it must exist, as training
    needs it), shard patterns (not looked at), or no path at all."""
    from .data_paths import data_path
    if _placeholder(config, 'data', recipe_values) and path is not None and not os.path.exists(path):
        return f"the recipe's placeholder {path!r}: not looked at; give --data with your copy's path"
    if form == 'wds':
        return 'shard patterns: not looked at by a dry run (the shard reader names a missing shard)'
    checked = data_path(config.data)
    if checked is None:
        return 'bundled or generated: no path'
    if not os.path.exists(checked):
        raise UsageError(f"--data {config.data}: {checked} does not exist (training would stop here too); "
                         "give the path of the data")
    return f"{checked} exists"


def _initial_weights_line(config: TrainConfig, recipe_values: Dict[str, Any]) -> Optional[str]:
    """Whether --initial-checkpoint / --pretrained-path exist here (the fine-tuning recipes name their
    pre-training recipe's default output)."""
    flag, path = (('--initial-checkpoint', config.initial_checkpoint) if config.initial_checkpoint else
                  ('--pretrained-path', config.pretrained_path) if config.pretrained_path else (None, None))
    if path is None:
        return None
    source = os.path.basename(os.path.normpath(str(path)))
    if not os.path.exists(path):
        hint = (f"; train `--recipe {source}` first (its default output), or point {flag} at your run or weights"
                if _placeholder(config, 'initial_checkpoint', recipe_values) else f"; give an existing {flag}")
        return f"starts from   {path}: NOT FOUND here{hint}"
    from .checkpoint import resolve_checkpoint
    try:
        checkpoint = resolve_checkpoint(path)
        state = json.loads((checkpoint / 'state.json').read_text())
        return f"starts from   {path}: found, epoch {state.get('epoch')} of {state.get('model')} ({checkpoint})"
    except (OSError, ValueError, KeyError):
        return f"starts from   {path}: found (a weights file; read when training starts)"


def _teacher_line(config: TrainConfig, recipe_values: Dict[str, Any]) -> str:
    if _placeholder(config, 'teacher', recipe_values) and not os.path.exists(config.teacher):
        return (f"  teacher: {config.teacher} is the recipe's placeholder: give --teacher RUN_DIR (a finished run "
                "of the dense model); not read by a dry run")
    where = 'found' if os.path.exists(config.teacher) else 'not a path here (a registered model name?)'
    return f"  teacher: {config.teacher} ({where}; not read by a dry run)"


def _phase_lines(config: TrainConfig, recipe_values: Dict[str, Any]) -> List[str]:
    if config.phases:
        return [f"  phase {p.get('name', i)}: {p.get('epochs')} epochs, losses {p.get('losses', {'ce': 1.0})}"
                + (f", trains {p['trainable']}" if p.get('trainable') else '') for i, p in enumerate(config.phases)]
    if not config.teacher:
        return []
    from .distill import distillation_phases
    stage1 = config.predictor_epochs if config.predictor_epochs is not None else config.default_predictor_epochs()
    lines = [_teacher_line(config, recipe_values)]
    for p in distillation_phases(config.epochs, stage1):
        trains = f", trains {', '.join(p['trainable'])}" if p.get('trainable') else ', trains everything'
        lines.append(f"  stage {p['name']}: {p['epochs']} epochs, losses {p['losses']}{trains}")
    lines.append("  (a student without Sparsifiner layers gets no predictor stage: all its epochs are joint)")
    return lines


def _reported_lines(config: TrainConfig, recipe_values: Dict[str, Any], about: Dict[str, Any]) -> List[str]:
    """The recipe's number only where this plan trains the recipe's own model as the recipe builds it."""
    relation = recipe_model_relation(config, recipe_values, about)
    model = recipe_values.get('model', TrainConfig.model)
    lines = []
    if relation == 'recipe':
        lines.append(f"  reported    {about['reported']}")
    else:
        what = {'kwargs': f"{model} with other --model-kwargs ({config.model_kwargs})",
                'row': f"{config.model}, one of the rows in the recipe's sweep",
                'shrink': f"{config.model}, a registered shrink of {model} (a smoke run)",
                'other': f"{config.model}, another model (--allow-other-model)"}[relation]
        lines.append(f"  reported    not shown: the recipe's number is for {model} as the recipe builds it; this "
                     f"plan trains {what}")
    lines.append(f"  covers      {about['covers']}")
    if about.get('sweep'):
        lines.append(f"  sweep       {' '.join(str(about['sweep']).split())}")
    lines.append(f"  paper ran   {about['devices']}")
    return lines


# ------------------------------------------------------------------------------------------------ the plan
def dry_run(config: TrainConfig, resume=None) -> str:
    """The plan of `config` as text: what `structformer train` would do, without training or writing; with `resume`
    (--resume, or its CHECKPOINT) also the checkpoint it would continue from and where (recovery.resume_plan)."""
    from ..data.spec import parse_data_spec
    from .distributed import resolve_device
    config.validate()
    about: Dict[str, Any] = {}
    recipe_values: Dict[str, Any] = {}
    if config.recipe:
        try:
            recipe_values, about = load_recipe(config.recipe)
        except UsageError:
            pass                         # a config.yaml naming a recipe that no longer ships: only the record
    world = _world_size()
    device = resolve_device(config.device, int(os.environ.get('LOCAL_RANK', '0') or 0))   # as training refuses
    form, path = parse_data_spec(config.data)
    lines = ["dry run: the plan below is resolved; nothing is trained or written"]
    if resume:
        from .recovery import resume_plan
        lines.append(resume_plan(resume, config.output or f"outputs/{config.model}_{config.data.split(':')[0]}",
                                 config.epochs))
    if config.recipe:
        lines.append(f"recipe        {config.recipe}" + (f": {about['paper']}; {about['source']}" if about else ''))
        if about:
            lines.extend(_reported_lines(config, recipe_values, about))

    # data
    lines.append(f"data          {config.data}" + (f"  {config.data_kwargs}" if config.data_kwargs else ''))
    lines.append(f"  where       {_data_line(config, form, path, recipe_values)}")
    if about.get('data'):
        lines.append(f"  expects     {about['data']}")
    read = _read_data(config, form, path)
    if read is not None:
        train_size, info = read
        unit = 'sequences' if form in _TEXT_FORMS else 'images'
        lines.append(f"  train size  {_count(train_size)} {unit} (read from the data: {info.num_classes} classes, "
                     f"{info.in_chans}x{info.img_size}x{info.img_size})")
        if config.dataset_size and config.dataset_size != train_size:
            lines.append(f"  (the stated dataset_size {_count(config.dataset_size)} is not used: the data is at hand)")
        data = info
    else:
        train_size, data = config.dataset_size, _stand_in(config, about, form)
        if train_size is None:
            lines.append("  train size  unknown (data not read; set --dataset-size N to count steps)")
        else:
            stated = ("the recipe's stated size" if recipe_values.get('dataset_size') == train_size
                      else 'dataset_size as given')
            lines.append(f"  train size  {_count(train_size)} ({stated}; data not read)")

    # model
    transforms = list(config.transforms)
    spec = config.factorize_spec()
    if spec and not config.factorize_at:
        transforms.append(spec)
    model, recipe, printed = _build_meta(config, data, transforms)
    n = _params(model)
    shape = 'x'.join(str(s) for s in recipe.input_size) if recipe.input_size else 'its default input'
    if form in _TEXT_FORMS and data is not None:          # token ids [B, T]: the context length
        shape = f"T={data.img_size} tokens"
    classes = getattr(model, 'num_classes', None)
    where = ('the data' if read is not None else "the recipe's stated classes" if data is not None
             else "the model's default")
    lines.append(f"model         {config.model}  {_human(n)} parameters ({_count(n)}; built on the meta device)")
    from ..models.inventory import effective_parameter_count
    kept = effective_parameter_count(model)        # SW-MLP: its masks keep p of each weight (its Ω), the rest stay 0
    if kept != n:
        lines.append(f"  masks keep  {_human(kept)} of them ({_count(kept)}); the rest are zero and never trained")
    lines.append(f"  input       {shape}, {classes} classes ({where})"
                 + (f"; kwargs {recipe.kwargs}" if config.model_kwargs else ''))
    if config.drop is not None or config.drop_path is not None:
        lines.append(f"  dropout     drop_rate {config.drop}, drop_path_rate {config.drop_path}")
    for t in config.transforms:
        lines.append(f"  transform   {t.get('name')} {t.get('kwargs', {})}")
    starts = _initial_weights_line(config, recipe_values)
    if starts:
        lines.append(starts)

    # batch and steps
    eff = config.effective_batch(world)
    lines.append(f"batch         {config.batch_size} per process x {config.grad_accum_steps} accumulation x {world} "
                 f"process{'es' if world > 1 else ''} (WORLD_SIZE{'' if 'WORLD_SIZE' in os.environ else ' unset'})"
                 f" = {_count(eff)} per optimiser step")
    sized = int(about.get('world_size', 0) or 0)
    if sized and sized != world:
        lines.append(f"  the recipe is sized for {sized} processes: effective batch {_count(config.effective_batch(sized))}"
                     f"; with {world}, keep it with --grad-accum-steps "
                     f"{max(1, round(config.grad_accum_steps * sized / world))} (see docs/recipes.md)")
    steps = None
    if train_size:
        streamed = form == 'wds'           # shards: N // P a process, batched by each loader worker (data/shards.py)
        samples = train_size // world if streamed else _per_process_samples(train_size, world, config)
        if config.limit_train_batches:
            samples = min(samples, config.limit_train_batches * config.batch_size)
        # the engine drops an epoch's last, smaller batch when it mixes images (timm does the same)
        mixing = config.mixup > 0 or config.cutmix > 0 or config.cutmix_minmax is not None
        batches = samples // config.batch_size if mixing else math.ceil(samples / config.batch_size)
        if streamed:
            from ..data.shards import worker_batches
            workers = config.num_workers if config.num_workers is not None else \
                min(8, max(1, (os.cpu_count() or 1) // int(os.environ.get('LOCAL_WORLD_SIZE', world))))
            batches = worker_batches(samples, config.batch_size, workers, mixing)
            if config.limit_train_batches:
                batches = min(batches, config.limit_train_batches)
        if batches == 0:                  # refused as training refuses it (train/loaders.py), before any step count
            from .loaders import no_training_batch
            raise no_training_batch(config.batch_size, samples, mixing)
        steps = math.ceil(batches / config.grad_accum_steps)
        lines.append(f"steps         {_count(steps)} optimiser steps per epoch ({_count(batches)} batches per process"
                     + (', last partial batch dropped (mixing)' if mixing and samples % config.batch_size else '')
                     + (f', limited by --limit-train-batches {config.limit_train_batches}' if config.limit_train_batches else '')
                     + f"), {_count(steps * config.epochs)} in total over {config.epochs} epochs")
        held = samples * world            # the images one epoch feeds, over every process
        if eff > held:
            # timm's arithmetic is kept (the batch above, --lr-base scaled by it): users compare with timm's train.py
            lines.append(f"  note: one optimiser step of {_count(eff)} images spans more than the {_count(held)} one "
                         f"epoch holds: each epoch makes {_count(steps)} optimiser step{'s' if steps != 1 else ''} of "
                         f"what it has ({_count(batches)} batch{'es' if batches != 1 else ''} per process), while "
                         f"the batch above{' and --lr-base scaling' if config.lr_base is not None else ''} "
                         f"count {_count(eff)}, as timm's train.py does")
    else:
        lines.append(f"steps         unknown without a dataset size; {config.epochs} epochs")

    # optimiser and learning rate
    phases = phase_plan(config)
    check_phase_settings(config, phases)
    peak = config.resolved_lr(world)
    if config.lr_base is not None:
        rule = config.lr_base_scale or ('sqrt' if any(o in config.opt.lower() for o in ('ada', 'lamb')) else 'linear')
        how = f"lr_base {config.lr_base:g} x ({_count(eff)} / {config.lr_base_size}), {rule} scaling"
    else:
        how = '--lr as given'
    lines.append(f"optimiser     {config.opt}, weight decay {config.weight_decay:g}"
                 + (' on every parameter' if config.decay_everything else ' (norms, biases, cls/pos exempt)')
                 + ('; the factors by Frobenius decay instead' if config.factorises() and config.factor_decay == 'frobenius' else '')
                 + (f", momentum {config.momentum:g}" if 'sgd' in config.opt or 'momentum' in config.opt else '')
                 + (f", betas {tuple(config.opt_betas)}" if config.opt_betas else '')
                 + (f", eps {config.opt_eps:g}" if config.opt_eps is not None else '')
                 + (f", clip grad {config.clip_mode} {config.clip_grad:g}" if config.clip_grad else '')
                 + (f", layer decay {config.layer_decay:g}" if config.layer_decay is not None else '')
                 + (", binary cross-entropy (--bce-loss)" if config.bce_loss else
                    f", label smoothing {config.label_smoothing:g}"))
    values = config.schedule_values()
    # the optimiser the run would make, over the meta model: a setting it refuses (--opt sgd with --opt-betas) is
    # refused by the plan too, not printed as if it would train
    from .mixing import build_mixup
    from .optim import make_optimizer
    make_optimizer(model, config, values, peak)
    build_mixup(config, 2, language_model=form in _TEXT_FORMS)     # Mixup's own refusals (text, an odd batch)
    factorised = ''
    if config.factorises() and config.factorize_lr_scale != 1:
        when = f"from epoch {config.factorize_at + 1} on" if config.factorize_at else 'the whole run'
        factorised = (f"; x {config.factorize_lr_scale:g} while factorised ({when}): peak "
                      f"{peak * config.factorize_lr_scale:.4g}")
    from .optim import schedule_shape
    lines.append(f"lr            peak {peak:.4g} ({how}){factorised}; {schedule_shape(values)}")
    for key in ('min_lr', 'warmup_lr'):
        value = values[key]
        if floor_read(values, key) and value > peak:
            lines.append(f"  warning: {key} {value:.3g} is above the peak {peak:.4g} at this batch (lr_base scales the "
                         f"peak, not {key}): run with the recipe's effective batch or lower --{key.replace('_', '-')}")
    lines.extend(_lr_lines(config, world, steps))

    # augmentation, precision, EMA, checkpoints
    aug = [f"aa {config.aa or 'none'}", f"reprob {config.reprob:g}", f"mixup {config.mixup:g}", f"cutmix {config.cutmix:g}"]
    if config.mixup or config.cutmix:
        aug.append(f"mixup_prob {config.mixup_prob:g}, switch {config.mixup_switch_prob:g}, mode {config.mixup_mode}"
                   + (f", off after epoch {config.mixup_off_epoch}" if config.mixup_off_epoch else ''))
    aug.append(f"aug_repeats {config.aug_repeats}")
    for key in ('color_jitter', 'scale', 'ratio', 'hflip', 'train_interpolation'):
        if getattr(config, key) is not None:
            aug.append(f"{key} {getattr(config, key)}")
    lines.append("augmentation  " + ', '.join(aug))
    lines.append("precision     " + (f"mixed ({config.amp_dtype or 'float16 on CUDA, bfloat16 on a CPU'}), "
                                     "float32 weights" if config.amp else 'float32 (amp off)')
                 + f"; device {config.device} ({device} here)" + ('; channels_last' if config.channels_last else '')
                 + ('; activation checkpointing' if config.grad_checkpointing else '')
                 + ('; SyncBatchNorm across processes' if config.sync_bn else '')
                 + (f"; torch.compile {config.compile}" if config.compile else ''))
    lines.append("EMA           " + (f"on, decay {config.model_ema_decay:g}" + (' with warm-up' if config.model_ema_warmup else '')
                                     if config.model_ema else 'off'))
    output = config.output or f"outputs/{config.model}_{config.data.split(':')[0]}"
    lines.append(f"checkpoints   {output}: every epoch, keep the last {config.keep_last}"
                 + (f" and every {config.save_every}th epoch" if config.save_every else '')
                 + ('; the best by val top-1 kept too' if config.keep_best else '')
                 + (f"; the last {config.avg_last} averaged at the end" if config.avg_last else '')
                 + (f"; a log line every {config.log_interval} steps" if config.log_interval else ''))

    # stages and factorisation
    stage_lines = _phase_lines(config, recipe_values)
    if stage_lines:
        lines.append("stages")
        lines.extend(stage_lines)
    if spec:
        when = (f"after {config.factorize_at} dense epoch(s), by truncated SVD" if config.factorize_at
                else 'from the start')
        lines.append(f"low-rank      rank {config.factorize_rank}, init {config.factorize_init}, layers "
                     f"{config.factorize_include or 'the default (every conv but the first / QKV + FFN)'}, "
                     f"{config.factor_decay} decay; {when}")
        if config.factorize_at:
            import torch

            from ..models.transforms import TransformContext, apply_transforms, normalize_transforms
            captured = io.StringIO()
            with torch.device('meta'), contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
                factored = apply_transforms(model, normalize_transforms([spec]),
                                            TransformContext(input_size=recipe.input_size))
            printed += [line for line in captured.getvalue().splitlines() if line.strip()]
            lines.append(f"  parameters  {_human(n)} dense, {_human(_params(factored))} after factorisation")
        lines.extend(f"  {line}" for line in printed)
    if about.get('notes'):
        lines.append(f"notes         {' '.join(str(about['notes']).split())}")
        # the notes describe the recipe as it ships: say which of its settings this plan no longer has
        from .config_file import config_defaults
        shipped = {name: recipe_values.get(name, default) for name, default in config_defaults(TrainConfig).items()}
        if shipped.get('label_smoothing') is None:      # left to the task: what validate() resolves for this run
            from .config import DEFAULT_LABEL_SMOOTHING
            from .config_checks import language_modelling
            shipped['label_smoothing'] = 0.0 if language_modelling(config) else DEFAULT_LABEL_SMOOTHING
        changed = sorted(k for k, v in shipped.items() if getattr(config, k) != v and k not in _WHERE_NOT_HOW)
        if changed:
            lines.append(f"  (the recipe's own notes: -c / the flags given changed {', '.join(changed)})")
    return '\n'.join(lines)
