"""`import structformer` and `structformer --help` stay light, and our models still reach timm's registry."""
import os
import subprocess
import sys
from pathlib import Path


def test_import_structformer_registers_models_whichever_comes_first():
    for code in ('import structformer, sys; assert "torch" not in sys.modules; import timm; '
                 'assert timm.is_model("crate_digits") and timm.is_model("soft_digits")',
                 'import timm, structformer; assert timm.is_model("crate_digits")',
                 'import structformer.layers, timm; assert timm.is_model("softpp_digits")'):
        subprocess.run([sys.executable, '-c', code], check=True)


def test_cli_help_imports_neither_torch_nor_timm():
    code = ('import sys; from structformer.cli import build_parser; build_parser(); '
            'heavy = sorted(m for m in ("torch", "timm") if m in sys.modules); '
            'assert not heavy, heavy')
    subprocess.run([sys.executable, '-c', code], check=True)


# without the kernel-choice settings (conftest sets one), which are checked against torch before any command
LIGHT_ENV = {k: v for k, v in os.environ.items() if not (k.startswith('STRUCTFORMER_CHOICE_') or k == 'STRUCTFORMER_AUTOTUNE')}


def _refused_without_importing(heavy, argv):
    """`structformer ARGV` in a fresh interpreter: its exit status and stderr, asserting none of `heavy` was imported."""
    code = ('import sys; from structformer.cli import main; rc = main(sys.argv[1:]); '
            f'heavy = sorted(m for m in {tuple(heavy)!r} if m in sys.modules); assert not heavy, heavy; sys.exit(rc)')
    done = subprocess.run([sys.executable, '-c', code, *argv], capture_output=True, text=True, env=LIGHT_ENV)
    return done.returncode, done.stderr


def test_train_eval_and_analyze_refuse_bad_input_before_importing_torch(tmp_path):
    """A value out of range, a -c that is a folder, a --checkpoint that is missing or no checkpoint: one line at
    once, not after the engine's imports (torch and timm: ~7 s on a 2-core Zen 1). `structformer.train`'s names
    load on first use; `train.checkpoint_paths` finds a checkpoint without torch."""
    missing = str(tmp_path / 'missing')
    for argv in (['train', '--epochs', '-1', '--model', 'crate_digits'], ['train', '--lr', '0'],
                 ['train', '-c', str(tmp_path)], ['eval', '--checkpoint', missing],
                 ['eval', '--checkpoint', str(Path(__file__))], ['analyze', '--checkpoint', missing]):
        status, stderr = _refused_without_importing(('torch', 'timm', 'structformer.train.engine'), argv)
        assert status == 2 and stderr.count('\n') == 1 and argv[1] in stderr, stderr
    status, stderr = _refused_without_importing(('torch', 'timm'), ['train', '--drop', '2'])   # data.augment's names
    assert status == 2 and stderr.strip().endswith('--drop=2.0 is out of range: accepted in [0, 1)'), stderr
    import structformer.train
    assert structformer.train.Trainer.__module__ == 'structformer.train.engine'
    assert 'TrainConfig' in dir(structformer.train)


def test_export_refuses_a_missing_source_before_importing_torch_or_onnx(tmp_path):
    """`structformer export` checks SOURCE (paths and file headers) before onnx's and torch's imports."""
    for fmt, suffix in (('onnx', '.onnx'), ('torch-export', '.pt2')):
        status, stderr = _refused_without_importing(('torch', 'timm', 'onnx', 'onnxruntime'), [
            'export', str(tmp_path / 'missing'), '--format', fmt, '--output', str(tmp_path / f'model{suffix}')])
        assert status == 2 and stderr.count('\n') == 1 and 'does not exist' in stderr, stderr
    assert list(tmp_path.iterdir()) == []


def test_compare_refuses_the_shared_recipe_out_of_range_before_importing_torch(tmp_path):
    """`structformer compare` checks the shared recipe's ranges before torch and the rows' sizing (~10 s on a Zen 1);
    --epochs -1 is named as out of range, not as too short for the pre-trained low-rank rows."""
    for argv, line in ((['--epochs', '-1'], '--epochs=-1 is out of range: accepted >= 1'),
                       (['--lr', '0'], '--lr=0.0 is out of range: accepted > 0'),
                       (['--models', 'vit', '-b', '0'], '-b/--batch-size=0 is out of range: accepted >= 1'),
                       (['--reprob', '3'], '--reprob=3.0 is out of range: accepted in [0, 1]')):
        status, stderr = _refused_without_importing(
            ('torch', 'timm'), ['compare', *argv, '--dry-run', '--output', str(tmp_path / 'grid')])
        assert status == 2 and stderr.count('\n') == 1 and stderr.strip().endswith(line), stderr
    assert list(tmp_path.iterdir()) == []
