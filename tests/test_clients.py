"""What a client of the weights meets (issue 45). timm's scripts with our models: `python -m structformer.run_script validate.py ...` runs a script with
the models registered, as timm's validate.py / inference.py need (train.py imports us itself through
`--device-modules structformer`). The script here makes timm's calls that validate.py makes for a model and its
weights (create_model with --model / --pretrained, load_checkpoint with --checkpoint / --use-ema,
resolve_data_config), in this process and, as the documented command line, in a fresh one. A model built in Python saved as a weights folder that export, eval and
local-dir: read; export of a run that is still training says so and which epoch it took."""
import os
import subprocess
import sys
from pathlib import Path

import timm

from structformer.run_script import main
from structformer.weights import save_weights_folder

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import argparse, sys
import timm
from timm.models import load_checkpoint
p = argparse.ArgumentParser()
p.add_argument('--model', '-m')
p.add_argument('--pretrained', action='store_true')
p.add_argument('--checkpoint', default='')
p.add_argument('--use-ema', action='store_true')
args = p.parse_args()
model = timm.create_model(args.model, pretrained=args.pretrained)
if args.checkpoint:
    load_checkpoint(model, args.checkpoint, args.use_ema)
config = timm.data.resolve_data_config({}, model=model)
print(__name__, type(model).__name__, tuple(config['input_size']), float(model.head.bias.detach().sum()))
"""


def test_run_script_runs_a_timm_script_with_our_models(tmp_path, monkeypatch, capsys):
    model = timm.create_model('crate_digits')
    folder = save_weights_folder(model, tmp_path / 'weights')
    (tmp_path / 'validate.py').write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS='1')
    bias = float(model.head.bias.detach().sum())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, 'argv', list(sys.argv))           # run_script sets both for the script
    monkeypatch.setattr(sys, 'path', list(sys.path))
    capsys.readouterr()
    for args in (['--model', 'crate_digits'], ['--model', f'local-dir:{folder}', '--pretrained'],
                 ['--model', 'crate_digits', '--checkpoint', str(folder / 'model.safetensors')]):
        assert main(['validate.py', *args]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert len(rows) == 3 and all(r.startswith('__main__ CRATE (1, 8, 8) ') for r in rows), rows
    assert float(rows[1].split()[-1]) == bias and float(rows[2].split()[-1]) == bias     # the saved weights
    # and as the documented command line, in its own process
    proc = subprocess.run([sys.executable, '-m', 'structformer.run_script', 'validate.py', '--model', 'crate_digits'],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith('__main__ CRATE'), proc.stderr


def test_run_script_without_a_script_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / 'validate.py')]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'no such file' in err[0]
    assert main([]) == 2 and 'usage:' in capsys.readouterr().out


def test_a_model_built_in_python_saved_as_a_folder_is_what_export_and_eval_read(tmp_path, capsys):
    """docs/weights.md: save_weights_folder's folder is export's SOURCE, eval's --checkpoint, local-dir:; kwargs that
    do not rebuild the weights are refused before anything is written."""
    import pytest
    import torch

    from structformer.cli import main as cli
    from structformer.errors import UsageError
    model = timm.create_model('crate_digits', depth=2)
    with pytest.raises(UsageError, match=r"do not fit crate_digits built with no kwargs .*pass the model_kwargs"):
        save_weights_folder(model, tmp_path / 'wrong')
    assert not (tmp_path / 'wrong').exists()
    folder = save_weights_folder(model, tmp_path / 'mine', model_kwargs={'depth': 2})
    assert cli(['export', str(folder), '--format', 'hf', '--output', str(tmp_path / 'hf')]) == 0
    assert cli(['eval', '--checkpoint', str(folder), '--data', 'digits']) == 0
    again = timm.create_model(f'local-dir:{tmp_path / "hf"}', pretrained=True)
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x), model.eval()(x))


def test_export_of_a_run_still_training_says_so_and_which_epoch(tmp_path, capsys):
    from structformer.cli import main as cli
    from structformer.train.run_dir import RunLock
    run = tmp_path / 'run'
    assert cli(['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '3', '--limit-train-batches', '1',
                '--output', str(run), '--no-progress']) == 0
    (run / 'summary.json').unlink()                              # as before the last epoch ends
    capsys.readouterr()
    with RunLock(run):                                          # what a train process into RUN holds
        assert cli(['export', str(run), '--format', 'hf', '--output', str(tmp_path / 'hf')]) == 0
    out = capsys.readouterr().out
    assert 'the run is still training' in out and 'epoch_0003 (epoch 3 of 3)' in out, out
    assert cli(['export', str(run / 'checkpoints' / 'epoch_0000'), '--format', 'hf', '--output',
                str(tmp_path / 'hf1')]) == 0
    assert 'took epoch_0000 (epoch 0 of 3, the run stopped before its last epoch)' in capsys.readouterr().out
