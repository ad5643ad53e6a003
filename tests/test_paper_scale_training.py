"""The papers' recipes as the engine runs them: mixed precision, Mixup / CutMix, timm's augmentations, EMA,
gradient accumulation, lr scaling, per-step logs (issue: paper-scale training)."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from structformer.cli import main
from structformer.errors import UsageError
from structformer.train import TrainConfig, train
from structformer.train.phases import LossContext, LOSS_TERMS
from structformer.train.precision import Precision, cpu_float16_supported


def _config(tmp_path, name='run', **overrides):
    values = dict(model='crate_digits', data='digits', epochs=2, batch_size=32, lr=3e-3, warmup_epochs=0,
                  limit_train_batches=4, log_interval=0, output=str(tmp_path / name))
    if 'val_fraction' not in overrides:
        values['val_fraction'] = 0.1            # 180 held-out images: evaluation is most of a tiny run's time
    values.update(overrides)
    return TrainConfig(**values)


def _weights(checkpoint: Path, name='model.safetensors'):
    return load_file(str(Path(checkpoint) / name))


def _curve(run: Path, key='train_loss'):
    return [json.loads(line)[key] for line in (run / 'metrics.jsonl').read_text().splitlines()]


EVERYTHING = dict(epochs=3, val_fraction=0.05, data_kwargs={'augment': True}, aa='rand-m9-mstd0.5-inc1', reprob=0.25, mixup=0.8,
                  cutmix=1.0, model_ema=True, model_ema_warmup=True, grad_accum_steps=2, drop_path=0.1,
                  amp=True, amp_dtype='bfloat16')


def test_resume_is_bit_exact_with_every_augmentation_on(tmp_path):
    """RandAugment, random erasing, Mixup / CutMix, drop path, EMA, accumulation and bfloat16 autocast together:
    a run stopped after an epoch and resumed ends with the same weights and weight average, bit for bit."""
    straight = train(_config(tmp_path, 'a', **EVERYTHING), progress=False)
    train(_config(tmp_path, 'b', **EVERYTHING), progress=False, stop_after=1)
    resumed = train(_config(tmp_path, 'b', **EVERYTHING), progress=False, resume=True)
    assert [r['epoch'] for r in resumed.history] == [2, 3]
    for name in ('model.safetensors', 'ema.safetensors'):
        a, b = _weights(straight.last_checkpoint, name), _weights(resumed.last_checkpoint, name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert _curve(tmp_path / 'a') == _curve(tmp_path / 'b')
    assert _curve(tmp_path / 'a', 'ema_val_top1') == _curve(tmp_path / 'b', 'ema_val_top1')


def test_augmentation_does_not_depend_on_the_loader_workers(tmp_path):
    """Each sample is augmented under RNGs seeded by (seed, epoch, rank, position), so two worker processes train
    exactly what the main process alone trains."""
    common = dict(epochs=2, data_kwargs={'augment': True}, aa='rand-m9-mstd0.5-inc1', reprob=0.5)
    a = train(_config(tmp_path, 'a', num_workers=0, **common), progress=False)
    b = train(_config(tmp_path, 'b', num_workers=2, **common), progress=False)
    wa, wb = _weights(a.last_checkpoint), _weights(b.last_checkpoint)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_accumulation_matches_the_larger_batch(tmp_path):
    """64 images in one batch or in two accumulated batches of 32 give the same optimiser steps: the same
    images (one shuffled order), each group's gradient the mean over its images. Only the summation order
    differs, so the weights agree to float32 rounding (SGD, whose update is linear in the gradient)."""
    common = dict(epochs=1, opt='sgd', lr=0.05, sched='none', label_smoothing=0.0)
    big = train(_config(tmp_path, 'big', batch_size=64, limit_train_batches=4, **common), progress=False)
    small = train(_config(tmp_path, 'small', batch_size=32, grad_accum_steps=2, limit_train_batches=8, **common),
                  progress=False)
    assert big.final['step'] == small.final['step'] == 4
    wa, wb = _weights(big.last_checkpoint), _weights(small.last_checkpoint)
    init = _weights(tmp_path / 'big' / 'checkpoints' / 'epoch_0000')
    for k in wa:
        assert not torch.equal(wa[k], init[k]) or wa[k].dtype != torch.float32 or 'norm' in k or 'cls' in k
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-6)


def test_effective_batch_and_lr_scaling_are_recorded(tmp_path, capsys):
    """timm's rule: lr = lr_base * effective batch / lr_base_size, linear for SGD, square root for AdamW."""
    sgd = _config(tmp_path, opt='sgd', lr_base=0.1, lr_base_size=256, batch_size=32, grad_accum_steps=2)
    assert sgd.effective_batch() == 64 and sgd.resolved_lr() == pytest.approx(0.1 * 64 / 256)
    assert sgd.resolved_lr(world_size=4) == pytest.approx(0.1 * 256 / 256)
    adamw = _config(tmp_path, opt='adamw', lr_base=1e-3, lr_base_size=256, batch_size=64)
    assert adamw.resolved_lr() == pytest.approx(1e-3 * 0.5)
    result = train(_config(tmp_path, opt='sgd', lr_base=0.1, lr_base_size=256, grad_accum_steps=2, sched='none',
                           epochs=1), progress=False)
    out = capsys.readouterr().out
    assert 'effective batch 64 (32 per process x 2 accumulated)' in out
    state = json.loads((result.last_checkpoint / 'state.json').read_text())
    assert state['effective_batch_size'] == 64 and state['world_size'] == 1
    assert result.final['lr'] == pytest.approx(0.025)
    assert json.loads((tmp_path / 'run' / 'summary.json').read_text())['effective_batch_size'] == 64


def test_bfloat16_autocast_keeps_float32_master_weights(tmp_path):
    result = train(_config(tmp_path, amp=True, amp_dtype='bfloat16', model_ema=True, epochs=1), progress=False)
    for name in ('model.safetensors', 'ema.safetensors', 'train_state.safetensors'):
        tensors = _weights(result.last_checkpoint, name)
        assert {t.dtype for k, t in tensors.items() if t.is_floating_point()} == {torch.float32}, name
    state = json.loads((result.last_checkpoint / 'state.json').read_text())
    assert state['precision'] == 'bfloat16'


def test_weight_average_is_evaluated_saved_and_scored_by_eval(tmp_path, capsys):
    result = train(_config(tmp_path, model_ema=True, model_ema_decay=0.9, epochs=2), progress=False)
    assert 'ema_val_top1' in result.final
    model, ema = _weights(result.last_checkpoint), _weights(result.last_checkpoint, 'ema.safetensors')
    assert model.keys() == ema.keys() and any(not torch.equal(model[k], ema[k]) for k in model)
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(tmp_path / 'run'), '--ema', '--json']) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored['weights'] == 'ema'
    assert scored['top1'] == pytest.approx(result.final['ema_val_top1'], abs=1e-9)   # the same 180 images counted



@pytest.mark.parametrize('warmup', [False, True])
def test_weight_average_follows_the_configured_decay(warmup):
    """--model-ema-decay d, as timm's ModelEmaV3 applies it after each optimiser step s: the first step copies the
    weights, every later one averages EMA ← δ·EMA + (1 − δ)·W with δ = d, or with --model-ema-warmup
    δ = min(d, 1 − (1 + (s − 1))^(−2/3)) (timm's warm-up: gamma 1, power 2/3). Also after `model_replaced` (the
    average restarted on a factorised network keeps the run's decay)."""
    from types import SimpleNamespace
    from structformer.train.parts import WeightAveragePart
    decay = 0.75
    config = SimpleNamespace(model_ema_decay=decay, model_ema_warmup=warmup, factorize_at=0)
    model = torch.nn.Linear(3, 2)
    trainer = SimpleNamespace(model=model, global_step=0, recipe=SimpleNamespace(transforms=[]))
    part = WeightAveragePart(model, config)
    for replaced in (False, True):
        if replaced:
            trainer.model = model = torch.nn.Linear(3, 2)
            part.model_replaced(trainer)
        expected = None
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(torch.randn(2, 3))
            trainer.global_step = step
            part.after_step(trainer)
            current = model.weight.detach().clone()
            delta = 0.0 if step == 1 else (min(decay, 1 - step ** (-2 / 3)) if warmup else decay)
            expected = current if expected is None else delta * expected + (1 - delta) * current
            torch.testing.assert_close(part.average.module.weight, expected, rtol=1e-6, atol=1e-6)

def test_soft_targets_take_soft_target_cross_entropy():
    """Mixup folds label smoothing into soft targets; the ce term must not smooth them again."""
    from timm.loss import SoftTargetCrossEntropy
    logits = torch.randn(4, 10)
    soft = torch.softmax(torch.randn(4, 10), -1)
    ctx = LossContext(None, None, soft, logits, label_smoothing=0.1)
    torch.testing.assert_close(LOSS_TERMS['ce'](ctx), SoftTargetCrossEntropy()(logits, soft))
    hard = torch.tensor([1, 2, 3, 4])
    ctx = LossContext(None, None, hard, logits, label_smoothing=0.1)
    torch.testing.assert_close(LOSS_TERMS['ce'](ctx), torch.nn.functional.cross_entropy(logits, hard, label_smoothing=0.1))


def test_mixup_switches_off_at_its_epoch(tmp_path):
    """timm's --mixup-off-epoch 2 mixes its epochs 0 and 1 (`epoch >= 2` stops it): our 1-based epochs 1 and 2."""
    from structformer.train.engine import Trainer
    trainer = Trainer(_config(tmp_path, mixup=0.8, mixup_off_epoch=2, epochs=3), progress=False)
    trainer._build()
    from structformer.train.mixing import mixing_active
    assert [mixing_active(trainer.mixup, trainer.config, e) for e in (1, 2, 3)] == [True, True, False]
    assert trainer.train_loader.drop_last                    # timm drops the smaller last batch when mixing


def test_float16_scaler_skips_an_overflowing_step_and_its_state_resumes():
    """The float16 path's loss scaling (GradScaler) on the CPU: an infinite gradient skips the step and halves
    the scale; the scale is part of the checkpoint state."""
    layer = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    precision = Precision(torch.device('cpu'), torch.float16, torch.amp.GradScaler('cpu', init_scale=1024.0))
    before = layer.weight.detach().clone()
    precision.backward(layer(torch.randn(3, 4)).sum())
    layer.weight.grad[0, 0] = float('inf')
    precision.step(optimizer, layer.parameters(), clip_grad=1.0)
    assert torch.equal(layer.weight, before)
    state = precision.state()
    assert state['scale'] == 512.0
    other = Precision(torch.device('cpu'), torch.float16, torch.amp.GradScaler('cpu'))
    other.load_state(json.loads(json.dumps(state)))                       # through state.json
    assert other.scaler.get_scale() == 512.0


@pytest.mark.skipif(cpu_float16_supported(), reason='this CPU computes float16 in hardware (AVX-512 FP16 or AMX-FP16)')
def test_float16_autocast_on_a_cpu_without_float16_is_refused():
    with pytest.raises(UsageError, match='--amp-dtype float16.*bfloat16'):
        Precision.create(True, 'float16', torch.device('cpu'))


@pytest.mark.skipif(torch.cuda.is_available(), reason='CUDA is present')
def test_cuda_device_without_cuda_is_refused(tmp_path, capsys):
    assert main(['train', '--device', 'cuda', '--output', str(tmp_path / 'out')]) == 2
    assert '--device cuda: CUDA is not available' in capsys.readouterr().err
    assert not (tmp_path / 'out').exists()


def test_step_log_lines_every_interval(tmp_path, capsys):
    train(_config(tmp_path, epochs=1, limit_train_batches=6, log_interval=2), progress=False)
    lines = [l for l in capsys.readouterr().out.splitlines() if l.strip().startswith('epoch 1/1  batch')]
    assert [l.split('step ')[1].split()[0] for l in lines] == ['2', '4', '6']
    assert all('img/s' in l and 'lr ' in l and 'loss ' in l for l in lines)


def test_drop_path_reaches_the_model(tmp_path):
    from structformer.train.checkpoint import load_model
    result = train(_config(tmp_path, epochs=1, drop_path=0.2, limit_train_batches=1), progress=False)
    _, state = load_model(result.last_checkpoint)
    assert state['model_kwargs']['drop_path_rate'] == 0.2
    with pytest.raises(UsageError, match='--drop-path 0.2 and --model-kwargs drop_path_rate=0.1 disagree'):
        train(_config(tmp_path, 'other', drop_path=0.2, model_kwargs={'drop_path_rate': 0.1}), progress=False)


FAMILIES = {
    'crate': dict(model='crate_digits'),
    'soft': dict(model='soft_digits'),
    'sparsifiner': dict(model='sparsifiner_digits'),
    'mixer': dict(model='rp_mixer_digits'),
    'lowrank': dict(model='vit_digits', factorize_rank=0.5),
}


@pytest.mark.slow
@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_bfloat16_training_follows_float32(tmp_path, family):
    """24 optimiser steps of a small model of each family under CPU bfloat16 autocast: finite, and each epoch's
    mean training loss within 3 % of float32's. bfloat16 keeps 8 significant bits (unit roundoff 2^-8 = 0.39 %);
    a loss averaged over batches moves by a few roundoffs when only the matmuls round, so 3 % (about 8 roundoffs)
    separates 'the same training' from a broken cast (a float32 island lost, a top-k on bfloat16 ties), which
    shows up as a loss off by tens of per cent or not finite."""
    common = dict(epochs=3, batch_size=32, lr=2e-3, limit_train_batches=8, val_fraction=0.05, **FAMILIES[family])
    full = train(_config(tmp_path, 'fp32', **common), progress=False)
    half = train(_config(tmp_path, 'bf16', amp=True, amp_dtype='bfloat16', **common), progress=False)
    a, b = [r['train_loss'] for r in full.history], [r['train_loss'] for r in half.history]
    assert all(torch.isfinite(torch.tensor(b)))
    for x, y in zip(a, b):
        assert abs(x - y) <= 0.03 * x, (a, b)


def test_distillation_takes_mixed_batches(tmp_path, vit_digits_teacher):
    """With Mixup, the teacher scores the same mixed images the student sees, and the ce term takes the soft
    targets: a two-stage Sparsifiner run with Mixup / CutMix trains, finite, through both stages."""
    result = train(_config(tmp_path, 'student', model='sparsifiner_digits', teacher=str(vit_digits_teacher), epochs=2,
                           predictor_epochs=1, mixup=0.8, cutmix=1.0, limit_train_batches=2), progress=False)
    assert [r['phase'] for r in result.history] == ['predictor', 'joint']
    joint = result.history[1]
    assert all(torch.isfinite(torch.tensor(joint[k])) for k in ('train_ce', 'train_distill_kl', 'train_distill_token'))


def test_sparsifiner_without_a_teacher_is_told_its_predictor_will_not_learn(tmp_path, capsys):
    train(_config(tmp_path, model='sparsifiner_digits', epochs=1, limit_train_batches=1), progress=False)
    err = capsys.readouterr().err
    assert 'sparsifiner_digits has' in err and 'without --teacher' in err and 'keep their initialisation' in err


def test_tensorboard_scalars_are_written(tmp_path, monkeypatch):
    """--log-tb DIR: every optimiser step's loss and lr, every epoch's numbers (a recording stand-in for
    tensorboard's SummaryWriter, which is an optional extra)."""
    import sys
    import types
    written = []

    class Recorder:
        def __init__(self, log_dir):
            written.append(('dir', log_dir, None))

        def add_scalar(self, tag, value, step):
            written.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            written.append(('closed', None, None))

    module = types.ModuleType('torch.utils.tensorboard')
    module.SummaryWriter = Recorder
    monkeypatch.setitem(sys.modules, 'torch.utils.tensorboard', module)
    train(_config(tmp_path, epochs=2, limit_train_batches=3, log_tb=str(tmp_path / 'tb')), progress=False)
    assert written[0] == ('dir', str(tmp_path / 'tb'), None) and written[-1][0] == 'closed'
    assert [step for tag, _, step in written if tag == 'train/loss'] == [1, 2, 3, 4, 5, 6]
    assert [step for tag, _, step in written if tag == 'epoch/val_top1'] == [1, 2]


def test_tensorboard_missing_is_one_line(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, 'torch.utils.tensorboard', None)      # import fails as without the package
    with pytest.raises(UsageError, match="--log-tb .*tensorboard"):
        train(_config(tmp_path, epochs=1, log_tb=str(tmp_path / 'tb')), progress=False)
    assert not (tmp_path / 'run').exists()


def test_lr_floor_above_a_scaled_peak_is_refused(tmp_path):
    with pytest.raises(UsageError, match='--min-lr 0.001 is above the peak learning rate'):
        train(_config(tmp_path, lr_base=1e-3, lr_base_size=1024, opt='sgd', min_lr=1e-3), progress=False)
    assert not (tmp_path / 'run').exists()
