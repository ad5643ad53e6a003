"""--initial-checkpoint: fine-tuning from trained weights, adapted as timm adapts pretrained weights."""
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from structformer.cli import main
from structformer.train import TrainConfig, train

VIT = {'patch_size': 2, 'depth': 2, 'embed_dim': 32, 'num_heads': 2}


@pytest.fixture(scope='module')
def digits_vit(tmp_path_factory):
    out = tmp_path_factory.mktemp('pre') / 'run'
    train(TrainConfig(model='vit_tiny_patch16_224', model_kwargs=dict(VIT), data='digits', epochs=1,
                      limit_train_batches=3, warmup_epochs=0, log_interval=0, output=str(out)), progress=False)
    return out


def _images(root, classes=3, size=16):
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f'c{c}').mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / f'c{c}' / f'{i}.png')
    return root


def test_fine_tune_adapts_head_channels_and_position_embedding(tmp_path, digits_vit, capsys):
    """Digits (1 channel, 8 px, 10 classes) -> RGB 16 px, 3 classes: the head is re-initialised, the patch
    embedding's channels adapted, the 4x4 position grid resampled to 8x8; every other weight is the pre-trained one."""
    folder = _images(tmp_path / 'imgs')
    config = TrainConfig(model='vit_tiny_patch16_224', model_kwargs=dict(VIT), data=f'imagefolder:{folder}',
                         data_kwargs={'img_size': 16}, epochs=1, limit_train_batches=1, warmup_epochs=0, log_interval=0,
                         initial_checkpoint=str(digits_vit), output=str(tmp_path / 'ft'), num_workers=0)
    result = train(config, progress=False)
    out = capsys.readouterr().out
    assert 'adapted head.weight [10, 32] -> [3, 32]' in out
    assert 'patch_embed.proj.weight: input channels 1 -> 3' in out
    assert 'pos_embed: grid 4x4 -> 8x8' in out
    pre = load_file(str(digits_vit / 'checkpoints' / 'epoch_0001' / 'model.safetensors'))
    start = load_file(str(tmp_path / 'ft' / 'checkpoints' / 'epoch_0000' / 'model.safetensors'))
    # the pre-trained weights, untouched where no adaptation applies
    torch.testing.assert_close(start['blocks.1.mlp.fc2.weight'], pre['blocks.1.mlp.fc2.weight'], rtol=0, atol=0)
    # timm's adapt_input_conv for 1 -> 3 channels: the single channel repeated and scaled by 1/3
    torch.testing.assert_close(start['patch_embed.proj.weight'], pre['patch_embed.proj.weight'].repeat(1, 3, 1, 1) / 3)
    assert start['pos_embed'].shape == (1, 65, 32)
    torch.testing.assert_close(start['pos_embed'][:, :1], pre['pos_embed'][:, :1])    # the cls position kept
    assert result.final['epoch'] == 1


def test_weights_only_pth_and_safetensors_files_load(tmp_path, digits_vit):
    weights = load_file(str(digits_vit / 'checkpoints' / 'epoch_0001' / 'model.safetensors'))
    torch.save({'model': {f'module.{k}': v for k, v in weights.items()}}, tmp_path / 'w.pth')   # a DDP script's layout
    save_file(weights, str(tmp_path / 'w.safetensors'))
    for name in ('w.pth', 'w.safetensors'):
        result = train(TrainConfig(model='vit_tiny_patch16_224', model_kwargs=dict(VIT), data='digits', epochs=1,
                                   limit_train_batches=1, log_interval=0, warmup_epochs=0, output=str(tmp_path / f'run_{name}'),
                                   initial_checkpoint=str(tmp_path / name)), progress=False)
        start = load_file(str(tmp_path / f'run_{name}' / 'checkpoints' / 'epoch_0000' / 'model.safetensors'))
        assert all(torch.equal(start[k], weights[k]) for k in weights)
        assert result.final['epoch'] == 1


def test_bad_initial_checkpoints_are_one_line(tmp_path, digits_vit, capsys):
    class Evil:
        def __reduce__(self):
            return (print, ('ran code',))
    torch.save({'x': Evil()}, tmp_path / 'pickle.pth')
    (tmp_path / 'notes.txt').write_text('hello')
    cases = [(str(tmp_path / 'missing.pth'), 'does not exist'),
             (str(tmp_path / 'pickle.pth'), 'refused: it needs the Python global builtins.print'),
             (str(tmp_path / 'notes.txt'), 'accepted a run or checkpoint folder'),
             (str(digits_vit), 'do not fit')]
    for path, words in cases:
        extra = ['--model', 'crate_digits'] if path == str(digits_vit) else []
        code = main(['train', '--initial-checkpoint', path, *extra, '--output', str(tmp_path / 'out'), '--no-progress'])
        err = capsys.readouterr().err
        assert code == 2 and '--initial-checkpoint' in err and words in err, err
        assert 'ran code' not in err
        assert not (tmp_path / 'out').exists()


def test_same_command_with_resume_takes_a_relative_initial_checkpoint(tmp_path, digits_vit, monkeypatch, capsys):
    """timm's habit: the interrupted command again with --resume. The run records --initial-checkpoint as an
    absolute path, and the same relative path given again was refused as a change (saved '/abs/run', given
    'run'); another place is still refused."""
    monkeypatch.chdir(digits_vit.parent)
    command = ['train', '--model', 'vit_tiny_patch16_224', '--model-kwargs', *[f'{k}={v}' for k, v in VIT.items()],
               '--data', 'digits', '--limit-train-batches', '1', '--warmup-epochs', '0', '--log-interval', '0',
               '--initial-checkpoint', digits_vit.name, '--output', str(tmp_path / 'ft'), '--no-progress']
    assert main([*command, '--epochs', '1']) == 0
    capsys.readouterr()
    assert main([*command, '--epochs', '2', '--resume']) == 0, capsys.readouterr().err
    assert 'resumed from epoch 1 of 2' in capsys.readouterr().out
    (tmp_path / 'other').mkdir()
    monkeypatch.chdir(tmp_path / 'other')
    assert main([*command, '--epochs', '2', '--resume']) == 2
    assert '--initial-checkpoint cannot change on --resume' in capsys.readouterr().err
