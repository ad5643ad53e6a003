"""timm's scripts with our models (issue 45): `python -m structformer.run_script validate.py ...` runs a script with
the models registered, as timm's validate.py / inference.py need (train.py imports us itself through
`--device-modules structformer`). The script here makes timm's calls that validate.py makes for a model and its
weights (create_model with --model / --pretrained, load_checkpoint with --checkpoint / --use-ema,
resolve_data_config), in a fresh process."""
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


def test_run_script_runs_a_timm_script_with_our_models(tmp_path):
    model = timm.create_model('crate_digits')
    folder = save_weights_folder(model, tmp_path / 'weights')
    (tmp_path / 'validate.py').write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS='1')
    bias = float(model.head.bias.detach().sum())
    code = '; '.join(f"sys.argv = ['x', 'validate.py'] + {args!r}; structformer.run_script.main()" for args in (
        ['--model', 'crate_digits'], ['--model', f'local-dir:{folder}', '--pretrained'],
        ['--model', 'crate_digits', '--checkpoint', str(folder / 'model.safetensors')]))
    out = subprocess.run([sys.executable, '-c', f"import sys, structformer.run_script; {code}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.strip().splitlines()
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
