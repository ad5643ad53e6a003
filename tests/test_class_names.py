"""Class names travel with a run (data/classes.py): RUN/classes.json and every checkpoint hold the names in the order
of the model's outputs and say which order that is; `eval --per-class` reports by name; `export --format hf` writes
them as timm's label_names, which timm's local-dir: loading reads back (and load_model puts them in the model's
pretrained_cfg, for inference); data whose classes differ, or come in another order, is refused on eval and resume.

An image folder of `Zebra`, `ant`, `Bee` is the case in point: torchvision's ImageFolder (ours) sorts by code point
(Bee, Zebra, ant), timm's reader without case (ant, Bee, Zebra)."""
import json

import numpy as np
import pytest

from structformer.cli import main

TORCHVISION_ORDER = ['Bee', 'Zebra', 'ant']


@pytest.fixture(scope='module')
def run(tmp_path_factory):
    from PIL import Image
    base = tmp_path_factory.mktemp('classes')
    rng = np.random.default_rng(0)
    for split, n in (('train', 4), ('val', 3)):
        for c, name in enumerate(('Zebra', 'ant', 'Bee')):
            (base / 'images' / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = np.full((8, 8, 3), 60 * c, np.uint8) + rng.integers(0, 20, (8, 8, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(base / 'images' / split / name / f'{i}.png')
    assert main(['train', '--model', 'crate_digits', '--data', f"imagefolder:{base / 'images'}", '--epochs', '1',
                 '-b', '4', '--workers', '0', '--warmup-epochs', '0', '--output', str(base / 'run'),
                 '--no-progress', '--log-interval', '0']) == 0
    return base


def test_the_run_folder_and_every_checkpoint_record_the_names_and_their_order(run):
    record = json.loads((run / 'run' / 'classes.json').read_text())
    assert record['classes'] == TORCHVISION_ORDER and record['num_classes'] == 3
    assert 'torchvision' in record['class_order'] and 'code point' in record['class_order']
    for checkpoint in ('epoch_0000', 'epoch_0001'):
        state = json.loads((run / 'run' / 'checkpoints' / checkpoint / 'state.json').read_text())
        assert state['data_info']['classes'] == TORCHVISION_ORDER
        assert state['data_info']['class_order'] == record['class_order']


def test_eval_reports_each_class_by_name(run, capsys):
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(run / 'run'), '--per-class', '--json']) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = result['per_class']
    assert [r['class'] for r in rows] == TORCHVISION_ORDER and [r['images'] for r in rows] == [3, 3, 3]
    hits = sum(r['top1'] * r['images'] / 100 for r in rows)
    assert hits == pytest.approx(result['top1'] * result['images'] / 100)
    assert main(['eval', '--checkpoint', str(run / 'run'), '--per-class']) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith('  ')]
    assert [row[0] for row in rows] == TORCHVISION_ORDER and all(row[2] == 'images' for row in rows)


def test_data_with_other_classes_or_order_is_refused_on_eval_and_resume(run, tmp_path, capsys):
    from structformer.data.shard_writer import write_shards
    write_shards(f"timm::{run / 'images'}", str(tmp_path / 'timm-order'), 8)       # ant, Bee, Zebra
    assert main(['eval', '--checkpoint', str(run / 'run'), '--data', f"wds:{tmp_path / 'timm-order'}"]) == 2
    err = capsys.readouterr().err
    assert "the same 3 class names in another order: class 0 is 'Bee' for the run, 'ant' in the data" in err
    assert 'torchvision' in err and len(err.strip().splitlines()) == 1, err
    import shutil
    shutil.copytree(run / 'run', tmp_path / 'run')
    shutil.copytree(run / 'images', tmp_path / 'images')
    (tmp_path / 'images' / 'train' / 'Zebra').rename(tmp_path / 'images' / 'train' / 'Yak')
    (tmp_path / 'images' / 'val' / 'Zebra').rename(tmp_path / 'images' / 'val' / 'Yak')
    config = (tmp_path / 'run' / 'config.yaml').read_text().replace(str(run / 'images'), str(tmp_path / 'images'))
    (tmp_path / 'run' / 'config.yaml').write_text(config)
    for state_file in (tmp_path / 'run' / 'checkpoints').glob('*/state.json'):
        state_file.write_text(state_file.read_text().replace(str(run / 'images'), str(tmp_path / 'images')))
    assert main(['train', '--resume', '--output', str(tmp_path / 'run'), '--epochs', '2', '--no-progress']) == 2
    err = capsys.readouterr().err
    assert "--resume: --data" in err and "only the run's: 'Zebra'" in err and "only the data's: 'Yak'" in err, err


def test_export_hf_writes_label_names_that_timm_reads_back(run, tmp_path):
    import timm

    import structformer  # noqa: F401
    from structformer.train import load_model
    model, _ = load_model(str(run / 'run'))
    assert model.pretrained_cfg['label_names'] == TORCHVISION_ORDER               # inference sees the names
    assert main(['export', str(run / 'run'), '--format', 'hf', '--output', str(tmp_path / 'hf')]) == 0
    config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
    assert config['label_names'] == TORCHVISION_ORDER
    loaded = timm.create_model(f"local-dir:{tmp_path / 'hf'}", pretrained=True)
    assert loaded.pretrained_cfg['label_names'] == TORCHVISION_ORDER
