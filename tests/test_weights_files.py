"""Weights as people have them, and what convert / export write from them (docs/weights.md, docs/export.md): files
read by what they hold, not by their name; wrappers' prefixes removed; timm Hub folders; numpy-1 pickles; damaged,
empty and code-running files refused in one line; exports that say where converted weights came from, name their
ONNX data after OUT and leave nothing behind. Cheap: tiny state dicts and the digits models (depth 1 where it can)."""
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from structformer.cli import main
from structformer.errors import UsageError
from structformer.train.initial_weights import read_weights

WEIGHTS = {'blocks.0.weight': torch.arange(6.).reshape(2, 3), 'head.bias': torch.tensor([1., -2.])}


def _same(got):
    assert set(got) == set(WEIGHTS) and all(torch.equal(got[k], WEIGHTS[k]) for k in WEIGHTS), sorted(got)


@pytest.mark.parametrize('prefix', ['_orig_mod.', 'module.', '_orig_mod.module.', 'module._orig_mod.'])
@pytest.mark.parametrize('fmt', ['torch', 'safetensors'])
def test_compiled_and_ddp_prefixes_are_removed(prefix, fmt, tmp_path):
    """A torch.compile'd model's state_dict() (`_orig_mod.`), DDP's `module.`, and both, as timm's loader cleans
    them (`clean_state_dict`); in a trainer's checkpoint and in a safetensors file alike."""
    wrapped = {prefix + k: v for k, v in WEIGHTS.items()}
    if fmt == 'torch':
        path = tmp_path / 'ckpt.pth.tar'
        torch.save({'state_dict': wrapped, 'epoch': 3}, path)
    else:
        path = tmp_path / 'model.safetensors'
        save_file(wrapped, str(path))
    _same(read_weights(path, '--pretrained-path'))


def test_a_file_is_read_as_what_it_holds_not_by_its_name(tmp_path):
    """safetensors saved as `.pth`, a torch.save zip saved as `.safetensors` (torch.load itself would read that name
    as safetensors), and either without a known suffix."""
    save_file(WEIGHTS, str(tmp_path / 'real.safetensors'))
    torch.save(WEIGHTS, tmp_path / 'real.pth')
    for source, name in (('real.safetensors', 'named.pth'), ('real.pth', 'named.safetensors'),
                         ('real.safetensors', 'weights.ckpt'), ('real.pth', 'weights')):
        shutil.copy(tmp_path / source, tmp_path / name)
        _same(read_weights(tmp_path / name, '--pretrained-path'))


def test_empty_and_truncated_files_are_one_line(tmp_path):
    (tmp_path / 'empty.pth').write_bytes(b'')
    torch.save(WEIGHTS, tmp_path / 'whole.pth')
    (tmp_path / 'cut.pth').write_bytes((tmp_path / 'whole.pth').read_bytes()[:200])
    with pytest.raises(UsageError, match=r'--pretrained-path .*empty\.pth: is empty \(0 bytes\)'):
        read_weights(tmp_path / 'empty.pth', '--pretrained-path')
    with pytest.raises(UsageError) as cut:
        read_weights(tmp_path / 'cut.pth', '--pretrained-path')
    line = str(cut.value)
    with pytest.raises(RuntimeError) as own:                   # torch's own words, which differ between releases
        torch.load(tmp_path / 'cut.pth', weights_only=True)
    first_sentence = re.split(r'(?<=\.) ', str(own.value).strip().splitlines()[0], maxsplit=1)[0]
    # the cause's first sentence only: no mid-sentence cut of torch's paragraph
    assert 'cut.pth: not a readable torch file' in line and '\n' not in line, line
    assert line.endswith(f'(RuntimeError: {first_sentence[:200]})'), (line, first_sentence)


class _CreatesAFile:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mknod, (self.path,))


def test_a_pickle_that_would_create_a_file_is_refused_without_running(tmp_path, capsys):
    """A `__reduce__` payload in a timm-style checkpoint, named `.pth` or disguised as `.safetensors`: refused by
    name, the file it would create never appears, nothing is written at --output."""
    marker = tmp_path / 'ran'
    for name in ('evil.pth', 'evil.safetensors'):
        torch.save({'state_dict': WEIGHTS, 'args': _CreatesAFile(marker)}, tmp_path / name)
        code = main(['convert', '--from', 'timm', str(tmp_path / name), '--model', 'crate_digits',
                     '--output', str(tmp_path / 'out')])
        err = capsys.readouterr().err
        assert code == 2 and 'refused' in err and 'mknod' in err and name in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert not marker.exists() and not (tmp_path / 'out').exists()


def _parsers(parser):
    yield parser
    for action in parser._actions:
        for child in (action.choices or {}).values() if isinstance(action.choices, dict) else ():
            yield from _parsers(child)


def test_help_examples_keep_their_line_breaks():
    """A `\\` at the end of an example line in a (non-raw) help string joins the next line into it, with the
    continuation's indentation in the middle: `convert --help` showed `--weights model       --output ...`."""
    import re

    from structformer.cli import build_parser
    joined = [line for parser in _parsers(build_parser()) for line in (parser.epilog or '').splitlines()
              if re.search(r'\S {5,}--', line)]
    assert not joined, joined


def test_the_documented_eval_of_converted_weights_names_the_dataset_root():
    """`imagefolder:PATH` scores PATH/val; given PATH/val itself it finds no val/ inside and scores a stratified
    fraction of it (docs/data.md): docs/weights.md's eval example named ImageNet's val folder."""
    import re
    docs = Path(__file__).resolve().parents[1] / 'docs'
    for page in ('weights.md', 'export.md'):
        found = re.findall(r'imagefolder:\S*/(?:val|test|train)\b', (docs / page).read_text())
        assert not found, (page, found)


def test_a_timm_hub_folder_saved_as_pytorch_model_bin_is_read(tmp_path):
    """timm's push_to_hf_hub / save_for_hf folder with safe_serialization=False: config.json + pytorch_model.bin
    (timm's local-dir: loads it); --pretrained-path and convert took only model.safetensors."""
    (tmp_path / 'hub').mkdir()
    (tmp_path / 'hub' / 'config.json').write_text('{"architecture": "crate_digits"}')
    torch.save({'module.' + k: v for k, v in WEIGHTS.items()}, tmp_path / 'hub' / 'pytorch_model.bin')
    _same(read_weights(tmp_path / 'hub', '--pretrained-path'))
    save_file({k: v + 1 for k, v in WEIGHTS.items()}, str(tmp_path / 'hub' / 'model.safetensors'))
    got = read_weights(tmp_path / 'hub', '--pretrained-path')           # both: safetensors first, as timm
    assert torch.equal(got['head.bias'], WEIGHTS['head.bias'] + 1)


def test_an_export_of_converted_weights_says_where_they_came_from(tmp_path, capsys):
    """A convert / save_weights_folder folder exported to the Hub layout: its model card said `trained with
    structformer train on unknown`, `epoch 0 of the run`, and export said `took ... (epoch 0)`; now the source file's
    name (not its local path), its layout and which weights were taken. eval's line said `epoch 0` too."""
    import timm

    from structformer.weights import save_weights_folder
    model = timm.create_model('crate_digits', depth=1)
    torch.save({'epoch': 7, 'state_dict': model.state_dict(), 'state_dict_ema': model.state_dict()},
               tmp_path / 'last.pth.tar')
    assert main(['convert', '--from', 'timm', str(tmp_path / 'last.pth.tar'), '--model', 'crate_digits',
                 '--model-kwargs', 'depth=1', '--output', str(tmp_path / 'converted')]) == 0
    save_weights_folder(model, tmp_path / 'python', model_kwargs={'depth': 1})
    capsys.readouterr()
    for folder, says in (('converted', 'converted by `structformer convert` from last.pth.tar (timm layout, took '
                                       'state_dict_ema, epoch 7'),
                         ('python', 'save_weights_folder')):
        hf = str(tmp_path / f'{folder}_hf')
        assert main(['export', str(tmp_path / folder), '--format', 'hf', '--output', hf]) == 0
        out = capsys.readouterr().out
        card = (tmp_path / f'{folder}_hf' / 'README.md').read_text()
        assert says in out and says in card, (out, card)
        assert 'epoch 0' not in out + card and 'trained with `structformer train`' not in card, (out, card)
        assert str(tmp_path) not in card
        # eval's line says the same instead of "epoch 0"
        assert main(['eval', '--checkpoint', str(tmp_path / folder), '--data', 'digits']) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert says.split(' (')[0] in line and 'epoch 0' not in line, line


def test_an_onnx_export_with_external_weights_names_its_data_after_the_output(tmp_path, monkeypatch):
    """Weights past protobuf's 2 GiB go to a data file the graph names; it was named after the temporary
    (`m.onnx.tmp-PID-...onnx.data`), which the next writer of m.onnx removes as an interrupted writer's leftover.
    The threshold is lowered to 0 so a tiny model takes that path. --overwrite by an export without external data
    removes the replaced export's data file; a failed check leaves nothing."""
    pytest.importorskip('onnxruntime')
    import numpy as np
    import onnx
    import onnxruntime
    import timm

    import structformer.export.graphs as graphs
    from structformer.export import export
    from structformer.weights import save_weights_folder
    monkeypatch.setattr(graphs, '_EXTERNAL_DATA_BYTES', 0)
    model = timm.create_model('mixer_digits', depth=1).eval()
    save_weights_folder(model, tmp_path / 'w', model_kwargs={'depth': 1})
    (tmp_path / 'out').mkdir()
    export(tmp_path / 'w', 'onnx', tmp_path / 'out' / 'm.onnx')
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == ['m.onnx', 'm.onnx.data']
    graph = onnx.load(str(tmp_path / 'out' / 'm.onnx'), load_external_data=False)
    assert {e.value for t in graph.graph.initializer for e in t.external_data if e.key == 'location'} == \
        {'m.onnx.data'}
    x = torch.randn(2, 1, 8, 8)
    got = onnxruntime.InferenceSession(str(tmp_path / 'out' / 'm.onnx')).run(None, {'input': x.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-5, atol=1e-5)

    monkeypatch.setattr(graphs, '_EXTERNAL_DATA_BYTES', 1 << 40)               # --overwrite with a small one
    export(tmp_path / 'w', 'onnx', tmp_path / 'out' / 'm.onnx', overwrite=True)
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == ['m.onnx']

    monkeypatch.setattr(graphs, 'onnx_error', lambda *args: 1.0)               # a wrong graph: nothing kept
    with pytest.raises(RuntimeError, match='away from eager torch'):
        export(tmp_path / 'w', 'onnx', tmp_path / 'out' / 'n.onnx')
    assert sorted(p.name for p in (tmp_path / 'out').iterdir()) == ['m.onnx']


def test_another_architecture_is_named_as_such_not_as_a_size(tmp_path, capsys):
    """`--from timm` maps every key, so a CRATE file converted into a Mixer had no 'unknown' key and was refused
    as a size (`blocks.0.norm1.weight is [64] in the checkpoint and [32] in the model; is --model the checkpoint's
    size?`): now by the keys that have no place in the model. A size is still named as a size."""
    import timm
    save_file(timm.create_model('crate_digits', depth=1).state_dict(), str(tmp_path / 'crate.safetensors'))
    for model, says in (('mixer_digits', ['without a place in SparseMixer', 'blocks.0.attn.', 'architecture']),
                        ('crate_mnist', ['cls_token is [1, 1, 64] in the checkpoint and [1, 1, 96]', 'size'])):
        code = main(['convert', '--from', 'timm', str(tmp_path / 'crate.safetensors'), '--model', model,
                     '--model-kwargs', 'depth=1', '--output', str(tmp_path / 'out')])
        err = capsys.readouterr().err
        assert code == 2 and all(s in err for s in says), err
        assert not (tmp_path / 'out').exists()


def test_a_failed_write_removes_the_folders_it_made_for_its_output(tmp_path, monkeypatch):
    """export and save_weights_folder create OUT's missing parent folders; a failure (here: a graph off eager
    torch, a full disk) left them behind, empty."""
    import safetensors.torch
    import timm

    import structformer.export.graphs as graphs
    from structformer.export import export
    from structformer.weights import save_weights_folder
    model = timm.create_model('mixer_digits', depth=1).eval()
    save_weights_folder(model, tmp_path / 'w', model_kwargs={'depth': 1})
    monkeypatch.setattr(graphs, 'program_error', lambda *args: 1.0)
    with pytest.raises(RuntimeError, match='away from eager torch'):
        export(tmp_path / 'w', 'torch-export', tmp_path / 'new' / 'sub' / 'm.pt2')
    assert sorted(p.name for p in tmp_path.iterdir()) == ['w']

    def full_disk(*args, **kwargs):
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(safetensors.torch, 'save_file', full_disk)
    with pytest.raises(OSError):
        save_weights_folder(model, tmp_path / 'new' / 'sub' / 'w', model_kwargs={'depth': 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ['w']


def test_export_errors_tool_and_the_numbers_docs_quote_from_its_record(tmp_path):
    """docs/export.md's per-family errors come from tools/export_errors.py's committed record (they were an old
    machine's test output, with a Mixer '0' the exporter does not give); the tool runs (one cheap family here)."""
    import importlib.util
    import json
    import re
    root = Path(__file__).resolve().parents[1]
    pytest.importorskip('onnxruntime')
    spec = importlib.util.spec_from_file_location('export_errors', root / 'tools' / 'export_errors.py')
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(['--only', 'swmlp_digits', '--output', str(tmp_path / 'r.json')]) == 0
    row, = json.loads((tmp_path / 'r.json').read_text())['rows']
    assert row['model'] == 'swmlp_digits' and 0 <= row['onnx']['max_relative_error'] <= 1e-4

    record = json.loads((root / 'docs' / 'export' / 'export_errors.json').read_text())
    page = (root / 'docs' / 'export.md').read_text()
    for row in record['rows']:
        number = re.sub(r'e-0?(\d+)', r'e-\1', f"{row['onnx']['max_relative_error']:.1e}")
        assert number in page, (row['family'], number)


def _as_numpy_1_wrote_it(path, payload):
    """torch.save of `payload`, its pickle's numpy module then named as numpy 1.x named it (numpy.core.multiarray;
    numpy 2 writes numpy._core.multiarray): the checkpoints of 2021-2023 trainers."""
    import io
    import zipfile
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    with zipfile.ZipFile(path, 'w', zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info.filename)
            if info.filename.endswith('data.pkl'):
                data = data.replace(b'numpy._core.multiarray', b'numpy.core.multiarray')
            target.writestr(info, data)


def test_a_numpy_scalar_pickled_by_numpy_1_is_read(tmp_path):
    """timm's CheckpointSaver `metric` / DeiT's `best` computed with numpy, in a file numpy 1.x wrote: its global
    numpy.core.multiarray.scalar was refused under numpy 2 although numpy scalars are allowed."""
    np = pytest.importorskip('numpy')
    if not hasattr(np, '_core'):
        pytest.skip('numpy 1.x reads its own name')
    _as_numpy_1_wrote_it(tmp_path / 'old.pth.tar', {'state_dict': WEIGHTS, 'metric': np.float64(79.5), 'epoch': 299})
    assert b'numpy.core.multiarray' in (tmp_path / 'old.pth.tar').read_bytes()
    _same(read_weights(tmp_path / 'old.pth.tar', '--pretrained-path'))


@pytest.mark.parametrize('name', ['crate_digits', 'soft_digits'])
def test_a_word_where_a_number_goes_is_named_in_model_kwargs(name):
    """convert / train --model-kwargs img_size=abc: CRATE said 'not all arguments converted during string
    formatting' and SOFT 'can only concatenate str (not "int") to str', naming neither the argument nor the fix.
    img_size is one of timm's argument names, checked before the model is built (arguments.py); a word for a
    model's own number (eta=abc) is named after the constructor fails (test_cli_errors' string-for-number row)."""
    from structformer.models.factory import build_model
    with pytest.raises(ValueError, match=r"^--model-kwargs img_size='abc' must be a positive integer or an \(H, W\) "
                                         r"pair"):
        build_model(name, {'img_size': 'abc'})


def test_plain_vit_weights_load_into_a_sparsifiner_with_a_fresh_predictor(tmp_path):
    """timm's pretrained=True (and --pretrained-path) of a plain ViT / DeiT file into its Sparsifiner: refused as
    '8 missing (blocks.0.attn.basis.w_down, ...)' although `convert --from timm` takes the same file; now the
    predictor is fresh and said so, and at keep 1.0 the logits are the ViT's."""
    import timm

    from structformer.train.initial_weights import load_initial_weights
    torch.manual_seed(0)
    vit = timm.create_model('vit_digits').eval()
    save_file(vit.state_dict(), str(tmp_path / 'deit.safetensors'))
    model = timm.create_model('sparsifiner_digits', keep_ratio=1.0, pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(tmp_path / 'deit.safetensors'))).eval()
    assert any('predictor freshly initialised' in line for line in model.pretrained_adaptations)
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model(x), vit(x), rtol=1e-5, atol=1e-5)
    other = timm.create_model('sparsifiner_digits')
    done = load_initial_weights(other, tmp_path / 'deit.safetensors', '--pretrained-path')
    assert any('predictor freshly initialised' in line for line in done), done

    partial = {k: v for k, v in other.state_dict().items() if not k.startswith('blocks.1.attn.basis.')}
    save_file(partial, str(tmp_path / 'partial.safetensors'))        # part of a predictor: refused by name
    with pytest.raises(UsageError, match=r'missing \(blocks\.1\.attn\.basis\.w_down'):
        load_initial_weights(timm.create_model('sparsifiner_digits'), tmp_path / 'partial.safetensors',
                             '--pretrained-path')


def test_timm_pretrained_takes_the_ema_of_a_deit_file_where_the_flags_take_the_model(tmp_path):
    """docs/weights.md: the same DeiT-layout file gives the EMA through timm's pretrained=True (timm's reader)
    and the model's weights through --pretrained-path (ours, DeiT's own default)."""
    import timm

    from structformer.train.initial_weights import read_weights
    model, ema = (timm.create_model('crate_digits', depth=1).state_dict() for _ in range(2))
    torch.save({'model': model, 'model_ema': ema, 'epoch': 3}, tmp_path / 'deit.pth')
    loaded = timm.create_model('crate_digits', depth=1, pretrained=True,
                               pretrained_cfg_overlay=dict(file=str(tmp_path / 'deit.pth'))).state_dict()
    assert torch.equal(loaded['head.weight'], ema['head.weight'])
    assert torch.equal(read_weights(tmp_path / 'deit.pth', '--pretrained-path')['head.weight'], model['head.weight'])
    assert "takes `state_dict_ema` or `model_ema` whenever one is there" in \
        (Path(__file__).resolve().parents[1] / 'docs' / 'weights.md').read_text().replace('\n', ' ')


def test_a_backbone_saved_without_a_classifier_converts(tmp_path, capsys):
    """timm.create_model(..., num_classes=0)'s weights: convert refused them ('2 weights of the model are not in the
    checkpoint (head.bias, head.weight)'), while --pretrained-path gives such a file a fresh head; now converted as
    they are (num_classes=0, said why), or with --model-kwargs num_classes=N and a fresh classifier."""
    import timm
    from safetensors.torch import load_file
    backbone = timm.create_model('crate_digits', depth=1, num_classes=0).state_dict()
    save_file(backbone, str(tmp_path / 'backbone.safetensors'))
    for extra, classes in (([], 0), (['num_classes=7'], 7)):
        out = tmp_path / f'out{classes}'
        assert main(['convert', '--from', 'timm', str(tmp_path / 'backbone.safetensors'), '--model', 'crate_digits',
                     '--model-kwargs', 'depth=1', *extra, '--output', str(out)]) == 0, capsys.readouterr().err
        assert 'no classifier' in capsys.readouterr().out
        written = load_file(str(out / 'model.safetensors'))
        assert all(torch.equal(written[k], v) for k, v in backbone.items())
        assert ('head.weight' in written) == bool(classes) and (not classes or written['head.weight'].shape[0] == 7)


def test_a_checkpoint_of_another_depth_converts_and_adapts_in_one_go(tmp_path, capsys):
    """--model-kwargs depth=1 num_classes=5 for a depth-1 checkpoint: every key was taken as the checkpoint's own,
    so the 10-class head did not fit and convert blamed the architecture ('24 weights of the model are not in the
    checkpoint'); now depth is the checkpoint's and the classes, size and channels are adapted."""
    import timm
    from safetensors.torch import load_file
    save_file(timm.create_model('crate_digits', depth=1).state_dict(), str(tmp_path / 'd1.safetensors'))
    assert main(['convert', '--from', 'timm', str(tmp_path / 'd1.safetensors'), '--model', 'crate_digits',
                 '--model-kwargs', 'depth=1', 'num_classes=5', 'img_size=16', 'in_chans=3',
                 '--output', str(tmp_path / 'out')]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "depth=1: as --model-kwargs asked, the checkpoint's own" in out
    assert all(f"adapted {key}" in out for key in ('head.weight', 'pos_embed', 'patch_embed.proj.weight')), out
    written = load_file(str(tmp_path / 'out' / 'model.safetensors'))
    assert list(written['head.weight'].shape) == [5, 64] and written['patch_embed.proj.weight'].shape[1] == 2 * 2 * 3


def test_the_convert_line_offered_for_an_hf_folder_runs_as_given(tmp_path, capsys):
    """eval of an `export --format hf` folder suggests the convert command that makes a checkpoint of it; it said
    `--model NAME` and no kwargs, so for any model but a default one it did not fit. It now names the
    architecture and constructor arguments config.json records, and runs as given."""
    import shlex

    import timm
    from safetensors.torch import load_file

    from structformer.weights import save_weights_folder
    model = timm.create_model('crate_digits', depth=1, img_size=16)
    save_weights_folder(model, tmp_path / 'w', model_kwargs={'depth': 1, 'img_size': 16})
    assert main(['export', str(tmp_path / 'w'), '--format', 'hf', '--output', str(tmp_path / 'hf')]) == 0
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(tmp_path / 'hf'), '--data', 'digits']) == 2
    err = capsys.readouterr().err
    argv = shlex.split(err.split('make one: ', 1)[1].replace('NEW_FOLDER', str(tmp_path / 'new')))
    assert argv[:2] == ['structformer', 'convert'] and 'crate_digits' in argv, argv
    assert main(argv[1:]) == 0, capsys.readouterr().err
    written = load_file(str(tmp_path / 'new' / 'model.safetensors'))
    assert all(torch.equal(written[k], v) for k, v in model.state_dict().items())


def test_convert_weights_ema_of_a_structformer_checkpoint_takes_its_average(tmp_path, capsys):
    """`convert --weights ema RUN` of a run trained with --model-ema was refused as 'holds one set of weights
    (safetensors)' although the checkpoint holds ema.safetensors beside model.safetensors (eval / export --ema read
    it); now it takes that average, and says so. A lone safetensors file is still refused."""
    import timm
    from safetensors.torch import load_file

    from structformer.weights import save_weights_folder
    model, average = (timm.create_model('crate_digits', depth=1) for _ in range(2))
    save_weights_folder(model, tmp_path / 'ckpt', model_kwargs={'depth': 1})
    save_file(average.state_dict(), str(tmp_path / 'ckpt' / 'ema.safetensors'))
    assert main(['convert', '--from', 'timm', str(tmp_path / 'ckpt'), '--model', 'crate_digits', '--model-kwargs',
                 'depth=1', '--weights', 'ema', '--output', str(tmp_path / 'out')]) == 0, capsys.readouterr().err
    assert 'weight average (--model-ema)' in capsys.readouterr().out
    written = load_file(str(tmp_path / 'out' / 'model.safetensors'))
    assert all(torch.equal(written[k], v) for k, v in average.state_dict().items())
    assert main(['convert', '--from', 'timm', str(tmp_path / 'ckpt' / 'ema.safetensors'), '--model', 'crate_digits',
                 '--weights', 'ema', '--output', str(tmp_path / 'out2')]) == 2
    assert 'holds one set of weights' in capsys.readouterr().err and not (tmp_path / 'out2').exists()


def test_a_public_sparsifiner_file_through_pretrained_says_which_public_settings_it_lacks(tmp_path):
    """pretrained=True of a public Sparsifiner checkpoint converts its keys, but the model is already built with
    our options (Eq. 2's threshold, 1/sqrt(d), |W_up| >= 1e-2) where convert --from sparsifiner-official sets the
    public code's (top-8, heads^-1/2, 2e-2): the forward differs at keep < 1 and nothing said so."""
    import timm
    from test_convert import _fill, sparsifiner_official_shapes
    from structformer.weights.convert import PUBLIC_SETTINGS
    state = _fill(sparsifiner_official_shapes(64, 4, 4, 16, 10), seed=3)
    save_file({k: v.float().contiguous() for k, v in state.items()}, str(tmp_path / 'sp.safetensors'))
    file = dict(file=str(tmp_path / 'sp.safetensors'))
    shapes = dict(n_down=state['blocks.0.attn.mask_predictor.proj_n'].shape[1], predictor_bias=True,
                  predictor_dim=state['blocks.0.attn.mask_predictor.proj_c_q.weight'].shape[0])
    ours = timm.create_model('sparsifiner_digits', pretrained=True, pretrained_cfg_overlay=file, **shapes)
    said = [line for line in ours.pretrained_adaptations if 'keeps its own' in line]
    assert len(said) == 1 and all(key in said[0] for key in ('coef_topk', 'predictor_scale', 'up_threshold')), said
    public = {key: value for key, value, _ in PUBLIC_SETTINGS['sparsifiner-official'] if key != 'keep_ratio'}
    built = timm.create_model('sparsifiner_digits', pretrained=True, pretrained_cfg_overlay=file, **shapes, **public)
    assert not any('keeps its own' in line for line in built.pretrained_adaptations)


def test_a_whole_pickled_model_is_refused_with_the_way_to_its_weights(tmp_path, capsys):
    """torch.save(model) (a common way to 'save a model'): refused, naming a class, and now saying what it is and
    what to give instead; the same file gives the same line each time (the globals were listed in set order)."""
    import timm
    torch.save(timm.create_model('crate_digits', depth=1), tmp_path / 'whole.pth')
    lines = []
    for _ in range(2):
        assert main(['convert', '--from', 'timm', str(tmp_path / 'whole.pth'), '--model', 'crate_digits',
                     '--output', str(tmp_path / 'out')]) == 2
        lines.append(capsys.readouterr().err)
    assert lines[0] == lines[1] and 'whole pickled model' in lines[0] and 'model.state_dict()' in lines[0], lines
    assert not (tmp_path / 'out').exists()


def _file_of(kind: str, path: Path) -> Path:
    import pickle
    if kind == 'zip':
        torch.save(WEIGHTS, path)
    elif kind == 'legacy':
        torch.save(WEIGHTS, path, _use_new_zipfile_serialization=False)
    elif kind.startswith('pickle-'):                 # a bare pickle.dump, at the default protocol of today's Python
        path.write_bytes(pickle.dumps({'a': 1}, protocol=int(kind[-1])))
    elif kind == 'safetensors':
        save_file(WEIGHTS, str(path))
    elif kind == 'empty':
        path.write_bytes(b'')
    else:                                            # 0x80 then no pickle protocol: text that happens to start so
        path.write_bytes(b'\x80not a pickle at all')
    return path


@pytest.mark.parametrize('kind,expected', [('zip', 'torch'), ('legacy', 'torch'), ('pickle-4', 'torch'),
                                           ('pickle-5', 'torch'), ('safetensors', 'safetensors'), ('empty', 'empty'),
                                           ('x80-text', None)])
def test_convert_and_export_call_the_same_files_pickles(kind, expected, tmp_path):
    """One sniffer (weights/file_kind.py) for --initial-checkpoint / convert and for export: a file named neither
    way (`.ckpt`) is a torch file to the first exactly when export refuses it as a pickle. Before, the reader
    knew protocol 2 only (a protocol-4 pickle was 'neither') and export called any file starting 0x80 a pickle."""
    from structformer.export.source import load_source
    from structformer.train.initial_weights import file_format
    from structformer.weights.file_kind import sniff
    path = _file_of(kind, tmp_path / 'weights.ckpt')
    assert sniff(path) == expected
    assert file_format(path) == (expected or '')
    with pytest.raises(UsageError) as refused:
        load_source(path)
    assert ('is a pickle' in str(refused.value)) == (expected == 'torch'), str(refused.value)


def test_a_torch_export_program_is_named_as_such_wherever_weights_are_expected(tmp_path):
    """torch.export.save's .pt2 starts with torch.save's zip header: convert / --initial-checkpoint said 'not a
    readable torch file (failed locating file data.pkl)', export 'is a pickle' and eval 'not a checkpoint's
    model.safetensors'. Each now says it is a torch.export program; a torch.save zip is not mistaken for one."""
    from structformer.export.source import load_source
    from structformer.train.checkpoint import CheckpointError, resolve_checkpoint
    from structformer.weights.file_kind import program_archive
    from structformer.weights.torch_file import load_torch_file
    program = tmp_path / 'model.pt2'
    torch.export.save(torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),)), program)
    assert program_archive(_file_of('zip', tmp_path / 'weights.pth')) == ''
    for refuse, error in ((lambda: load_torch_file(program, 'convert FILE'), UsageError),
                          (lambda: load_source(program), UsageError),
                          (lambda: resolve_checkpoint(program), CheckpointError)):
        with pytest.raises(error, match=r'model\.pt2:? is a torch\.export program'):
            refuse()


@pytest.mark.filterwarnings('ignore:Detected pickle protocol')      # torch's, from the probe below
@pytest.mark.parametrize('zipped', [True, False], ids=['zip', 'legacy'])
@pytest.mark.parametrize('protocol', [4, 5])
def test_a_pickle_protocol_the_weights_only_reader_lacks_is_named(protocol, zipped, tmp_path, capsys):
    """torch.save(..., pickle_protocol=4 or 5) writes opcodes (FRAME, MEMOIZE, ...) that torch's weights-only
    unpickler does not read: the file is whole, and the refusal says why and what to do instead of calling it 'not
    a readable torch file (Unsupported operand 149)'. Where torch reads it (a later release), it is read."""
    path = tmp_path / 'ckpt.pth.tar'
    torch.save({'state_dict': WEIGHTS, 'epoch': 3}, path, pickle_protocol=protocol,
               _use_new_zipfile_serialization=zipped)
    try:
        torch.load(path, weights_only=True)
    except Exception:
        pass
    else:                                            # a torch whose weights-only reader takes the protocol
        _same(read_weights(path, '--pretrained-path'))
        return
    assert main(['convert', '--from', 'timm', str(path), '--model', 'crate_digits',
                 '--output', str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"structformer convert: error: convert FILE {path}: saved with pickle protocol {protocol} "
                   f"(torch.save(..., pickle_protocol={protocol})), which torch's weights-only reader does not read "
                   "(it reads protocol 2, torch.save's default); re-save it with the default protocol where it was "
                   "made, or as safetensors"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ['ckpt.pth.tar']


def test_a_numpy_npz_archive_is_named_as_such_wherever_weights_are_expected(tmp_path):
    """Google's JAX / Flax checkpoints (ViT, MLP-Mixer) are NumPy .npz archives: a zip, so torch.save's header, and
    convert / --pretrained-path said 'not a readable torch file (Expected hasRecord("version") ...)', export 'is a
    pickle'. Each now says it is an .npz archive that is not read (docs/weights.md claims no .npz support)."""
    import numpy as np

    from structformer.export.source import load_source
    from structformer.train.checkpoint import CheckpointError, resolve_checkpoint
    path = tmp_path / 'imagenet21k_Mixer-B_16.npz'
    np.savez(path, **{'stem/kernel': np.zeros((16, 16, 3, 8), 'float32'), 'head/bias': np.zeros(10, 'float32')})
    for refuse, error in ((lambda: read_weights(path, '--pretrained-path'), UsageError),
                          (lambda: load_source(path), UsageError),
                          (lambda: resolve_checkpoint(path), CheckpointError)):
        with pytest.raises(error, match=r'Mixer-B_16\.npz:? is a NumPy \.npz archive \(JAX / Flax weights'):
            refuse()


def test_eval_of_a_timm_hub_folder_of_pytorch_model_bin_offers_the_convert_line(tmp_path, capsys):
    """timm's save_for_hf / push_to_hf_hub with safe_serialization=False writes config.json + pytorch_model.bin (the
    training flags and convert read it). eval of that folder said only 'not a structformer checkpoint or run
    directory'; it now says what it is and offers the convert line, as for a model.safetensors Hub folder, which runs
    as given."""
    import shlex

    import timm
    from safetensors.torch import load_file
    from timm.models._hub import save_for_hf
    model = timm.create_model('crate_digits', depth=1)
    save_for_hf(model, str(tmp_path / 'hub'), model_args={'depth': 1}, safe_serialization=False)
    assert sorted(p.name for p in (tmp_path / 'hub').iterdir()) == ['config.json', 'pytorch_model.bin']
    assert main(['eval', '--checkpoint', str(tmp_path / 'hub'), '--data', 'digits']) == 2
    err = capsys.readouterr().err
    assert 'is a timm Hugging Face folder (config.json + pytorch_model.bin' in err, err
    argv = shlex.split(err.split('make one: ', 1)[1].replace('NEW_FOLDER', str(tmp_path / 'new')))
    assert main(argv[1:]) == 0, capsys.readouterr().err
    written = load_file(str(tmp_path / 'new' / 'model.safetensors'))
    assert all(torch.equal(written[k], v) for k, v in model.state_dict().items())
