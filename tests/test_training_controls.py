"""The training controls of timm's train.py (issue 42): step / multistep schedules, cooldown, warm-up prefix, layer
decay, betas / eps, activation checkpointing, SyncBatchNorm, BCE, --keep-best, --avg-last; per-phase optimisers
and schedules (phase_settings); --amp at an op without a low-precision kernel; `eval` in the run's precision;
torchvision's RandAugment policy (--aa tv-rand-...).

Each control is checked against timm's (or torchvision's) own implementation called directly: the schedules step
by step against timm's create_scheduler_v2 as timm's train.py calls it, the layer-decay groups against timm's
param_groups_layer_decay, the loss against timm's BinaryCrossEntropy.
"""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from structformer.cli import main
from structformer.errors import UsageError
from structformer.train import TrainConfig, Trainer, train


def _tiny(tmp_path, **overrides):
    """crate_digits on digits, one optimiser step per epoch (so a per-step and a per-epoch schedule coincide)."""
    values = dict(model='crate_digits', data='digits', epochs=4, batch_size=32, lr=1e-2, warmup_epochs=0,
                  limit_train_batches=1, log_interval=0, output=str(tmp_path / 'run'))
    values.update(overrides)
    return TrainConfig(**values)


def _timm_lrs(peak, steps, **kwargs):
    """The lr after each of `steps` updates of timm's create_scheduler_v2 on its own SGD, one update an epoch."""
    from timm.scheduler import create_scheduler_v2
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    scheduler, _ = create_scheduler_v2(optimizer, step_on_epochs=False, updates_per_epoch=1, **kwargs)
    out = []
    for step in range(1, steps + 1):
        scheduler.step_update(num_updates=step)
        out.append(optimizer.param_groups[0]['lr'])
    return out


# (our configuration, timm's create_scheduler_v2 arguments as timm's train.py passes them for the same run: its
# --epochs E then --cooldown-epochs C runs E + C epochs, here --epochs E + C with C of them the cooldown)
SCHEDULES = {
    'step': (dict(epochs=7, sched='step', decay_epochs=2, decay_rate=0.5, warmup_epochs=1, warmup_lr=1e-3),
             dict(sched='step', num_epochs=7, decay_epochs=2, decay_rate=0.5, warmup_epochs=1, warmup_lr=1e-3)),
    'multistep': (dict(epochs=7, sched='multistep', decay_milestones=[2, 5], decay_rate=0.2),
                  dict(sched='multistep', num_epochs=7, decay_milestones=[2, 5], decay_rate=0.2, warmup_epochs=0)),
    'cosine-cooldown': (dict(epochs=8, cooldown_epochs=3, min_lr=1e-4),
                        dict(sched='cosine', num_epochs=5, cooldown_epochs=3, min_lr=1e-4, warmup_epochs=0)),
    'cosine-warmup-prefix': (dict(epochs=7, warmup_epochs=2, warmup_prefix=True, warmup_lr=0.0, min_lr=1e-3),
                             dict(sched='cosine', num_epochs=5, warmup_epochs=2, warmup_prefix=True, warmup_lr=0.0,
                                  min_lr=1e-3)),
    'tanh-warmup-cooldown': (dict(epochs=9, sched='tanh', warmup_epochs=2, warmup_lr=1e-3, cooldown_epochs=2,
                                  min_lr=1e-4),
                             dict(sched='tanh', num_epochs=7, warmup_epochs=2, warmup_lr=1e-3, cooldown_epochs=2,
                                  min_lr=1e-4)),
    # poly's power is --decay-rate (here 2, above the (0, 1] a step factor may take)
    'poly-power': (dict(epochs=7, sched='poly', decay_rate=2.0, min_lr=1e-4, warmup_epochs=1, warmup_lr=1e-3),
                   dict(sched='poly', num_epochs=7, decay_rate=2.0, min_lr=1e-4, warmup_epochs=1, warmup_lr=1e-3)),
    # restarts: our --epochs holds every cycle (and the cooldown); timm's num_epochs is one cycle (its train.py runs
    # --epochs per cycle): 2 equal cycles of 4 in 8 + 1 epochs, then cycles of 3 and 6 (mul 2) in 9
    'cosine-two-cycles': (dict(epochs=9, lr_cycle_limit=2, lr_cycle_decay=0.5, cooldown_epochs=1, min_lr=1e-4),
                          dict(sched='cosine', num_epochs=4, cycle_limit=2, cycle_decay=0.5, cooldown_epochs=1,
                               min_lr=1e-4, warmup_epochs=0)),
    'tanh-growing-cycles': (dict(epochs=9, sched='tanh', lr_cycle_limit=2, lr_cycle_mul=2.0, lr_cycle_decay=0.8,
                                 min_lr=1e-4),
                            dict(sched='tanh', num_epochs=3, cycle_limit=2, cycle_mul=2.0, cycle_decay=0.8,
                                 min_lr=1e-4, warmup_epochs=0)),
    'poly-k-decay': (dict(epochs=6, sched='poly', decay_rate=0.5, lr_k_decay=2.0, min_lr=1e-4),
                     dict(sched='poly', num_epochs=6, decay_rate=0.5, k_decay=2.0, min_lr=1e-4, warmup_epochs=0)),
    # the noise's seed is the run's --seed, as timm's train.py passes it
    'cosine-noise': (dict(epochs=8, seed=3, lr_noise=[0.25, 0.75], lr_noise_pct=0.4, lr_noise_std=0.5, min_lr=1e-4),
                     dict(sched='cosine', num_epochs=8, noise=[0.25, 0.75], noise_pct=0.4, noise_std=0.5,
                          noise_seed=3, min_lr=1e-4, warmup_epochs=0)),
}


def test_every_accepted_schedule_is_a_timm_schedule_and_the_cli_offers_it():
    """Each name the config accepts builds a timm scheduler (timm returns None for a name it does not know, which
    would silently train at a constant lr), and `--sched`'s choices are exactly those names."""
    from timm.scheduler import create_scheduler_v2

    from structformer.cli import build_parser
    from structformer.train.config_checks import SCHEDULES
    for name in SCHEDULES:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler, _ = create_scheduler_v2(optimizer, sched=name, num_epochs=4, step_on_epochs=False,
                                           updates_per_epoch=2)
        assert (scheduler is None) == (name == 'none'), name
    train_parser = build_parser()._subparsers._group_actions[0].choices['train']
    sched = next(a for a in train_parser._actions if '--sched' in a.option_strings)
    assert tuple(sched.choices) == SCHEDULES


def test_a_constant_schedule_run_extends_on_resume(tmp_path):
    """--sched none has no warm-up, so a given one is refused; --resume --epochs N of such a run must not pin the
    warm-up fitted to the old length (it pins it for the other schedules)."""
    out = tmp_path / 'run'
    common = ['--data', 'digits', '--limit-train-batches', '1', '--no-progress', '--output', str(out)]
    assert main(['train', '--sched', 'none', '--epochs', '1', *common]) == 0
    assert main(['train', '--resume', '--epochs', '2', *common]) == 0
    assert [json.loads(line)['epoch'] for line in (out / 'metrics.jsonl').read_text().splitlines()] == [1, 2]


def test_noise_moves_the_lr_only_inside_its_span(tmp_path):
    """--lr-noise 0.25 0.75 over 8 epochs: the lr equals the noiseless cosine outside epochs 2-5 and not inside."""
    from structformer.train.optim import scheduled_lr
    values = TrainConfig(**dict(vars(_tiny(tmp_path, epochs=8)), lr_noise=[0.25, 0.75])).schedule_values()
    plain = scheduled_lr(dict(values, lr_noise=None), 1e-2, 1, list(range(1, 9)))
    noisy = scheduled_lr(values, 1e-2, 1, list(range(1, 9)))
    moved = [a != b for a, b in zip(plain, noisy)]
    assert moved == [False, True, True, True, True, False, False, False]


def test_the_plan_names_a_poly_schedule_with_its_power(capsys):
    assert main(['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '3', '--sched', 'poly',
                 '--decay-rate', '2', '--min-lr', '1e-5', '--dry-run']) == 0
    assert 'poly, warm-up 0.3 epochs from 1e-06, power 2, floor 1e-05' in capsys.readouterr().out
    assert main(['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '6', '--lr-cycle-limit', '3',
                 '--lr-k-decay', '2', '--lr-noise', '0.5', '--seed', '4', '--dry-run']) == 0
    assert ('cosine, warm-up 0.6 epochs from 1e-06, floor 1e-06, 3 cycles (each x1 as long, its peak x0.5), '
            'k-decay 2, lr noise from 0.5 of a cycle on (std 1, |noise| < 0.67 of the lr, seed 4)') in capsys.readouterr().out


@pytest.mark.parametrize('name', list(SCHEDULES))
def test_schedules_equal_timms_step_by_step(name, tmp_path):
    ours, theirs = SCHEDULES[name]
    result = train(_tiny(tmp_path, **ours), progress=False)
    trained = [r['lr'] for r in result.history]
    assert len(trained) == ours['epochs']
    assert trained == pytest.approx(_timm_lrs(1e-2, ours['epochs'], **theirs), rel=1e-12, abs=0)
    assert len(set(trained)) > 1                             # the schedule moved the lr


def test_layer_decay_groups_are_timms(tmp_path):
    """--layer-decay 0.7: the optimiser's groups are timm's param_groups_layer_decay over the model's group_matcher
    (same parameters, weight decay and lr_scale per group), and after a step each group's lr is peak x lr_scale."""
    from timm.optim._param_groups import param_groups_layer_decay
    trainer = Trainer(_tiny(tmp_path, layer_decay=0.7, epochs=2, sched='cosine', warmup_epochs=0))
    trainer._build()
    model = trainer.model
    theirs = param_groups_layer_decay(model, weight_decay=0.05, no_weight_decay_list=model.no_weight_decay(),
                                      layer_decay=0.7)
    ours = trainer.optimizer.param_groups
    assert len(ours) == len(theirs) > 3
    for mine, timms in zip(ours, theirs):
        assert [id(p) for p in mine['params']] == [id(p) for p in timms['params']]
        assert mine['lr_scale'] == timms['lr_scale'] and mine['weight_decay'] == timms['weight_decay']
    scales = sorted({g['lr_scale'] for g in ours})
    assert scales[-1] == 1.0 and scales[0] == pytest.approx(0.7 ** (len(scales) - 1))
    trainer.scheduler.step_update(num_updates=0)
    for group in ours:
        assert group['lr'] == pytest.approx(1e-2 * group['lr_scale'])


def test_betas_and_eps_reach_the_optimiser(tmp_path):
    trainer = Trainer(_tiny(tmp_path, opt_betas=[0.8, 0.95], opt_eps=1e-6))
    trainer._build()
    assert trainer.optimizer.defaults['betas'] == (0.8, 0.95) and trainer.optimizer.defaults['eps'] == 1e-6
    with pytest.raises(UsageError, match='--opt sgd does not take --opt-betas'):
        Trainer(_tiny(tmp_path, opt='sgd', opt_betas=[0.9, 0.99]))._build()
    # timm's sgd is Nesterov SGD: torch refuses it a zero momentum (a ValueError traceback before)
    with pytest.raises(UsageError, match="--momentum 0 with --opt sgd: timm's sgd is Nesterov SGD.*--opt momentum"):
        Trainer(_tiny(tmp_path, opt='sgd', momentum=0.0))._build()


def test_grad_checkpointing_trains_the_same_weights(tmp_path):
    """Activation checkpointing recomputes the blocks in the backward: the same step, to float32 rounding."""
    plain = train(_tiny(tmp_path / 'a', epochs=1), progress=False)
    checkpointed = train(_tiny(tmp_path / 'b', epochs=1, grad_checkpointing=True), progress=False)
    a = load_file(str(plain.last_checkpoint / 'model.safetensors'))
    b = load_file(str(checkpointed.last_checkpoint / 'model.safetensors'))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)
    trainer = Trainer(_tiny(tmp_path / 'c', grad_checkpointing=True))
    trainer._build()
    assert trainer.model.grad_checkpointing is True


def test_sync_bn_with_one_process_says_there_is_nothing_to_sync(tmp_path, capsys):
    trainer = Trainer(_tiny(tmp_path, model='wrn_10_2_digits', sync_bn=True))
    trainer._build()
    assert 'nothing to synchronise' in capsys.readouterr().out
    assert not any(isinstance(m, torch.nn.SyncBatchNorm) for m in trainer.model.modules())


def test_bce_loss_is_timms_binary_cross_entropy(tmp_path):
    """--bce-loss: the 'ce' term is timm's BinaryCrossEntropy (smoothing its own without Mixup, none with it, where
    Mixup folds it into the targets); the first step's loss equals timm's loss of the same logits."""
    from timm.loss import BinaryCrossEntropy

    from structformer.train.phases import LossContext, cross_entropy_term
    logits, targets = torch.randn(6, 10, dtype=torch.float64), torch.tensor([0, 3, 9, 2, 2, 7])
    ours = cross_entropy_term(LossContext(None, None, targets, logits, 0.1,
                                          {'bce': BinaryCrossEntropy(smoothing=0.1, target_threshold=0.2)}))
    assert ours == BinaryCrossEntropy(smoothing=0.1, target_threshold=0.2)(logits, targets)
    trainer = Trainer(_tiny(tmp_path, bce_loss=True, label_smoothing=0.1, bce_target_thresh=0.3))
    trainer._build()
    assert isinstance(trainer.bce, BinaryCrossEntropy)
    assert (trainer.bce.smoothing, trainer.bce.target_threshold) == (0.1, 0.3)
    trainer = Trainer(_tiny(tmp_path, bce_loss=True, label_smoothing=0.1, mixup=0.8))
    trainer._build()
    assert trainer.bce.smoothing == 0.0
    with pytest.raises(UsageError, match='--bce-loss'):
        TrainConfig(model='gpt2_byte_tiny', data='pysource', bce_loss=True).validate()


def test_keep_best_keeps_the_best_epoch_whatever_keep_last_says(tmp_path):
    """_prune with --keep-last 1: epoch 0 and the newest stay; with --keep-best also the best val top-1 so far."""
    from structformer.train.save_resume import CheckpointGlue

    def prune(keep_best):
        run = tmp_path / f'run_{keep_best}'
        for e in range(5):
            (run / 'checkpoints' / f'epoch_{e:04d}').mkdir(parents=True)
        (run / 'metrics.jsonl').write_text(''.join(json.dumps({'epoch': e, 'val_top1': top1}) + '\n'
                                                   for e, top1 in ((1, 50.0), (2, 90.0), (3, 70.0))))
        glue = CheckpointGlue()
        glue.config = TrainConfig(keep_last=1, keep_best=keep_best)
        glue.output, glue.ckpt_dir = run, run / 'checkpoints'
        glue._prune(4, {'epoch': 4, 'val_top1': 60.0})
        return sorted(p.name for p in glue.ckpt_dir.iterdir())
    assert prune(True) == ['epoch_0000', 'epoch_0002', 'epoch_0004']
    assert prune(False) == ['epoch_0000', 'epoch_0004']


def test_avg_last_averages_the_last_epochs(tmp_path, capsys):
    """--avg-last 2: checkpoints/average_last_2 holds the mean of epochs 2 and 3 (timm's avg_checkpoints: float64
    sum, then the tensor's dtype), and its metrics in summary.json are what `structformer eval` gives it."""
    result = train(_tiny(tmp_path, epochs=3, keep_last=2, avg_last=2), progress=False)
    ckpt = Path(result.output) / 'checkpoints'
    two, three = (load_file(str(ckpt / f'epoch_{e:04d}' / 'model.safetensors')) for e in (2, 3))
    average = load_file(str(ckpt / 'average_last_2' / 'model.safetensors'))
    assert not torch.equal(two['head.weight'], three['head.weight'])
    for key in average:
        expected = ((two[key].double() + three[key].double()) / 2).to(two[key].dtype) \
            if two[key].is_floating_point() else three[key]
        assert torch.equal(average[key], expected), key
    summary = json.loads((Path(result.output) / 'summary.json').read_text())
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(ckpt / 'average_last_2'), '--json']) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored['top1'] == summary['average_last_2_val_top1'] and scored['loss'] == summary['average_last_2_val_loss']
    assert scored['averaged_epochs'] == [2, 3] and scored['model'] == 'crate_digits'   # not "epoch 3"'s weights
    assert main(['eval', '--checkpoint', str(ckpt / 'average_last_2')]) == 0
    assert ' average of epochs 2-3 on digits ' in capsys.readouterr().out
    assert main(['eval', '--checkpoint', str(ckpt / 'average_last_2'), '--ema']) == 2   # not "trained without"
    assert 'is the --avg-last average of epochs 2-3' in capsys.readouterr().err
    with pytest.raises(UsageError, match='--keep-last'):
        TrainConfig(avg_last=3, keep_last=2).validate()


def test_avg_last_over_checkpoints_of_two_networks_says_so_instead_of_a_key_error(tmp_path, capsys):
    """The last N checkpoints hold different networks (factorised between them, or a run resumed with another
    --factorize-at): a note and no average, where it ended the run with KeyError 'blocks.0.attn.qkv.U'.
    (The config refuses --avg-last across --factorize-at up front; this is the end's own guard.)"""
    result = train(_tiny(tmp_path, epochs=3, keep_last=2), progress=False)
    ckpt = Path(result.output) / 'checkpoints'
    weights = load_file(str(ckpt / 'epoch_0002' / 'model.safetensors'))
    weights['extra.U'] = torch.zeros(2)
    from safetensors.torch import save_file
    save_file(weights, str(ckpt / 'epoch_0002' / 'model.safetensors'))
    trainer = Trainer(_tiny(tmp_path, epochs=3, keep_last=2, avg_last=2), resume=True)
    trainer._build()
    capsys.readouterr()
    assert trainer._average_last() == {}
    assert 'do not hold the same network' in capsys.readouterr().out
    assert not (ckpt / 'average_last_2').exists()


# ------------------------------------------------------------------------------------- phase settings
PHASES = [{'name': 'a', 'epochs': 3}, {'name': 'b', 'epochs': 3}]
PHASE_SETTINGS = {'a': {'lr': 2e-2, 'warmup_epochs': 1, 'warmup_lr': 0.0, 'warmup_prefix': True, 'min_lr': 1e-2},
                  'b': {'lr': 5e-3, 'sched': 'step', 'decay_epochs': 1, 'decay_rate': 0.5, 'weight_decay': 0.0}}


def test_each_phase_has_its_own_optimiser_and_timms_schedule(tmp_path):
    """Two phases, each a fresh optimiser and its own timm schedule over its own epochs (Sparsifiner's public
    stages): the lr of every step equals timm's create_scheduler_v2 for that phase, counted from its start."""
    seen = []
    result = train(_tiny(tmp_path, epochs=6, phases=PHASES, phase_settings=PHASE_SETTINGS), progress=False,
                   callbacks=[lambda trainer, epoch, record: seen.append(trainer.optimizer)])
    lrs = [r['lr'] for r in result.history]
    first = _timm_lrs(2e-2, 3, sched='cosine', num_epochs=2, warmup_epochs=1, warmup_lr=0.0, warmup_prefix=True,
                      min_lr=1e-2)
    second = _timm_lrs(5e-3, 3, sched='step', num_epochs=3, decay_epochs=1, decay_rate=0.5, warmup_epochs=0)
    assert lrs == pytest.approx(first + second, rel=1e-12, abs=0)
    assert seen[0] is seen[2] and seen[3] is not seen[2] and seen[3] is seen[5]    # a fresh optimiser for phase b
    assert max(g['weight_decay'] for g in seen[0].param_groups) == 0.05            # the run's decay in phase a,
    assert all(g['weight_decay'] == 0.0 for g in seen[3].param_groups)              # phase b's own (0)


def test_resume_at_a_phase_boundary_equals_the_uninterrupted_run(tmp_path):
    """Stopped after phase a's last epoch (its checkpoint holds phase a's optimiser) and resumed: phase b starts
    its fresh optimiser as the uninterrupted run does; and stopped inside a phase, its optimiser state is reloaded."""
    config = dict(epochs=6, phases=PHASES, phase_settings=PHASE_SETTINGS, limit_train_batches=2)
    whole = train(_tiny(tmp_path / 'whole', **config), progress=False)
    for stop in (3, 2):
        part = tmp_path / f'part{stop}'
        train(_tiny(part, **config), progress=False, stop_after=stop)
        resumed = Trainer(_tiny(part, **config), resume=True, progress=False).fit()
        a = load_file(str(whole.last_checkpoint / 'model.safetensors'))
        b = load_file(str(resumed.last_checkpoint / 'model.safetensors'))
        assert all(torch.equal(a[k], b[k]) for k in a), stop


def test_a_recovery_point_inside_a_phase_reloads_that_phases_optimiser(tmp_path, monkeypatch):
    """Ctrl-C inside phase b's first epoch, after a recovery point (--recovery-interval 1): the point holds phase
    b's optimiser, which --resume reloads (not a fresh one, as at a phase boundary): the same weights as the
    uninterrupted run, bit for bit."""
    argv = ['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '4', '-b', '32', '--warmup-epochs',
            '0', '--limit-train-batches', '3', '--recovery-interval', '1', '--no-progress', '--log-interval', '0']
    phased = tmp_path / 'phases.yaml'
    phased.write_text(json.dumps({'phases': [{'name': 'a', 'epochs': 2}, {'name': 'b', 'epochs': 2}],
                                  'phase_settings': {'b': {'lr': 5e-3, 'warmup_epochs': 0}}}))
    assert main([*argv, '-c', str(phased), '--output', str(tmp_path / 'straight')]) == 0
    monkeypatch.setenv('STRUCTFORMER_TEST_KILL_AT', 'epoch 3:step 2')
    monkeypatch.setenv('STRUCTFORMER_TEST_KILL_WITH', 'SIGINT')
    assert main([*argv, '-c', str(phased), '--output', str(tmp_path / 'resumed')]) == 130
    monkeypatch.delenv('STRUCTFORMER_TEST_KILL_AT')
    assert list((tmp_path / 'resumed' / 'checkpoints').glob('recovery_0003_*'))
    assert main(['train', '--resume', '--output', str(tmp_path / 'resumed'), '--no-progress']) == 0
    a = load_file(str(tmp_path / 'straight' / 'checkpoints' / 'epoch_0004' / 'model.safetensors'))
    b = load_file(str(tmp_path / 'resumed' / 'checkpoints' / 'epoch_0004' / 'model.safetensors'))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_phase_settings_are_checked_before_any_work(tmp_path):
    with pytest.raises(UsageError, match=r"phase_settings\.c: the run has no phase 'c'"):
        Trainer(_tiny(tmp_path, epochs=6, phases=PHASES, phase_settings={'c': {'lr': 1e-3}}))._build()
    with pytest.raises(UsageError, match=r'phase_settings\.a\.warmup_epochs=3'):
        Trainer(_tiny(tmp_path, epochs=6, phases=PHASES, phase_settings={'a': {'warmup_epochs': 3}}))._build()
    with pytest.raises(UsageError, match=r'phase_settings\.a\.nope: not a phase setting'):
        _tiny(tmp_path, phase_settings={'a': {'nope': 1}}).validate()
    # a restart on phase b's step schedule, which timm would ignore, is refused by its phase key
    with pytest.raises(UsageError, match=r'phase_settings\.b\.lr_cycle_limit=2 .*cosine, tanh, poly'):
        Trainer(_tiny(tmp_path, epochs=6, phases=PHASES,
                      phase_settings={'b': dict(PHASE_SETTINGS['b'], lr_cycle_limit=2)}))._build()
    assert not (tmp_path / 'run').exists()


def test_a_phase_restarts_its_own_schedule(tmp_path):
    """Phase a with two cosine cycles of its own (lr_cycle_limit 2 over its 4 epochs), phase b the run's schedule:
    phase a's lrs are timm's two cycles of 2 epochs, counted from its start."""
    phases = [{'name': 'a', 'epochs': 4}, {'name': 'b', 'epochs': 2}]
    settings = {'a': {'lr': 2e-2, 'lr_cycle_limit': 2, 'lr_cycle_decay': 0.5, 'min_lr': 1e-3, 'warmup_epochs': 0}}
    lrs = [r['lr'] for r in train(_tiny(tmp_path, epochs=6, phases=phases, phase_settings=settings),
                                  progress=False).history]
    first = _timm_lrs(2e-2, 4, sched='cosine', num_epochs=2, cycle_limit=2, cycle_decay=0.5, min_lr=1e-3,
                      warmup_epochs=0)
    assert lrs[:4] == pytest.approx(first, rel=1e-12, abs=0)
    assert lrs[1] == pytest.approx(0.5 * 2e-2) and lrs[2] < lrs[1]      # after epoch 2: cycle 2 at its halved peak


# ------------------------------------------------------------------------------------- precision at the edges
class _LogdetHead(torch.nn.Module):
    """A model with an op torch has no bfloat16 kernel for, and that CPU autocast does not cast to float32 (it
    does cast cholesky, svd, qr, eigh): the logdet of its logits' Gram matrix, which autocast computes in bfloat16."""

    def __init__(self, inner, num_classes):
        super().__init__()
        self.inner, self.num_classes = inner, num_classes

    def forward(self, x):
        logits = self.inner(x)
        gram = logits.T @ logits
        gram = gram + torch.eye(gram.shape[0], dtype=gram.dtype)
        return logits + torch.logdet(gram).to(logits.dtype) * 0


def test_an_op_without_a_bfloat16_kernel_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    import structformer.train.build as build
    real = build.build_model

    def with_logdet(*args, **kwargs):
        model, recipe = real(*args, **kwargs)
        return _LogdetHead(model, model.num_classes), recipe
    monkeypatch.setattr(build, 'build_model', with_logdet)
    output = tmp_path / 'run'
    rc = main(['train', '--model', 'crate_digits', '--data', 'digits', '--amp', '--amp-dtype', 'bfloat16',
               '--device', 'cpu', '--output', str(output), '--no-progress', '--limit-train-batches', '1'])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert 'no bfloat16 kernel for logdet on cpu' in err[0] and 'float32' in err[0] and '--amp' in err[0]
    assert not output.exists()
    from torch.utils.data import DataLoader, TensorDataset

    from structformer.train import evaluate
    from structformer.train.precision import Precision
    model = _LogdetHead(torch.nn.Linear(4, 3), 3)
    loader = DataLoader(TensorDataset(torch.randn(4, 4), torch.tensor([0, 1, 2, 0])), batch_size=4)
    with pytest.raises(UsageError, match='no bfloat16 kernel for logdet'):
        evaluate(model, loader, 'cpu', Precision.create(True, 'bfloat16', torch.device('cpu')))
    assert evaluate(model, loader, 'cpu')['top1'] >= 0        # float32: the op runs


def test_eval_scores_as_the_run_evaluated(tmp_path, capsys):
    """A bfloat16 run: `structformer eval` evaluates under bfloat16 autocast by default (the run's precision, its
    evaluation batch size) and gives exactly the metric the run recorded; --no-amp says it scores in float32."""
    result = train(_tiny(tmp_path, epochs=1, amp=True, amp_dtype='bfloat16', device='cpu', limit_train_batches=3),
                   progress=False)
    recorded = result.history[-1]
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(result.output), '--json']) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored['precision'] == 'bfloat16' and "the run's" in scored['precision_from']
    assert scored['top1'] == recorded['val_top1'] and scored['loss'] == recorded['val_loss']
    assert main(['eval', '--checkpoint', str(result.output), '--no-amp']) == 0
    assert '[float32: as asked]' in capsys.readouterr().out



def test_eval_of_an_old_amp_checkpoint_takes_the_devices_default_dtype():
    """A checkpoint from before the precision record, trained with --amp and no --amp-dtype: train's default for the
    device it named (bfloat16 on a CPU, float16 on CUDA), not float16 everywhere; --device auto is refused, one line
    naming --amp-dtype."""
    from argparse import Namespace

    from structformer.commands.eval import _precision
    from structformer.train.precision import cpu_float16_supported
    asked = Namespace(amp=None, amp_dtype=None)
    precision, how = _precision(asked, {'amp': True, 'device': 'cpu'}, {'path': 'old.pt'})
    assert precision.name == 'bfloat16' and how == "the run's (bfloat16 autocast)"
    precision, how = _precision(asked, {'amp': True, 'device': 'cuda:0'}, {'path': 'old.pt'})
    assert precision.name == ('float16' if cpu_float16_supported() else 'float32') and 'float16' in how
    with pytest.raises(UsageError, match=r'^--amp-dtype: old.pt .*--device auto.*records no precision'):
        _precision(asked, {'amp': True, 'device': 'auto'}, {'path': 'old.pt'})
    assert _precision(asked, {'amp': True, 'device': 'auto'}, {'precision': 'bfloat16'})[0].name == 'bfloat16'


# ------------------------------------------------------------------------------------- torchvision's RandAugment
def test_tv_rand_is_torchvisions_randaugment_where_timm_puts_its_policy():
    """--aa tv-rand-n2-m14 (the public CRATE finetune.py's RandAugment(2, 14)): torchvision's transform with those
    settings, after the crop and the flip and before the tensor conversion; the same draws give the same image."""
    import numpy as np
    from PIL import Image
    from torchvision import transforms as T

    from structformer.data.augment import Augmentation, check_auto_augment, timm_train_transform
    transform, record = timm_train_transform(32, Augmentation(aa='tv-rand-n2-m14'), (0.5,) * 3, (0.5,) * 3)
    names = [type(t).__name__ for t in transform.transforms]
    assert names[:4] == ['RandomResizedCropAndInterpolation', 'RandomHorizontalFlip', 'RandAugment', 'MaybeToTensor']
    ours = transform.transforms[2]
    assert (ours.num_ops, ours.magnitude, ours.num_magnitude_bins) == (2, 14, 31)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    torch.manual_seed(5)
    a = np.asarray(ours(image))
    torch.manual_seed(5)
    b = np.asarray(T.RandAugment(2, 14)(image))
    assert np.array_equal(a, b)
    with pytest.raises(UsageError, match=r"--aa='tv-rand-n2-m31'"):     # bins 0..30
        check_auto_augment('tv-rand-n2-m31')


@pytest.mark.parametrize('mode', ['value', 'agc'])
def test_clip_mode_is_timms_value_and_adaptive_clipping(mode, tmp_path):
    """--clip-mode (timm's dispatch_clip_grad): one plain SGD step (lr 1, no momentum or decay) moves each weight by
    its clipped gradient. 'value' bounds every element by --clip-grad (the global norm is far above it); 'agc'
    bounds each unit's gradient by clip-grad x its weight's norm and, as timm's train.py, leaves the head alone."""
    clip = 1e-4
    run = tmp_path / mode
    train(_tiny(run, epochs=1, opt='momentum', momentum=0.0, weight_decay=0.0, lr=1.0, clip_grad=clip, clip_mode=mode),
          progress=False)
    before = load_file(str(run / 'run/checkpoints/epoch_0000/model.safetensors'))
    after = load_file(str(run / 'run/checkpoints/epoch_0001/model.safetensors'))
    moved = {k: (after[k] - before[k]).double() for k in before if before[k].is_floating_point()}
    body = [k for k in moved if not k.startswith('head.')]
    # the step is rounded to float32 weights: each moved element is off by at most half an ulp of the new weight
    rounding = {k: 2.0 ** -24 * after[k].double().abs().max().item() for k in moved}
    if mode == 'value':
        largest = max(moved, key=lambda k: moved[k].abs().max())
        assert moved[largest].abs().max().item() == pytest.approx(clip, abs=rounding[largest])
        assert all(moved[k].abs().max().item() <= clip + rounding[k] for k in moved)
        assert sum(moved[k].square().sum().item() for k in moved) ** 0.5 > 20 * clip
        return
    from timm.utils.agc import unitwise_norm
    for key in body:                       # every unit of the body within clip x max(its weight norm, 1e-3)
        limit = clip * unitwise_norm(before[key].double()).clamp_min(1e-3)
        unit_size = moved[key][0].numel() if moved[key].dim() > 1 else moved[key].numel()
        # timm scales the gradient in float32: its norm lands within a few float32 ulps of the limit
        assert (unitwise_norm(moved[key]) <= limit * (1 + 8 * 2.0 ** -23) + rounding[key] * unit_size ** 0.5).all(), key
    assert unitwise_norm(moved['head.weight']).max().item() > 10 * clip * unitwise_norm(
        before['head.weight'].double()).max().item()


def test_clip_mode_is_checked(tmp_path):
    with pytest.raises(UsageError, match="--clip-mode='max': accepted norm, value, agc"):
        _tiny(tmp_path, clip_grad=1.0, clip_mode='max').validate()
    with pytest.raises(UsageError, match='--clip-mode value needs --clip-grad'):
        _tiny(tmp_path, clip_mode='value').validate()


def test_timms_short_and_model_flags_are_taken_or_pointed_to_model_kwargs(capsys):
    """timm's --dr is --decay-rate; --bn-momentum and the like are constructor arguments timm hands to create_model:
    they point to --model-kwargs, not to a near name of another meaning (--bn-momentum said 'did you mean
    --momentum?', the optimiser's; --dr 'did you mean --drop or --lr?')."""
    assert main(['train', '--dry-run', '--sched', 'step', '--dr', '0.5']) == 0
    assert 'x0.5 every 90 epochs' in capsys.readouterr().out
    for flag, kwarg in (('--bn-momentum', 'bn_momentum'), ('--bn-eps', 'bn_eps'), ('--drop-block', 'drop_block_rate'),
                        ('--gp', 'global_pool')):
        with pytest.raises(SystemExit):
            main(['train', '--dry-run', flag, '0.1'])
        err = capsys.readouterr().err
        assert f'{flag} is not a flag here' in err and f'--model-kwargs {kwarg}=' in err and 'did you mean' not in err


def test_a_config_file_takes_timms_keys_or_says_where_their_setting_is(tmp_path, capsys):
    """timm's train.py reads -c YAML of its argparse dest names: those of settings we hold under another key are
    taken (smoothing, workers, torchcompile, torchcompile_mode), `lr: null` with lr_base is timm's scaling rule, and
    a timm key without a counterpart is refused with its flag's hint (checkpoint_hist said 'did you mean
    grad_checkpointing?')."""
    from structformer.train.config import load_config_file
    path = tmp_path / 'timm.yaml'
    path.write_text('smoothing: 0.2\nworkers: 3\ntorchcompile: eager\nlr: null\nlr_base: 0.1\n')
    assert load_config_file(path) == {'label_smoothing': 0.2, 'num_workers': 3, 'compile': 'eager', 'lr_base': 0.1}
    for text, needle in [('smoothing: 0.2\nlabel_smoothing: 0.1\n', "keys 'smoothing' and 'label_smoothing' both set"),
                         ('lr: null\n', 'lr: null leaves the peak lr to lr_base'),
                         ('checkpoint_hist: 3\n', "'checkpoint_hist' is timm train.py's key, not one here: use "
                                                  '--keep-last N')]:
        path.write_text(text)
        assert main(['train', '--dry-run', '-c', str(path)]) == 2
        assert needle in capsys.readouterr().err


@pytest.mark.parametrize('argv, needle', [
    (['--lr-base-size', '1024'], "--lr-base-size 1024 does nothing in this run: it sizes --lr-base's scaling"),
    (['--model-ema-warmup'], '--model-ema-warmup does nothing in this run: it shapes the weight average'),
    (['--mixup-off-epoch', '3'], '--mixup-off-epoch 3 does nothing in this run: it shapes Mixup / CutMix'),
    (['--decay-milestones', '5', '9'], '--decay-milestones 5 9 does nothing in this run: only --sched multistep'),
    (['--lr-noise-std', '0.5'], '--lr-noise-std 0.5 does nothing in this run: it shapes --lr-noise'),
    (['--lr-cycle-decay', '0.9'], '--lr-cycle-decay 0.9 does nothing in this run: it shapes the restarts'),
    (['--momentum', '0.5'], '--momentum 0.5 does nothing in this run: --opt adamw has no momentum'),
    (['--sched', 'step', '--min-lr', '1e-5'], '--min-lr 1e-05 does nothing in this run: only a --sched cosine / tanh'),
    (['--sched', 'multistep', '--min-lr', '0'], '--min-lr 0.0 does nothing in this run: only a --sched cosine'),
    (['--sched', 'none', '--min-lr', '0'], '--min-lr 0.0 does nothing in this run: only a --sched cosine'),
    (['--sched', 'none', '--warmup-lr', '0'], '--warmup-lr 0.0 does nothing in this run: only a warm-up'),
    (['--warmup-epochs', '0', '--warmup-lr', '1e-5'], 'only a warm-up (--warmup-epochs > 0 and a --sched other '
     'than none) reads it, and the run has --sched cosine, --warmup-epochs 0'),
    (['--warmup-epochs', '0', '--warmup-prefix'], '--warmup-prefix does nothing in this run: only a warm-up '
     '(--warmup-epochs > 0 and a --sched other than none) reads it, and the run has --sched cosine, --warmup-epochs 0'),
    (['--sched', 'none', '--warmup-prefix'], '--warmup-prefix does nothing in this run: only a warm-up')])
def test_a_flag_that_acts_on_nothing_is_refused(argv, needle, capsys):
    """timm's train.py ignores these without a word (and its lr_base defaults to 0.1, so its --lr-base-size alone
    scales the lr; here it did nothing): one line instead."""
    assert main(['train', '--dry-run', *argv]) == 2
    assert needle in capsys.readouterr().err


def test_flags_that_act_somewhere_in_the_run_are_taken(capsys):
    """With what they shape on (or a phase's schedule reading them), or at their default value, they are taken."""
    for argv in (['--lr-base', '1e-3', '--lr-base-size', '1024'], ['--model-ema', '--model-ema-warmup'],
                 ['--cutmix', '1', '--mixup-off-epoch', '1'], ['--mixup-off-epoch', '0'],
                 ['--phase-settings', 'main', 'sched=multistep', '--decay-milestones', '5', '9'],
                 ['--lr-noise', '0.5', '--lr-noise-std', '0.5'], ['--lr-cycle-limit', '2', '--lr-cycle-decay', '0.9'],
                 ['--opt', 'lookahead_sgd', '--momentum', '0.5'], ['--momentum', '0.9'],
                 ['--sched', 'poly', '--min-lr', '0'], ['--sched', 'step', '--warmup-lr', '0'],
                 ['--sched', 'step', '--phase-settings', 'main', 'sched=cosine', '--min-lr', '0'],
                 ['--warmup-epochs', '1', '--warmup-prefix'],
                 ['--warmup-epochs', '0', '--phase-settings', 'main', 'warmup_epochs=1', '--warmup-prefix']):
        assert main(['train', '--dry-run', '--epochs', '10', *argv]) == 0, argv
    capsys.readouterr()


def test_a_phases_own_optimiser_scales_lr_base_by_its_own_rule(tmp_path):
    """timm's --lr-base rule depends on the optimiser (square root for ada* / lamb, else linear): a phase with its
    own --opt scales by that optimiser's rule, not the run's (an sgd phase of an adamw run took the square root)."""
    common = dict(lr_base=1e-3, lr_base_size=256, batch_size=64, lr=1e-3, warmup_epochs=0)
    trainer = Trainer(_tiny(tmp_path / 'a', phase_settings={'main': {'opt': 'sgd'}}, **common))
    trainer._build()
    assert trainer.optimizer.param_groups[0]['lr'] == pytest.approx(1e-3 * 64 / 256)            # linear
    trainer = Trainer(_tiny(tmp_path / 'b', **common))
    trainer._build()
    assert trainer.optimizer.param_groups[0]['lr'] == pytest.approx(1e-3 * (64 / 256) ** 0.5)   # adamw: sqrt


def test_a_floor_the_schedule_never_reads_is_not_held_against_the_peak(tmp_path):
    """A recipe's min_lr under --sched step (which decays by decay_rate and never reads it), or its warmup_lr with
    no warm-up, was refused as 'above the peak' at a batch that scales the peak below it; a floor the schedule
    reads still is."""
    common = dict(lr_base=1e-3, lr_base_size=1024, opt='sgd', batch_size=32)
    for unread in (dict(sched='step', min_lr=1e-3), dict(warmup_epochs=0, warmup_lr=1e-3),
                   dict(sched='none', min_lr=1e-3, warmup_lr=1e-3)):
        Trainer(_tiny(tmp_path / 'a', **common, **unread))._build()
    for read, flag in ((dict(sched='cosine', min_lr=1e-3), '--min-lr'),
                       (dict(sched='step', warmup_epochs=1, warmup_lr=1e-3), '--warmup-lr')):
        with pytest.raises(UsageError, match=f'{flag} 0.001 is above the peak learning rate'):
            Trainer(_tiny(tmp_path / 'b', **common, **read))._build()


def test_smoothing_reaches_the_training_loss(tmp_path, monkeypatch):
    """--smoothing is the cross-entropy's label smoothing in every training step (each step's 'ce' term seen here
    is F.cross_entropy(logits, targets, label_smoothing=0.3) of that step's own logits), and the run's logged
    train loss is those terms' mean over its steps."""
    from structformer.train import train
    from structformer.train.phases import LOSS_TERMS
    seen, original = [], LOSS_TERMS['ce']

    def recording(ctx):
        value = original(ctx)
        seen.append((ctx.label_smoothing, value.item(),
                     F.cross_entropy(ctx.logits, ctx.targets, label_smoothing=0.3).item(), ctx.targets.numel()))
        return value
    monkeypatch.setitem(LOSS_TERMS, 'ce', recording)
    result = train(_tiny(tmp_path, epochs=1, limit_train_batches=2, label_smoothing=0.3), progress=False)
    assert len(seen) == 2 and all(smoothing == 0.3 for smoothing, *_ in seen)
    assert all(value == pytest.approx(expected, rel=1e-6) for _, value, expected, _ in seen)
    mean = sum(value * n for _, value, _, n in seen) / sum(n for *_, n in seen)
    assert result.final['train_loss'] == pytest.approx(mean, rel=1e-6)
