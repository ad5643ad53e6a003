"""A run's checkpoint folder names are made and read in one place (train/checkpoint.py): epoch checkpoints, recovery
points, and the names that are neither (copies, temporaries, timm train.py's CheckpointSaver files)."""
import pytest

from structformer.train.checkpoint import (CheckpointError, checkpoint_epoch, checkpoint_name, committed_checkpoints,
                                           parse_checkpoint_name, resolve_checkpoint)
from structformer.train.recovery import epoch_of, newer_than, recovery_name, recovery_points


def _folder(root, name):
    path = root / name
    path.mkdir(parents=True)
    (path / 'state.json').write_text('{}')
    (path / 'model.safetensors').write_bytes(b'')
    return path


def test_names_read_back_as_written_and_other_names_are_no_checkpoint():
    for epoch, step in ((0, None), (3, None), (12345, None), (2, 10), (10000, 123456789)):
        assert parse_checkpoint_name(checkpoint_name(epoch, step)) == (epoch, step)
    assert recovery_name(2, 10) == 'recovery_0002_00000010' and checkpoint_name(7) == 'epoch_0007'
    for other in ('checkpoint-3.pth.tar', 'last.pth.tar', 'model_best.pth.tar', 'epoch_0003.bak', 'epoch_3',
                  'epoch_00003', 'epoch_0003.tmp-x1y2', 'recovery_0002_00000010 (2)', 'recovery_0002_10',
                  'recovery_0002_0000001x', 'latest.json'):
        assert parse_checkpoint_name(other) is None, other
    with pytest.raises(ValueError, match='not a checkpoint folder name'):
        checkpoint_epoch('model_best.pth.tar')


def test_a_copied_recovery_point_is_no_recovery_point(tmp_path):
    """recovery_points sorted by int() of the name's parts: a user's copy recovery_0002_00000010.bak (which its glob
    matched) made every resume of the run a ValueError traceback; now only the names the trainer writes count."""
    _folder(tmp_path, 'recovery_0002_00000010.bak')
    _folder(tmp_path, 'recovery_0002_00000012')
    _folder(tmp_path, 'recovery_0001_00000004')
    (tmp_path / 'recovery_0003_00000020').mkdir()                 # not committed: no state, no weights
    assert [p.name for p in recovery_points(tmp_path)] == ['recovery_0001_00000004', 'recovery_0002_00000012']
    assert newer_than(tmp_path, 1).name == 'recovery_0002_00000012' and epoch_of(newer_than(tmp_path, 1)) == 2


def test_epoch_checkpoints_past_9999_and_only_those_names(tmp_path):
    """The glob epoch_[0-9][0-9][0-9][0-9] missed epoch_10000, which the trainer names with {:04d}."""
    for name in ('epoch_0000', 'epoch_9999', 'epoch_10000', 'epoch_0005.bak', 'epoch_0006.tmp-abc', 'last.pth.tar'):
        _folder(tmp_path, name)
    assert [p.name for p in committed_checkpoints(tmp_path)] == ['epoch_0000', 'epoch_9999', 'epoch_10000']
    assert resolve_checkpoint(tmp_path).name == 'epoch_10000'      # no latest.json: the newest complete one


@pytest.mark.parametrize('name', ['checkpoint-12.pth.tar', 'last.pth.tar', 'model_best.pth.tar'])
def test_a_timm_train_checkpoint_is_named_as_such(name, tmp_path):
    """timm train.py's CheckpointSaver files were refused as 'a file but not a checkpoint's model.safetensors'; now the
    line says what they are and where their weights go in."""
    (tmp_path / name).write_bytes(b'')
    with pytest.raises(CheckpointError, match=r"is a timm train\.py checkpoint .* --initial-checkpoint FILE"):
        resolve_checkpoint(tmp_path / name)


@pytest.mark.parametrize('name', ['deit_small.pth.tar', 'weights.pth'])
def test_eval_and_export_of_a_torch_file_say_to_convert_it(name, tmp_path):
    """`eval --checkpoint X.pth.tar` said only 'a file but not a checkpoint's model.safetensors' and `export X.pth`
    only 'a pickle': neither said what to run. Both now give the convert line (or --initial-checkpoint)."""
    import torch

    from structformer.errors import UsageError
    from structformer.export.source import load_source
    path = tmp_path / name
    torch.save({'state_dict': {'head.weight': torch.zeros(2, 2)}}, path)
    with pytest.raises(CheckpointError, match=r"torch\.save file.*structformer convert .*--initial-checkpoint"):
        resolve_checkpoint(path)
    with pytest.raises(UsageError, match=r"is a pickle.*structformer convert .*--output DIR\) and export"):
        load_source(path)
