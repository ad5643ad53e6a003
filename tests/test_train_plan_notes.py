"""What `structformer train` says about a run's schedule and batch before it trains (the plan of --dry-run and the
lines at the start of a run): a step / multistep schedule that never decays within the run, the step at which the
warm-up ends, an optimiser step larger than the training set. Each is checked against timm's scheduler as the
trainer calls it (train/optim.py), not against a copy of the arithmetic."""
import pytest

from structformer.cli import main
from structformer.train import TrainConfig
from structformer.train.optim import scheduled_lr

DIGITS = ['train', '--model', 'crate_digits', '--data', 'digits']


def _decays(values, steps_per_epoch):
    """Whether timm's scheduler (as the trainer builds it) gives any optimiser step of the run a decayed lr: the
    decay rate 0.5 puts every decayed lr at or below half the peak, the warm-up (from 0.9 of the peak) above it."""
    total = values['epochs'] * steps_per_epoch
    lrs = scheduled_lr(values, 1.0, steps_per_epoch, list(range(total)))    # the lr each step 1..total trains at
    return any(lr <= 0.5 for lr in lrs)


@pytest.mark.parametrize('sched, setting', [
    ('step', dict(decay_epochs=90)), ('step', dict(decay_epochs=2)), ('step', dict(decay_epochs=1.95)),
    ('step', dict(decay_epochs=1.5)), ('step', dict(decay_epochs=1)),
    ('multistep', dict(decay_milestones=[90, 180, 270])), ('multistep', dict(decay_milestones=[2])),
    ('multistep', dict(decay_milestones=[3, 4])), ('multistep', dict(decay_milestones=[1, 5]))])
@pytest.mark.parametrize('warmup, prefix', [(0, False), (0.5, False), (0.5, True), (1.5, False)])
@pytest.mark.parametrize('steps', [1, 10])
def test_never_decays_is_what_timms_scheduler_does(sched, setting, warmup, prefix, steps):
    from structformer.train.optim import never_decays
    values = TrainConfig(epochs=2, sched=sched, decay_rate=0.5, warmup_epochs=warmup, warmup_prefix=prefix,
                         lr=1.0, warmup_lr=0.9, **setting).schedule_values()
    assert (never_decays(values, steps) is None) == _decays(values, steps), (values, steps)


def test_the_plan_warns_when_a_step_schedule_never_decays(capsys):
    """timm's --decay-epochs 90 (ImageNet's) in a 2-epoch run: the plan says the lr never decays, naming the flag."""
    assert main([*DIGITS, '--epochs', '2', '--sched', 'step', '--dry-run']) == 0
    out = capsys.readouterr().out
    assert ("warning: --decay-epochs 90 with --sched step: the lr never decays in this 2-epoch run" in out)
    assert main([*DIGITS, '--epochs', '2', '--sched', 'step', '--decay-epochs', '1', '--dry-run']) == 0
    assert 'never decays' not in capsys.readouterr().out
    assert main([*DIGITS, '--epochs', '2', '--sched', 'multistep', '--decay-milestones', '3', '5', '--dry-run']) == 0
    assert ("warning: --decay-milestones 3 5 with --sched multistep: the lr never decays in this 2-epoch run"
            in capsys.readouterr().out)


def test_a_phases_schedule_that_never_decays_is_named_by_its_phase_setting(capsys, tmp_path):
    config = tmp_path / 'c.yaml'
    config.write_text("phases: [{name: a, epochs: 1}, {name: b, epochs: 2}]\n"
                      "phase_settings: {a: {sched: step, decay_epochs: 5}, b: {sched: step, decay_epochs: 1}}\n")
    assert main([*DIGITS, '-c', str(config), '--epochs', '3', '--dry-run']) == 0
    out = capsys.readouterr().out
    assert "warning: phase_settings.a.decay_epochs 5 with phase_settings.a.sched step: the lr never decays" in out
    assert 'phase_settings.b.' not in out


def test_a_run_whose_schedule_never_decays_says_so_at_its_start(tmp_path, capsys):
    assert main([*DIGITS, '--epochs', '1', '--sched', 'multistep', '--limit-train-batches', '1', '--no-progress',
                 '--output', str(tmp_path / 'run')]) == 0
    err = capsys.readouterr().err
    assert ("warning: --decay-milestones 90 180 270 with --sched multistep: the lr never decays in this 1-epoch "
            "run") in err


def test_a_step_larger_than_the_training_set_is_noted_with_timms_arithmetic_kept(capsys):
    """digits trains on 1,437 images: 512 x 8 accumulated is 4,096 a step as timm counts it (and --lr-base scales
    by it), but each epoch makes one step of the 3 batches it has; the plan says both."""
    assert main([*DIGITS, '-b', '512', '--grad-accum-steps', '8', '--lr-base', '1e-3', '--dry-run']) == 0
    out = capsys.readouterr().out
    assert '= 4,096 per optimiser step' in out and 'lr_base 0.001 x (4,096 / 256)' in out
    assert "steps         1 optimiser steps per epoch (3 batches per process)" in out
    assert ("  note: one optimiser step of 4,096 images spans more than the 1,437 one epoch holds: each epoch makes "
            "1 optimiser step of what it has (3 batches per process), while the batch above and --lr-base scaling "
            "count 4,096, as timm's train.py does") in out
    assert main([*DIGITS, '-b', '512', '--grad-accum-steps', '2', '--dry-run']) == 0       # 1,024: no note
    assert 'spans more than' not in capsys.readouterr().out


@pytest.mark.parametrize('warmup', [0.25, 0.14, 0.3, 0.2])
def test_the_plans_end_of_warm_up_is_the_first_step_at_the_peak(warmup, capsys):
    """-b 144 makes 10 steps an epoch (1,437 images); a step schedule that does not decay in the run holds the peak
    right after the warm-up, so the printed step is the first whose lr is the peak (timm's warm-up covers
    t < warmup_epochs x steps: 2.5 steps end at step 3, where rounding said 2)."""
    assert main([*DIGITS, '-b', '144', '--epochs', '2', '--sched', 'step', '--decay-epochs', '5', '--lr', '0.1',
                 '--warmup-lr', '0', '--warmup-epochs', str(warmup), '--dry-run']) == 0
    out = capsys.readouterr().out
    assert 'steps         10 optimiser steps per epoch' in out
    end = int(out.split('end of warm-up (step ')[1].split(')')[0])
    values = TrainConfig(model='crate_digits', data='digits', epochs=2, sched='step', decay_epochs=5, lr=0.1,
                         warmup_lr=0.0, warmup_epochs=warmup).schedule_values()
    before, at = scheduled_lr(values, 0.1, 10, [end - 1, end])
    assert before < 0.1 and at == 0.1


def test_the_plan_refuses_a_batch_that_leaves_no_training_batch_as_training_does(tmp_path, capsys):
    """--mixup drops an epoch's last, smaller batch: -b 2048 over 1,437 images leaves none, which training refuses in
    one line before anything is written; the plan printed '0 optimiser steps per epoch' and exit 0."""
    argv = [*DIGITS, '-b', '2048', '--mixup', '0.8', '--epochs', '1', '--no-progress', '--output', str(tmp_path / 'r')]
    assert main(argv) == 2
    refused = capsys.readouterr().err
    assert '-b/--batch-size 2048 leaves no training batch: this process has 1437 training samples and --mixup' \
           in refused and not (tmp_path / 'r').exists()
    assert main([*argv, '--dry-run']) == 2
    out, err = capsys.readouterr()
    assert err == refused and 'optimiser steps per epoch' not in out
