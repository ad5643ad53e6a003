"""`--data hfds:PATH` and `data shard hfds:PATH` on datasets as users have them (data/hfds.py): image columns stored
as raw bytes or as the Image feature's {'bytes', 'path'} struct without the feature, the Hub's imagenet-1k split
layout (train / validation / test, the test labels all -1), labels outside the classes, and a Hub download
(parquet files) given where a save_to_disk folder is expected."""
import io

import numpy as np
import pytest

from structformer.data import build_datasets
from structformer.errors import UsageError

datasets = pytest.importorskip('datasets')


def _png(value: int) -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.fromarray(np.full((6, 6, 3), value, np.uint8)).save(out, 'PNG')
    return out.getvalue()


def _pixel(tensor_or_bytes) -> int:
    from PIL import Image
    return int(np.asarray(Image.open(io.BytesIO(tensor_or_bytes)))[0, 0, 0])


NAMES = ['tench, Tinca tinca', 'goldfish, Carassius auratus']       # the Hub's imagenet-1k ClassLabel names


def _in1k(n: int, labels, image_feature=True):
    """Rows as the Hub's imagenet-1k has them: `image` (Image: {'bytes', 'path'}), `label` (ClassLabel)."""
    features = datasets.Features({'image': datasets.Image() if image_feature else datasets.Value('binary'),
                                  'label': datasets.ClassLabel(names=NAMES)})
    images = [{'bytes': _png(20 * i + 10), 'path': f'img_{i}.JPEG'} for i in range(n)] if image_feature \
        else [_png(20 * i + 10) for i in range(n)]
    return datasets.Dataset.from_dict({'image': images, 'label': labels}, features=features)


@pytest.mark.parametrize('column', ['binary', 'struct'])
def test_images_stored_as_bytes_without_the_image_feature_are_read(column, tmp_path):
    """A binary column (raw encoded bytes) and a {'bytes', 'path'} struct column (the Image feature lost, e.g. parquet
    written without it) were unreadable on every row ('embedded null byte', "'dict' object has no attribute
    'read'"); data shard stopped with a ValueError traceback."""
    from structformer.data.shard_writer import write_shards
    from structformer.data.tars import iter_shard
    if column == 'binary':
        ds = _in1k(4, [0, 1, 1, 0], image_feature=False)
    else:
        ds = datasets.Dataset.from_dict({'image': [{'bytes': _png(20 * i + 10), 'path': None} for i in range(4)],
                                         'label': [0, 1, 1, 0]})
    datasets.DatasetDict({'train': ds, 'validation': ds}).save_to_disk(str(tmp_path / 'hf'))
    train, val, _ = build_datasets(f"hfds:{tmp_path / 'hf'}", img_size=8, augment=False, crop_pct=1.0)
    x, y = val[1]
    assert x.shape == (3, 8, 8) and y == 1
    info = write_shards(f"hfds:{tmp_path / 'hf'}", str(tmp_path / 'wds'), 3)
    got = sorted((_pixel(data), label) for name in info['splits']['train']['filenames']
                 for _, _, data, label in iter_shard(str(tmp_path / 'wds' / name)))
    assert got == [(10, 0), (30, 1), (50, 1), (70, 0)]


def test_the_hubs_unlabelled_test_split_is_not_taken_for_validation(tmp_path, capsys):
    """imagenet-1k's `test` split has label -1 on every row. Without a `validation` split it was scored as the
    validation split (class -1: a traceback in the loss) and written as the validation shards with class -1."""
    from structformer.data.shard_writer import write_shards
    datasets.DatasetDict({'train': _in1k(6, [0, 1] * 3), 'test': _in1k(2, [-1, -1])}).save_to_disk(
        str(tmp_path / 'hf'))
    train, val, info = build_datasets(f"hfds:{tmp_path / 'hf'}", img_size=8, augment=False)
    assert 'test hold no labels' in capsys.readouterr().out
    assert info.extra['split'].startswith('stratified split') and (len(train), len(val)) == (4, 2)
    assert sorted(val[i][1] for i in range(len(val))) == [0, 1]
    assert info.extra['classes'] == NAMES
    info = write_shards(f"hfds:{tmp_path / 'hf'}", str(tmp_path / 'wds'), 4)
    assert sorted(info['splits']) == ['train'] and info['splits']['train']['num_samples'] == 6
    # with a labelled validation split beside it, that one is used
    datasets.DatasetDict({'train': _in1k(6, [0, 1] * 3), 'validation': _in1k(2, [1, 0]),
                          'test': _in1k(2, [-1, -1])}).save_to_disk(str(tmp_path / 'hf3'))
    _, val, info = build_datasets(f"hfds:{tmp_path / 'hf3'}", img_size=8, augment=False)
    assert info.extra['split'] == 'split train (6) train, validation (2) val' and val[0][1] == 1


@pytest.mark.parametrize('class_label', [True, False])
def test_a_label_outside_the_classes_is_one_line(class_label, tmp_path):
    """A ClassLabel column accepts -1 (missing), an integer column anything: such a row in a labelled split reached
    the loss (a traceback at that batch, or -1 counted as a class)."""
    ds = _in1k(4, [0, 1, -1, 0])
    if not class_label:
        ds = ds.cast_column('label', datasets.Value('int64'))
    datasets.DatasetDict({'train': ds, 'validation': ds.select([0, 1])}).save_to_disk(str(tmp_path / 'hf'))
    _refused_by_training_and_data_shard(tmp_path, "split 'train' row 2 has label -1, outside the 2 classes")


def _refused_by_training_and_data_shard(tmp_path, match: str) -> None:
    """The dataset saved in tmp_path/hf is refused in one line naming `match` by a run's data and by data shard,
    which leaves no shard folder."""
    from structformer.data.shard_writer import write_shards
    with pytest.raises(UsageError, match=match) as e:
        build_datasets(f"hfds:{tmp_path / 'hf'}", img_size=8)
    assert '\n' not in str(e.value)
    with pytest.raises(UsageError, match=match):
        write_shards(f"hfds:{tmp_path / 'hf'}", str(tmp_path / 'wds'), 4)
    assert not (tmp_path / 'wds').exists()


def test_a_hub_download_of_parquet_files_names_the_conversion(tmp_path, capsys):
    """`huggingface-cli download ILSVRC/imagenet-1k` gives data/{train,validation,test}-*.parquet: 'not a dataset
    saved with save_to_disk' alone did not say what to do with it."""
    from structformer.cli import main
    (tmp_path / 'in1k' / 'data').mkdir(parents=True)
    _in1k(2, [0, 1]).to_parquet(str(tmp_path / 'in1k' / 'data' / 'train-00000-of-00001.parquet'))
    capsys.readouterr()
    rc = main(['train', '--model', 'crate_digits', '--data', f"hfds:{tmp_path / 'in1k'}", '--output',
               str(tmp_path / 'run'), '--no-progress'])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert 'holds parquet files' in err and f"load_dataset('{tmp_path / 'in1k'}').save_to_disk(" in err
    assert not (tmp_path / 'run').exists()


def test_labels_are_read_as_one_column_equal_to_the_rows():
    from structformer.data.hfds import labels_of
    ds = _in1k(5, [1, 0, 1, 1, 0]).select([4, 2, 0])              # an indices mapping: rows 4, 2, 0
    assert labels_of(ds, 'label', 'x').tolist() == [0, 1, 1] == [row['label'] for row in ds]


@pytest.mark.parametrize('names, needle', [
    (NAMES[::-1], "class 0 is 'goldfish, Carassius auratus' there, 'tench, Tinca tinca' in train"),
    (NAMES + ['extra'], '3 classes there, 2 in train')])
def test_a_validation_split_with_other_class_names_is_one_line(names, needle, tmp_path):
    """A validation ClassLabel in another order (or with other names) than train's was used as is: its label k was
    scored as train's class k, silently. Both the training run and data shard refuse it, naming the split."""
    val = _in1k(2, [1, 0]).cast_column('label', datasets.ClassLabel(names=names))
    datasets.DatasetDict({'train': _in1k(4, [0, 1] * 2), 'validation': val}).save_to_disk(str(tmp_path / 'hf'))
    _refused_by_training_and_data_shard(
        tmp_path, f"split 'validation' has other ClassLabel names than split 'train' \\({needle}\\)")
