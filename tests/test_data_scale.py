"""Big folders and sizes (data/imagecheck.py, data/imagefolder.py, data/sizing.py): the up-front check opens headers
only, is cached by file list + sizes + mtimes and invalidated by a change; an image that fails to decode in training
under bad_images=skip is replaced and named; the image size follows the model; a size the model cannot take is one
line naming both sizes."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from structformer.cli import main
from structformer.data import build_datasets
from structformer.data import imagecheck

sys.path.insert(0, str(Path(__file__).parent))
from test_data import _write_cifar  # noqa: E402


def _images(root: Path, per_class: int = 4, side: int = 40):
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in ('a', 'b'):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(root / c / f'{i}.jpg',
                                                                                       quality=95)
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tmp_path / 'cache'))
    return tmp_path / 'cache'


def _counting(monkeypatch):
    calls = []
    real = imagecheck.header_problem

    def counted(path):
        calls.append(path)
        return real(path)
    monkeypatch.setattr(imagecheck, 'header_problem', counted)
    monkeypatch.setattr(imagecheck, 'decode_problem', lambda p: pytest.fail('the default check decoded an image'))
    return calls


def test_header_check_is_cached_and_invalidated_by_a_change(tmp_path, cache, monkeypatch, capsys):
    root = _images(tmp_path / 'imgs')
    calls = _counting(monkeypatch)
    spec = f'imagefolder:{root}'
    build_datasets(spec, img_size=8)
    assert len(calls) == 8 and 'reused' not in capsys.readouterr().out
    build_datasets(spec, img_size=8)
    assert len(calls) == 8 and 'header check of 8 files reused' in capsys.readouterr().out
    (root / 'b' / '3.jpg').write_bytes(b'this is not an image at all')     # same name, new size and mtime
    with pytest.raises(ValueError, match=r"1 of 8 images cannot be read: .*b/3\.jpg"):
        build_datasets(spec, img_size=8)
    assert len(calls) == 16                                                 # checked again, all of them
    (root / 'b' / '3.jpg').unlink()
    build_datasets(spec, img_size=8)                                       # a removed file: a new list
    assert len(calls) == 23
    assert len(list(cache.rglob('*.json'))) == 3


def test_a_file_that_fails_to_decode_in_training_is_replaced_and_named(tmp_path, cache, capsys):
    root = _images(tmp_path / 'imgs', side=64)
    bad = root / 'a' / '2.jpg'
    data = bad.read_bytes()
    bad.write_bytes(data[:len(data) * 2 // 3])          # the header is whole: only decoding finds the cut
    assert imagecheck.header_problem(str(bad)) is None and imagecheck.decode_problem(str(bad)) is not None
    spec = f'imagefolder:{root}'
    train, val, _ = build_datasets(spec, img_size=8, bad_images='skip', val_fraction=0.25, augment=False)
    both = [(ds, i) for ds in (train, val) for i in range(len(ds))
            if ds.dataset.dataset.samples[ds.dataset.indices[i]][0] == str(bad)]
    (ds, i), = both
    x, y = ds[i]
    n = len(ds)
    assert torch.equal(x, ds[(i + 1) % n][0])                                  # the next readable item's image
    assert y == (-1 if ds is val else ds[(i + 1) % n][1])          # its label in training; held out: counted nowhere
    out = capsys.readouterr().out
    assert str(bad) in out and 'bad_images=skip' in out and '1 unreadable image(s)' in out
    with pytest.raises(ValueError, match='2.jpg cannot be read'):
        train_e, val_e, _ = build_datasets(spec, img_size=8, val_fraction=0.25)
        [ds[k] for ds in (train_e, val_e) for k in range(len(ds))]
    # a whole training run: the epoch completes, the file is named in the log, nothing crashes
    out_dir = tmp_path / 'run'
    assert main(['train', '--model', 'crate_digits', '--data', spec, '--data-kwargs', 'bad_images=skip',
                 '--epochs', '1', '-b', '2', '--workers', '0', '--output', str(out_dir), '--no-progress',
                 '--val-fraction', '0.25']) == 0
    assert str(bad) in capsys.readouterr().out
    assert (out_dir / 'checkpoints' / 'epoch_0001').is_dir()


def test_an_unreadable_held_out_image_is_left_out_of_the_evaluation_not_counted_twice(tmp_path, cache, capsys):
    """Under bad_images=skip an unreadable validation image stood in as the next item, which evaluation then counted
    twice (and `eval` said 4 images for 3 read); now it is counted nowhere: the metrics equal those of the folder
    without the file, the epoch record says `val_left_out`, `eval` says how many images it scored."""
    from torch.utils.data import DataLoader

    from structformer.train import evaluate
    root = tmp_path / 'data'
    _images(root / 'train', side=64)
    _images(root / 'val', per_class=2, side=64)
    bad = root / 'val' / 'b' / '0.jpg'
    bad.write_bytes(bad.read_bytes()[:len(bad.read_bytes()) * 2 // 3])
    spec = f'imagefolder:{root}'
    _, val, _ = build_datasets(spec, img_size=8, bad_images='skip', augment=False)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2))
    torch.manual_seed(0)
    got = evaluate(model, DataLoader(val, batch_size=4), 'cpu')
    clean = root.parent / 'clean'
    import shutil
    shutil.copytree(root, clean)
    (clean / 'val' / 'b' / '0.jpg').unlink()
    _, val_clean, _ = build_datasets(f'imagefolder:{clean}', img_size=8, augment=False)
    want = evaluate(model, DataLoader(val_clean, batch_size=4), 'cpu')
    assert got.pop('left_out') == 1 and got == pytest.approx(want)
    assert 'left out of the evaluation' in capsys.readouterr().out
    assert main(['train', '--model', 'crate_digits', '--data', spec, '--data-kwargs', 'bad_images=skip', '--epochs',
                 '1', '-b', '4', '--workers', '0', '--output', str(tmp_path / 'run'), '--no-progress']) == 0
    import json
    record = json.loads((tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()[-1])
    assert record['val_left_out'] == 1
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(tmp_path / 'run')]) == 0
    assert '(val, 3 images, 1 unreadable left out)' in capsys.readouterr().out


def test_a_symlink_loop_in_a_class_folder_is_one_line_and_other_links_are_read(tmp_path, cache):
    """`b/up -> ..` made the listing (os.walk following links) go round until the path was too long: 8 images
    became ~300, every class's images labelled 'b'. Now refused naming the link; a link to an image or to a folder
    elsewhere is read as before."""
    root = _images(tmp_path / 'imgs')
    (root / 'a' / 'linked.jpg').symlink_to(root / 'b' / '0.jpg')
    elsewhere = _images(tmp_path / 'more')
    (root / 'b' / 'more').symlink_to(elsewhere / 'a')
    train, _, _ = build_datasets(f'imagefolder:{root}', img_size=8, val_fraction=0.25)
    assert len(train.dataset.samples) == 8 + 1 + 4
    (root / 'b' / 'up').symlink_to('..')
    with pytest.raises(ValueError, match=r"b/up is a link to .*imgs, a folder above it.*remove the link"):
        build_datasets(f'imagefolder:{root}', img_size=8, val_fraction=0.25)


def test_a_16_bit_greyscale_png_is_read_at_its_top_8_bits_not_clipped_white(tmp_path, cache):
    """PIL's convert('RGB') clips a 16-bit PNG's values at 255 (torchvision's and timm's loaders read a ramp over
    0..65535 as 98 % white); the folder loader, shards written from it and the shard decoder take its top 8 bits."""
    from PIL import Image

    from structformer.data.imagefolder import load_rgb
    from structformer.data.tars import decode_rgb
    ramp = np.linspace(0, 65535, 64).reshape(8, 8).astype(np.uint16)
    path = tmp_path / 'sixteen.png'
    Image.fromarray(ramp).save(path)
    assert Image.open(path).mode in ('I;16', 'I')
    want = (ramp >> 8).astype(np.uint8)
    for image in (load_rgb(str(path)), decode_rgb(path.read_bytes(), 'sixteen.png')):
        got = np.asarray(image)
        assert got.shape == (8, 8, 3) and (got == want[..., None]).all()
    rgb = np.asarray(load_rgb(str(_images(tmp_path / 'eight') / 'a' / '0.jpg')))       # 8-bit images as before
    assert rgb.dtype == np.uint8 and rgb.shape == (40, 40, 3)


def test_decode_check_is_the_option_and_finds_what_the_header_misses(tmp_path, cache):
    root = _images(tmp_path / 'imgs', side=64)
    data = (root / 'a' / '1.jpg').read_bytes()
    (root / 'a' / '1.jpg').write_bytes(data[:len(data) * 2 // 3])
    build_datasets(f'imagefolder:{root}', img_size=8)                        # the header is fine
    with pytest.raises(ValueError, match=r'1 of 8 images cannot be read: .*a/1\.jpg'):
        build_datasets(f'imagefolder:{root}', img_size=8, check='decode')


def test_the_check_runs_once_on_process_0_and_is_shared(tmp_path, cache):
    """Two gloo processes: process 0 checks (its count of header reads is the file count), process 1 reads none."""
    import subprocess
    root = _images(tmp_path / 'imgs')
    script = (
        "import os, torch.distributed as dist; from structformer.data import imagecheck as ic\n"
        "dist.init_process_group('gloo')\n"
        "calls = []\n"
        "real = ic.header_problem\n"
        "ic.header_problem = lambda p: calls.append(p) or real(p)\n"
        f"bad = ic.shared_check(sorted(str(p) for p in __import__('pathlib').Path({str(root)!r}).rglob('*.jpg')), 'header')\n"
        # each rank writes its own file: two processes' lines on one pipe were once lost under a loaded suite
        f"open({str(tmp_path)!r} + f'/rank{{dist.get_rank()}}.txt', 'w').write(f'{{dist.get_rank()}} {{len(calls)}} {{len(bad)}}')\n"
        "dist.destroy_process_group()\n")
    (tmp_path / 'check.py').write_text(script)
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           str(tmp_path / 'check.py')], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = sorted((tmp_path / f'rank{r}.txt').read_text().split() for r in (0, 1))
    assert ranks == [['0', '8', '0'], ['1', '0', '0']]


@pytest.mark.parametrize('model, kwargs, expected', [
    ('crate_digits', {}, 8),
    ('crate_tiny_patch16_224', {}, 224),
    ('crate_tiny_patch16_224', {'img_size': 32}, 32),
    ('crate_mnist', {}, 28),
])
def test_image_size_follows_the_model(tmp_path, cache, model, kwargs, expected):
    root = _images(tmp_path / 'imgs')
    train, val, info = build_datasets(f'imagefolder:{root}', model=model, model_kwargs=kwargs, augment=False)
    assert info.img_size == expected and val[0][0].shape == (3, expected, expected)
    _, _, given = build_datasets(f'imagefolder:{root}', model=model, model_kwargs=kwargs, img_size=16)
    assert given.img_size == 16                                               # img_size given: it wins
    _, _, alone = build_datasets(f'imagefolder:{root}')
    assert alone.img_size == 224                                              # no model: the folder default


def test_cifar_follows_the_model_and_is_resized(tmp_path):
    _write_cifar(tmp_path / 'cifar')
    train, val, info = build_datasets(f"cifar10:{tmp_path / 'cifar'}", model='crate_tiny_patch16_224')
    assert info.img_size == 224 and val[0][0].shape == (3, 224, 224) and train[0][0].shape == (3, 224, 224)
    _, small, info32 = build_datasets(f"cifar10:{tmp_path / 'cifar'}", model='crate_digits')
    assert info32.img_size == 8 and small[0][0].shape == (3, 8, 8)
    _, plain, native = build_datasets(f"cifar10:{tmp_path / 'cifar'}")
    assert native.img_size == 32 and plain[0][0].shape == (3, 32, 32)


def test_engine_records_the_followed_size_and_trains_at_it(tmp_path, cache):
    import yaml
    root = _images(tmp_path / 'imgs')
    out = tmp_path / 'run'
    assert main(['train', '--model', 'crate_digits', '--data', f'imagefolder:{root}', '--epochs', '1',
                 '--limit-train-batches', '1', '--output', str(out), '--no-progress', '--workers', '0']) == 0
    config = yaml.safe_load((out / 'config.yaml').read_text())
    assert config['data_kwargs']['img_size'] == 8
    assert main(['eval', '--checkpoint', str(out)]) == 0


def test_a_size_the_model_cannot_take_is_one_line_naming_both(tmp_path, cache, capsys):
    root = _images(tmp_path / 'imgs')
    rc = main(['train', '--model', 'crate_tiny_patch16_224', '--data', f'imagefolder:{root}', '--data-kwargs',
               'img_size=100', '--output', str(tmp_path / 'run'), '--no-progress'])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if 'error:' in line]
    assert rc == 2 and len(lines) == 1 and 'Traceback' not in err
    assert 'img_size=100' in lines[0] and 'input size 224' in lines[0] and 'divisible' in lines[0]
    assert not (tmp_path / 'run').exists()


def test_bench_data_runs_and_records_what_it_measured(tmp_path, capsys):
    """A tiny run of `structformer bench data`: every loader x recipe x worker row, the ratios to timm, the training
    step's rate and the load average are in the JSON (the numbers themselves are for a quiet machine)."""
    import json
    out = tmp_path / 'data.json'
    # 6 images, fewer than the generator's 10 classes: no class folder may be left empty (it was: 'not an image folder')
    assert main(['bench', 'data', '--images', '6', '--batch-size', '3', '--workers', '1', '--img-size', '32',
                 '--step-batch', '1', '--output', str(out)]) == 0
    result = json.loads(out.read_text())
    assert {(r['loader'], r['recipe'], r['workers']) for r in result['rows']} == {
        (kind, recipe, 1) for kind in ('imagefolder', 'shards', 'timm') for recipe in ('rrc_flip', 'rrc_flip_ra_re')}
    assert all(r['images'] == 3 for r in result['rows'])          # 6 images, the first batch of 3 untimed
    assert set(result['training_step_images_per_s']) == {'float32', 'bfloat16'}
    assert len(result['ratios_vs_timm']) == 4 and len(result['load_average_before']) == 3
    assert result['args']['workers'] == [1] and result['args']['step_batch'] == 1     # the command that made it


def test_bench_data_has_the_flag_its_busy_advice_names_and_helps_every_flag():
    import argparse

    from structformer.bench import data as bench_data
    from structformer.bench.load import ADVICE
    parser = argparse.ArgumentParser()
    bench_data.add_arguments(parser)
    flags = {flag: action for action in parser._actions for flag in action.option_strings}
    assert '--threads 1' in ADVICE and '--threads' in flags
    assert all(flags[f].help for f in ('--batch-size', '--img-size', '--step-batch', '--threads'))


@pytest.mark.parametrize('argv, needle', [
    (['--images', '8', '--batch-size', '8'], '--images 8'),
    (['--threads', '-1'], '--threads must be an integer in [0, 4096]'),        # argparse's, in one line
    (['--images', '99999999999'], 'GiB free'),
    (['--workers', '0'], '--workers'),
    (['--output', '{tmp}'], 'is a folder'),
    (['--batch-size', '0'], '--batch-size 0'),          # was torch's ValueError traceback from its BatchSampler
    (['--step-batch', '0'], '--step-batch 0'),
    (['--img-size', '0'], '--img-size 0'),
    (['--up-front', '3'], '--up-front 3'),
    (['--model', 'no_such_model', '--images', '4', '--batch-size', '2', '--workers', '1', '--img-size', '16'], '--model'),          # was timm's traceback, after every loader row was timed
])
def test_bench_data_refuses_bad_input_before_measuring(argv, needle, tmp_path, capsys):
    try:
        rc = main(['bench', 'data'] + [a.format(tmp=tmp_path) for a in argv])
    except SystemExit as e:                      # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_bench_data_up_front_records_the_cpu_kind_and_the_load(tmp_path):
    """`bench data --up-front N` writes a record like every other benchmark's (CPU kind, machine load), from a folder
    of N images it can split (it made 100 classes whatever N, and below 200 images the validation split failed)."""
    import json
    out = tmp_path / 'up_front.json'
    mine = tmp_path / 'check-cache' / 'keep.txt'          # a user's folder beside --folder: the run deleted it
    mine.parent.mkdir()
    mine.write_text('mine')
    assert main(['bench', 'data', '--up-front', '10', '--folder', str(tmp_path / 'images'), '--output', str(out)]) == 0
    assert mine.read_text() == 'mine' and list(mine.parent.iterdir()) == [mine]     # its cache was its own, and gone
    record = json.loads(out.read_text())
    assert record['environment']['cpu_kind']['kind'] and 'busy' in record['machine_load']
    assert set(record['up_front_seconds']) == {'decode (before)', 'header, first run', 'header, cached', 'none'}


def test_class_folders_differing_only_in_unicode_normalisation_are_named_so(tmp_path, cache, capsys):
    """val/ copied on a Mac (or unzipped from an archive made there) names 'éclair' in NFD, train/ in NFC: the two
    sort differently ('e' + U+0301 before 'fraise', U+00E9 after) and print alike, so the refusal listed two lists
    that looked the same. It now says what differs; data shard says the same."""
    import unicodedata
    from PIL import Image
    for split, form in (('train', 'NFC'), ('val', 'NFD')):
        for c in ('éclair', 'fraise', 'Zèbre'):
            folder = tmp_path / 'src' / split / unicodedata.normalize(form, c)
            folder.mkdir(parents=True)
            for i in range(2):
                Image.fromarray(np.full((8, 8, 3), 9 * i, np.uint8)).save(folder / f'{i}.png')
    with pytest.raises(ValueError, match=r'Unicode normalisation: .*NFC.*NFD'):
        build_datasets(f"imagefolder:{tmp_path / 'src'}", img_size=8, augment=False)
    rc = main(['data', 'shard', str(tmp_path / 'src'), str(tmp_path / 'out')])
    err = capsys.readouterr().err
    assert rc == 2 and 'Unicode normalisation' in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / 'out').exists()


def test_hidden_folders_and_files_of_an_image_folder_are_passed_over(tmp_path, cache, capsys):
    """torchvision's ImageFolder takes every folder for a class and every '*.jpg' for an image: an empty
    .ipynb_checkpoints/ made the folder 'not an image folder', and the AppleDouble '._NAME.jpg' a copy on a Mac leaves
    beside each file (4 bytes of magic) failed the header check, so the run stopped naming files that are no images."""
    from PIL import Image
    for split in ('train', 'val'):
        for c in ('ant', 'bee'):
            folder = tmp_path / 'src' / split / c
            folder.mkdir(parents=True)
            for i in range(3):
                Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(folder / f'{i}.jpg')
                (folder / f'._{i}.jpg').write_bytes(b'\0\5\26\7 apple double')
            (folder / '.DS_Store').write_bytes(b'\0\0\0\1Bud1')
        (tmp_path / 'src' / split / '.ipynb_checkpoints').mkdir()
    train, val, info = build_datasets(f"imagefolder:{tmp_path / 'src'}", img_size=8, augment=False)
    assert info.extra['classes'] == ['ant', 'bee'] and (len(train), len(val)) == (6, 6)
    assert not any(os.path.basename(p).startswith('.') for p, _ in train.samples + val.samples)
    rc = main(['data', 'shard', str(tmp_path / 'src'), str(tmp_path / 'out')])
    assert rc == 0, capsys.readouterr().err
    info = json.loads((tmp_path / 'out' / '_info.json').read_text())
    assert info['classes'] == ['ant', 'bee'] and info['splits']['train']['num_samples'] == 6


@pytest.mark.parametrize('name', ['validation', 'valid'])
def test_a_validation_folder_named_as_timm_searches_is_the_validation_split(name, tmp_path, cache, capsys):
    """train/ + validation/ (the name timm's split search, Hugging Face and our own shards use) or valid/ (Kaggle's
    train/valid/test) was read as an image folder of two classes, 'train' and 'validation', silently; valid/ beside
    test/ is the validation split, test/ stays held out."""
    from PIL import Image
    for split, n in (('train', 3), (name, 1), ('test', 2)):
        for c in ('ant', 'bee'):
            (tmp_path / 'src' / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(tmp_path / 'src' / split / c / f'{i}.png')
    train, val, info = build_datasets(f"imagefolder:{tmp_path / 'src'}", img_size=8, augment=False)
    assert info.extra['classes'] == ['ant', 'bee'] and (len(train), len(val)) == (6, 2)
    assert all(f'{os.sep}{name}{os.sep}' in p for p, _ in val.samples)
    assert main(['data', 'shard', str(tmp_path / 'src'), str(tmp_path / 'out')]) == 0
    info = json.loads((tmp_path / 'out' / '_info.json').read_text())
    assert info['classes'] == ['ant', 'bee'] and info['splits']['validation']['num_samples'] == 2
