"""webdataset shards (data/shards.py, data/wds.py): the writer round-trips a folder; the stream splits shards over
processes and workers and gives every sample once per epoch; the epoch depends on (seed, epoch) alone, so a
resumed run equals a straight one; held-out shards are named; bad shards are one line, exit 2, nothing written."""
import io
import json
import os
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from structformer.cli import main
from structformer.data import build_datasets
from structformer.data.shards import ShardStream, iter_shard, stream_loader
from structformer.data.shard_writer import write_shards

CLASSES = ('ant', 'bee', 'cow')


def _folder(root: Path, per_class: int, offset: int = 0):
    """PNG images (lossless) whose first pixel encodes a unique id, and a few JPEGs: id = R + 256 G."""
    from PIL import Image
    k = offset
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((12, 10, 3), 7, np.uint8)
            pixels[0, 0] = (k % 256, k // 256, 0)
            Image.fromarray(pixels).save(root / c / f'{k:04d}.png')
            k += 1
    return k


def pixel_id(image):
    """The id a test image carries in its first pixel (a picklable transform for loader workers)."""
    r, g, _ = image.getpixel((0, 0))
    return torch.tensor(r + 256 * g)


@pytest.fixture(scope='module')
def shards(tmp_path_factory):
    base = tmp_path_factory.mktemp('shards')
    _folder(base / 'images', 8)                       # 24 samples in 4 shards of 6: two processes x two workers
    write_shards(str(base / 'images'), str(base / 'wds'), 6)
    return base


def test_shards_round_trip_images_labels_and_class_order(tmp_path):
    from torchvision.datasets import ImageFolder
    n = _folder(tmp_path / 'tv' / 'train', 5)
    _folder(tmp_path / 'tv' / 'val', 2, offset=n)
    assert main(['data', 'shard', str(tmp_path / 'tv'), str(tmp_path / 'out'), '--shard-size', '4']) == 0
    info = json.loads((tmp_path / 'out' / '_info.json').read_text())
    assert info['classes'] == list(CLASSES)
    for split, folder in (('train', 'train'), ('validation', 'val')):
        source = ImageFolder(str(tmp_path / 'tv' / folder))
        expected = sorted((Path(p).read_bytes(), label) for p, label in source.samples)
        names = info['splits'][split]['filenames']
        got = [(data, label) for name in names for _, ext, data, label in iter_shard(str(tmp_path / 'out' / name))]
        assert sorted(got) == expected                   # the same bytes under the same labels
        assert info['splits'][split]['shard_lengths'] == [len(list(iter_shard(str(tmp_path / 'out' / f))))
                                                          for f in names]
        assert sum(info['splits'][split]['shard_lengths']) == len(source.samples)
    train, val, data_info = build_datasets(f"wds:{tmp_path / 'out'}", img_size=8)
    assert data_info.extra['classes'] == list(CLASSES) and data_info.num_classes == 3
    assert (len(train), len(val)) == (15, 6)
    val_source = ImageFolder(str(tmp_path / 'tv' / 'val'))
    assert val.targets == val_source.targets            # validation keeps the folder's order


def _epoch_ids(stream: ShardStream, epoch: int, world: int, workers: int, batch: int = 4):
    """{rank: [(worker-order batch, ids)]} of one epoch through real DataLoaders (ranks one after another)."""
    seen = {}
    for rank in range(world):
        loader, order, batches = stream_loader(stream, batch_size=batch, workers=workers, rank=rank,
                                               world_size=world, drop_last=False)
        order.set_epoch(epoch)
        got = [x.tolist() for x, _ in loader]
        assert len(got) == batches
        seen[rank] = got
    return seen


def _stream(shards, **kw):
    train, _, _ = build_datasets(f"wds:{shards / 'wds' / 'train-{000000..000003}.tar'},"
                                 f"{shards / 'wds' / 'train-000000.tar'}", train_transform=pixel_id, **kw)
    return train


def test_two_processes_two_workers_see_disjoint_shards_and_every_sample_once(shards):
    stream = _stream(shards, shuffle_buffer=3)
    for epoch in (1, 2):
        slots = [stream.slot_shards(epoch, slot, 4) for slot in range(4)]
        assert sorted(s for slot in slots for s in slot) == [0, 1, 2, 3]      # dealt: disjoint, all of them
        seen = _epoch_ids(stream, epoch, world=2, workers=2)
        ids = [i for rank in seen.values() for batch in rank for i in batch]
        assert sorted(ids) == list(range(24))                                  # every sample once
        by_rank = [{i for batch in seen[r] for i in batch} for r in (0, 1)]
        assert not by_rank[0] & by_rank[1] and len(seen[0]) == len(seen[1])   # disjoint, equal steps (DDP)
        # each process's two workers read whole shards: the ids of a shard stay in one rank
        shard_of = {i: s for s in range(4) for _, _, _, i in
                    [(0, 0, 0, int(pixel_id(__import__('PIL.Image', fromlist=['x']).open(io.BytesIO(d)))))
                     for _, _, d, _ in iter_shard(str(shards / 'wds' / f'train-{s:06d}.tar'))]}
        for r in (0, 1):
            assert len({shard_of[i] for i in by_rank[r]}) == 2
    first, again, later = (_epoch_ids(stream, e, 2, 2) for e in (1, 1, 2))
    assert first == again and first != later               # seeded by (seed, epoch): same epoch, same order


def test_epoch_is_the_stated_number_of_samples_and_limit_cuts_batches(shards):
    stream = _stream(shards, train_samples=10)
    seen = _epoch_ids(stream, 1, world=1, workers=2, batch=3)
    assert sum(len(b) for b in seen[0]) == 10              # 10 of the 24, from both workers
    loader, _, batches = stream_loader(stream, batch_size=3, workers=2, rank=0, world_size=1, drop_last=False,
                                       limit_batches=2)
    assert batches == 2 and len(list(loader)) == 2


def test_held_out_shards_are_named_and_sample_holdout_is_disjoint(shards, capsys):
    train, val, info = build_datasets(f"wds:{shards / 'wds' / 'train-{000000..000003}.tar'}", img_size=8)
    out = capsys.readouterr().out
    assert 'held out the last 1 of 4 shards' in out and 'train-000003.tar' in out
    assert (len(train), len(val), train.urls[-1].endswith('train-000002.tar')) == (18, 6, True)
    one = shards / 'wds' / 'train-000000.tar'
    train, val, info = build_datasets(f'wds:{one}', train_transform=pixel_id, eval_transform=pixel_id,
                                      val_fraction=0.5, seed=3)
    assert 'seeded val_fraction=0.5' in capsys.readouterr().out
    train.configure(0, 1)
    train.set_epoch(1)
    train_ids = {int(x) for x, _ in train}
    val_ids = {int(val[i][0]) for i in range(len(val))}
    assert len(train) == len(train_ids) and not train_ids & val_ids and len(train_ids | val_ids) == 6
    assert 0 < len(val_ids) < 6


def _train(out: Path, data: str, *extra):
    return main(['train', '--model', 'crate_digits', '--data', data, '--epochs', '2', '-b', '4', '--workers', '2',
                 '--warmup-epochs', '0', '--output', str(out), '--no-progress', '--log-interval', '0',
                 '--aa', 'rand-m9-mstd0.5-inc1', '--reprob', '0.25', *extra])


def test_resume_at_an_epoch_boundary_is_exact_with_shards(shards, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    data = f"wds:{shards / 'wds'}/train-{{000000..000003}}.tar,{shards / 'wds'}/train-000000.tar"
    assert _train(tmp_path / 'straight', data) == 0
    assert _train(tmp_path / 'resumed', data, '--stop-after', '1') == 0
    assert main(['train', '--resume', '--output', str(tmp_path / 'resumed'), '--no-progress', '--workers', '2']) == 0
    a, b = (load_file(str(tmp_path / run / 'checkpoints' / 'epoch_0002' / 'model.safetensors'))
            for run in ('straight', 'resumed'))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    one = load_file(str(tmp_path / 'straight' / 'checkpoints' / 'epoch_0001' / 'model.safetensors'))
    assert not all(torch.equal(a[k], one[k]) for k in a)          # it trained


def _tar(path: Path, members):
    with tarfile.open(path, 'w') as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.fixture
def bad_shards(shards, tmp_path):
    good = (shards / 'wds' / 'train-000000.tar').read_bytes()
    png = next(iter_shard(str(shards / 'wds' / 'train-000000.tar')))[2]
    _tar(tmp_path / 'nocls.tar', [('a.png', png), ('b.png', png)])
    (tmp_path / 'corrupt.tar').write_bytes(good[:len(good) // 2 + 100])
    (tmp_path / 'garbage.tar').write_bytes(b'\x01' * 1024)
    import gzip        # what webdataset's ShardWriter('...%06d.tar.gz') writes, and timm reads as a stream
    (tmp_path / 'packed.tar.gz').write_bytes(gzip.compress(good))
    return tmp_path


@pytest.mark.parametrize('data, needles', [
    ('wds:{d}/none-*.tar', ['none-*.tar', 'names no shard']),
    ('wds:{d}/missing-{{0..1}}.tar', ['do not exist', 'missing-0.tar']),
    ('wds:{d}/nocls.tar', ['nocls.tar', "'a'", 'lacks a class member']),
    ('wds:{d}/corrupt.tar', ['corrupt.tar', 'truncated']),
    ('wds:{d}/garbage.tar', ['garbage.tar', 'not a readable tar']),
    ('wds:{d}/packed.tar.gz', ['packed.tar.gz', 'gzip-compressed', 'read by seeking', 'gunzip']),
    ('wds:{s}/train-000000.tar,', ['expected TRAIN_PATTERN']),
])
def test_bad_shards_are_one_line_exit_2_nothing_written(data, needles, bad_shards, shards, tmp_path, capsys):
    before = sorted(p.name for p in tmp_path.iterdir())
    data = data.format(d=bad_shards, s=shards / 'wds')
    if data.endswith(','):
        data += ',x.tar'
    rc = main(['train', '--model', 'crate_digits', '--data', data, '--output', str(tmp_path / 'run'), '--no-progress'])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if 'error:' in line]
    assert len(lines) == 1 and 'Traceback' not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_shard_command_refuses_a_used_output_and_writes_nothing_on_failure(shards, tmp_path, capsys):
    (tmp_path / 'used').mkdir()
    (tmp_path / 'used' / 'x').write_text('')
    assert main(['data', 'shard', str(shards / 'images'), str(tmp_path / 'used')]) == 2
    assert 'not an empty folder' in capsys.readouterr().err
    bad = tmp_path / 'bad'
    _folder(bad, 2)
    (bad / 'ant' / 'z.png').write_bytes(b'not an image')
    assert main(['data', 'shard', str(bad), str(tmp_path / 'out')]) == 2
    assert 'z.png' in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ['bad', 'used']


def test_hfds_reads_a_saved_dataset(tmp_path):
    import datasets
    from PIL import Image
    images = [Image.fromarray(np.full((6, 6, 3), 10 * i, np.uint8)) for i in range(8)]
    features = datasets.Features({'image': datasets.Image(), 'label': datasets.ClassLabel(names=['x', 'y'])})
    ds = datasets.DatasetDict({
        'train': datasets.Dataset.from_dict({'image': images[:6], 'label': [0, 1] * 3}, features=features),
        'test': datasets.Dataset.from_dict({'image': images[6:], 'label': [1, 0]}, features=features)})
    ds.save_to_disk(str(tmp_path / 'hf'))
    train, val, info = build_datasets(f"hfds:{tmp_path / 'hf'}", img_size=8, augment=False)
    assert (len(train), len(val), info.num_classes, info.extra['classes']) == (6, 2, 2, ['x', 'y'])
    x, y = val[0]
    assert x.shape == (3, 8, 8) and y == 1


@pytest.mark.parametrize('form, package, extra', [('wds', 'webdataset', 'wds'), ('hfds', 'datasets', 'hf')])
def test_without_the_optional_package_one_line_names_the_extra(form, package, extra, shards, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, package, None)                 # import fails as if not installed
    rc = main(['train', '--model', 'crate_digits', '--data', f"{form}:{shards / 'wds'}", '--no-progress',
               '--output', str(shards / 'never')])
    err = capsys.readouterr().err
    assert rc == 2 and f"structformer[{extra}]" in err and len(err.strip().splitlines()) == 1, err
    assert not (shards / 'never').exists()


@pytest.mark.slow
def test_shards_train_on_two_processes_with_two_workers_each(shards, tmp_path, capsys):
    """torchrun, gloo: 4 shards over 2 processes x 2 workers; the processes take equal steps (else DDP hangs) and
    end with the same weights; evaluation counts the 6 validation samples once."""
    import subprocess
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = tmp_path / 'run'
    data = f"wds:{shards / 'wds'}/train-{{000000..000003}}.tar,{shards / 'wds'}/train-000000.tar"
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           '-m', 'structformer', 'train', '--model', 'crate_digits', '--data', data, '--epochs', '1',
                           '-b', '3', '--workers', '2', '--warmup-epochs', '0', '--no-progress', '--log-interval', '0',
                           '--output', str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    digests = [(out / f'final_params_rank{r}.sha256').read_text() for r in (0, 1)]
    assert digests[0] == digests[1]
    record = json.loads((out / 'metrics.jsonl').read_text().splitlines()[-1])
    assert record['step'] == 4                    # 24 samples / 2 processes = 12 each; 2 workers x 6 -> 2 x 2 batches of 3
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(out), '--json']) == 0          # one process over all 6 samples
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record['val_top1'] == pytest.approx(alone['top1'], abs=1e-9) and alone['images'] == 6


def test_an_undecodable_image_in_a_shard_is_passed_over_under_skip(shards, tmp_path, capsys):
    """bad_images=skip: the stream gives its quota, the next sample standing in for the broken one, named in the log;
    without skip the error names the sample."""
    samples = list(iter_shard(str(shards / 'wds' / 'train-000000.tar')))
    members = []
    for i, (key, ext, data, label) in enumerate(samples):
        members += [(f'{key}.{ext}', b'\xff\xd8 not a jpeg' if i == 2 else data), (f'{key}.cls', str(label).encode())]
    _tar(tmp_path / 'broken.tar', members)
    spec = f"wds:{tmp_path / 'broken.tar'},{shards / 'wds' / 'train-000001.tar'}"
    train, _, _ = build_datasets(spec, train_transform=pixel_id, bad_images='skip', train_samples=4)
    train.configure(0, 1)
    train.set_epoch(1)
    ids = [int(x) for x, _ in train]
    good = [int(pixel_id(__import__('PIL.Image', fromlist=['x']).open(io.BytesIO(d)))) for i, (_, _, d, _) in
            enumerate(samples) if i != 2]
    assert len(ids) == 4 and set(ids) <= set(good)
    out = capsys.readouterr().out
    assert f'{samples[2][0]}.png' in out and 'replaced by the next sample' in out
    train, _, _ = build_datasets(spec, train_transform=pixel_id, train_samples=6)
    train.configure(0, 1)
    with pytest.raises(ValueError, match=f"{samples[2][0]}.png cannot be read.*bad_images=skip"):
        list(train)


def test_a_folder_run_is_scored_on_its_shards(shards, tmp_path, capsys):
    """`eval --data wds:...` of a run trained on the image folder: the folder's own options (check=, bad_images=)
    are not options of shards and are not carried over; the images are read at the size the model was trained on."""
    run = tmp_path / 'run'
    assert main(['train', '--model', 'crate_digits', '--data', f"imagefolder:{shards / 'images'}", '--data-kwargs',
                 'check=decode', '--epochs', '1', '--limit-train-batches', '1', '--no-progress',
                 '--output', str(run)]) == 0
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(run), '--data', f"wds:{shards / 'wds'}", '--json']) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result['data'] == f"wds:{shards / 'wds'}" and result['images'] > 0


def _relabel(path: Path, position: int, label: bytes) -> None:
    """Rewrite a shard with the class of its `position`-th sample replaced (the rest byte for byte)."""
    with tarfile.open(path) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar]
    keys = sorted({name.split('.')[0] for name, _ in members})
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode='w') as tar:
        for name, data in members:
            data = label if name == f'{keys[position]}.cls' else data
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(out.getvalue())


@pytest.mark.parametrize('label', [b'3', b'-1'])
def test_a_training_class_outside_the_classes_stops_naming_the_sample(label, shards, tmp_path):
    """The training labels are not read before the run: a shard of another data set (class 3 of 3) or of an
    unlabelled split (-1) ended mid-epoch in the loss's 'IndexError: Target 3 is out of bounds'."""
    import shutil
    shutil.copytree(shards / 'wds', tmp_path / 'wds')
    _relabel(tmp_path / 'wds' / 'train-000001.tar', 2, label)
    train, _, info = build_datasets(f"wds:{tmp_path / 'wds'}", img_size=8, augment=False, val_fraction=0.25)
    assert info.num_classes == 3
    with pytest.raises(ValueError) as caught:
        list(iter(train))
    message = str(caught.value)
    assert 'train-000001.tar' in message and f'has class {label.decode()}, outside the 3 classes' in message, message


def test_an_unlabelled_validation_shard_is_one_line(shards, tmp_path, capsys):
    """A validation sample of class -1 (shards of imagenet-1k's test split) was scored as a class, silently."""
    import shutil
    shutil.copytree(shards / 'wds', tmp_path / 'wds')
    _relabel(tmp_path / 'wds' / 'train-000003.tar', 0, b'-1')         # the held-out (last) shard
    rc = main(['train', '--model', 'crate_digits', '--data', f"wds:{tmp_path / 'wds'}", '--output',
               str(tmp_path / 'run'), '--no-progress'])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and 'a label -1 is outside the 3 classes' in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('given', [2, 4])
def test_num_classes_that_disagrees_with_the_info_json_is_one_line(given, shards):
    """num_classes=N beside an _info.json naming 3 classes was taken as is: a head of N outputs whose indices no
    longer meant the named classes. The message names both numbers."""
    from structformer.errors import UsageError
    with pytest.raises(UsageError) as caught:
        build_datasets(f"wds:{shards / 'wds'}", img_size=8, augment=False, val_fraction=0.25, num_classes=given)
    message = str(caught.value)
    assert f'num_classes={given}' in message and 'names 3 classes' in message and '\n' not in message, message
    _, _, info = build_datasets(f"wds:{shards / 'wds'}", img_size=8, augment=False, val_fraction=0.25, num_classes=3)
    assert info.num_classes == 3


def test_validation_shards_in_their_own_folder_are_counted_by_their_own_info_json(tmp_path):
    """train/shard-0000.tar and val/shard-0000.tar, each folder with its _info.json (shards written per split): the
    validation shards' stated lengths were looked up by file name in the training folder's _info.json, so
    val/shard-0000.tar (3 samples) was 'damaged: _info.json says 6' and the run refused."""
    from PIL import Image
    image = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 50, np.uint8)).save(image, 'PNG')
    for split, lengths in (('train', [6, 5]), ('val', [3, 2])):
        (tmp_path / split).mkdir()
        for s, n in enumerate(lengths):
            _tar(tmp_path / split / f'shard-{s:04d}.tar', [m for i in range(n) for m in (
                (f'{split}{s}_{i}.png', image.getvalue()), (f'{split}{s}_{i}.cls', str(i % 3).encode()))])
        (tmp_path / split / '_info.json').write_text(json.dumps({'splits': {split: {
            'name': split, 'num_samples': sum(lengths), 'filenames': [f'shard-{s:04d}.tar' for s in range(2)],
            'shard_lengths': lengths}}}))
    train, val, info = build_datasets(f"wds:{tmp_path}/train/shard-{{0000..0001}}.tar,"
                                      f"{tmp_path}/val/shard-{{0000..0001}}.tar", img_size=8, augment=False)
    assert (len(train), len(val)) == (11, 5)
    (tmp_path / 'val' / 'shard-0001.tar').write_bytes((tmp_path / 'val' / 'shard-0000.tar').read_bytes())
    with pytest.raises(ValueError, match=r'val/shard-0001\.tar holds 3 samples; _info.json says 2'):
        build_datasets(f"wds:{tmp_path}/train/shard-{{0000..0001}}.tar,{tmp_path}/val/shard-{{0000..0001}}.tar",
                       img_size=8, augment=False)           # the validation folder's own statement still holds
    # two folders' training shards joined with '::': each is counted by its own folder's _info.json
    train, _, _ = build_datasets(f"wds:{tmp_path}/train/shard-{{0000..0001}}.tar::{tmp_path}/val/shard-0000.tar,"
                                 f"{tmp_path}/val/shard-0000.tar", img_size=8, augment=False)
    assert len(train) == 14 and train.lengths == [6, 5, 3]


def _sharded_train_and_val(tmp_path, capsys) -> int:
    """`data shard` of a train/ (5 a class) and val/ (2 a class) folder into tmp_path/out, 4 images a shard; returns
    the number of training images (the val/ images are numbered after them)."""
    n = _folder(tmp_path / 'tv' / 'train', 5)
    _folder(tmp_path / 'tv' / 'val', 2, offset=n)
    assert main(['data', 'shard', str(tmp_path / 'tv'), str(tmp_path / 'out'), '--shard-size', '4']) == 0
    capsys.readouterr()
    return n


def test_a_glob_over_our_shards_is_validated_on_the_validation_split_its_info_json_names(tmp_path, capsys):
    """wds:OUT/train-*.tar over `data shard` output of train/ + val/: no validation pattern, so the last of the
    training shards were held out (the model trained on 10 % fewer images and was scored on training ones) while
    _info.json beside them names the validation split. Now that split is the validation; the log says so.
    An explicit holdout= keeps its meaning."""
    n = _sharded_train_and_val(tmp_path, capsys)
    train, val, info = build_datasets(f"wds:{tmp_path / 'out'}/train-*.tar", img_size=8, train_transform=pixel_id,
                                      eval_transform=pixel_id)
    out = capsys.readouterr().out
    assert (len(train), len(val), len(train.urls)) == (15, 6, 4)
    assert sorted(int(val[i][0]) for i in range(len(val))) == list(range(n, n + 6))   # the val/ images, all
    assert "validation split of _info.json" in out and 'held out' not in out, out
    assert 'validation split of _info.json' in info.extra['holdout']
    train, val, _ = build_datasets(f"wds:{tmp_path / 'out'}/train-*.tar", img_size=8, holdout='shards')
    assert (len(train.urls), len(val)) == (3, 3) and 'held out the last 1 of 4' in capsys.readouterr().out
    # its validation shards gone: the hold-out, as for shards without _info.json
    for name in json.loads((tmp_path / 'out' / '_info.json').read_text())['splits']['validation']['filenames']:
        (tmp_path / 'out' / name).unlink()
    train, val, _ = build_datasets(f"wds:{tmp_path / 'out'}/train-*.tar", img_size=8)
    assert len(train.urls) == 3 and 'held out the last 1 of 4' in capsys.readouterr().out


def test_a_glob_over_all_of_our_shards_leaves_the_validation_split_out_of_training(tmp_path, capsys):
    """wds:OUT/*.tar over `data shard` output of train/ + val/ matched the validation shards too: they were trained
    on, and the last shard (a validation one) held out from them. Now the shards _info.json names as the validation
    split are left out of training (one line says so) and are the validation; an explicit holdout= holds out
    training shards."""
    n = _sharded_train_and_val(tmp_path, capsys)
    train, val, _ = build_datasets(f"wds:{tmp_path / 'out'}/*.tar", img_size=8, train_transform=pixel_id,
                                   eval_transform=pixel_id)
    out = capsys.readouterr().out
    assert [os.path.basename(u) for u in train.urls] == [f'train-{k:06d}.tar' for k in range(4)] and len(train) == 15
    assert sorted(int(val[i][0]) for i in range(len(val))) == list(range(n, n + 6))   # the val/ images, all
    lines = [line for line in out.splitlines() if 'left out of training' in line]
    assert len(lines) == 1 and 'validation-000000.tar, validation-000001.tar' in lines[0], out
    train, val, _ = build_datasets(f"wds:{tmp_path / 'out'}/*.tar", img_size=8, holdout='shards')
    assert [os.path.basename(u) for u in train.urls] == [f'train-{k:06d}.tar' for k in range(3)] and len(val) == 3


@pytest.mark.parametrize('classes, needle', [
    (['ant', 'cow', 'bee'], r"class 1 is 'bee' in .*wds, 'cow' in .*val"),
    (['ant', 'bee'], r'3 classes in .*wds, 2 in .*val'),
])
def test_validation_shards_whose_info_json_names_other_classes_are_refused(classes, needle, shards, tmp_path,
                                                                            capsys):
    """wds:TRAIN,VAL with VAL in a folder of its own: the classes came from the training folder's _info.json only,
    so validation shards of another class list (another data set, or the same names in another order) were scored
    against the training index without a word. Now one line names both folders and the first difference."""
    import shutil
    (tmp_path / 'val').mkdir()
    shutil.copy(shards / 'wds' / 'train-000000.tar', tmp_path / 'val' / 'v-0.tar')
    info = {'classes': classes, 'splits': {'validation': {'filenames': ['v-0.tar'], 'shard_lengths': [6]}}}
    (tmp_path / 'val' / '_info.json').write_text(json.dumps(info))
    data = f"wds:{shards / 'wds' / 'train-{000000..000003}.tar'},{tmp_path / 'val' / 'v-0.tar'}"
    with pytest.raises(ValueError, match=needle):
        build_datasets(data, img_size=8)
    assert main(['train', '--model', 'crate_digits', '--data', data, '--epochs', '1', '--workers', '0',
                 '--output', str(tmp_path / 'run')]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'classes' in err and not (tmp_path / 'run').exists(), err
    info['classes'] = list(CLASSES)                   # the same list: accepted
    (tmp_path / 'val' / '_info.json').write_text(json.dumps(info))
    assert len(build_datasets(data, img_size=8)[1]) == 6



def _build_on_rank(rank, world, init_file, data, out):
    """One process of a gloo group: build `data` twice (held-out shards, held-out samples), counting shard opens."""
    import torch.distributed as dist
    from structformer.data import tars
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    opened, real = [], tars.open_tar
    tars.open_tar = lambda url, *a: opened.append(url) or real(url, *a)
    record = {}
    for name, options in (('shards', {}), ('samples', {'holdout': 'samples'})):
        train, val, info = build_datasets(data, img_size=8, **options)
        record[name] = [len(opened), len(train), [list(e) for e in val.entries], info.extra['holdout']]
        opened.clear()
    try:                                        # process 0's error is every process's (none waits for good)
        build_datasets(f"wds:{Path(out, 'bad', 'train-{000000..000003}.tar')}", img_size=8)
    except ValueError as e:
        record['bad'] = [len(opened), str(e)]
    Path(out, f'rank{rank}.json').write_text(json.dumps(record))
    dist.destroy_process_group()


def test_under_ddp_process_0_alone_opens_the_shards_to_index_them(shards, tmp_path):
    """Two gloo processes build wds:TRAIN (no VAL: a shard held out). Each process opened every shard to check it and
    read every validation shard's headers to index it (and, holding out samples or without _info.json, every
    training shard's), P times the reads of one, at once on one disk. Now process 0 does it and shares the index:
    process 1 opens no shard while building, and both hold the same validation index and epoch."""
    import shutil
    import torch.multiprocessing as tmp
    data = f"wds:{shards / 'wds' / 'train-{000000..000003}.tar'}"
    shutil.copytree(shards / 'wds', tmp_path / 'bad')
    with open(tmp_path / 'bad' / 'train-000002.tar', 'r+b') as f:
        f.truncate(1000)
    tmp.start_processes(_build_on_rank, args=(2, str(tmp_path / 'init'), data, str(tmp_path)), nprocs=2,
                        start_method='fork')
    first, second = (json.loads((tmp_path / f'rank{r}.json').read_text()) for r in (0, 1))
    assert first['shards'][0] == 4 + 1 and first['samples'][0] == 4 + 4      # checks, then the scans
    assert second['shards'][0] == 0 and second['samples'][0] == 0
    for name in ('shards', 'samples'):
        assert first[name][1:] == second[name][1:] and first[name][2]          # the same index and epoch
    assert first['bad'][0] == 2 and second['bad'][0] == 0 and first['bad'][1] == second['bad'][1]
    assert 'train-000002.tar is truncated' in second['bad'][1]
