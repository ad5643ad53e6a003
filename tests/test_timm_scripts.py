"""Weights moving between timm's scripts (train.py / validate.py, through `structformer convert`) and our tools give
timm's numbers: `structformer eval` of a weights folder normalises as the folder's config.json says, as timm's
`local-dir:` loading with `resolve_data_config` / `create_transform` (validate.py's calls) does."""
import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config

from structformer.cli import main
from structformer.weights.folder import save_weights_folder


def _image_folder(root, classes=2, per_class=3, size=12, seed=0):
    rng = np.random.default_rng(seed)
    for split in ('train', 'val'):
        for c in range(classes):
            folder = root / split / f'class{c}'
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = (rng.random((size, size, 3)) * 120 + 60 * c).astype('uint8')
                Image.fromarray(pixels).save(folder / f'{i}.png')
    return root


def test_eval_of_a_weights_folder_normalises_as_its_config_says(tmp_path, capsys):
    """A crate_digits built for RGB (as timm's train.py builds it) keeps the digits statistics in its config; eval on
    an image folder scored it with ImageNet's mean / std (41.7 % where validate.py gave 16.7 %)."""
    torch.manual_seed(0)
    model = timm.create_model('crate_digits', in_chans=3, num_classes=2)
    weights = save_weights_folder(model.eval(), tmp_path / 'weights', {'in_chans': 3, 'num_classes': 2})
    data = _image_folder(tmp_path / 'images')
    assert main(['eval', '--checkpoint', str(weights), '--data', f'imagefolder:{data}', '--json']) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    from torchvision.datasets import ImageFolder
    loaded = timm.create_model(f'local-dir:{weights}', pretrained=True).eval()
    config = resolve_data_config({}, model=loaded)
    assert config['mean'] != pytest.approx((0.485, 0.456, 0.406))      # the test would not tell otherwise
    images = ImageFolder(str(data / 'val'), transform=create_transform(**config))
    batch = torch.stack([x for x, _ in images])
    labels = torch.tensor([y for _, y in images])
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(loaded(batch), labels).item()
    assert ours['loss'] == pytest.approx(loss, rel=1e-5)
    assert ours['mean'] == pytest.approx(config['mean'])


def test_convert_takes_a_timm_train_py_checkpoint_of_a_one_channel_model(tmp_path, capsys):
    """timm's train.py builds crate_digits with in_chans=3 unless --in-chans 1; convert of its model_best.pth.tar
    without --model-kwargs refused it as another size ('is --model the checkpoint's size?'). A checkpoint of
    another model is still refused."""
    import argparse
    torch.manual_seed(0)
    model = timm.create_model('crate_digits', in_chans=3, num_classes=3)
    checkpoint = tmp_path / 'model_best.pth.tar'
    torch.save({'epoch': 0, 'arch': 'crate_digits', 'state_dict': model.state_dict(),
                'state_dict_ema': model.state_dict(), 'args': argparse.Namespace(in_chans=None)}, checkpoint)
    assert main(['convert', str(checkpoint), '--from', 'timm', '--model', 'crate_digits',
                 '--output', str(tmp_path / 'w')]) == 0
    assert 'in_chans=3' in capsys.readouterr().out
    config = json.loads((tmp_path / 'w' / 'config.json').read_text())
    assert config['model_args']['in_chans'] == 3 and config['pretrained_cfg']['input_size'] == [3, 8, 8]
    loaded = timm.create_model(f"local-dir:{tmp_path / 'w'}", pretrained=True).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model.eval()(x))
    assert main(['convert', str(checkpoint), '--from', 'timm', '--model', 'crate_mnist',
                 '--output', str(tmp_path / 'm')]) == 2
    assert "is --model the checkpoint's size?" in capsys.readouterr().err and not (tmp_path / 'm').exists()


def test_eval_and_export_of_a_timm_checkpoint_point_to_convert(tmp_path, capsys):
    """eval / export of timm's model_best.pth.tar name the verb that takes it (they named train
    --initial-checkpoint only, or no way at all)."""
    checkpoint = tmp_path / 'model_best.pth.tar'
    torch.save({'epoch': 0, 'state_dict': timm.create_model('crate_digits').state_dict()}, checkpoint)
    assert main(['eval', '--checkpoint', str(checkpoint), '--data', 'digits']) == 2
    assert 'structformer convert FILE --from timm' in capsys.readouterr().err
    assert main(['export', str(checkpoint), '--format', 'hf', '--output', str(tmp_path / 'hf')]) == 2
    assert 'structformer convert FILE --from timm' in capsys.readouterr().err and not (tmp_path / 'hf').exists()


def test_eval_of_a_folder_without_a_split_takes_the_val_fraction_its_error_names(tmp_path, capsys):
    """A folder of class folders alone (no train/ and val/, as validate.py reads one) is split by the held-out
    fraction; too few images for the run's 0.2 and eval's one line said 'give --val-fraction in [0.34, 0.66]', a flag
    eval did not take (argparse: unrecognized arguments). eval now takes it, and the remedy works."""
    torch.manual_seed(0)
    model = timm.create_model('crate_digits', in_chans=3, num_classes=3)
    weights = save_weights_folder(model.eval(), tmp_path / 'weights', {'in_chans': 3, 'num_classes': 3})
    for c in range(3):
        (tmp_path / 'flat' / f'class{c}').mkdir(parents=True)
        for i in range(3):
            Image.new('RGB', (8, 8), (40 * c, 10 * i, 0)).save(tmp_path / 'flat' / f'class{c}' / f'{i}.png')
    argv = ['eval', '--checkpoint', str(weights), '--data', f"imagefolder:{tmp_path / 'flat'}"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert '--val-fraction in [0.34, 0.66]' in error
    assert main(argv + ['--val-fraction', '0.5', '--json']) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])['images'] == 5      # sklearn holds out ceil(9 * 0.5)
    with pytest.raises(SystemExit):
        main(argv + ['--val-fraction', '1'])
    assert '--val-fraction' in capsys.readouterr().err
