"""Training recipes: every training setting the five papers report, as `TrainConfig` values.

A recipe is `structformer/recipes/<name>.yaml` (package data): TrainConfig keys, exactly the field names
(checked by `config.check_values`, which refuses unknown keys and wrong types), plus one reserved key
`about:`, removed before loading, that says where the values come from:

    about:
      paper:    the paper (seed number)
      source:   section / table / appendix, or the public-code file where the paper is silent
      reported: the paper's number for this setting ("ImageNet-1k top-1 70.8% (Table 1)")
      data:     what --data should point at ("ImageNet-1k train/val as an ImageFolder")
      devices:  the paper's accelerators and global batch, where known
      notes:    where the recipe departs from the paper, and the values the paper does not give
      world_size: the process count the recipe's batch_size x grad_accum_steps is sized for: at that count
                  the effective batch is the paper's (optional, default 1)
      classes:  classes of the intended data (optional): the dry run builds the model with them when it
                does not read the data

`data:` in a recipe is a placeholder (`imagefolder:IMAGENET`) that `--data` overrides; every recipe sets
`dataset_size` (train images of the intended data) so `--dry-run` can count steps without the data.
`structformer train --recipe NAME` puts the recipe under `-c FILE` and the flags given (priority: defaults <
recipe < -c < flags) and records `recipe: NAME` in the run's config.yaml.

`dry_run(config)` is `structformer train --dry-run`: the resolved plan (model and parameter count, built on
the meta device; data; batch, accumulation, processes; steps; learning rates at the end of warm-up, half-way
and the end, from the same timm scheduler call as the engine; augmentation, precision, EMA, checkpoints,
teacher and stages, factorisation), printed without training or writing anything.
"""
import contextlib
import difflib
import io
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from ..errors import UsageError
from .config import TrainConfig, check_values

RECIPE_DIR = Path(__file__).resolve().parent.parent / 'recipes'
ABOUT_REQUIRED = ('paper', 'source', 'reported', 'data', 'devices', 'notes')
ABOUT_OPTIONAL = ('world_size', 'classes')
# --data forms a dry run reads: bundled or small, in memory (imagefolder decodes every image once and text
# may be gigabytes: those are counted from `dataset_size`)
_READ_FORMS = ('digits', 'synthetic-subspaces', 'pysource', 'mnist', 'cifar10')
_TEXT_FORMS = ('pysource', 'text')


def list_recipes() -> List[str]:
    """Names of the shipped recipes, sorted."""
    return sorted(p.stem for p in RECIPE_DIR.glob('*.yaml'))


def _unknown(name: str) -> UsageError:
    names = list_recipes()
    close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ''
    return UsageError(f"--recipe {name!r} is not a recipe: {hint}`structformer recipes` lists the {len(names)} recipes")


def load_recipe(name: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(values, about) of recipe `name`: the TrainConfig values, checked by key and type, and the `about`
    block. An unknown name is a UsageError naming --recipe, the closest names and `structformer recipes`."""
    if not isinstance(name, str) or not name or '/' in name or '\\' in name or name.startswith('.'):
        raise _unknown(name)
    path = RECIPE_DIR / f'{name}.yaml'
    if not path.is_file():
        raise _unknown(name)
    where = f"--recipe {name} ({path})"
    try:
        values = yaml.safe_load(path.read_text(encoding='utf-8'))
    except yaml.YAMLError as e:
        raise UsageError(f"{where}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise UsageError(f"{where}: expected a mapping of key: value")
    about = values.pop('about', None)
    if not isinstance(about, dict):
        raise UsageError(f"{where}: no `about:` block (paper, source, reported, data, devices, notes)")
    missing = [k for k in ABOUT_REQUIRED if k not in about]
    unknown = sorted(set(about) - set(ABOUT_REQUIRED) - set(ABOUT_OPTIONAL))
    if missing or unknown:
        raise UsageError(f"{where}: `about:` " + (f"lacks {', '.join(missing)}" if missing else '')
                         + ('; ' if missing and unknown else '') + (f"has unknown {', '.join(unknown)}" if unknown else ''))
    values = check_values(values, where)
    if values.get('dataset_size') is None:
        raise UsageError(f"{where}: sets no dataset_size (a dry run counts steps from it)")
    return values, dict(about)


def recipe_rows() -> List[Dict[str, Any]]:
    """One row per recipe for `structformer recipes`: name, paper, source, model, data, reported."""
    rows = []
    for name in list_recipes():
        values, about = load_recipe(name)
        rows.append({'name': name, 'paper': about['paper'], 'source': about['source'],
                     'model': values.get('model', TrainConfig.model), 'data': values.get('data', TrainConfig.data),
                     'reported': about['reported']})
    return rows


# ----------------------------------------------------------------------------------------------- dry run
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
    image size its data_kwargs ask for (or the model's own), channels by the data's form."""

    def __init__(self, num_classes, in_chans, img_size):
        self.num_classes, self.in_chans, self.img_size = num_classes, in_chans, img_size


def _stand_in(config: TrainConfig, about: Dict[str, Any], form: str):
    import timm

    import structformer.models  # noqa: F401  (registers our models)
    classes = about.get('classes')
    if classes is None:
        return None
    cfg = timm.get_pretrained_cfg(config.model) if timm.is_model(config.model) else None
    default = cfg.input_size if cfg is not None and cfg.input_size else (3, 224, 224)
    size = config.data_kwargs.get('seq_len' if form in _TEXT_FORMS else 'img_size', default[-1])
    chans = 1 if form in _TEXT_FORMS or form == 'mnist' else 3
    if form == 'cifar10':
        size = 32
    return _StandIn(int(classes), chans, int(size))


def _read_data(config: TrainConfig, form: str, path: Optional[str]):
    """(train size, info) when the data is bundled or small and at hand; else None."""
    if form not in _READ_FORMS or (path is not None and not os.path.isdir(path)):
        return None
    from ..data import build_datasets
    train, _, info = build_datasets(config.data, seed=config.seed, val_fraction=config.val_fraction,
                                    **config.data_kwargs)
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


def _schedule(config: TrainConfig, world: int, steps_per_epoch: int) -> List[Tuple[str, int, float]]:
    """(label, step, lr) at the end of warm-up, half-way and the end: timm's create_scheduler_v2 on a dummy
    optimiser, called as Trainer._make_scheduler calls it."""
    import torch
    from timm.scheduler import create_scheduler_v2
    peak = config.resolved_lr(world)
    total = steps_per_epoch * config.epochs
    warm = round(config.resolved_warmup_epochs() * steps_per_epoch)
    points = [('end of warm-up' if warm else 'start (no warm-up)', warm), ('half-way', total // 2), ('end', total)]
    if config.sched != 'cosine':
        return [(label, step, peak) for label, step in points]
    out = []
    for label, step in points:
        # --factorize-lr-scale from the switch on (the trainer rebuilds its schedule from the scaled lr there)
        factorised = config.factorize_rank is not None and step >= (config.factorize_at or 0) * steps_per_epoch
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))],
                                    lr=peak * (config.factorize_lr_scale if factorised else 1.0))
        scheduler, _ = create_scheduler_v2(
            optimizer, sched='cosine', num_epochs=config.epochs, warmup_epochs=config.resolved_warmup_epochs(),
            warmup_lr=config.resolved_warmup_lr(), min_lr=config.resolved_min_lr(), step_on_epochs=False,
            updates_per_epoch=steps_per_epoch)
        scheduler.step_update(num_updates=step)
        out.append((label, step, optimizer.param_groups[0]['lr']))
    return out


def _phase_lines(config: TrainConfig) -> List[str]:
    if config.phases:
        return [f"  phase {p.get('name', i)}: {p.get('epochs')} epochs, losses {p.get('losses', {'ce': 1.0})}"
                + (f", trains {p['trainable']}" if p.get('trainable') else '') for i, p in enumerate(config.phases)]
    if not config.teacher:
        return []
    from .distill import distillation_phases
    stage1 = config.predictor_epochs if config.predictor_epochs is not None else config.default_predictor_epochs()
    lines = [f"  teacher: {config.teacher} (not read by a dry run; a finished run of the dense model)"]
    for p in distillation_phases(config.epochs, stage1):
        trains = f", trains {', '.join(p['trainable'])}" if p.get('trainable') else ', trains everything'
        lines.append(f"  stage {p['name']}: {p['epochs']} epochs, losses {p['losses']}{trains}")
    lines.append("  (a student without Sparsifiner layers gets no predictor stage: all its epochs are joint)")
    return lines


def dry_run(config: TrainConfig) -> str:
    """The plan of `config` as text: what `structformer train` would do, without training or writing."""
    from ..data.spec import parse_data_spec
    config.validate()
    about: Dict[str, Any] = {}
    if config.recipe:
        try:
            recipe_values, about = load_recipe(config.recipe)
        except UsageError:
            recipe_values = {}           # a config.yaml naming a recipe that no longer ships: only the record
    else:
        recipe_values = {}
    world = _world_size()
    form, path = parse_data_spec(config.data)
    lines = ["dry run: the plan below is resolved; nothing is trained or written"]
    if config.recipe:
        lines.append(f"recipe        {config.recipe}" + (f": {about['paper']}; {about['source']}" if about else ''))
        if about:
            lines.append(f"  reported    {about['reported']}")
            lines.append(f"  paper ran   {about['devices']}")

    # data
    read = _read_data(config, form, path)
    lines.append(f"data          {config.data}" + (f"  {config.data_kwargs}" if config.data_kwargs else ''))
    if about.get('data'):
        lines.append(f"  expects     {about['data']}")
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
        why = (f"path {path!r} does not exist here" if path is not None and not os.path.exists(path)
               else 'data not read')
        if train_size is None:
            lines.append(f"  train size  unknown ({why}; set --dataset-size N to count steps)")
        else:
            stated = ("the recipe's stated size" if recipe_values.get('dataset_size') == train_size
                      else 'dataset_size as given')
            lines.append(f"  train size  {_count(train_size)} ({stated}; {why})")

    # model
    transforms = list(config.transforms)
    spec = config.factorize_spec()
    if spec and not config.factorize_at:
        transforms.append(spec)
    model, recipe, printed = _build_meta(config, data, transforms)
    n = _params(model)
    shape = 'x'.join(str(s) for s in recipe.input_size) if recipe.input_size else 'its default input'
    classes = getattr(model, 'num_classes', None)
    where = ('the data' if read is not None else "the recipe's stated classes" if data is not None
             else "the model's default")
    lines.append(f"model         {config.model}  {_human(n)} parameters ({_count(n)}; built on the meta device)")
    lines.append(f"  input       {shape}, {classes} classes ({where})"
                 + (f"; kwargs {recipe.kwargs}" if config.model_kwargs else ''))
    if config.drop is not None or config.drop_path is not None:
        lines.append(f"  dropout     drop_rate {config.drop}, drop_path_rate {config.drop_path}")
    for t in config.transforms:
        lines.append(f"  transform   {t.get('name')} {t.get('kwargs', {})}")

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
        samples = _per_process_samples(train_size, world, config)
        if config.limit_train_batches:
            samples = min(samples, config.limit_train_batches * config.batch_size)
        # the engine drops an epoch's last, smaller batch when it mixes images (timm does the same)
        mixing = config.mixup > 0 or config.cutmix > 0 or config.cutmix_minmax is not None
        batches = samples // config.batch_size if mixing else math.ceil(samples / config.batch_size)
        steps = math.ceil(batches / config.grad_accum_steps)
        lines.append(f"steps         {_count(steps)} optimiser steps per epoch ({_count(batches)} batches per process"
                     + (', last partial batch dropped (mixing)' if mixing and samples % config.batch_size else '')
                     + (f', limited by --limit-train-batches {config.limit_train_batches}' if config.limit_train_batches else '')
                     + f"), {_count(steps * config.epochs)} in total over {config.epochs} epochs")
    else:
        lines.append(f"steps         unknown without a dataset size; {config.epochs} epochs")

    # optimiser and learning rate
    peak = config.resolved_lr(world)
    if config.lr_base is not None:
        rule = config.lr_base_scale or ('sqrt' if any(o in config.opt.lower() for o in ('ada', 'lamb')) else 'linear')
        how = f"lr_base {config.lr_base:g} x ({_count(eff)} / {config.lr_base_size}), {rule} scaling"
    else:
        how = '--lr as given'
    lines.append(f"optimiser     {config.opt}, weight decay {config.weight_decay:g}"
                 + (' on every parameter' if config.decay_everything else ' (norms, biases, cls/pos exempt)')
                 + (f", momentum {config.momentum:g}" if 'sgd' in config.opt or 'momentum' in config.opt else '')
                 + (f", clip grad norm {config.clip_grad:g}" if config.clip_grad else '')
                 + f", label smoothing {config.label_smoothing:g}")
    lines.append(f"lr            peak {peak:.4g} ({how}); {config.sched}"
                 + (f", warm-up {config.resolved_warmup_epochs():g} epochs from {config.resolved_warmup_lr():.3g}, "
                    f"floor {config.resolved_min_lr():.3g}" if config.sched == 'cosine' else ''))
    for key, value in (('min_lr', config.resolved_min_lr()), ('warmup_lr', config.resolved_warmup_lr())):
        if config.sched == 'cosine' and value > peak:
            lines.append(f"  warning: {key} {value:.3g} is above the peak {peak:.4g} at this batch (lr_base scales the "
                         f"peak, not {key}): run with the recipe's effective batch or lower --{key.replace('_', '-')}")
    if steps:
        lines.append("  " + " | ".join(f"{label} (step {_count(step)}): {lr:.4g}"
                                       for label, step, lr in _schedule(config, world, steps)))

    # augmentation, precision, EMA, checkpoints
    aug = [f"aa {config.aa or 'none'}", f"reprob {config.reprob:g}", f"mixup {config.mixup:g}", f"cutmix {config.cutmix:g}"]
    if config.mixup or config.cutmix:
        aug.append(f"mixup_prob {config.mixup_prob:g}, switch {config.mixup_switch_prob:g}, mode {config.mixup_mode}"
                   + (f", off after epoch {config.mixup_off_epoch}" if config.mixup_off_epoch else ''))
    aug.append(f"aug_repeats {config.aug_repeats}")
    for key in ('color_jitter', 'scale', 'ratio', 'hflip'):
        if getattr(config, key) is not None:
            aug.append(f"{key} {getattr(config, key)}")
    lines.append("augmentation  " + ', '.join(aug))
    lines.append("precision     " + (f"mixed ({config.amp_dtype or 'float16 on CUDA, bfloat16 on a CPU'}), "
                                     "float32 weights" if config.amp else 'float32 (amp off)')
                 + f"; device {config.device}" + ('; channels_last' if config.channels_last else '')
                 + (f"; torch.compile {config.compile}" if config.compile else ''))
    lines.append("EMA           " + (f"on, decay {config.model_ema_decay:g}" + (' with warm-up' if config.model_ema_warmup else '')
                                     if config.model_ema else 'off'))
    output = config.output or f"outputs/{config.model}_{config.data.split(':')[0]}"
    lines.append(f"checkpoints   {output}: every epoch, keep the last {config.keep_last}"
                 + (f" and every {config.save_every}th epoch" if config.save_every else '')
                 + (f"; a log line every {config.log_interval} steps" if config.log_interval else ''))

    # stages and factorisation
    stage_lines = _phase_lines(config)
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
    return '\n'.join(lines)
