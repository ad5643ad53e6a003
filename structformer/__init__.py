"""structformer: structured deep networks (CRATE, SOFT, Sparsifiner, sparse Mixers, low-rank
training) as timm models, with one CLI and white-box measurements.

`import structformer` registers every model with timm, so after it
`timm.create_model('crate_tiny_patch16_224')` works, whichever of the two was imported first.

Nothing heavy is imported here: subpackages load on first use (`structformer.models`, `.layers`, ...),
and our models are registered the moment timm itself is imported (at once if it already is). This is
what lets `structformer --help` answer without importing torch, which alone takes over a second.
"""
import importlib
import importlib.abc
import importlib.util
import sys

__version__ = '0.1.0'

_SUBMODULES = ('analysis', 'bench', 'data', 'functional', 'hooks', 'layers', 'models', 'records', 'reproduce',
               'train')
_EXPORTS = {'list_structformer_models': 'models', 'build_model': 'models.factory', 'rebuild': 'models.factory',
            'register_transform': 'models.transforms', 'capture': 'hooks',
            'factorize': 'models.factorize', 'sparsify': 'models.sparsifiner',
            'swap_attention': 'models.attention_swap', 'prune_tokens': 'models.token_pruning'}
__all__ = list(_SUBMODULES) + list(_EXPORTS)


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f'{__name__}.{name}')
    if name in _EXPORTS:
        return getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _RegisterModelsWithTimm(importlib.abc.MetaPathFinder):
    """A one-shot import hook: when `timm` is imported, import `structformer.models` right after
    timm's own module has run, so its registry holds our models before anyone can ask it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != 'timm':
            return None
        sys.meta_path.remove(self)                    # one shot, and no recursion in the lookup below
        spec = importlib.util.find_spec('timm')
        if spec is None or spec.loader is None or not hasattr(spec.loader, 'exec_module'):
            return spec
        run_timm = spec.loader.exec_module

        def exec_module(module):
            run_timm(module)
            importlib.import_module(f'{__name__}.models')
        spec.loader.exec_module = exec_module
        return spec


if 'timm' in sys.modules:
    importlib.import_module(f'{__name__}.models')
elif not any(isinstance(finder, _RegisterModelsWithTimm) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterModelsWithTimm())
