"""`import structformer` and `structformer --help` stay light, and our models still reach timm's registry."""
import subprocess
import sys


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
