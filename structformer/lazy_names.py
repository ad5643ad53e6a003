"""Names a package exports but loads on first use (PEP 562): `structformer.train` and `structformer.data` name their
API at the top, while a command that only checks its arguments (through `train.config`, `data.spec`) never imports
torch. The package's own `__init__` (structformer/__init__.py) does the same with its subpackages."""
import importlib
import sys
from typing import Callable, Dict, List, Tuple


def lazy_exports(package: str, exports: Dict[str, str]) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose names `exports` (name -> submodule) load on first use."""
    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(f'{package}.{exports[name]}'), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> List[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))
    return __getattr__, __dir__
