"""The checks of the schedule, the paper-scale settings (precision, augmentation, EMA, accumulation), the training
controls and the per-phase settings of a `TrainConfig` (timm train.py's names): ranges, and what each needs, as
one-line UsageErrors naming the flag (or `phase_settings.NAME.KEY`)."""
import math
import typing
from typing import Any, Dict

from ..errors import UsageError
from .config_file import _KIND_WORDS, _coerce, _field_kind, flag_name

# what a phase may set for itself (`phase_settings`): its own optimiser (fresh state) and its own schedule over
# its epochs, as Sparsifiner's public code gives each stage; keys and meanings as the run-wide ones
PHASE_SETTING_KEYS = ('opt', 'lr', 'weight_decay', 'momentum', 'sched', 'warmup_epochs', 'warmup_lr', 'warmup_prefix',
                      'min_lr', 'decay_epochs', 'decay_milestones', 'decay_rate', 'cooldown_epochs', 'lr_cycle_mul',
                      'lr_cycle_decay', 'lr_cycle_limit', 'lr_k_decay', 'lr_noise', 'lr_noise_pct', 'lr_noise_std')
MAX_AUG_REPEATS = 64                             # --aug-repeats' and --recount's bound (validate_paper_scale)
CYCLING = ('cosine', 'tanh', 'poly')             # the schedules timm restarts (cycle_mul / decay / limit)
K_DECAYING = ('cosine', 'poly')                  # the schedules with timm's k-decay
TO_MIN_LR = ('cosine', 'tanh', 'poly')           # the schedules that end at min_lr (step / multistep decay by rate)
# timm's schedules stepped per optimiser step (create_scheduler_v2 with step_on_epochs=False): cosine and tanh to
# min_lr, poly to min_lr with power decay_rate (timm's train.py passes --decay-rate as poly's power), step, multistep;
# 'none' keeps the optimiser's lr. Not 'plateau': it steps once an epoch on an eval metric (deprecated in timm)
SCHEDULES = ('cosine', 'tanh', 'poly', 'step', 'multistep', 'none')
SCHEDULES_ACCEPTED = "'cosine', 'tanh', 'poly', 'step', 'multistep' or 'none'"
# the settings of --rank's factorisation and of the factors it makes: validate_lowrank refuses each of them where
# nothing would act on it (so compare hands them to its low-rank rows alone)
FACTORISATION_SETTINGS = ('factorize_include', 'factorize_init', 'factor_decay', 'factorize_lr_scale')


def validate_schedule(values: Dict[str, Any], where: str) -> None:
    """The schedule's numbers (run-wide, or a phase's: `where` names it), before any work."""
    def bad(key, accepted):
        raise UsageError(f"{where}{flag_name(key) if not where else key}={values[key]!r} is out of range: "
                         f"accepted {accepted}")
    epochs = values['epochs']
    if values['sched'] not in SCHEDULES:
        bad('sched', SCHEDULES_ACCEPTED)
    if not values['decay_epochs'] > 0:
        bad('decay_epochs', '> 0')
    if values['sched'] == 'poly':            # the polynomial's power, (1 - t/T)^decay_rate
        if not 0 < values['decay_rate'] <= 10:
            bad('decay_rate', 'in (0, 10] with --sched poly (its power)')
    elif not 0 < values['decay_rate'] <= 1:
        bad('decay_rate', 'in (0, 1]')
    milestones = values['decay_milestones']
    if not (isinstance(milestones, list) and milestones and all(isinstance(m, int) and not isinstance(m, bool)
                                                                  and m > 0 for m in milestones)
            and milestones == sorted(set(milestones))):
        bad('decay_milestones', 'increasing whole epochs > 0, e.g. 60 120 160')
    if not 0 <= values['cooldown_epochs'] < epochs:
        bad('cooldown_epochs', f'in [0, epochs={epochs})')
    if not 0 <= values['warmup_epochs'] < epochs - values['cooldown_epochs']:
        bad('warmup_epochs', f"in [0, epochs - cooldown_epochs = {epochs - values['cooldown_epochs']})")
    _validate_shape(values, bad)


def _validate_shape(values: Dict[str, Any], bad) -> None:
    """Restarts, k-decay and noise: their ranges, and only on the schedules timm applies them to."""
    sched = values['sched']
    limit = values['lr_cycle_limit']
    if not (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1):
        bad('lr_cycle_limit', 'a whole number of cycles >= 1')
    if not values['lr_cycle_mul'] > 0:
        bad('lr_cycle_mul', '> 0')
    if not 0 < values['lr_cycle_decay'] <= 1:
        bad('lr_cycle_decay', 'in (0, 1]')
    if limit > 1 and sched not in CYCLING:
        bad('lr_cycle_limit', f"1 with --sched {sched}: restarts apply to {', '.join(CYCLING)}")
    if not values['lr_k_decay'] > 0:
        bad('lr_k_decay', '> 0')
    if values['lr_k_decay'] != 1 and sched not in K_DECAYING:
        bad('lr_k_decay', f"1 with --sched {sched}: k-decay applies to {', '.join(K_DECAYING)}")
    noise = values['lr_noise']
    if noise is not None:
        if not (isinstance(noise, list) and len(noise) in (1, 2) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1 for x in noise)
                and noise == sorted(noise)):
            bad('lr_noise', 'one or two increasing fractions of a cycle in [0, 1], e.g. 0.4 0.9')
        if sched == 'none':
            bad('lr_noise', "unset with --sched none (no schedule to add noise to)")
    if not values['lr_noise_pct'] > 0:        # timm redraws until |noise| < pct: 0 would never end
        bad('lr_noise_pct', '> 0')
    if not values['lr_noise_std'] > 0:
        bad('lr_noise_std', '> 0')


def validate_paper_scale(config) -> None:
    """Precision, augmentation, EMA, accumulation and logging settings: ranges and names, before any work."""
    from ..data.augment import TRAIN_INTERPOLATIONS
    checks = [
        ('drop', config.drop is None or 0 <= config.drop < 1, 'in [0, 1)'),
        ('drop_path', config.drop_path is None or 0 <= config.drop_path < 1, 'in [0, 1)'),
        ('amp_dtype', config.amp_dtype in (None, 'float16', 'bfloat16'), "'float16' or 'bfloat16'"),
        ('reprob', 0 <= config.reprob <= 1, 'in [0, 1]'),
        ('remode', config.remode in ('const', 'rand', 'pixel'), "'const', 'rand' or 'pixel'"),
        # random erasing draws 1..recount boxes per image (timm's RandomErasing): 1e11 never finished an image
        ('recount', 1 <= config.recount <= MAX_AUG_REPEATS, f'an integer in [1, {MAX_AUG_REPEATS}]'),
        ('color_jitter', config.color_jitter is None or 0 <= config.color_jitter <= 1, 'in [0, 1]'),
        ('hflip', config.hflip is None or 0 <= config.hflip <= 1, 'in [0, 1]'),
        ('train_interpolation', config.train_interpolation in (None,) + TRAIN_INTERPOLATIONS,
         ', '.join(TRAIN_INTERPOLATIONS[:-1]) + ' or ' + TRAIN_INTERPOLATIONS[-1]),
        # the sampler lists every image `aug_repeats` times (timm's RepeatAugSampler; DeiT repeats 3 times): a bound
        # that keeps ImageNet's list within a few GiB, where 1e11 failed inside torch's allocator
        ('aug_repeats', config.aug_repeats == 0 or 2 <= config.aug_repeats <= MAX_AUG_REPEATS,
         f'0 (off) or an integer in [2, {MAX_AUG_REPEATS}]'),
        ('mixup', config.mixup >= 0, '>= 0 (0 = off)'),
        ('cutmix', config.cutmix >= 0, '>= 0 (0 = off)'),
        ('mixup_prob', 0 <= config.mixup_prob <= 1, 'in [0, 1]'),
        ('mixup_switch_prob', 0 <= config.mixup_switch_prob <= 1, 'in [0, 1]'),
        ('mixup_mode', config.mixup_mode in ('batch', 'pair', 'elem'), "'batch', 'pair' or 'elem'"),
        ('mixup_off_epoch', 0 <= config.mixup_off_epoch <= config.epochs, f'in [0, epochs={config.epochs}]'),
        ('model_ema_decay', 0 < config.model_ema_decay < 1, 'in (0, 1)'),
        ('grad_accum_steps', 1 <= config.grad_accum_steps <= 65536, 'an integer in [1, 65536]'),
        ('lr_base', config.lr_base is None or config.lr_base > 0, '> 0'),
        ('lr_base_size', config.lr_base_size >= 1, '>= 1'),
        ('lr_base_scale', config.lr_base_scale in ('', 'linear', 'sqrt'), "'linear', 'sqrt' or '' (by optimiser)"),
        ('log_interval', config.log_interval >= 0, '>= 0 (0 = epoch lines only)'),
        ('dist_bn', config.dist_bn in ('reduce', 'broadcast', ''), "'reduce', 'broadcast' or ''"),
        ('dataset_size', config.dataset_size is None or config.dataset_size >= 1, '>= 1'),
    ]
    for name, ok, accepted in checks:
        if not ok:
            raise UsageError(f"{flag_name(name)}={getattr(config, name)!r} is out of range: accepted {accepted}")
    for name, low, high in (('scale', 0.0, 1.0), ('ratio', 0.0, float('inf')), ('cutmix_minmax', 0.0, 1.0)):
        value = getattr(config, name)      # finite: timm's crop takes log(ratio), which an infinite one makes nan
        if value is not None and not (len(value) == 2 and all(isinstance(v, (int, float)) for v in value)
                                      and all(math.isfinite(v) for v in value) and low < value[0] <= value[1] <= high):
            span = f"({low:g}, {high:g}]" if high != float('inf') else '(0, inf)'
            raise UsageError(f"{flag_name(name)}={value!r} is out of range: accepted two numbers MIN MAX with "
                             f"MIN <= MAX in {span}")
    if config.aa is not None:
        from ..data.augment import check_auto_augment     # timm's parser, with the flag named
        check_auto_augment(config.aa)
    device = config.device
    if not (device in ('auto', 'cpu', 'cuda') or (device.startswith('cuda:') and device[5:].isdigit())):
        raise UsageError(f"--device={device!r}: accepted auto, cpu, cuda or cuda:N")


def validate_controls(config) -> None:
    """Betas, eps, layer decay, BCE: ranges and what they need; a warm-up given to the constant schedule."""
    if config.sched == 'none' and config.warmup_epochs:     # unset is None: only a given warm-up is refused
        raise UsageError(f"--warmup-epochs={config.warmup_epochs!r} with --sched none: the constant schedule has no "
                         "warm-up (it would be ignored); leave it out or choose a schedule, e.g. --sched cosine")
    betas = config.opt_betas
    if betas is not None and not (len(betas) in (2, 3) and all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                                                and 0 <= b < 1 for b in betas)):
        raise UsageError(f"--opt-betas={betas!r} is out of range: accepted two (or three) numbers in [0, 1), "
                         "e.g. 0.9 0.999")
    if config.opt_eps is not None and not config.opt_eps > 0:
        raise UsageError(f"--opt-eps={config.opt_eps!r} is out of range: accepted > 0")
    if config.layer_decay is not None and not 0 < config.layer_decay <= 1:
        raise UsageError(f"--layer-decay={config.layer_decay!r} is out of range: accepted a factor in (0, 1]")
    if config.bce_target_thresh is not None:
        if not config.bce_loss:
            raise UsageError("--bce-target-thresh needs --bce-loss")
        if not 0 < config.bce_target_thresh < 1:
            raise UsageError(f"--bce-target-thresh={config.bce_target_thresh!r} is out of range: accepted in (0, 1)")
    from ..data.spec import parse_data_spec
    try:
        form = parse_data_spec(config.data)[0]
    except ValueError:
        return                      # the dataset builder names --data
    tokens = form in ('pysource', 'text')
    if config.channels_last and (tokens or _takes_token_ids(config.model)):
        what = f"--data {config.data} is text" if tokens else f"--model {config.model} takes token ids"
        raise UsageError(f"--channels-last: {what}, not images; channels-last is a memory format of image "
                         "batches [B, C, H, W] and convolutions; leave it out")
    if config.bce_loss and (tokens or _takes_token_ids(config.model)):
        what = f"--data {config.data} is text" if tokens else f"--model {config.model} is a language model"
        raise UsageError(f"--bce-loss: {what}; binary cross-entropy is for image classes (one output per "
                         "class and image); leave it out")

def floor_read(values: Dict, key: str) -> bool:
    """Whether the schedule of `values` (TrainConfig.schedule_values) reads the floor `key` ('min_lr' or
    'warmup_lr'): timm's cosine, tanh and poly end at min_lr (step and multistep do not read it), a warm-up of
    warmup_epochs > 0 starts at warmup_lr, and 'none' has no schedule."""
    if values['sched'] == 'none':
        return False
    return values['sched'] in TO_MIN_LR if key == 'min_lr' else values['warmup_epochs'] > 0


def idle_settings(config) -> Dict[str, str]:
    """The settings that act on nothing in this configuration, each with why: the scaling of an --lr-base that is not
    given, the shape of a weight average or of a Mixup that is off, a schedule's parameters where no schedule of the
    run (or of a phase, `phase_settings`) reads them. timm's train.py ignores them silently; `structformer train`
    refuses them where given as flags (train_config), so a run never trains other than the command line reads."""
    idle = {}
    if config.lr_base is None:
        for key in ('lr_base_size', 'lr_base_scale'):
            idle[key] = ("it sizes --lr-base's scaling, and no --lr-base is given: --lr is the peak as it is (timm's "
                         "train.py has a default lr_base of 0.1; there is none here)")
    if not config.model_ema:
        for key in ('model_ema_decay', 'model_ema_warmup'):
            idle[key] = "it shapes the weight average, which only --model-ema keeps"
    if not (config.mixup > 0 or config.cutmix > 0 or config.cutmix_minmax is not None):
        for key in ('mixup_prob', 'mixup_switch_prob', 'mixup_mode', 'mixup_off_epoch'):
            idle[key] = "it shapes Mixup / CutMix, which are off (give --mixup or --cutmix > 0)"
    phases = [config.phase_settings[name] for name in config.phase_settings]
    used = lambda key, default: {p.get(key, default) for p in phases} | {default}    # noqa: E731
    scheds = used('sched', config.sched)
    for key, readers in (('decay_epochs', ('step',)), ('decay_milestones', ('multistep',)),
                         ('decay_rate', ('step', 'multistep', 'poly'))):
        if not scheds & set(readers) and not any(key in p for p in phases):
            idle[key] = f"only --sched {' / '.join(readers)} reads it, and the run's schedule is {config.sched}"
    # the floors: timm's cosine / tanh / poly end at min_lr, step / multistep decay by decay_rate alone (min_lr is
    # not theirs), 'none' has no schedule; warmup_lr starts a warm-up, which --warmup-epochs 0 (or 'none') leaves out,
    # and warmup_prefix places that warm-up before the schedule (timm's scheduler reads it only when there is one)
    schedules = [config.schedule_values(None)] + [config.schedule_values(name) for name in config.phase_settings]
    warm_up = 'a warm-up (--warmup-epochs > 0 and a --sched other than none)'
    for key, needs in (('min_lr', 'a --sched cosine / tanh / poly (step and multistep decay by --decay-rate, none '
                                  'keeps --lr)'), ('warmup_lr', warm_up), ('warmup_prefix', warm_up)):
        floor = 'min_lr' if key == 'min_lr' else 'warmup_lr'
        if not any(floor_read(values, floor) for values in schedules) and not any(key in p for p in phases):
            shape = f"--sched {config.sched}" + (f", --warmup-epochs {config.resolved_warmup_epochs():g}"
                                                 if floor == 'warmup_lr' and config.sched != 'none' else '')
            idle[key] = f"only {needs} reads it, and the run has {shape}"
    # the cooldown holds min_lr: timm's cosine / tanh / poly schedulers take it, its step / multistep ones ignore it
    # (its train.py then trains no extra epochs) and 'none' has no schedule
    if not any(values['sched'] in TO_MIN_LR for values in schedules) and not any('cooldown_epochs' in p
                                                                                 for p in phases):
        idle['cooldown_epochs'] = ("only a --sched cosine / tanh / poly holds the last epochs at --min-lr (timm's "
                                   "step and multistep schedulers take no cooldown, none keeps --lr), and the run "
                                   f"has --sched {config.sched}")
    if config.lr_noise is None and all(p.get('lr_noise') is None for p in phases):
        for key in ('lr_noise_pct', 'lr_noise_std'):
            idle[key] = "it shapes --lr-noise, which is not given"
    from timm.optim import get_optimizer_info         # timm's record of each optimiser's settings
    try:
        momentum = any(get_optimizer_info(opt.lower().replace('lookahead_', '')).has_momentum
                       for opt in used('opt', config.opt))
    except (KeyError, ValueError):
        momentum = True                               # an unknown --opt: validate names it
    if not momentum:
        idle['momentum'] = f"--opt {config.opt} has no momentum (timm's sgd, momentum, rmsprop, lars, ... have)"
    if used('lr_cycle_limit', config.lr_cycle_limit) == {1}:
        for key in ('lr_cycle_mul', 'lr_cycle_decay'):
            idle[key] = "it shapes the restarts of --lr-cycle-limit N > 1, and the run has one cycle"
    return idle


def validate_phase_settings(config) -> None:
    """`phase_settings`: a mapping of phase name to PHASE_SETTING_KEYS, each value checked as the run-wide one."""
    if not isinstance(config.phase_settings, dict):
        raise UsageError(f"phase_settings must be a mapping of phase name to settings; got {config.phase_settings!r}")
    for name, settings in config.phase_settings.items():
        where = f"phase_settings.{name}."
        if not isinstance(settings, dict):
            raise UsageError(f"phase_settings.{name}: expected a mapping of key: value; got {settings!r}")
        unknown = sorted(set(settings) - set(PHASE_SETTING_KEYS))
        if unknown:
            raise UsageError(f"{where}{unknown[0]}: not a phase setting; accepted {', '.join(PHASE_SETTING_KEYS)}")
        hints = typing.get_type_hints(type(config))
        for key, value in settings.items():
            kind, optional = _field_kind(hints[key])
            try:
                settings[key] = None if value is None and optional else _coerce(value, kind)
            except (TypeError, ValueError):
                raise UsageError(f"{where}{key} must be {_KIND_WORDS.get(kind, kind.__name__)}; got {value!r}") from None
        if 'lr' in settings and not settings['lr'] > 0:
            raise UsageError(f"{where}lr={settings['lr']!r} is out of range: accepted > 0")
        if 'weight_decay' in settings and not settings['weight_decay'] >= 0:
            raise UsageError(f"{where}weight_decay={settings['weight_decay']!r} is out of range: accepted >= 0")
        for key in ('warmup_lr', 'min_lr'):
            if settings.get(key) is not None and not settings[key] >= 0:
                raise UsageError(f"{where}{key}={settings[key]!r} is out of range: accepted >= 0")
        if 'opt' in settings:
            try:
                type(config)(opt=settings['opt'])._validate_optimizer()
            except UsageError as e:
                raise UsageError(f"{where}opt: {str(e).split(': ', 1)[-1]}") from None


def _refuse_decay_counted_twice(config) -> None:
    """A phase's `frobenius_decay` / `factor_l2` loss term on factors that --factor-decay already decays: the term came
    on top, silently (train/lowrank_decay.py: the factors must leave the optimiser's weight decay for Frobenius decay)."""
    for i, phase in enumerate(config.phases or []):
        if not isinstance(phase, dict) or not isinstance(phase.get('losses'), dict):
            continue
        name = phase.get('name', f'phase{i}')
        decay = (config.phase_settings or {}).get(name, {}).get('weight_decay', config.weight_decay)
        used = [t for t in ('frobenius_decay', 'factor_l2') if phase['losses'].get(t)]
        if not used or not decay:
            continue
        if config.factor_decay == 'frobenius' and 'frobenius_decay' in used:
            raise UsageError(f"phase {name!r}: loss term frobenius_decay with --factor-decay frobenius, which adds "
                             f"weight_decay ({decay:g}) x frobenius_decay already: it would count twice; drop one")
        if config.factor_decay == 'l2':
            raise UsageError(f"phase {name!r}: loss term {' and '.join(used)} with --factor-decay l2, whose weight "
                             f"decay ({decay:g}) already decays the factors U and V: give --factor-decay frobenius "
                             "(the factors leave the weight decay) or weight_decay 0")


def validate_lowrank(config) -> None:
    """The low-rank settings (--rank and what says how it factorises): ranges, and settings with nothing to act on
    refused rather than ignored."""
    if config.factor_decay not in ('l2', 'frobenius'):
        raise UsageError(f"--factor-decay={config.factor_decay!r}: accepted 'l2' or 'frobenius'")
    _refuse_decay_counted_twice(config)
    inits = ('spectral', 'spectral_ones', 'he')          # structformer.layers.linear.factorized.INITS
    if config.factorize_init not in inits:
        raise UsageError(f"--init={config.factorize_init!r} is not a factor initialisation: accepted {', '.join(inits)}")
    rank = config.factorize_rank
    by_transform = config.factorised_by_transform()
    if rank is None:
        if config.factorize_at is not None:
            raise UsageError(f"--factorize-at={config.factorize_at} needs --rank (an integer count or a fraction "
                             "in (0, 1] of min(m, n))")
        # settings of --rank's factorisation, which nothing else reads: without it they would do nothing
        unused = ([f"--init {config.factorize_init}"] if config.factorize_init != 'spectral' else []) + (
            [f"--factorize-include {' '.join(map(str, config.factorize_include))}"] if config.factorize_include else [])
        if unused:
            raise UsageError(f"{' and '.join(unused)} set(s) how --rank factorises, but no --rank is given: add "
                             "--rank R (an integer count or a fraction in (0, 1] of min(m, n)), or leave "
                             f"{'them' if len(unused) > 1 else 'it'} out (--transform factorize takes init= / include=)")
        # these act on factorised layers, by --rank or by --transform factorize: with neither there are none
        idle = ([f"--factor-decay {config.factor_decay}"] if config.factor_decay != 'l2' else []) + (
            [f"--factorize-lr-scale {config.factorize_lr_scale:g}"] if config.factorize_lr_scale != 1 else [])
        if idle and not by_transform:
            raise UsageError(f"{' and '.join(idle)} act(s) on factorised layers, but the model has none: add "
                             "--rank R (or --transform factorize rank=R), or leave "
                             f"{'them' if len(idle) > 1 else 'it'} out")
        return
    starting = ('--factorize-at' if config.factorize_at else '--initial-checkpoint' if config.initial_checkpoint
                else '--pretrained-path' if config.pretrained_path else '--pretrained' if config.pretrained else None)
    if config.factorize_init == 'he' and starting and not by_transform:
        raise UsageError(f"--init he with {starting}: He init draws the factors afresh and ignores the trained "
                         "weights it would factorise (seed 004 §3.4 factorises them by truncated SVD): give --init "
                         "spectral or spectral_ones, or leave the trained weights out")
    if by_transform and config.factorize_at:
        raise UsageError(f"--factorize-at={config.factorize_at} with --transform factorize: the transform factorises the "
                         "model from the start, so the switch after pre-training would never happen; give "
                         "--rank / --factorize-at for pre-training, or the transform alone")
    if (isinstance(rank, bool) or not isinstance(rank, (int, float))
            or not (rank >= 1 if isinstance(rank, int) else 0 < rank <= 1)):
        raise UsageError(f"--rank={rank!r} is out of range: accepted an integer >= 1 or a fraction in (0, 1]")
    if config.factorize_at is not None and not 0 <= config.factorize_at < config.epochs:
        raise UsageError(f"--factorize-at={config.factorize_at} is out of range: accepted an epoch in "
                         f"[0, epochs={config.epochs})")
    if config.factorize_at and config.avg_last > config.epochs - config.factorize_at:     # was a KeyError at the end
        raise UsageError(f"--avg-last {config.avg_last} averages epochs {config.epochs - config.avg_last + 1}-{config.epochs}, "
                         f"but --factorize-at {config.factorize_at} changes the network's weights into factors after "
                         f"epoch {config.factorize_at}; give --avg-last {config.epochs - config.factorize_at} or less "
                         "(the factorised epochs)")


def language_modelling(config) -> bool:
    """Whether the run trains a language model: text data (`pysource`, `text:`) or a registered language model."""
    from ..data.spec import parse_data_spec
    try:
        if parse_data_spec(config.data)[0] in ('pysource', 'text'):
            return True
    except ValueError:
        pass                        # the dataset builder names --data
    return _takes_token_ids(config.model)


def _takes_token_ids(model: str) -> bool:
    """True for a registered language model (its input is token ids [B, T], not images)."""
    from ..models import list_structformer_language_models
    return model in list_structformer_language_models()
