"""The optimiser and the learning-rate schedule of a run, or of one phase, from timm's factories.

    param_groups      which parameters decay, and each group's lr_scale under --layer-decay (timm's
                      param_groups_weight_decay / param_groups_layer_decay, over the model's group_matcher)
    make_optimizer    timm's create_optimizer_v2 on those groups, with --opt-betas / --opt-eps
    make_scheduler    timm's create_scheduler_v2, stepped per optimiser step (cosine, tanh, poly, step, multistep;
                      'none' is a constant lr), with --cooldown-epochs, a --warmup-prefix warm-up and every
                      restart (--lr-cycle-*) counted inside --epochs; --lr-k-decay, --lr-noise as timm's
    never_decays      a warning where a step / multistep schedule never decays within its epochs
    schedule_shape    a schedule in words (the plan's lr line)

`values` is `TrainConfig.schedule_values()`: the run's settings, or a phase's (`phase_settings`) over them.
The trainer and `--dry-run` both call these, so the plan prints the learning rates training will use.
"""
from typing import Any, Collection, Dict, List, Optional

import torch

from ..errors import UsageError
from .config_checks import CYCLING, TO_MIN_LR

__all__ = ['param_groups', 'make_optimizer', 'make_scheduler', 'scheduled_lr', 'never_decays', 'schedule_shape']


def param_groups(model: torch.nn.Module, config, weight_decay: float, exempt: Collection[str] = ()) -> List[Dict]:
    """The optimiser's parameter groups. Default (timm's): 1-d parameters, biases and `model.no_weight_decay()`
    are not decayed; `decay_everything` decays every parameter (the public CRATE code); `exempt` names leave the
    decay in either case (Frobenius decay's factors). With `layer_decay`, timm's param_groups_layer_decay over the
    model's `group_matcher`: each group carries lr_scale = layer_decay^(last group - its group), which timm's
    schedulers multiply into the lr."""
    from timm.optim._param_groups import param_groups_layer_decay, param_groups_weight_decay
    exempt = set(exempt)
    own = set(model.no_weight_decay()) if hasattr(model, 'no_weight_decay') and not config.decay_everything else set()
    if config.layer_decay is not None:
        if not hasattr(model, 'group_matcher'):
            raise UsageError(f"--layer-decay: --model {config.model} defines no group_matcher (timm's stem / blocks "
                             "/ head grouping), so it has no layers to decay the lr over; leave --layer-decay out")
        return param_groups_layer_decay(model, weight_decay, no_weight_decay_list=own | exempt,
                                        weight_decay_exclude_1d=not config.decay_everything,
                                        layer_decay=config.layer_decay)
    if config.decay_everything:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{'params': [p for n, p in named if n not in exempt], 'weight_decay': weight_decay},
                  {'params': [p for n, p in named if n in exempt], 'weight_decay': 0.0}]
        return [g for g in groups if g['params']]
    return param_groups_weight_decay(model, weight_decay, no_weight_decay_list=own | exempt)


def make_optimizer(model: torch.nn.Module, config, values: Dict[str, Any], lr: float,
                   exempt: Collection[str] = ()) -> torch.optim.Optimizer:
    """timm's create_optimizer_v2 with `values`' optimiser and weight decay at peak `lr`, over the parameters that
    require a gradient now, with --opt-betas / --opt-eps passed to the optimiser as timm's train.py does."""
    from timm.optim import create_optimizer_v2
    groups = param_groups(model, config, values['weight_decay'], exempt)
    extra = {}
    if config.opt_betas is not None:
        extra['betas'] = tuple(config.opt_betas)
    if config.opt_eps is not None:
        extra['eps'] = config.opt_eps
    try:
        optimizer = create_optimizer_v2(groups, opt=values['opt'], lr=lr, weight_decay=values['weight_decay'],
                                        momentum=values['momentum'], **extra)
    except TypeError as e:                # e.g. --opt-betas for an optimiser without betas
        given = ' / '.join(f"--opt-{k}" for k in extra) or 'its settings'
        raise UsageError(f"--opt {values['opt']} does not take {given} ({str(e).splitlines()[0]})") from None
    except ValueError as e:               # torch's own range checks of the optimiser's settings
        message = str(e).splitlines()[0]
        if 'Nesterov' in message:         # timm's sgd / nesterov are Nesterov SGD, which needs a momentum
            raise UsageError(f"--momentum {values['momentum']:g} with --opt {values['opt']}: timm's {values['opt']} "
                             "is Nesterov SGD, which needs --momentum > 0; for SGD without momentum give --opt "
                             "momentum --momentum 0") from None
        raise UsageError(f"--opt {values['opt']}: {message}") from None
    ignored = [f"--opt-{k}" for k in extra if k not in optimizer.defaults]     # timm drops what SGD has no use for
    if ignored:
        raise UsageError(f"--opt {values['opt']} does not take {' / '.join(ignored)} ({type(optimizer).__name__} has "
                         "no such setting); leave it out or choose an optimiser that has it (adamw, lamb, ...)")
    if values['sched'] == 'none':       # no scheduler to apply the layer scales: apply them once
        for group in optimizer.param_groups:
            group['lr'] = lr * group.get('lr_scale', 1.0)
    return optimizer


def make_scheduler(optimizer: torch.optim.Optimizer, values: Dict[str, Any], steps_per_epoch: int):
    """timm's create_scheduler_v2 for `values` (None for sched 'none': the optimiser's lr stays), stepped per
    optimiser step. --cooldown-epochs C holds the last C of `epochs` at min_lr: the schedule proper runs over
    epochs - C (timm's train.py runs --epochs, then C more; here `epochs` counts them)."""
    from timm.scheduler import create_scheduler_v2
    if values['sched'] == 'none':
        return None
    cooldown = values['cooldown_epochs']
    # with --warmup-prefix timm runs the schedule proper after the warm-up: it gets the epochs left after it
    prefix = values['warmup_epochs'] if values['warmup_prefix'] else 0
    # restarts: the schedule's epochs hold every cycle, the first of length T with T·Σ mul^i = those epochs (timm's
    # train.py runs --epochs per cycle and adds them; here --epochs counts them all, as it counts the cooldown)
    cycles = values['lr_cycle_limit'] if values['sched'] in CYCLING else 1
    first_cycle = (values['epochs'] - cooldown - prefix) / sum(values['lr_cycle_mul'] ** i for i in range(cycles))
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=values['sched'], num_epochs=first_cycle,
        decay_epochs=values['decay_epochs'], decay_milestones=list(values['decay_milestones']), cooldown_epochs=cooldown,
        decay_rate=values['decay_rate'], min_lr=values['min_lr'], warmup_lr=values['warmup_lr'],
        warmup_epochs=values['warmup_epochs'], warmup_prefix=values['warmup_prefix'], step_on_epochs=False,
        updates_per_epoch=steps_per_epoch, cycle_mul=values['lr_cycle_mul'], cycle_decay=values['lr_cycle_decay'],
        cycle_limit=cycles, k_decay=values['lr_k_decay'], noise=values['lr_noise'], noise_pct=values['lr_noise_pct'],
        noise_std=values['lr_noise_std'], noise_seed=values['seed'])
    return scheduler


def scheduled_lr(values: Dict[str, Any], lr: float, steps_per_epoch: int, steps: List[int]) -> List[float]:
    """The lr of `make_scheduler` after each of `steps` optimiser steps (of this schedule), on a dummy optimiser:
    what `--dry-run` prints."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = make_scheduler(optimizer, values, steps_per_epoch)
    out = []
    for step in steps:
        if scheduler is not None:
            scheduler.step_update(num_updates=step)
        out.append(optimizer.param_groups[0]['lr'])
    return out


def never_decays(values: Dict[str, Any], steps_per_epoch: Optional[int], where: str = '--') -> Optional[str]:
    """A warning where a step / multistep schedule (`values`, as `make_scheduler` takes them) never decays within its
    epochs, else None: timm's train.py says nothing, and its defaults (--decay-epochs 90, --decay-milestones 90 180
    270) are ImageNet's, so a short run trains at the peak throughout. Judged as timm's scheduler steps: an optimiser
    step uses the lr of index t = steps made so far (0 .. total - 1); the warm-up covers t < warmup_t; step decays
    at t - prefix >= decay_t, multistep at t - prefix + 1 >= a milestone (timm's convention), in optimiser steps
    (epochs x steps_per_epoch, timm's own products). Without steps_per_epoch the judgement is on epochs alone.
    `where` prefixes the setting's name (`--`, or `phase_settings.NAME.`)."""
    sched = values['sched']
    if sched not in ('step', 'multistep'):
        return None
    per = steps_per_epoch or 10 ** 6        # unknown: a fine grain, so the test is on epochs
    warm = values['warmup_epochs'] * per
    prefix = warm if values['warmup_prefix'] else 0
    last = values['epochs'] * per - 1
    def named(key: str) -> str:
        return f"--{key.replace('_', '-')}" if where == '--' else f"{where}{key}"
    if sched == 'step':
        first = max(values['decay_epochs'] * per + prefix, warm)
        setting = f"{named('decay_epochs')} {values['decay_epochs']:g}"
    else:
        milestones = [m * per for m in values['decay_milestones']]
        first = max(min(milestones) + prefix - 1, warm) if milestones else float('inf')
        setting = f"{named('decay_milestones')} {' '.join(f'{m:g}' for m in values['decay_milestones'])}"
    if first <= last:
        return None
    after = ' (after the warm-up prefix)' if prefix else ''
    return (f"warning: {setting} with {named('sched')} {sched}: the lr never decays in this "
            f"{values['epochs']:g}-epoch run, its first decay{after} falls past the last optimiser step; give a smaller "
            f"{named('decay_epochs' if sched == 'step' else 'decay_milestones')} for it to decay")


def schedule_shape(values: dict) -> str:
    """The schedule of `values` (TrainConfig.schedule_values) in words: its name, warm-up, and what it decays to."""
    sched = values['sched']
    shape = sched + (f", warm-up {values['warmup_epochs']:g} epochs from {values['warmup_lr']:.3g}"
                     if sched != 'none' else '')
    floor = f", floor {values['min_lr']:.3g}"
    shape += {'cosine': floor, 'tanh': floor, 'poly': f", power {values['decay_rate']:g}{floor}",
              'step': f", x{values['decay_rate']:g} every {values['decay_epochs']:g} epochs",
              'multistep': f", x{values['decay_rate']:g} at epochs {values['decay_milestones']}"}.get(sched, '')
    if sched in CYCLING and values['lr_cycle_limit'] > 1:
        shape += (f", {values['lr_cycle_limit']} cycles (each x{values['lr_cycle_mul']:g} as long, its peak "
                  f"x{values['lr_cycle_decay']:g})")
    if values['lr_k_decay'] != 1:
        shape += f", k-decay {values['lr_k_decay']:g}"
    noise = values['lr_noise']
    if noise is not None:
        span = f"from {noise[0]:g} of a cycle on" if len(noise) == 1 else f"over {noise[0]:g}-{noise[1]:g} of a cycle"
        shape += (f", lr noise {span} (std {values['lr_noise_std']:g}, |noise| < {values['lr_noise_pct']:g} of the "
                  f"lr, seed {values['seed']})")
    if values['cooldown_epochs'] and values['sched'] in TO_MIN_LR:      # step / multistep / none take no cooldown
        shape += f", the last {values['cooldown_epochs']} epochs at {values['min_lr']:.3g} (cooldown)"
    return shape


def lr_at(optimizer: Optional[torch.optim.Optimizer]) -> float:
    """The lr of the optimiser's unscaled group (lr_scale 1: the head under --layer-decay), for logs."""
    groups = optimizer.param_groups
    return max(groups, key=lambda g: g.get('lr_scale', 1.0))['lr']
