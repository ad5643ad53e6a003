"""Exact resume with loader workers and every stochastic op on (drop path, Mixup, RandAugment, random erasing), for
image folders, shards and Hugging Face data sets: a run stopped after epoch 1, resumed, stopped again inside epoch 2
(Ctrl-C after step 5, a recovery point at step 4: --recovery-interval 2) and resumed from that point ends with the
weights of the straight run, bit for bit. Recovery points do not pile up (train/recovery.py).

Epoch 3 is what catches a loader that draws from torch's global RNG when it makes its iterator (the evaluation
loader did): with persistent workers the straight run makes it once, a resumed run once more."""
import os

import numpy as np
import pytest
import torch

from structformer.cli import main

STOCHASTIC = ['--drop-path', '0.1', '--mixup', '0.5', '--aa', 'rand-m9-mstd0.5-inc1', '--reprob', '0.25']


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
    """The same 24 RGB images as an image folder (train/ 18, val/ 6), as shards and as a saved hfds DatasetDict."""
    import datasets
    from PIL import Image

    from structformer.data.shard_writer import write_shards
    base = tmp_path_factory.mktemp('resume')
    rng = np.random.default_rng(0)
    rows = {'train': ([], []), 'validation': ([], [])}
    for split, folder, n in (('train', 'train', 6), ('validation', 'val', 2)):
        for c, name in enumerate(('ant', 'bee', 'cow')):
            (base / 'folder' / folder / name).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(base / 'folder' / folder / name / f'{i}.png')
                rows[split][0].append(Image.fromarray(pixels))
                rows[split][1].append(c)
    os.environ.setdefault('STRUCTFORMER_CACHE', str(base / 'cache'))
    write_shards(str(base / 'folder'), str(base / 'wds'), 5)
    features = datasets.Features({'image': datasets.Image(),
                                  'label': datasets.ClassLabel(names=['ant', 'bee', 'cow'])})
    datasets.DatasetDict({split: datasets.Dataset.from_dict({'image': images, 'label': labels}, features=features)
                          for split, (images, labels) in rows.items()}).save_to_disk(str(base / 'hf'))
    return {'imagefolder': f"imagefolder:{base / 'folder'}", 'wds': f"wds:{base / 'wds'}", 'hfds': f"hfds:{base / 'hf'}"}


def _train(out, data, *extra):
    return main(['train', '--model', 'crate_digits', '--data', data, '--epochs', '3', '-b', '2', '--workers', '2',
                 '--warmup-epochs', '0', '--output', str(out), '--no-progress', '--log-interval', '0',
                 '--recovery-interval', '2', '--keep-last', '3', *STOCHASTIC, *extra])


def _weights(run, epoch):
    from safetensors.torch import load_file
    return load_file(str(run / 'checkpoints' / f'epoch_{epoch:04d}' / 'model.safetensors'))


@pytest.mark.parametrize('form', ['imagefolder', 'wds', 'hfds'])
def test_stopped_resumed_and_crashed_mid_epoch_equals_the_straight_run(form, sources, tmp_path, monkeypatch, capsys):
    data = sources[form]
    assert _train(tmp_path / 'straight', data) == 0
    assert _train(tmp_path / 'resumed', data, '--stop-after', '1') == 0
    monkeypatch.setenv('STRUCTFORMER_TEST_KILL_AT', 'epoch 2:step 5')      # Ctrl-C after step 5 of epoch 2
    monkeypatch.setenv('STRUCTFORMER_TEST_KILL_WITH', 'SIGINT')
    assert main(['train', '--resume', '--output', str(tmp_path / 'resumed'), '--no-progress']) == 130
    monkeypatch.delenv('STRUCTFORMER_TEST_KILL_AT')
    ckpt = tmp_path / 'resumed' / 'checkpoints'
    points = sorted(p.name for p in ckpt.glob('recovery_*'))
    assert len(points) == 1 and points[0].startswith('recovery_0002_'), points      # the newest only
    capsys.readouterr()
    assert main(['train', '--resume', '--output', str(tmp_path / 'resumed'), '--no-progress']) == 0
    assert 'resumed inside epoch 2 of 3, after 4 of its' in capsys.readouterr().out
    for epoch in (1, 2, 3):
        a, b = _weights(tmp_path / 'straight', epoch), _weights(tmp_path / 'resumed', epoch)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (form, epoch)
    assert not all(torch.equal(v, _weights(tmp_path / 'straight', 2)[k]) for k, v in _weights(tmp_path / 'straight', 3).items())
    assert not list(ckpt.glob('recovery_*')) and not list((tmp_path / 'straight' / 'checkpoints').glob('recovery_*'))
