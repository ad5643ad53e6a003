"""`structformer data shard` (data/shard_writer.py, data/shard_sources.py): what it writes is readable by others
(the umask's permissions), it shows progress and an ETA, decodes what goes in (a JPEG cut after its header is
refused, or left out under --bad-images skip, named), several writer processes write the same bytes as one, a
killed run (kill -9) leaves a work folder the next run resumes from or removes, and shards can be written from an
hfds: data set and from timm's create_dataset readers (their class order recorded)."""
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from structformer.data.shard_writer import work_folder, write_shards
from structformer.data.tars import iter_shard

CLASSES = ('Zebra', 'ant', 'Bee')           # torchvision sorts by code point, timm without case


def _folder(root: Path, per_class: int = 3, side: int = 8, seed: int = 0) -> Path:
    from PIL import Image
    rng = np.random.default_rng(seed)
    for c in CLASSES:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(root / c / f'{i}.jpg')
    return root


def _truncated_jpeg(path: Path) -> None:
    """A JPEG cut in its entropy-coded data: the header parses, the pixels do not."""
    from PIL import Image
    big = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(big, 'JPEG')
    data = big.getvalue()
    path.write_bytes(data[:int(len(data) * 0.7)])
    with Image.open(path) as im:
        assert im.size == (64, 64)                  # the header check passes it


def _shard_bytes(out: Path):
    return {p.name: p.read_bytes() for p in sorted(out.glob('*.tar'))}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tmp_path / 'cache'))


def test_output_follows_the_umask_and_progress_shows_an_eta(tmp_path, cache, capsys):
    src = _folder(tmp_path / 'src')
    old = os.umask(0o027)
    try:
        write_shards(str(src), str(tmp_path / 'out'), 2)
    finally:
        os.umask(old)
    out = tmp_path / 'out'
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)                   # not mkdtemp's 0700
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o640)}
    text = capsys.readouterr().out
    assert 'data shard: 9/9 images (100.0 %)' in text and 'img/s, ETA ' in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ['cache', 'out', 'src']     # no work folder left


def test_a_jpeg_cut_after_its_header_is_refused_or_left_out_named(tmp_path, cache, capsys):
    from structformer.data import build_datasets
    src = _folder(tmp_path / 'src')
    _truncated_jpeg(src / 'ant' / 'cut.jpg')
    with pytest.raises(ValueError, match=r"ant/cut\.jpg cannot be read .*--bad-images skip"):
        write_shards(str(src), str(tmp_path / 'out'), 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['cache', 'src']             # nothing written, nothing kept
    info = write_shards(str(src), str(tmp_path / 'out'), 20, bad_images='skip')
    left_out = info['splits']['train']['left_out']
    assert [Path(p).name for p, _ in left_out] == ['cut.jpg'] and info['splits']['train']['num_samples'] == 9
    assert len(list(iter_shard(str(tmp_path / 'out' / 'train-000000.tar')))) == 9
    train, val, _ = build_datasets(f"wds:{tmp_path / 'out'}", img_size=8, holdout='samples')
    assert len(train) + len(val) == 9


def test_several_writer_processes_write_the_same_bytes_as_one(tmp_path, cache):
    src = _folder(tmp_path / 'src', per_class=4)
    one = write_shards(str(src), str(tmp_path / 'one'), 3, workers=1)
    two = write_shards(str(src), str(tmp_path / 'two'), 3, workers=2)
    assert one == two and _shard_bytes(tmp_path / 'one') == _shard_bytes(tmp_path / 'two')
    assert len(one['splits']['train']['filenames']) == 4


_SLOW_WRITER = """
import sys, time
import structformer.data.shard_writer as writer
real = writer.write_one
def slow(job):
    time.sleep(0.4)
    return real(job)
writer.write_one = slow
from structformer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_run_is_resumed_by_the_next_or_cleaned(tmp_path, cache, capsys):
    """kill -9 mid-run: the work folder beside OUT is recognisably ours (owner file, finished shards), OUT does not
    exist; the next run with the same input resumes from the finished shards and gives the same bytes as a
    straight run; with other settings it removes them; a live owner is refused naming --clean."""
    src = _folder(tmp_path / 'src', per_class=4)
    out, work = tmp_path / 'out', Path(work_folder(str(tmp_path / 'out')))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS='1')
    child = subprocess.Popen([sys.executable, '-c', _SLOW_WRITER, 'data', 'shard', str(src), str(out),
                              '--shard-size', '1'], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(work.glob('*.tar'))) < 2:
        assert child.poll() is None, child.stderr.read()
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    finished = sorted(p.name for p in work.glob('*.tar'))
    assert 2 <= len(finished) < 12 and not out.exists()
    assert json.loads((work / '_owner.json').read_text())['pid'] == child.pid
    write_shards(str(src), str(tmp_path / 'straight'), 1)
    capsys.readouterr()
    write_shards(str(src), str(out), 1)                                   # the same command: resumed
    assert f'{len(finished)} finished shard(s)' in capsys.readouterr().out
    assert _shard_bytes(out) == _shard_bytes(tmp_path / 'straight') and not work.exists()
    assert (out / '_info.json').read_text() == (tmp_path / 'straight' / '_info.json').read_text()

    other, work_other = tmp_path / 'other', Path(work_folder(str(tmp_path / 'other')))
    work_other.mkdir()                                                    # leftovers of a dead run of other settings
    (work_other / '_owner.json').write_text(json.dumps({'host': os.uname().nodename, 'pid': child.pid,
                                                        'plan': 'another plan', 'format': 1}))
    (work_other / 'train-000000.tar').write_bytes(b'stale')
    write_shards(str(src), str(other), 5)
    assert 'removed' in capsys.readouterr().out and not work_other.exists()
    assert _shard_bytes(other)['train-000000.tar'] != b'stale'
    import shutil
    shutil.rmtree(other)
    work_other.mkdir()                                                    # a live owner: refused, naming --clean
    (work_other / '_owner.json').write_text(json.dumps({'host': os.uname().nodename, 'pid': os.getpid()}))
    with pytest.raises(ValueError, match='is still running.*--clean'):
        write_shards(str(src), str(other), 5)
    assert work_other.exists() and not other.exists()
    write_shards(str(src), str(other), 5, clean=True)
    assert 'removed' in capsys.readouterr().out and not work_other.exists() and other.is_dir()


def test_shards_from_an_hfds_dataset(tmp_path, cache):
    import datasets
    from PIL import Image
    images = [Image.fromarray(np.full((6, 6, 3), 10 * i, np.uint8)) for i in range(6)]
    features = datasets.Features({'image': datasets.Image(), 'label': datasets.ClassLabel(names=['x', 'y'])})
    datasets.DatasetDict({
        'train': datasets.Dataset.from_dict({'image': images[:4], 'label': [0, 1, 1, 0]}, features=features),
        'validation': datasets.Dataset.from_dict({'image': images[4:], 'label': [1, 0]}, features=features),
    }).save_to_disk(str(tmp_path / 'hf'))
    info = write_shards(f"hfds:{tmp_path / 'hf'}", str(tmp_path / 'out'), 3)
    assert info['classes'] == ['x', 'y'] and info['splits']['validation']['num_samples'] == 2
    got = sorted((int(np.asarray(Image.open(io.BytesIO(d)))[0, 0, 0]), label) for n in info['splits']['train']['filenames']
                 for _, _, d, label in iter_shard(str(tmp_path / 'out' / n)))
    assert got == [(0, 0), (10, 1), (20, 1), (30, 0)]


def test_an_hfds_source_without_columns_names_source_and_how_to_fix_it(tmp_path, capsys):
    """`data shard hfds:PATH`: its errors name SOURCE (not `--data`, a flag data shard lacks) and, for a dataset
    without a label column, what data shard reads instead of `--data-kwargs label_column=`, which it does not take."""
    import datasets
    from PIL import Image

    from structformer.cli import main
    images = [Image.fromarray(np.full((6, 6, 3), 10 * i, np.uint8)) for i in range(2)]
    datasets.Dataset.from_dict({'image': images, 'target': [0, 1]}).save_to_disk(str(tmp_path / 'hf'))
    (tmp_path / 'empty').mkdir()
    capsys.readouterr()                                    # datasets' progress bar
    for source, needle in ((f"hfds:{tmp_path / 'hf'}", "no label column among ['image', 'target']; data shard "
                            "takes the first Image and ClassLabel columns"),
                           (f"hfds:{tmp_path / 'empty'}", 'save_to_disk')):
        assert main(['data', 'shard', source, str(tmp_path / 'out')]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f'structformer data shard: error: SOURCE {source}: ') and needle in err, err
        assert '--data' not in err and not (tmp_path / 'out').exists()


@pytest.mark.parametrize('seed', ['-1', str(2 ** 32)])
def test_a_seed_numpy_cannot_take_is_one_line(seed, tmp_path, capsys):
    """--seed -1 ended in numpy's traceback ('expected non-negative integer') after the source was read."""
    from structformer.cli import main
    src = _folder(tmp_path / 'src')
    assert main(['data', 'shard', str(src), str(tmp_path / 'out'), '--seed', seed]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f'structformer data shard: error: --seed {seed}: ') and '[0, 2**32)' in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ['src']


@pytest.mark.parametrize('form', ['', 'imagefolder:', 'timm::', 'timm:'])
def test_out_inside_the_source_folder_or_empty_is_refused_before_any_work(form, tmp_path, capsys, monkeypatch):
    """OUT inside SOURCE would add a class folder without images to it (the next read of SOURCE fails); OUT '' was
    the current folder: the shards were written into a work folder beside it and the final rename failed."""
    from structformer.cli import main
    src = _folder(tmp_path / 'src')
    (tmp_path / 'cwd').mkdir()
    monkeypatch.chdir(tmp_path / 'cwd')                # '' is this folder: its work folder would go beside it
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob('*'))
    for out, needle in ((src / 'ant' / 'shards', f'inside SOURCE {form}{src}'), ('', "OUT '': empty")):
        assert main(['data', 'shard', f'{form}{src}', str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith('structformer data shard: error: ') and needle in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob('*')) == before


def test_shards_from_timm_readers_keep_timms_class_order(tmp_path, cache):
    src = _folder(tmp_path / 'src' / 'train')
    _folder(tmp_path / 'src' / 'val', per_class=1, seed=2)
    info = write_shards(f"timm::{tmp_path / 'src'}", str(tmp_path / 'out'), 5)
    assert info['classes'] == ['ant', 'Bee', 'Zebra'] and 'case ignored' in info['class_order']
    assert (info['splits']['train']['num_samples'], info['splits']['validation']['num_samples']) == (9, 3)
    expected = sorted(((src / c / f'{i}.jpg').read_bytes(), ['ant', 'Bee', 'Zebra'].index(c))
                      for c in CLASSES for i in range(3))
    got = sorted((d, label) for n in info['splits']['train']['filenames']
                 for _, _, d, label in iter_shard(str(tmp_path / 'out' / n)))
    assert got == expected
    folder_info = write_shards(str(tmp_path / 'src'), str(tmp_path / 'tv'), 5)       # torchvision's order differs
    assert folder_info['classes'] == ['Bee', 'Zebra', 'ant'] and 'code point' in folder_info['class_order']
    # timm's tar-of-tars reader (ReaderImageInTar): one tar per class inside one tar
    outer = io.BytesIO()
    with tarfile.open(fileobj=outer, mode='w') as tar:
        for c in CLASSES:
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode='w') as t:
                for i in range(3):
                    t.add(str(src / c / f'{i}.jpg'), arcname=f'{i}.jpg')
            member = tarfile.TarInfo(f'{c}.tar')
            member.size = len(inner.getvalue())
            tar.addfile(member, io.BytesIO(inner.getvalue()))
    (tmp_path / 'nested.tar').write_bytes(outer.getvalue())
    nested = write_shards(f"timm::{tmp_path / 'nested.tar'}", str(tmp_path / 'from-tar'), 20)
    assert nested['classes'] == ['ant', 'Bee', 'Zebra']
    got = sorted((d, label) for n in nested['splits']['train']['filenames']
                 for _, _, d, label in iter_shard(str(tmp_path / 'from-tar' / n)))
    assert got == expected


def test_cli_lines_name_the_command_out_and_what_is_kept(tmp_path, cache, monkeypatch, capsys):
    """Errors start `structformer data shard:` as argparse's do; Ctrl-C says what is kept (not checkpoints); a full
    disk names OUT; each is one line."""
    import errno

    import structformer.data.shard_writer as writer
    from structformer.cli import main
    src = _folder(tmp_path / 'src')
    assert main(['data', 'shard', str(tmp_path / 'nowhere'), str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err
    assert err.startswith('structformer data shard: error: SOURCE') and len(err.strip().splitlines()) == 1, err
    real, calls = writer.write_one, []

    def stopped(job):
        calls.append(job)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(job)
    monkeypatch.setattr(writer, 'write_one', stopped)
    assert main(['data', 'shard', str(src), str(tmp_path / 'out'), '--shard-size', '2']) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith('structformer data shard: interrupted; OUT ') and \
        '1 finished shard(s) are kept' in err[0] and 'checkpoint' not in err[0], err

    def full(job):
        raise OSError(errno.ENOSPC, 'No space left on device')
    monkeypatch.setattr(writer, 'write_one', full)
    assert main(['data', 'shard', str(src), str(tmp_path / 'out'), '--shard-size', '2']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"OUT {tmp_path / 'out'}: the disk is full" in err[0], err


@pytest.mark.parametrize('target_exists', [True, False])
def test_out_a_link_to_a_folder_on_another_disk_is_written_there(target_exists, tmp_path, cache):
    """OUT a symlink to an empty folder (or to one not made yet) on a bigger disk: the work folder went beside the
    link, on the link's disk, and after every shard was written the rename stopped with 'not a directory'."""
    src = _folder(tmp_path / 'src')
    (tmp_path / 'big').mkdir()
    if target_exists:
        (tmp_path / 'big' / 'wds').mkdir()
    (tmp_path / 'small').mkdir()
    (tmp_path / 'small' / 'wds').symlink_to(tmp_path / 'big' / 'wds')
    info = write_shards(str(src), str(tmp_path / 'small' / 'wds'), 4)
    assert (tmp_path / 'small' / 'wds').is_symlink()
    written = sorted(p.name for p in (tmp_path / 'big' / 'wds').iterdir())
    assert written == ['_info.json'] + info['splits']['train']['filenames']
    assert sorted(p.name for p in (tmp_path / 'small').iterdir()) == ['wds']          # no work folder left there
    assert sorted(p.name for p in (tmp_path / 'big').iterdir()) == ['wds']


def test_a_folder_with_train_alone_is_its_training_split_not_one_class(tmp_path, cache):
    """DIR/train/<class>/... without val/ (not prepared yet): `data shard DIR` wrote one class named 'train' holding
    every image, and `--data imagefolder:DIR` refused it as one class. A class folder named 'train' (vehicles)
    holds images and stays a class."""
    from structformer.data import build_datasets
    _folder(tmp_path / 'src' / 'train')
    info = write_shards(str(tmp_path / 'src'), str(tmp_path / 'wds'), 5)
    assert info['classes'] == ['Bee', 'Zebra', 'ant'] and sorted(info['splits']) == ['train']
    assert info['splits']['train']['num_samples'] == 9
    _, _, data = build_datasets(f"imagefolder:{tmp_path / 'src'}", img_size=8, val_fraction=0.34)
    assert data.extra['classes'] == ['Bee', 'Zebra', 'ant'] and data.extra['split'].endswith('of train/')
    vehicles = _folder(tmp_path / 'vehicles')
    (vehicles / 'train').mkdir()
    from PIL import Image
    Image.new('RGB', (8, 8)).save(vehicles / 'train' / 'locomotive.jpg')
    info = write_shards(str(vehicles), str(tmp_path / 'wds2'), 5)
    assert info['classes'] == ['Bee', 'Zebra', 'ant', 'train']
    (vehicles / 'train' / 'locomotive.jpg').rename(tmp_path / 'loco.jpg')             # images one level down
    (vehicles / 'train' / '2019').mkdir()
    (tmp_path / 'loco.jpg').rename(vehicles / 'train' / '2019' / 'locomotive.jpg')
    info = write_shards(str(vehicles), str(tmp_path / 'wds3'), 5)
    assert info['classes'] == ['Bee', 'Zebra', 'ant', 'train']                        # other classes beside it


def test_out_a_mounted_disk_is_written_on_that_disk(tmp_path, cache, monkeypatch, capsys):
    """OUT an empty disk mounted there (`data shard SRC /mnt/disk`): the work folder went beside it, on the parent's
    disk, and after every shard the rename over the mount point failed ('Device or resource busy'). The work
    folder is now inside OUT and its files are moved in, _info.json last; a failed run keeps its finished shards in
    OUT/.shard-work and the next run resumes from them. (The mount is simulated: os.path.ismount says so for OUT,
    and os.rmdir of it fails as a mount point's does.)"""
    import errno

    import structformer.data.shard_writer as writer
    src = _folder(tmp_path / 'src')
    out = tmp_path / 'disk'
    out.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, 'ismount', lambda p: os.path.abspath(p) == str(out) or real_ismount(p))
    real_rmdir, real_write = os.rmdir, writer.write_one

    def rmdir(path, *a, **k):
        if os.path.abspath(path) == str(out):
            raise OSError(errno.EBUSY, 'Device or resource busy', str(path))
        return real_rmdir(path, *a, **k)
    monkeypatch.setattr(os, 'rmdir', rmdir)
    works, calls = set(), []

    def interrupted(job):
        works.add(job[0])
        calls.append(job)
        if len(calls) == 3:
            raise OSError(errno.EIO, 'I/O error')
        return real_write(job)
    monkeypatch.setattr(writer, 'write_one', interrupted)
    with pytest.raises(OSError):
        write_shards(str(src), str(out), 2)
    assert works == {str(out / '.shard-work')}
    assert sorted(p.name for p in tmp_path.iterdir()) == ['cache', 'disk', 'src']
    monkeypatch.setattr(writer, 'write_one', real_write)
    info = write_shards(str(src), str(out), 2)                          # resumed from OUT/.shard-work
    assert '2 finished shard(s)' in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(['_info.json'] + info['splits']['train']['filenames'])
    write_shards(str(src), str(tmp_path / 'straight'), 2)
    assert _shard_bytes(out) == _shard_bytes(tmp_path / 'straight')


@pytest.mark.parametrize('form, needle', [
    ('timm:nosuch:{src}', "NAME 'nosuch' is not a timm TYPE/NAME data set name"),
    ('timm:torch/:{src}', "NAME 'torch/' is not a timm TYPE/NAME data set name"),
    ('timm:', 'no ROOT'), ('timm:nosuch:', 'no ROOT')])
def test_a_timm_source_without_a_timm_name_or_root_is_one_line(form, needle, tmp_path, capsys):
    """timm's create_dataset reads only NAME's TYPE/ prefix: `timm:nosuch:ROOT` was ignored and ROOT written as an
    image folder (rc 0); an empty `timm:` said "SOURCE timm:::  does not exist". One line naming SOURCE as given and
    the accepted forms; nothing written."""
    from structformer.cli import main
    src = _folder(tmp_path / 'src')
    text = form.format(src=src)
    assert main(['data', 'shard', text, str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"structformer data shard: error: SOURCE {text!r}: {needle}") and len(err.splitlines()) == 1
    assert 'timm:torch/NAME:ROOT' in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ['src']


def test_long_and_unicode_file_names_fit_a_tar_header(tmp_path, cache):
    """A tar (ustar) member name holds 100 bytes of UTF-8; file names hold 255. A 130-character name or a 60-
    character Japanese one (180 bytes) stopped the writer with tarfile's 'name is too long' traceback."""
    from PIL import Image
    names = {'ant': ['x' * 130 + '.jpg', '写真' * 30 + '.jpg', 'short.jpg'], 'Bee': ['é' * 100 + '.jpg', 'b.jpg']}
    for c, files in names.items():
        (tmp_path / 'src' / c).mkdir(parents=True)
        for k, name in enumerate(files):
            Image.fromarray(np.full((8, 8, 3), 40 * k, np.uint8)).save(tmp_path / 'src' / c / name)
    info = write_shards(str(tmp_path / 'src'), str(tmp_path / 'out'), 10)
    with tarfile.open(tmp_path / 'out' / 'train-000000.tar') as tar:
        members = tar.getnames()
    assert len(members) == 10 and all(len(m.encode('utf-8')) <= 100 for m in members)
    got = sorted((d, label) for _, _, d, label in iter_shard(str(tmp_path / 'out' / 'train-000000.tar')))
    assert got == sorted(((tmp_path / 'src' / c / n).read_bytes(), ['Bee', 'ant'].index(c))
                         for c, files in names.items() for n in files)
    assert info['splits']['train']['num_samples'] == 5
    # the readable part of the name is kept: the 8-digit position, then as much of the stem as fits
    assert any(m.startswith(tuple(f'{i:08d}_写真写真' for i in range(5))) for m in members)


@pytest.mark.parametrize('form, said', [('wds:', 'shards already'), ('digits:', "'digits:' is not a form of SOURCE")])
def test_a_data_form_that_is_not_a_source_is_named_as_such(tmp_path, form, said, capsys):
    """`data shard wds:DIR OUT` (shards given to be re-sharded): one line saying they are shards already, not that
    DIR, which exists, is 'not a folder'; nothing written."""
    from structformer.cli import main
    shards = tmp_path / 'shards'
    shards.mkdir()
    assert main(['data', 'shard', f'{form}{shards}', str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err and 'not a folder' not in err, err
    assert not (tmp_path / 'out').exists()
