"""Weights in: timm's pretrained loading for structformer models (per-family filters, `filters`) and converters from
the public code's checkpoints (`convert`, `structformer convert`); the weights folder a model built in Python is saved
as (`save_weights_folder`: what `export`, `eval --checkpoint` and `local-dir:` read). docs/weights.md.

Nothing heavy at import: `structformer --help` builds the convert parser from `weights.cli` without torch."""
import importlib

# the layouts `convert` reads (weights/convert.py has their key maps); here, import-light, so that the convert
# command (weights/cli.py) builds its parser without torch and the converters need no command module
SOURCES = ('crate-official', 'soft-official', 'sparsifiner-official', 'timm')

__all__ = ['WeightsMismatch', 'adapt_state_dict', 'filter_fn_for', 'pretrained_filter_fn', 'save_weights_folder']


def __getattr__(name):
    if name == 'save_weights_folder':
        return importlib.import_module(f'{__name__}.folder').save_weights_folder
    if name in __all__:
        return getattr(importlib.import_module(f'{__name__}.filters'), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
