"""Checkpoints as public trainers write them (issue 45): timm's CheckpointSaver (SOFT's train loop and timm's
train.py) and DeiT's / Sparsifiner's `utils.save_model`, written here with the real classes (timm's
CheckpointSaver, ModelEmaV3, NativeScaler, an optimizer after one step, a scheduler, an argparse.Namespace from a
parser of the trainers' flags). `convert`, `--pretrained-path` and `--initial-checkpoint` read them without running
code, take the weights the source evaluates (EMA for the CheckpointSaver layout, the model for save_model), say
which, and take the other on request; a file needing any other Python global is refused, naming it."""
import argparse
import datetime
import pathlib

import pytest
import timm
import torch
from torch import nn

from structformer.cli import main
from structformer.errors import UsageError
from structformer.weights.cli import convert_checkpoint
from test_convert import _as_loaded, _fill, crate_official_forward, crate_official_shapes

F64 = torch.float64


def module_from_state(state):
    """A real nn.Module whose state_dict has exactly `state`'s keys (the public layout), tensors as parameters."""
    root = nn.Module()
    for name, value in state.items():
        *path, leaf = name.split('.')
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, nn.Parameter(value.clone().float()))
    return root


def trainer_args(**overrides):
    """The Namespace a trainer pickles as `args`: parsed from flags of its parser (paths, lists, floats, None,
    booleans), plus what the scripts set afterwards (device, distributed state)."""
    p = argparse.ArgumentParser()
    p.add_argument('--model', default='soft_tiny')
    p.add_argument('--data-dir', default='/data/imagenet')
    p.add_argument('--output', type=pathlib.Path, default=pathlib.Path('output/train'))
    p.add_argument('--lr', type=float, default=1e-3)
    p.add_argument('--opt-betas', type=float, nargs='+', default=None)
    p.add_argument('--mean', type=float, nargs=3, default=[0.485, 0.456, 0.406])
    p.add_argument('--model-ema', action='store_true', default=True)
    p.add_argument('--model-ema-decay', type=float, default=0.99996)
    p.add_argument('--epochs', type=int, default=300)
    args = p.parse_args([])
    args.device, args.distributed, args.world_size, args.rank = 'cuda:0', False, 1, 0
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


@pytest.fixture(scope='module')
def weights():
    """crate_digits-sized weights in CRATE's public layout, and EMA weights that differ from them."""
    model = _fill(crate_official_shapes(1, 2, 64, 4, 4, 16, 16, 10), seed=7)
    ema = {k: v + 0.05 * torch.randn(v.shape, dtype=v.dtype, generator=torch.Generator().manual_seed(8))
           for k, v in model.items()}
    return model, ema


def _trained(state):
    """The module, an AdamW after one step (optimizer state with tensors) and a timm scheduler."""
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2
    module = module_from_state(state)
    opt = create_optimizer_v2(module, 'adamw', lr=1e-3)
    sum(p.sum() for p in module.parameters()).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():                      # back to the weights under test (the step moved them)
        for name, p in module.named_parameters():
            p.copy_(state[name])
    sched, _ = create_scheduler_v2(opt, 'cosine', num_epochs=10, warmup_epochs=1)
    return module, opt, sched


@pytest.fixture(scope='module')
def saver_file(weights, tmp_path_factory):
    """As SOFT's main.py saves through timm's CheckpointSaver (args, model_ema and amp_scaler given)."""
    import warnings

    from timm.utils import CheckpointSaver, ModelEmaV3, NativeScaler
    model_w, ema_w = weights
    module, opt, _ = _trained(model_w)
    ema = ModelEmaV3(module, decay=0.99996)
    with torch.no_grad():
        for name, p in ema.module.named_parameters():
            p.copy_(ema_w[name])
    folder = tmp_path_factory.mktemp('soft_trainer')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')        # NativeScaler's GradScaler without CUDA
        scaler = NativeScaler()
    saver = CheckpointSaver(module, opt, args=trainer_args(), model_ema=ema, amp_scaler=scaler,
                            checkpoint_dir=str(folder), recovery_dir=str(folder))
    saver.save_checkpoint(12, metric=71.25)
    path = folder / 'checkpoint-12.pth.tar'
    assert {'args', 'state_dict', 'state_dict_ema', 'optimizer', 'amp_scaler', 'metric'} <= set(torch.load(
        path, weights_only=False))
    return path


@pytest.fixture(scope='module')
def save_model_file(weights, tmp_path_factory):
    """As DeiT's / Sparsifiner's utils.save_model write it: model, optimizer, lr_scheduler, epoch, scaler (a
    GradScaler's state), args, best accuracies and model_ema."""
    model_w, ema_w = weights
    module, opt, sched = _trained(model_w)
    path = tmp_path_factory.mktemp('deit_trainer') / 'checkpoint-29.pth'
    torch.save({'model': module.state_dict(), 'optimizer': opt.state_dict(), 'lr_scheduler': sched.state_dict(),
                'epoch': 29, 'scaler': {'scale': 65536.0, 'growth_factor': 2.0, 'backoff_factor': 0.5,
                                        'growth_interval': 2000, '_growth_tracker': 17},
                'args': trainer_args(model='sparsifiner', output_dir='out'), 'best': 71.5, 'best_ema': 72.0,
                'model_ema': {k: v.float() for k, v in ema_w.items()}}, path)
    return path


def _logits(model, state):
    x = torch.randn(2, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.double().eval()(x), crate_official_forward(_as_loaded(state), x, 2, 4, 4)


@pytest.mark.parametrize('layout, asked, expected', [
    ('saver', None, 'ema'), ('saver', 'model', 'model'), ('save_model', None, 'model'), ('save_model', 'ema', 'ema')])
def test_trainer_checkpoints_convert_with_the_evaluated_weights(layout, asked, expected, weights, saver_file,
                                                                save_model_file):
    path = saver_file if layout == 'saver' else save_model_file
    model, notes = convert_checkpoint('crate-official', path, 'crate_digits', weights=asked)
    ours, reference = _logits(model, weights[0] if expected == 'model' else weights[1])
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-10)
    key = {('saver', 'ema'): 'state_dict_ema', ('saver', 'model'): 'state_dict',
           ('save_model', 'ema'): 'model_ema', ('save_model', 'model'): 'model'}[layout, expected]
    (taken,) = [line for line in notes if line.startswith('took ')]
    assert taken.startswith(f"took {key}, epoch {12 if layout == 'saver' else 29}: "), taken
    assert ('as --weights asked' in taken) == (asked is not None)


def test_training_flags_read_a_trainer_checkpoint_and_say_which_weights(weights, saver_file, tmp_path, capsys):
    run = tmp_path / 'run'
    assert main(['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '1', '--limit-train-batches',
                 '1', '--pretrained-path', str(saver_file), '--output', str(run), '--no-progress']) == 0
    out = capsys.readouterr().out
    assert 'took state_dict_ema, epoch 12: the EMA weights' in out and 'converted from the crate-official' in out
    from safetensors.torch import load_file
    start = load_file(str(run / 'checkpoints' / 'epoch_0000' / 'model.safetensors'))
    torch.testing.assert_close(start['blocks.1.mlp.weight'], weights[1]['transformer.layers.1.1.fn.weight'].float(),
                               rtol=0, atol=0)


@pytest.mark.parametrize('value, refused', [(datetime.datetime(2024, 5, 1), 'datetime.datetime'),
                                            (print, 'builtins.print')])
def test_a_file_needing_another_global_is_refused_naming_it(value, refused, weights, tmp_path):
    path = tmp_path / 'ckpt.pth'
    torch.save({'state_dict': {k: v.float() for k, v in weights[0].items()}, 'args': trainer_args(when=value)},
               path)
    with pytest.raises(UsageError, match=rf"convert FILE {path}: refused: it needs the Python global {refused}, "):
        convert_checkpoint('crate-official', path, 'crate_digits')


def test_weights_asked_for_that_the_file_does_not_hold(weights, tmp_path):
    plain = tmp_path / 'plain.pth'
    torch.save({'state_dict': {k: v.float() for k, v in weights[0].items()}, 'epoch': 3}, plain)
    with pytest.raises(UsageError, match='--weights ema: .*holds no EMA weights'):
        convert_checkpoint('crate-official', plain, 'crate_digits', weights='ema')
    model, notes = convert_checkpoint('crate-official', plain, 'crate_digits', weights='model')
    assert 'took state_dict, epoch 3' in notes


def test_the_training_flags_point_to_convert_for_the_other_weights(save_model_file, tmp_path, capsys):
    """`structformer train` has no --weights: the line saying which weights a training flag took names the command
    that takes the other kind (convert --weights), not a flag train would refuse; convert's own line names its flag."""
    run = tmp_path / 'run'
    assert main(['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '1', '--limit-train-batches',
                 '1', '--pretrained-path', str(save_model_file), '--output', str(run), '--no-progress']) == 0
    out = capsys.readouterr().out
    taken = next(line for line in out.splitlines() if 'took model, epoch 29' in line)
    assert taken.endswith('; to start from the EMA weights, convert the file with structformer convert --weights ema'
                          ), taken
    _, notes = convert_checkpoint('crate-official', save_model_file, 'crate_digits')
    assert next(n for n in notes if n.startswith('took ')).endswith('; --weights ema takes the other')
