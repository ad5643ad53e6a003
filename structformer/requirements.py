"""The oldest torch and timm this package runs on, and a warning where an older one is installed.

pyproject.toml declares the same floors (a test ties the two together and to the README). They are the oldest
releases the whole test suite was run on and passed (docs/design.md#requirement-floors), not guesses: older ones
fail in ways a user cannot read back to the version (timm before 1.0.31 has no `base_chans` in `adapt_input_conv`
and no `_model_args` on its models; torch 2.8 and 2.9 cannot `torch.export` SOFT with a free batch). pip keeps them
out; an install with `--no-deps` (a cluster image, the GPU machine's) does not, so importing the models says which
package to upgrade, once, instead of failing deep inside timm or torch.

A warning, not an error: the check runs inside `import timm` (our models register when timm loads), and an
exception there would take timm down with us.
"""
import re
import warnings
from importlib import metadata
from typing import Dict, Optional, Tuple

# the floors: pyproject.toml's `torch>=`, `timm>=` (tests/test_layout.py checks they agree)
MINIMUM: Dict[str, Tuple[int, ...]] = {'torch': (2, 10), 'timm': (1, 0, 31)}


def release(version: str) -> Tuple[int, ...]:
    """The numeric release of a version string: '2.8.0+cu128' -> (2, 8, 0), '1.0.32.dev0' -> (1, 0, 32)."""
    match = re.match(r'\d+(?:\.\d+)*', version.strip())
    return tuple(int(part) for part in match.group(0).split('.')) if match else ()


def too_old(package: str, installed: Optional[str] = None) -> Optional[str]:
    """One line saying `package` is older than its floor, or None (also when it is not installed)."""
    if installed is None:
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            return None
    have = release(installed)
    if not have or have >= MINIMUM[package]:
        return None
    floor = '.'.join(map(str, MINIMUM[package]))
    return (f"structformer needs {package} >= {floor}, found {installed}: models and commands may fail; "
            f"pip install -U '{package}>={floor}'")


def warn_if_too_old() -> None:
    """A warning for each package below its floor (nothing when all are recent enough)."""
    for package in MINIMUM:
        line = too_old(package)
        if line is not None:
            warnings.warn(line, stacklevel=2)
