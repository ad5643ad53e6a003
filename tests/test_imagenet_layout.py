"""ImageNet as downloaded (data/imagenet.py), on generated data laid out exactly so: ILSVRC2012_img_train.tar holding
one tar per class, the flat val/ folder, the devkit's meta.mat (written with scipy.io.savemat in the devkit's
structure, its ILSVRC2012_ID order unlike the sorted WNIDs) and ground truth, or Kaggle's LOC_val_solution.csv and
LOC_synset_mapping.txt. Read in place (no unpacking): the classes follow the sorted synsets, the same for train and
val; `data shard imagenet:PATH` writes the same samples as shards."""
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from structformer.data import build_datasets

WNIDS = ['n01440764', 'n01443537', 'n01484850']          # sorted; the devkit numbers them in another order
DEVKIT_ORDER = ['n01484850', 'n01440764', 'n01443537']   # ILSVRC2012_ID 1, 2, 3


def _jpeg(value: int) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(out, 'JPEG', quality=95)
    return out.getvalue()


def _tar_bytes(members) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode='w') as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _meta_mat(path: Path) -> None:
    """The devkit's meta.mat: a 'synsets' struct array, leaves (num_children 0) first, then a parent synset."""
    import scipy.io
    fields = ['ILSVRC2012_ID', 'WNID', 'words', 'gloss', 'num_children', 'children', 'wordnet_height',
              'num_train_images']
    rows = np.zeros((len(DEVKIT_ORDER) + 1, 1), dtype=[(f, 'O') for f in fields])
    for i, wnid in enumerate(DEVKIT_ORDER):
        rows[i, 0] = (i + 1, wnid, f'words of {wnid}', 'a gloss', 0, np.zeros((1, 0)), 0, 3)
    rows[-1, 0] = (len(DEVKIT_ORDER) + 1, 'n00001740', 'entity', 'a parent', 3, np.arange(1, 4).reshape(1, -1), 9, 0)
    scipy.io.savemat(str(path), {'synsets': rows})


def download(root: Path, labels: str = 'devkit', per_class: int = 3, val_per_class: int = 2) -> dict:
    """The layout as downloaded; returns {'val': {file name: wnid}, 'train': {member: wnid}}."""
    root.mkdir(parents=True, exist_ok=True)
    truth, train, value = {}, {}, 1
    inner = []
    for wnid in WNIDS:
        members = []
        for i in range(per_class):
            members.append((f'{wnid}_{i}.JPEG', _jpeg(value)))
            train[f'{wnid}/{wnid}_{i}.JPEG'] = (wnid, value)
            value += 1
        inner.append((f'{wnid}.tar', _tar_bytes(members)))
    (root / 'ILSVRC2012_img_train.tar').write_bytes(_tar_bytes(inner))
    (root / 'val').mkdir()
    rng = np.random.default_rng(0)
    order = [w for w in WNIDS for _ in range(val_per_class)]
    rng.shuffle(order)
    for k, wnid in enumerate(order, start=1):
        name = f'ILSVRC2012_val_{k:08d}.JPEG'
        (root / 'val' / name).write_bytes(_jpeg(100 + k))
        truth[name] = wnid
    if labels == 'devkit':
        data = root / 'ILSVRC2012_devkit_t12' / 'data'
        data.mkdir(parents=True)
        _meta_mat(data / 'meta.mat')
        ids = {w: i + 1 for i, w in enumerate(DEVKIT_ORDER)}
        (data / 'ILSVRC2012_validation_ground_truth.txt').write_text(
            ''.join(f'{ids[truth[f"ILSVRC2012_val_{k:08d}.JPEG"]]}\n' for k in range(1, len(order) + 1)))
    else:
        (root / 'LOC_synset_mapping.txt').write_text(''.join(f'{w} words of {w}\n' for w in WNIDS))
        (root / 'LOC_val_solution.csv').write_text('ImageId,PredictionString\n' + ''.join(
            f'{name[:-5]},{wnid} 1 2 3 4 {wnid} 5 6 7 8 \n' for name, wnid in sorted(truth.items(), reverse=True)))
    return {'val': truth, 'train': train}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tmp_path / 'cache'))


@pytest.mark.parametrize('labels', ['devkit', 'kaggle'])
def test_imagenet_as_downloaded_reads_in_place_in_the_synset_order(labels, tmp_path, cache):
    truth = download(tmp_path / 'in', labels)
    files = sorted((tmp_path / 'in').rglob('*'))
    train, val, info = build_datasets(f"imagenet:{tmp_path / 'in'}", img_size=8, augment=False)
    assert sorted((tmp_path / 'in').rglob('*')) == files               # read in place: nothing unpacked or added
    assert info.extra['classes'] == WNIDS and info.num_classes == 3
    assert info.extra['class_descriptions'] == [f'words of {w}' for w in WNIDS]
    assert (len(train), len(val)) == (9, 6)
    # training: the class of each image is its class tar, indexed in the sorted synset order
    split = train.split
    for name, label in zip(split.names, split.labels):
        assert WNIDS[label] == truth['train'][name][0]
        assert split.read(split.names.index(name))[1] == _jpeg(truth['train'][name][1])    # the image's own bytes
    # validation: the label file's class for each flat file, in the same order as training
    got = {Path(name).name: WNIDS[label] for name, label in zip(val.split.names, val.split.labels)}
    assert got == truth['val']
    x, y = val[0]
    assert x.shape == (3, 8, 8) and 0 <= y < 3


def test_the_nested_tar_is_indexed_once_then_cached(tmp_path, cache, monkeypatch):
    download(tmp_path / 'in')
    build_datasets(f"imagenet:{tmp_path / 'in'}", img_size=8)
    import structformer.data.imagenet as imagenet
    monkeypatch.setattr(imagenet, '_members', lambda *a: pytest.fail('indexed the tar again'))
    train, _, _ = build_datasets(f"imagenet:{tmp_path / 'in'}", img_size=8)
    assert len(train) == 9


def _cut(path: Path, fraction: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])


def _devkit_as_tgz(root: Path) -> None:
    import shutil
    with tarfile.open(root / 'ILSVRC2012_devkit_t12.tar.gz', 'w:gz') as tar:
        tar.add(root / 'ILSVRC2012_devkit_t12', arcname='ILSVRC2012_devkit_t12')
    shutil.rmtree(root / 'ILSVRC2012_devkit_t12')


@pytest.mark.parametrize('damage, needle', [
    (lambda root: (root / 'val' / 'ILSVRC2012_val_00000002.JPEG').unlink(), 'labels 6 validation images'),
    (lambda root: (root / 'ILSVRC2012_devkit_t12' / 'data' / 'meta.mat').unlink(), 'needs its meta.mat'),
    (lambda root: [p.unlink() for p in (root / 'ILSVRC2012_devkit_t12' / 'data').iterdir()], 'need their labels'),
    # cut short: the training tar inside a class tar's bytes (tarfile's ReadError 'unexpected end of data' as it
    # seeks to the next header) and the devkit's tar.gz (gzip's EOFError) were tracebacks
    (lambda root: _cut(root / 'ILSVRC2012_img_train.tar', 0.5), 'ILSVRC2012_img_train.tar is cut short or damaged'),
    (lambda root: _cut(root / 'ILSVRC2012_img_train.tar', 0.1), 'ILSVRC2012_img_train.tar is cut short or damaged'),
    (lambda root: (_devkit_as_tgz(root), _cut(root / 'ILSVRC2012_devkit_t12.tar.gz', 0.6)),
     'ILSVRC2012_devkit_t12.tar.gz cannot be read'),
])
def test_an_incomplete_or_cut_download_is_one_line(damage, needle, tmp_path, cache, capsys):
    """A download missing files, or cut short, is one line naming what is wrong."""
    from structformer.cli import main
    download(tmp_path / 'in')
    damage(tmp_path / 'in')
    rc = main(['train', '--model', 'crate_digits', '--data', f"imagenet:{tmp_path / 'in'}", '--output',
               str(tmp_path / 'run'), '--no-progress'])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_data_shard_writes_imagenet_as_downloaded(tmp_path, cache):
    from structformer.data.shard_writer import write_shards
    from structformer.data.tars import iter_shard
    truth = download(tmp_path / 'in')
    info = write_shards(f"imagenet:{tmp_path / 'in'}", str(tmp_path / 'wds'), 4)
    assert info['classes'] == WNIDS and info['class_descriptions'][0] == 'words of n01440764'
    got = sorted((data, label) for name in info['splits']['train']['filenames']
                 for _, _, data, label in iter_shard(str(tmp_path / 'wds' / name)))
    assert got == sorted((_jpeg(v), WNIDS.index(w)) for w, v in truth['train'].values())
    val = [label for name in info['splits']['validation']['filenames']
           for _, _, _, label in iter_shard(str(tmp_path / 'wds' / name))]
    assert [WNIDS[v] for v in val] == [truth['val'][n] for n in sorted(truth['val'])]
    assert json.loads((tmp_path / 'wds' / '_info.json').read_text())['class_order'].startswith('the synset list')


def _extract_train(root: Path, as_tars: bool = False, classes=None) -> None:
    """train/ as users extract it: a folder per class (or the per-class tars as they are), the big tar removed."""
    (root / 'train').mkdir()
    with tarfile.open(root / 'ILSVRC2012_img_train.tar') as outer:
        for member in outer:
            wnid = member.name[:-4]
            if classes is not None and wnid not in classes:
                continue
            if as_tars:
                (root / 'train' / member.name).write_bytes(outer.extractfile(member).read())
                continue
            (root / 'train' / wnid).mkdir()
            with tarfile.open(fileobj=outer.extractfile(member)) as inner:
                for m in inner:
                    (root / 'train' / wnid / m.name).write_bytes(inner.extractfile(m).read())
    (root / 'ILSVRC2012_img_train.tar').unlink()


def _val_as_tar(root: Path, keep_empty_folder: bool = False) -> None:
    with tarfile.open(root / 'ILSVRC2012_img_val.tar', 'w') as tar:
        for p in sorted((root / 'val').iterdir()):
            tar.add(p, arcname=p.name)
    for p in (root / 'val').iterdir():
        p.unlink()
    if not keep_empty_folder:
        (root / 'val').rmdir()


def _valprep(root: Path, truth) -> None:
    """val/ sorted into class folders, as the widely used valprep.sh does."""
    for name, wnid in truth['val'].items():
        (root / 'val' / wnid).mkdir(exist_ok=True)
        (root / 'val' / name).rename(root / 'val' / wnid / name)


def _oddities(root: Path) -> None:
    """The real train set's oddities: a PNG and a CMYK JPEG named .JPEG, a greyscale JPEG."""
    from PIL import Image
    Image.new('RGB', (8, 8), (1, 2, 3)).save(root / 'train' / WNIDS[0] / f'{WNIDS[0]}_png.JPEG', 'PNG')
    Image.new('CMYK', (8, 8), (0, 0, 0, 255)).save(root / 'train' / WNIDS[0] / f'{WNIDS[0]}_cmyk.JPEG', 'JPEG')
    Image.new('L', (8, 8), 5).save(root / 'train' / WNIDS[1] / f'{WNIDS[1]}_grey.JPEG', 'JPEG')


@pytest.mark.parametrize('layout', ['val tar + devkit tar.gz', 'extracted train + valprep val + oddities',
                                    'extracted train + val tar, empty val/', 'kaggle, train/ of class tars'])
def test_the_usual_mixes_of_tars_and_folders_read_the_same_classes(layout, tmp_path, cache):
    """Each mix users have (parts extracted, parts as tars) gives the same classes and labels. An empty val/ (made
    to extract into) beside the val tar was read as a val/ of no images ('labels 6 validation images; holds 0')."""
    root = tmp_path / 'in'
    truth = download(root, 'kaggle' if layout.startswith('kaggle') else 'devkit')
    extra = 0
    if layout == 'val tar + devkit tar.gz':
        _val_as_tar(root)
        _devkit_as_tgz(root)
    elif layout.startswith('extracted train + valprep'):
        _extract_train(root)
        _valprep(root, truth)
        _oddities(root)
        extra = 3
    elif layout.startswith('extracted train + val tar'):
        _extract_train(root)
        _val_as_tar(root, keep_empty_folder=True)
    else:
        _extract_train(root, as_tars=True)
    train, val, info = build_datasets(f'imagenet:{root}', img_size=8, augment=False)
    assert info.extra['classes'] == WNIDS and (len(train), len(val)) == (9 + extra, 6)
    got = {Path(n).name: WNIDS[y] for n, y in zip(val.split.names, val.split.labels)}
    assert got == truth['val']
    train_got = {n.replace('\\', '/').split('/')[-2] + '/' + Path(n).name: WNIDS[y]
                 for n, y in zip(train.split.names, train.split.labels)}
    assert all(train_got[k] == w for k, (w, _) in truth['train'].items())
    assert all(train[i][0].shape == (3, 8, 8) for i in range(len(train)))      # the oddities decode as RGB


def test_a_train_folder_of_one_class_tar_names_its_class(tmp_path, cache):
    """train/ holding one per-class tar (a subset): its images were named without their class and the run stopped
    with 'training class n01440764_0.JPEG is not in the synset list'."""
    root = tmp_path / 'in'
    download(root, 'kaggle')
    _extract_train(root, as_tars=True, classes=WNIDS[1:2])
    train, _, info = build_datasets(f'imagenet:{root}', img_size=8, augment=False)
    assert info.extra['classes'] == WNIDS and train.split.labels == [1, 1, 1]
    assert all(n.startswith(f'{WNIDS[1]}/') for n in train.split.names)


@pytest.mark.parametrize('as_tars', [False, True])
def test_an_empty_training_class_without_a_synset_list_is_one_line(as_tars, tmp_path, cache, capsys):
    """Without the labels the classes are the training folders (or class tars); an empty one was dropped, so the
    model had a class fewer and every later class's index shifted. torchvision's ImageFolder refuses it; so do we."""
    from structformer.cli import main
    root = tmp_path / 'in'
    download(root, 'kaggle')
    _extract_train(root, as_tars=as_tars)
    for name in ('LOC_synset_mapping.txt', 'LOC_val_solution.csv'):
        (root / name).unlink()
    for p in (root / 'val').iterdir():
        p.unlink()
    (root / 'val').rmdir()
    if as_tars:
        (root / 'train' / f'{WNIDS[1]}.tar').write_bytes(_tar_bytes([]))
    else:
        for p in (root / 'train' / WNIDS[1]).iterdir():
            p.unlink()
    rc = main(['train', '--model', 'crate_digits', '--data', f'imagenet:{root}', '--output', str(tmp_path / 'run'),
               '--no-progress'])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and f'hold no image, e.g. {WNIDS[1]}' in err, err
    assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('damage', [b'', b'PK\x03\x04 not a zip', None])
def test_a_damaged_index_cache_is_rebuilt(damage, tmp_path, cache):
    """An empty or damaged cache file (np.load's EOFError, zipfile's BadZipFile) was a traceback on every run."""
    download(tmp_path / 'in')
    before = build_datasets(f"imagenet:{tmp_path / 'in'}", img_size=8)[0].split
    (cached,) = (tmp_path / 'cache').rglob('*.npz')
    cached.write_bytes(damage if damage is not None else cached.read_bytes()[:100])
    after = build_datasets(f"imagenet:{tmp_path / 'in'}", img_size=8)[0].split
    assert after.names == before.names and after.ranges == before.ranges and len(after) == 9
    assert [n.decode() for n in np.load(cached)['names'].tolist()] == before.names      # written again, whole


def test_shards_of_the_download_are_read_whole_by_timms_wds_reader(tmp_path, cache):
    """ImageNet's files are named `.JPEG`: the shards held `KEY.jpeg`, and timm's wds reader (image keys
    'jpg;png;webp') passed over every sample, reading 0 of them. Members are now named by the image's format,
    the PNG named `.JPEG` in the real train set included."""
    from timm.data import create_dataset

    from structformer.data.shard_writer import write_shards
    root = tmp_path / 'in'
    truth = download(root)
    _extract_train(root)
    _oddities(root)
    write_shards(f'imagenet:{root}', str(tmp_path / 'wds'), 4)
    members = [n for p in sorted((tmp_path / 'wds').glob('*.tar')) for n in tarfile.open(p).getnames()]
    assert {n.rsplit('.', 1)[1] for n in members} == {'jpg', 'png', 'cls'}
    assert [n for n in members if n.endswith('.png')] and all('_png' in n for n in members if n.endswith('.png'))
    for split, count in (('train', len(truth['train']) + 3), ('validation', len(truth['val']))):
        ds = create_dataset('wds/imagenet', root=str(tmp_path / 'wds'), split=split, is_training=False, batch_size=1)
        samples = list(ds)
        assert len(samples) == count and all(image.size == (8, 8) for image, _ in samples)


@pytest.mark.parametrize('part', ['train', 'val'])
def test_an_extraction_left_half_done_is_one_line(part, tmp_path, cache, capsys):
    """train/ with class folders and class tars (the extraction loop cut), or val/ with class folders and flat
    images (valprep.sh cut): the folders alone were read, the rest left out of the run without a word."""
    from structformer.cli import main
    root = tmp_path / 'in'
    truth = download(root)
    if part == 'train':
        _extract_train(root, as_tars=True)
        with tarfile.open(root / 'train' / f'{WNIDS[0]}.tar') as tar:
            tar.extractall(root / 'train' / WNIDS[0], filter='data')
        (root / 'train' / f'{WNIDS[0]}.tar').unlink()
        needle = 'holds both class folders (1) and class tars (2'
    else:
        _valprep(root, {'val': dict(list(truth['val'].items())[:3])})
        needle = 'holds class folders and 3 images outside them'
    rc = main(['train', '--model', 'crate_digits', '--data', f'imagenet:{root}', '--output', str(tmp_path / 'run'),
               '--no-progress'])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / 'run').exists()


def test_a_run_on_the_hubs_copy_is_scored_on_the_download(tmp_path, cache, capsys):
    """The Hub's imagenet-1k names its classes by their words ('tench, Tinca tinca'), the download by WNIDs with the
    words as descriptions, in the same order: `eval` of a run on one refused the other ('other classes: ... only
    the run's: ...'). Another order is still refused."""
    datasets = pytest.importorskip('datasets')
    from structformer.cli import main
    from structformer.data.classes import class_mismatch
    download(tmp_path / 'in')
    words = [f'words of {w}' for w in WNIDS]
    feature = datasets.Features({'image': datasets.Image(), 'label': datasets.ClassLabel(names=words)})
    rows = {'image': [{'bytes': _jpeg(40 * k), 'path': None} for k in range(6)], 'label': [0, 1, 2] * 2}
    datasets.DatasetDict({'train': datasets.Dataset.from_dict(rows, features=feature),
                          'validation': datasets.Dataset.from_dict(rows, features=feature)}).save_to_disk(
        str(tmp_path / 'hub'))
    assert main(['train', '--model', 'crate_digits', '--data', f"hfds:{tmp_path / 'hub'}", '--epochs', '1',
                 '--batch-size', '3', '--workers', '0', '--no-progress', '--output', str(tmp_path / 'run')]) == 0
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(tmp_path / 'run'), '--data', f"imagenet:{tmp_path / 'in'}"]) == 0
    assert '(val, 6 images)' in capsys.readouterr().out
    assert class_mismatch(WNIDS, words, words, None) is None                   # either side's words
    assert class_mismatch(words[::-1], WNIDS, None, words).startswith('other classes')   # another order: refused


def test_kaggles_label_files_saved_with_a_bom_and_crlf_are_read(tmp_path, cache):
    """LOC_val_solution.csv / LOC_synset_mapping.txt saved again by a spreadsheet or on Windows (a UTF-8 BOM, CRLF):
    the BOM named the first column '\\ufeffImageId' (every validation image 'has no label') and the first synset
    '\\ufeffn01440764'."""
    root = tmp_path / 'in'
    truth = download(root, 'kaggle')
    for name in ('LOC_val_solution.csv', 'LOC_synset_mapping.txt'):
        text = (root / name).read_text()
        (root / name).write_bytes(b'\xef\xbb\xbf' + text.replace('\n', '\r\n').encode())
    _, val, info = build_datasets(f'imagenet:{root}', img_size=8, augment=False)
    assert info.extra['classes'] == WNIDS and info.extra['class_descriptions'][0] == f'words of {WNIDS[0]}'
    assert {Path(n).name: WNIDS[y] for n, y in zip(val.split.names, val.split.labels)} == truth['val']


def test_the_index_cache_keeps_the_newest_few_and_non_ascii_names(tmp_path, cache, monkeypatch):
    """Each copy of a download (a cluster job copying it to local disk) is indexed anew: its index file (174 MB for
    ImageNet's train tar, names held as 4-byte characters) stayed in the cache for good. The most recently used
    KEEP_INDEXES are kept, names stored as UTF-8 (read back the same, non-ASCII too)."""
    import os

    import structformer.data.imagenet as imagenet
    keep = getattr(imagenet, 'KEEP_INDEXES', 8)
    folder = tmp_path / 'cache' / 'imagenet-index'
    folder.mkdir(parents=True)
    for k in range(keep + 3):                       # older indexes of earlier copies
        (folder / f'old{k}.npz').write_bytes(b'x')
        os.utime(folder / f'old{k}.npz', (1000 + k, 1000 + k))
    root = tmp_path / 'in'
    download(root, 'kaggle')
    _extract_train(root, as_tars=True)
    with tarfile.open(root / 'train' / f'{WNIDS[0]}.tar') as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar]
    (root / 'train' / f'{WNIDS[0]}.tar').write_bytes(_tar_bytes(members + [('n01440764_é.JPEG', _jpeg(7))]))
    first = build_datasets(f'imagenet:{root}', img_size=8)[0].split
    left = sorted(p.name for p in folder.iterdir())
    assert len(left) == keep and 'old0.npz' not in left and f'old{keep + 2}.npz' in left
    monkeypatch.setattr(imagenet, '_members', lambda *a: pytest.fail('indexed again'))
    again = build_datasets(f'imagenet:{root}', img_size=8)[0].split
    assert again.names == first.names and f'{WNIDS[0]}/n01440764_é.JPEG' in again.names


def _download_with_a_cut_image(root: Path) -> Path:
    """The ImageNet download at `root` with the second image of the third class's train tar cut after its header
    (it passes the tars' listing and fails to decode when it is read)."""
    download(root)
    with tarfile.open(root / 'ILSVRC2012_img_train.tar') as outer:
        inner = [(m.name, outer.extractfile(m).read()) for m in outer]
    with tarfile.open(fileobj=io.BytesIO(inner[2][1])) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar]
    members[1] = (members[1][0], members[1][1][:60])
    inner[2] = (inner[2][0], _tar_bytes(members))
    (root / 'ILSVRC2012_img_train.tar').write_bytes(_tar_bytes(inner))
    return root


def test_a_bad_image_met_while_writing_shards_says_skip_resumes(tmp_path, cache, capsys):
    """An image inside the train tar that does not decode stops `data shard` hours in (the tars get no up-front
    check). The line said 'fix or remove it': removing it changes what every shard holds, so every finished shard
    was written again. It now says so, and that --bad-images skip resumes from the finished shards."""
    from structformer.cli import main
    root = _download_with_a_cut_image(tmp_path / 'in')
    argv = ['data', 'shard', f'imagenet:{root}', str(tmp_path / 'wds'), '--shard-size', '1']
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f'{WNIDS[2]}/{WNIDS[2]}_1.JPEG cannot be read' in err, err
    assert 'pass --bad-images skip' in err and 'removing it changes what every shard holds' in err, err
    assert main(argv + ['--bad-images', 'skip']) == 0
    out = capsys.readouterr().out
    assert 'resuming the interrupted run' in out and '1 left out' in out, out


def test_the_validation_images_alone_score_a_model_and_are_refused_for_training(tmp_path, cache, capsys):
    """The val tar and the devkit alone (6.3 GB, what one downloads to score pretrained models): `eval` was refused
    ('no training images'). Now they score a model; training and `eval --split train` are one line each (the
    latter divided by zero), nothing written."""
    from structformer.cli import main
    root = tmp_path / 'in'
    truth = download(root)
    assert main(['train', '--model', 'crate_digits', '--data', f'imagenet:{root}', '--epochs', '1', '--batch-size',
                 '3', '--workers', '0', '--no-progress', '--output', str(tmp_path / 'run')]) == 0
    _val_as_tar(root)
    _devkit_as_tgz(root)
    (root / 'ILSVRC2012_img_train.tar').unlink()
    train, val, info = build_datasets(f'imagenet:{root}', img_size=8)
    assert (len(train), len(val), info.extra['classes']) == (0, 6, WNIDS)
    assert {Path(n).name: WNIDS[y] for n, y in zip(val.split.names, val.split.labels)} == truth['val']
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(tmp_path / 'run'), '--data', f'imagenet:{root}']) == 0
    assert '(val, 6 images)' in capsys.readouterr().out
    for argv in (['eval', '--checkpoint', str(tmp_path / 'run'), '--data', f'imagenet:{root}', '--split', 'train'],
                 ['train', '--model', 'crate_digits', '--data', f'imagenet:{root}', '--no-progress', '--output',
                  str(tmp_path / 'run2')]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and 'holds the validation images alone' in err, err
    assert not (tmp_path / 'run2').exists()


def test_imagenets_flat_val_read_as_an_image_folder_points_to_imagenet(tmp_path, cache, capsys):
    """train/ extracted and the flat val/ beside it, given as an image folder (torchvision's layout): the line said
    only that val/ has no class folders; it now names the form that reads its labels."""
    from structformer.cli import main
    root = tmp_path / 'in'
    download(root)
    _extract_train(root)
    for argv in (['train', '--model', 'crate_digits', '--data', f'imagefolder:{root}', '--no-progress', '--output',
                  str(tmp_path / 'run')], ['data', 'shard', str(root), str(tmp_path / 'wds')]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f'imagenet:{root}' in err and 'LOC_val_solution.csv' in err, err
    assert not (tmp_path / 'run').exists() and not (tmp_path / 'wds').exists()


@pytest.mark.parametrize('extracted', [True, False])
def test_the_download_kept_inside_train_is_not_a_class_tar(extracted, tmp_path, cache):
    """The common recipe moves ILSVRC2012_img_train.tar into train/ and extracts it there; kept beside the class
    folders it was read as the one class tar (no image in it: 0 training images); alone there, as a class tar
    of class tars. It is passed over beside the class folders and read as the download when alone; so is the val
    tar alone in val/ (it was a val/ of 0 images)."""
    root = tmp_path / 'in'
    truth = download(root, 'kaggle')
    if extracted:
        _extract_train(root)
        (root / 'train' / 'ILSVRC2012_img_train.tar').write_bytes(_tar_bytes([]))
    else:
        (root / 'train').mkdir()
        (root / 'ILSVRC2012_img_train.tar').rename(root / 'train' / 'ILSVRC2012_img_train.tar')
        _val_as_tar(root, keep_empty_folder=True)                  # and the val tar moved into val/, not extracted
        (root / 'ILSVRC2012_img_val.tar').rename(root / 'val' / 'ILSVRC2012_img_val.tar')
    train, val, info = build_datasets(f'imagenet:{root}', img_size=8, augment=False)
    assert {Path(n).name: WNIDS[y] for n, y in zip(val.split.names, val.split.labels)} == truth['val']
    assert info.extra['classes'] == WNIDS and len(train) == len(truth['train'])
    got = {n.replace('\\', '/').split('/')[-2] + '/' + Path(n).name: WNIDS[y]
           for n, y in zip(train.split.names, train.split.labels)}
    assert got == {k: w for k, (w, _) in truth['train'].items()}


def _hidden(root: Path) -> None:
    """What a desktop, a notebook or a copy on a Mac leaves in a download: .DS_Store, a trash or checkpoint folder,
    and the AppleDouble '._NAME' file beside each copied file (4 bytes of magic, no image)."""
    for folder in (root / 'train', root / 'val'):
        if folder.is_dir():
            (folder / '.DS_Store').write_bytes(b'\0\0\0\1Bud1')
            (folder / '.ipynb_checkpoints').mkdir()
            for p in list(folder.iterdir()):
                if not p.name.startswith('.'):
                    (folder / f'._{p.name}').write_bytes(b'\0\5\26\7 apple double')
                if p.is_dir() and not p.name.startswith('.'):
                    for q in list(p.iterdir()):
                        (p / f'._{q.name}').write_bytes(b'\0\5\26\7 apple double')


@pytest.mark.parametrize('layout', ['train of class tars + flat val', 'train folders (no synset list) + valprep val',
                                    'train folders + val tar in an otherwise empty val/'])
def test_hidden_files_and_folders_are_neither_classes_nor_images(layout, tmp_path, cache):
    """Entries named '.…' are not ImageNet's: a hidden folder beside class tars was 'class folders and class tars'
    (an extraction cut short), one in the flat val/ 'class folders and images outside them', an AppleDouble
    '._ILSVRC2012_val_00000001.JPEG' an unlabelled seventh validation image, a val/ holding .DS_Store alone was
    not passed over for the val tar, and an empty .ipynb_checkpoints an empty training class."""
    root = tmp_path / 'in'
    truth = download(root, 'kaggle')
    if layout.startswith('train of class tars'):
        _extract_train(root, as_tars=True)
        tar = root / 'train' / f'{WNIDS[0]}.tar'        # tarred on a Mac: '._NAME' members beside the images
        with tarfile.open(tar) as t:
            members = [(m.name, t.extractfile(m).read()) for m in t]
        tar.write_bytes(_tar_bytes([m for name, data in members for m in ((f'._{name}', b'\0\5\26\7'), (name, data))]))
    elif layout.startswith('train folders (no synset list)'):
        _extract_train(root)
        _valprep(root, truth)
        (root / 'LOC_synset_mapping.txt').unlink()
    else:
        _extract_train(root)
        _val_as_tar(root, keep_empty_folder=True)
    _hidden(root)
    train, val, info = build_datasets(f'imagenet:{root}', img_size=8, augment=False)
    assert info.extra['classes'] == WNIDS and (len(train), len(val)) == (9, 6)
    assert not any(Path(n).name.startswith('.') for n in train.split.names + val.split.names)
    assert {Path(n).name: WNIDS[y] for n, y in zip(val.split.names, val.split.labels)} == truth['val']


def test_an_undecodable_image_met_while_training_names_bad_images_skip(tmp_path, cache, capsys):
    """An image inside the train tar cut after its header is met mid-run (the tars get no up-front check): the stop
    said 'image … cannot be read: …' alone, while the wds form's line names --data-kwargs bad_images=skip, which
    trains past it. It now names the option too; with it the image is replaced (and named in the log)."""
    from structformer.cli import main
    root = _download_with_a_cut_image(tmp_path / 'in')
    train, _, _ = build_datasets(f'imagenet:{root}', img_size=8)
    bad = train.split.names.index(f'{WNIDS[2]}/{WNIDS[2]}_1.JPEG')
    with pytest.raises(ValueError, match=r'^--data .imagenet:.*cannot be read: .*--data-kwargs bad_images=skip'):
        train[bad]
    argv = ['train', '--model', 'crate_digits', '--data', f'imagenet:{root}', '--epochs', '1', '--batch-size', '3',
            '--workers', '0', '--no-progress', '--output', str(tmp_path / 'run')]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'cannot be read' in err and '--data-kwargs bad_images=skip' in err, err
    skipping, _, _ = build_datasets(f'imagenet:{root}', img_size=8, bad_images='skip')
    assert skipping[bad][1] == 2 and f'{WNIDS[2]}_1.JPEG cannot be read' in capsys.readouterr().out


def _build_on_rank(rank, world, init_file, root, out):
    """One process of a gloo group: build imagenet:ROOT, counting the tars it walks to index them."""
    import torch.distributed as dist
    from structformer.data import imagenet
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world)
    walked, real = [], imagenet._members
    imagenet._members = lambda tar, where: walked.append(where) or real(tar, where)
    train, val, _ = build_datasets(f'imagenet:{root}', img_size=8)
    Path(out, f'rank{rank}.json').write_text(json.dumps([len(walked), train.split.names, val.split.names]))
    dist.destroy_process_group()


def test_under_ddp_process_0_alone_indexes_the_tars(tmp_path, cache):
    """The train tar (a tar of class tars) and the val tar: on a first run each torchrun process indexed them, at once
    (1.28 M headers each on ImageNet). Now process 0 indexes and the others read its cache: the same index."""
    import torch.multiprocessing as tmp
    root = tmp_path / 'in'
    download(root)
    _val_as_tar(root)
    tmp.start_processes(_build_on_rank, args=(2, str(tmp_path / 'init'), str(root), str(tmp_path)), nprocs=2,
                        start_method='fork')
    first, second = (json.loads((tmp_path / f'rank{r}.json').read_text()) for r in (0, 1))
    assert first[0] == 1 + len(WNIDS) + 1 and second[0] == 0          # outer tar, its class tars, the val tar
    assert first[1:] == second[1:] and len(first[1]) == 9 and len(first[2]) == 6
