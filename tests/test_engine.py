"""The training engine: accuracy, bit-exact resume, NaN handling, configs (DDP: tests/test_ddp_families.py)."""
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from structformer.train import TrainConfig, TrainingDiverged, load_model, train
from structformer.train.checkpoint import resolve_checkpoint


def _tiny(tmp_path, **overrides):
    values = dict(model='crate_digits', data='digits', epochs=3, batch_size=64, lr=3e-3, warmup_epochs=1,
                  output=str(tmp_path / 'run'))
    values.update(overrides)
    return TrainConfig(**values)


@pytest.mark.slow
def test_crate_reaches_90_percent_on_held_out_digits(tmp_path):
    result = train(_tiny(tmp_path, epochs=20), progress=False)
    assert result.final['val_top1'] >= 90.0, result.final
    lines = (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()
    assert len(lines) == 20 and json.loads(lines[-1])['epoch'] == 20


def test_resume_is_bit_exact(tmp_path):
    # dropout + random-translation augmentation make the result depend on every RNG the loop uses
    kwargs = dict(epochs=3, model_kwargs={'drop_rate': 0.1}, data_kwargs={'augment': True}, limit_train_batches=6)
    straight = train(_tiny(tmp_path / 'a', **kwargs), progress=False)
    first = train(_tiny(tmp_path / 'b', **kwargs), progress=False, stop_after=1)
    assert [r['epoch'] for r in first.history] == [1]
    resumed = train(_tiny(tmp_path / 'b', **kwargs), progress=False, resume=True)
    assert [r['epoch'] for r in resumed.history] == [2, 3]
    a = load_file(str(straight.last_checkpoint / 'model.safetensors'))
    b = load_file(str(resumed.last_checkpoint / 'model.safetensors'))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    curve = lambda run: [json.loads(line)['train_loss'] for line in (run / 'metrics.jsonl').read_text().splitlines()]
    assert curve(tmp_path / 'a' / 'run') == curve(tmp_path / 'b' / 'run')


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    def poison(trainer, epoch, record):
        if epoch == 1:
            with torch.no_grad():
                trainer.model.head.weight.fill_(float('nan'))

    with pytest.raises(TrainingDiverged, match='last good checkpoint.*Try a lower --lr or --clip-grad'):
        train(_tiny(tmp_path), progress=False, callbacks=[poison])
    latest = resolve_checkpoint(tmp_path / 'run')
    assert latest.name == 'epoch_0001'
    model, state = load_model(tmp_path / 'run')
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not list((tmp_path / 'run' / 'checkpoints').glob('*.tmp-*'))


def test_a_resumed_run_that_diverges_points_to_a_new_run_for_a_lower_lr(tmp_path):
    """--resume keeps the run's lr and clipping, so the advice for a resumed run is a new run from the checkpoint."""
    train(_tiny(tmp_path, epochs=1, warmup_epochs=0, limit_train_batches=2), progress=False)

    def poison(trainer, epoch, record):
        with torch.no_grad():
            trainer.model.head.weight.fill_(float('nan'))

    with pytest.raises(TrainingDiverged, match='--resume keeps the run.*--initial-checkpoint'):
        train(_tiny(tmp_path, epochs=3, warmup_epochs=0, limit_train_batches=2), resume=str(tmp_path / 'run'),
              progress=False, callbacks=[poison])


def test_existing_run_is_not_overwritten_by_accident(tmp_path):
    train(_tiny(tmp_path, epochs=1, warmup_epochs=0, limit_train_batches=2), progress=False)
    before = (tmp_path / 'run' / 'checkpoints' / 'epoch_0001' / 'model.safetensors').read_bytes()
    with pytest.raises(FileExistsError, match='--resume'):
        train(_tiny(tmp_path, epochs=1, warmup_epochs=0), progress=False)
    assert (tmp_path / 'run' / 'checkpoints' / 'epoch_0001' / 'model.safetensors').read_bytes() == before


def test_init_checkpoint_and_pruning(tmp_path):
    train(_tiny(tmp_path, epochs=4, keep_last=1, limit_train_batches=1), progress=False)
    names = sorted(p.name for p in (tmp_path / 'run' / 'checkpoints').iterdir())
    assert names == ['epoch_0000', 'epoch_0004', 'latest.json']


def test_phases_freeze_parameters(tmp_path):
    phases = [{'name': 'head_only', 'epochs': 1, 'trainable': ['head.*']},
              {'name': 'all', 'epochs': 1}]
    cfg = _tiny(tmp_path, epochs=2, warmup_epochs=0, phases=phases, limit_train_batches=2)
    seen = {}

    def snapshot(trainer, epoch, record):
        seen[epoch] = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    result = train(cfg, progress=False, callbacks=[snapshot])
    init = load_file(str(tmp_path / 'run' / 'checkpoints' / 'epoch_0000' / 'model.safetensors'))
    assert torch.equal(seen[1]['blocks.0.mlp.weight'], init['blocks.0.mlp.weight'])   # frozen in phase 1
    assert not torch.equal(seen[1]['head.weight'], init['head.weight'])
    assert not torch.equal(seen[2]['blocks.0.mlp.weight'], init['blocks.0.mlp.weight'])
    assert [r['phase'] for r in result.history] == ['head_only', 'all']


def test_phase_validation():
    with pytest.raises(ValueError, match='phases cover'):
        train(TrainConfig(epochs=3, warmup_epochs=0, phases=[{'epochs': 2}], output='/nonexistent/never'))


@pytest.mark.parametrize('name,kwargs', [('vit_tiny_patch16_224', {'patch_size': 2, 'depth': 2}),
                                         ('resnet10t', {})])
def test_any_timm_model_trains_on_embedded_data(tmp_path, name, kwargs):
    """Data decides classes/channels/size: ViTs get img_size, convolutional nets (no img_size) do not."""
    result = train(_tiny(tmp_path, model=name, model_kwargs=kwargs, epochs=1, warmup_epochs=0,
                         limit_train_batches=2), progress=False)
    model, state = load_model(result.last_checkpoint)
    assert state['model_kwargs']['num_classes'] == 10 and state['model_kwargs']['in_chans'] == 1
    assert ('img_size' in state['model_kwargs']) == name.startswith('vit')
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    # timm's data config of the reloaded model is the training data's, not ImageNet's 3 x 224 defaults
    import timm.data

    from structformer.data import DIGITS_MEAN, DIGITS_STD
    cfg = timm.data.resolve_data_config({}, model=model)
    assert cfg['input_size'] == (1, 8, 8) and cfg['crop_pct'] == 1.0
    assert cfg['mean'] == (DIGITS_MEAN / 255,) and cfg['std'] == (DIGITS_STD / 255,)
    assert model.default_cfg is model.pretrained_cfg


def test_attn_layer_by_name_swaps_a_timm_vit_and_round_trips(tmp_path):
    """`--model-kwargs attn_layer=soft attn_kwargs=...` puts SOFT into timm's ViT; its lazily shaped conv sampler is
    materialised before the optimizer is built (so it trains), and the checkpoint rebuilds the same model."""
    from structformer.layers import SoftAttention
    kwargs = {'attn_layer': 'soft', 'attn_kwargs': {'num_landmarks': 4}, 'patch_size': 2, 'depth': 2,
              'embed_dim': 32, 'num_heads': 2}
    with warnings.catch_warnings():
        warnings.simplefilter('error')                           # no lazy-parameter warning reaches the user
        result = train(_tiny(tmp_path, model='vit_tiny_patch16_224', model_kwargs=kwargs, epochs=2,
                             warmup_epochs=0, limit_train_batches=3), progress=False)
    model, state = load_model(result.last_checkpoint)
    assert state['model_kwargs']['attn_layer'] == 'soft'         # stored by name, resolved on load
    assert state['model_kwargs']['attn_kwargs'] == {'num_landmarks': 4}
    attn = model.blocks[0].attn
    assert isinstance(attn, SoftAttention) and attn.conv.kernel_size == 2     # 4×4 grid, m = 4 landmarks
    first = load_file(str(tmp_path / 'run' / 'checkpoints' / 'epoch_0000' / 'model.safetensors'))
    assert not torch.equal(first['blocks.0.attn.conv.weight'], attn.conv.weight)   # the sampler was trained


def test_epoch_line_rate_keeps_slow_runs_readable():
    from structformer.train.engine import _rate
    assert _rate(0.0774) == '0.0774' and _rate(12.345) == '12.3' and _rate(1234.6) == '1235'


def test_the_dry_forward_before_writing_draws_no_random_numbers(tmp_path):
    """`train` runs one forward of two validation samples before it writes anything (a model that cannot take
    the data is refused with nothing written); it must leave the RNG where it was, even for a model whose
    forward draws (here: dropout left in training mode would), or the run would differ from a run without it."""
    from structformer.train.engine import Trainer
    trainer = Trainer(_tiny(tmp_path, model_kwargs={'drop_rate': 0.5}), progress=False)
    trainer._build()
    trainer.model.eval = lambda: trainer.model               # keep dropout active: the forward draws
    state = torch.get_rng_state()
    trainer._check_input_shapes()
    assert torch.equal(torch.get_rng_state(), state)
    assert not (tmp_path / 'run').exists()


def test_the_divergence_line_names_the_batch_and_the_optimiser_step_as_the_step_log_does(tmp_path, capsys):
    """It said 'step 0' for the first batch of epoch 2 (the 0-based batch index) while the step log's 'step' is the
    optimiser step: with two batches an optimiser step, epoch 1 makes steps 1-2, so epoch 2's first batch is
    'batch 1/4' of optimiser step 3."""
    def poison(trainer, epoch, record):
        with torch.no_grad():
            trainer.model.head.weight.fill_(float('nan'))

    config = _tiny(tmp_path, epochs=2, batch_size=16, grad_accum_steps=2, limit_train_batches=4, warmup_epochs=0,
                   log_interval=1)
    with pytest.raises(TrainingDiverged) as caught:
        train(config, progress=False, callbacks=[poison])
    assert 'loss became nan at epoch 2, batch 1/4 (optimiser step 3) ' in str(caught.value), str(caught.value)
    logged = capsys.readouterr().out
    assert 'epoch 1/2  batch 4/4  step 2 ' in logged and 'step 3 ' not in logged, logged


def test_the_step_logs_loss_is_the_mean_over_every_accumulated_batch_of_the_step(tmp_path, monkeypatch):
    """With --grad-accum-steps 2 the step log (and TensorBoard's train/loss) gave the loss of the step's last batch
    alone, 8 of its 16 images. A one-step epoch's step loss is the epoch's train_loss (both the mean over the same
    16 images, taken before the step)."""
    from structformer.train.steplog import StepLog
    logged = []
    original = StepLog.step

    def step(self, epoch, batch, batches, global_step, loss, *rest):
        logged.append(loss)
        return original(self, epoch, batch, batches, global_step, loss, *rest)

    monkeypatch.setattr(StepLog, 'step', step)
    result = train(_tiny(tmp_path, epochs=1, batch_size=8, grad_accum_steps=2, limit_train_batches=2,
                         warmup_epochs=0, log_interval=1), progress=False)
    assert len(logged) == 1 and result.final['step'] == 1
    assert logged[0] == pytest.approx(result.final['train_loss'], rel=1e-6)
