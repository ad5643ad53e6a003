"""Files as the public trainers write them, read by `convert`, the training flags and timm's `pretrained=True`
(docs/weights.md), second pass: each refusal names the flag and the file the user gave (not convert's --from where
the layout was recognised by its keys), a web page or error text saved in place of a checkpoint says so, options
are honoured whatever the file's name, and which inner dict and which prefixes were taken is said. Tiny CRATE
weights in the public layout (crate_digits' shapes)."""
import argparse

import pytest
import timm
import torch

from structformer.errors import UsageError
from structformer.train.initial_weights import load_initial_weights
from test_convert import _fill, crate_official_shapes


@pytest.fixture(scope='module')
def public_crate():
    """crate_digits-sized weights in CRATE's public layout (Ma-Lab-Berkeley/CRATE model/crate.py), float32."""
    return {k: v.float() for k, v in _fill(crate_official_shapes(1, 2, 64, 4, 4, 16, 16, 10), seed=7).items()}


@pytest.mark.parametrize('change', ['extra', 'missing'])
def test_a_public_layout_that_does_not_fit_names_the_flag_and_file_not_converts_from(change, public_crate, tmp_path):
    """The training flags and timm's loader find the public layout by its keys: no --from was given, so a key that
    does not fit is reported after the flag and the file (and '--model NAME'), as every other mismatch there."""
    state = dict(public_crate)
    if change == 'extra':       # a layer the public CRATE does not have (a ViT's relative position table)
        state['transformer.layers.0.0.fn.relative_position_bias_table'] = torch.zeros(3, 4)
    else:
        del state['transformer.layers.1.1.fn.weight']
    path = tmp_path / 'main.pth.tar'
    torch.save({'epoch': 3, 'arch': 'CRATE_small', 'state_dict': {'module.' + k: v for k, v in state.items()}}, path)
    with pytest.raises(UsageError) as caught:
        load_initial_weights(timm.create_model('crate_digits'), path)
    message = str(caught.value)
    assert message.startswith(f"--initial-checkpoint {path}: ") and '--from' not in message, message
    assert '--model crate_digits' in message and 'crate-official layout' in message, message
    assert ('relative_position_bias_table' if change == 'extra' else 'blocks.1.mlp.weight') in message, message
    with pytest.raises(ValueError, match=r"^pretrained weights: the checkpoint does not fit model crate_digits|"
                                         r"^pretrained weights: 1 weights of model crate_digits are not"):
        timm.create_model('crate_digits', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))


@pytest.mark.parametrize('content, said', [
    (b'<!DOCTYPE html>\n<html><head><title>Google Drive - Virus scan warning</title>', "it is a web page ('<!DOCTYPE"),
    (b'404: Not Found\n', "it is text ('404: Not Found'...)"),
    (bytes([0x52, 0x7f, 0xd9, 0xd6, 0xcf, 0x6d, 0xc9, 0x35]) * 40, 'starts with bytes 52 7f d9 d6'),
    (b'\x1f\x8b\x08\x00' + bytes(60), 'gzip-compressed'),
    (b'\x80\x04<html>', 'Unsupported operand 60'),          # a pickle header, then no pickle: torch's cause kept
], ids=['web page', 'error text', 'random bytes', 'gzip', 'pickle header only'])
def test_what_is_no_torch_file_is_refused_saying_what_it_is(content, said, tmp_path, capsys):
    """A failed download leaves a web page or an error text under the checkpoint's name; the unpickler called it
    'UnpicklingError: ' with nothing after it (its cause is on the line after 'WeightsUnpickler error:')."""
    from structformer.cli import main
    path = tmp_path / 'soft_tiny.pth.tar'
    path.write_bytes(content)
    assert main(['convert', '--from', 'crate-official', str(path), '--model', 'crate_digits',
                 '--output', str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err and not err.endswith(': )'), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ['soft_tiny.pth.tar']


def test_weights_ema_of_a_safetensors_file_is_refused_whatever_its_name(public_crate, tmp_path):
    """A safetensors file is read as what it holds whatever its name; `--weights ema` of one named .pth was
    silently ignored (the check looked at the suffix) and the model's weights converted as if they were the EMA."""
    from safetensors.torch import save_file

    from structformer.weights.cli import convert_checkpoint
    for name in ('ema.safetensors', 'ema.pth'):
        path = tmp_path / name
        save_file(public_crate, str(path))
        with pytest.raises(UsageError, match=r"^--weights ema: .* holds one set of weights \(safetensors\)"):
            convert_checkpoint('crate-official', path, 'crate_digits', weights='ema')


def test_weights_under_net_are_taken_and_other_keys_are_named(public_crate, tmp_path):
    """{'net': state_dict, 'acc', 'epoch'}, the CIFAR scripts' layout (CRATE's finetune.py resumes from 'net'), was
    refused as 'holds no mapping of names to tensors', which it does; Sparsifiner's checkpoint-best-ema.pth (epoch
    'best-ema') is said to be that file, since its default weights are still the model's."""
    from structformer.weights.cli import convert_checkpoint
    net = tmp_path / 'ckpt.t7'
    torch.save({'net': {'module.' + k: v for k, v in public_crate.items()}, 'acc': 55.0, 'epoch': 3}, net)
    model, notes = convert_checkpoint('crate-official', net, 'crate_digits')
    assert 'took net, epoch 3' in notes, notes
    torch.testing.assert_close(model.state_dict()['blocks.1.mlp.weight'],
                               public_crate['transformer.layers.1.1.fn.weight'], rtol=0, atol=0)
    best = tmp_path / 'checkpoint-best-ema.pth'
    torch.save({'model': public_crate, 'model_ema': public_crate, 'epoch': 'best-ema', 'best': 71.0}, best)
    _, notes = convert_checkpoint('crate-official', best, 'crate_digits')
    assert any(line.startswith("took model, epoch 'best-ema': the model's weights") for line in notes), notes
    other = tmp_path / 'gan.pth'
    torch.save({'generator': public_crate, 'step': 10}, other)
    with pytest.raises(UsageError, match=r"holds no state dict under state_dict, model, module, net or an EMA key "
                                         r"\(keys: generator, step\); tensors are under generator"):
        convert_checkpoint('crate-official', other, 'crate_digits')


def test_a_trainers_output_folder_is_refused_naming_the_files_to_give(public_crate, tmp_path):
    """timm train.py's output folder (checkpoint-N.pth.tar, last / model_best.pth.tar, args.yaml, summary.csv) given
    instead of one of its files was refused as 'not a structformer checkpoint or run directory (expected
    model.safetensors + state.json, ...)': now the line names the files to give, best and last first."""
    folder = tmp_path / '20240101-000000-crate_digits-32'
    folder.mkdir()
    for name in ('checkpoint-7.pth.tar', 'last.pth.tar', 'model_best.pth.tar'):
        torch.save({'state_dict': public_crate, 'epoch': 7, 'args': argparse.Namespace(model='crate')}, folder / name)
    for name in ('args.yaml', 'summary.csv'):
        (folder / name).write_text('x\n')
    with pytest.raises(UsageError, match=r"give one of its files: model_best\.pth\.tar, last\.pth\.tar, "
                                         r"checkpoint-7\.pth\.tar$"):
        load_initial_weights(timm.create_model('crate_digits'), folder)


def test_the_folders_of_a_structformer_run_are_still_read(crate_digits_run):
    """The refusal above leaves our own folders to the checkpoint reader: a run, its checkpoints/ (latest.json
    and epoch_* folders), one checkpoint folder."""
    from structformer.train.initial_weights import read_weights
    expected = read_weights(crate_digits_run / 'checkpoints' / 'epoch_0001')
    for folder in (crate_digits_run, crate_digits_run / 'checkpoints'):
        got = read_weights(folder)
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize('fmt', ['torch', 'safetensors'])
def test_the_wrappers_prefix_removed_is_said_and_the_record_keeps_which_weights(fmt, public_crate, tmp_path):
    """CRATE's main.py saves a DataParallel / DDP model's state_dict ('module.' on every key): convert removed the
    prefix without a word; now it says so, and the folder's record still names the weights taken."""
    import json

    from safetensors.torch import save_file

    from structformer.weights.cli import convert_checkpoint
    state = {'module.' + k: v for k, v in public_crate.items()}
    path = tmp_path / ('main.pth.tar' if fmt == 'torch' else 'main.safetensors')
    if fmt == 'torch':
        torch.save({'epoch': 3, 'arch': 'CRATE_small', 'state_dict': state, 'best_acc1': torch.tensor(55.0)}, path)
    else:
        save_file(state, str(path))
    _, notes = convert_checkpoint('crate-official', path, 'crate_digits', output=tmp_path / 'out')
    assert f"removed the prefix 'module.' from {len(state)} keys" in ' '.join(notes), notes
    record = json.loads((tmp_path / 'out' / 'state.json').read_text())['converted_from']
    assert record['weights'] == ('took state_dict, epoch 3' if fmt == 'torch' else None), record


class _PathAs:
    """Pickles as the pathlib class named `module.name` (as the trainer's Python wrote it), without making one."""
    def __init__(self, cls, text):
        self.cls, self.text = cls, text

    def __reduce__(self):
        return self.cls, (self.text,)


@pytest.mark.parametrize('module, name', [('pathlib', 'WindowsPath'), ('pathlib._local', 'PosixPath')])
def test_paths_in_args_from_windows_or_python_3_13_are_read(module, name, public_crate, tmp_path, monkeypatch):
    """A Path option in `args` of a checkpoint written on Windows names pathlib.WindowsPath, which cannot be made on
    Linux: it was refused as 'not a readable torch file (NotImplementedError: cannot instantiate ...)'; Python 3.13
    pickles paths as pathlib._local.X, which the allow-list did not name."""
    import pathlib
    import sys
    import types
    if module == 'pathlib':
        cls = pathlib.WindowsPath
    else:                        # stand in for Python 3.13's module, for the pickler to name (read back: ours)
        cls = type(name, (), {'__module__': module, '__qualname__': name})
        fake = types.ModuleType(module)
        setattr(fake, name, cls)
        monkeypatch.setitem(sys.modules, module, fake)
    path = tmp_path / 'checkpoint-3.pth.tar'
    torch.save({'state_dict': public_crate, 'args': argparse.Namespace(data_dir=_PathAs(cls, 'C:\\data\\imagenet'))},
               path)
    if module != 'pathlib':
        monkeypatch.delitem(sys.modules, module)        # read back by name alone, as on a Python without it
    from structformer.weights.torch_file import load_torch_file
    loaded = load_torch_file(path, 'convert FILE')
    assert str(loaded['args'].data_dir).endswith('imagenet') and set(loaded['state_dict']) == set(public_crate)


def test_timm_pretrained_reads_the_trainer_files_convert_reads_and_still_runs_no_code(public_crate, tmp_path):
    """pretrained_cfg_overlay=dict(file=...) goes through timm's loader, which allows argparse.Namespace only: a
    checkpoint whose args hold a path, or whose metric is a numpy scalar, failed there while convert and the training
    flags read it (docs/weights.md promises timm's pretrained=True for trainers' files). A whole pickled model is
    still refused there."""
    import pathlib

    import numpy as np
    path = tmp_path / 'checkpoint-3.pth.tar'
    torch.save({'state_dict': public_crate, 'metric': np.float64(71.25), 'epoch': 3,
                'args': argparse.Namespace(output=pathlib.Path('output/train'), model='crate')}, path)
    model = timm.create_model('crate_digits', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    torch.testing.assert_close(model.state_dict()['blocks.1.mlp.weight'],
                               public_crate['transformer.layers.1.1.fn.weight'], rtol=0, atol=0)
    whole = tmp_path / 'whole.pth'
    torch.save(torch.nn.Linear(2, 2), whole)
    with pytest.raises(Exception, match='torch.nn.modules.linear.Linear'):
        timm.create_model('crate_digits', pretrained=True, pretrained_cfg_overlay=dict(file=str(whole)))


def test_a_torchscript_archive_is_refused_as_one_without_torchs_warning(tmp_path, capsys, recwarn):
    """torch.jit.save's archive is a zip like torch.save's: torch.load refuses it under weights_only (before
    torch.jit.load runs), after a warning that it would dispatch to torch.jit.load; the line said 'not a readable
    torch file (RuntimeError: Cannot use ``weights_only=True`` ...)'."""
    import warnings

    from structformer.cli import main
    path = tmp_path / 'model.pt'
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')                  # torch.jit's deprecation notices
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))
    assert main(['convert', '--from', 'timm', str(path), '--model', 'vit_digits', '--output',
                 str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err.strip()
    assert 'is a TorchScript archive (torch.jit.save)' in err and len(err.splitlines()) == 1, err
    assert not [w for w in recwarn if 'TorchScript' in str(w.message)]
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('fmt', ['safetensors', 'torch'])
def test_a_file_with_no_tensors_says_so(fmt, tmp_path):
    """An empty safetensors file was reported as '44 weights of the model are not in the checkpoint; is --model the
    checkpoint's architecture?', an empty torch dict as 'holds no state dict under ... (keys: )'."""
    from safetensors.torch import save_file

    from structformer.weights.cli import convert_checkpoint
    path = tmp_path / ('w.safetensors' if fmt == 'safetensors' else 'w.pth')
    if fmt == 'safetensors':
        save_file({}, str(path))
    else:
        torch.save({}, path)
    with pytest.raises(UsageError, match=rf"^convert FILE {path}: holds (no tensors|an empty mapping, no tensors)"):
        convert_checkpoint('crate-official', path, 'crate_digits')


def test_timm_pretrained_of_a_web_page_says_so_not_unsafe_globals(tmp_path):
    """timm's loader called a web page saved as the weights 'non-allowlisted pickle globals' and offered
    weights_only=False; our models' pretrained=True says what the file is, as convert does."""
    path = tmp_path / 'crate_s.pth'
    path.write_bytes(b'<!DOCTYPE html>\n<html><head><title>Sign in</title></head></html>\n')
    with pytest.raises(ValueError, match=r"^crate_digits: pretrained weights .*crate_s\.pth: not a torch file: it is "
                                         r"a web page") as caught:
        timm.create_model('crate_digits', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert 'weights_only=False' not in str(caught.value)


def test_timm_pretrained_unwraps_what_its_loader_leaves_wrapped(public_crate, tmp_path):
    """timm's loader unwraps state_dict(_ema) / model(_ema) only: a {'net': ...} file reached the filter whole and
    was refused as '3 unexpected (acc, epoch, net)'; now it is read as convert reads it, and a file whose tensors sit
    under another key is refused naming the keys."""
    path = tmp_path / 'ckpt.t7'
    torch.save({'net': {'module.' + k: v for k, v in public_crate.items()}, 'acc': 55.0, 'epoch': 3}, path)
    model = timm.create_model('crate_digits', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    assert model.pretrained_adaptations[0] == 'took net, epoch 3', model.pretrained_adaptations
    torch.testing.assert_close(model.state_dict()['blocks.1.mlp.weight'],
                               public_crate['transformer.layers.1.1.fn.weight'], rtol=0, atol=0)
    other = tmp_path / 'gan.pth'
    torch.save({'generator': public_crate, 'step': 3}, other)
    with pytest.raises(ValueError, match=r"pretrained weights .*gan\.pth: holds no state dict under .*tensors are "
                                         r"under generator"):
        timm.create_model('crate_digits', pretrained=True, pretrained_cfg_overlay=dict(file=str(other)))


def test_crate_finetunes_checkpoint_folder_names_its_t7_file(public_crate, tmp_path):
    """CRATE's finetune.py saves `./checkpoint/{net}-{patch}-ckpt.t7` ({'model': DataParallel's state dict, 'optimizer',
    'scaler'}): the file is read by its content whatever its suffix, and its folder given instead is refused naming
    it (it said 'not a structformer checkpoint or run directory' without naming the file)."""
    folder = tmp_path / 'checkpoint'
    folder.mkdir()
    path = folder / 'CRATE_small-16-ckpt.t7'
    torch.save({'model': {'module.' + k: v for k, v in public_crate.items()}, 'optimizer': {'state': {}},
                'scaler': {}}, path)
    with pytest.raises(UsageError, match=r"give one of its files: CRATE_small-16-ckpt\.t7$"):
        load_initial_weights(timm.create_model('crate_digits'), folder)
    notes = []
    assert load_initial_weights(timm.create_model('crate_digits'), path, notes=notes) == [
        'converted from the crate-official layout']
    assert notes[0] == 'took model' and "removed the prefix 'module.' from 44 keys" in notes[1], notes


@pytest.mark.parametrize('case', ['protocol 4', 'legacy format, another global'])
def test_timm_pretrained_of_a_file_torch_cannot_read_safely_says_why_as_convert_does(case, public_crate, tmp_path):
    """timm's loader called a torch.save(..., pickle_protocol=4) file 'non-allowlisted pickle globals' and offered
    weights_only=False (no global is involved: torch's weights-only reader lacks the protocol's opcodes), and a
    legacy-format (_use_new_zipfile_serialization=False) file needing datetime did not name the global. Our models'
    pretrained=True now gives convert's one line for both, and offers no unsafe load."""
    import datetime
    path = tmp_path / 'checkpoint-3.pth.tar'
    if case == 'protocol 4':
        torch.save({'state_dict': public_crate}, path, pickle_protocol=4)
        said = "saved with pickle protocol 4 (torch.save(..., pickle_protocol=4)), which torch's weights-only reader"
    else:
        torch.save({'state_dict': public_crate, 'when': datetime.datetime(2024, 5, 1)}, path,
                   _use_new_zipfile_serialization=False)
        said = 'refused: it needs the Python global datetime.datetime, which loading would have to run'
    try:
        timm.create_model('crate_digits', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))
    except Exception as e:          # noqa: BLE001 (the type is timm's or ours: the words are checked)
        message = str(e)
    else:
        message = ''
    assert message.startswith(f'crate_digits: pretrained weights {path}: {said}'), message
    assert 'weights_only=False' not in message and '\n' not in message
