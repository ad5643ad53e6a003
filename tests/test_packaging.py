"""The package as users install it (a wheel, not this checkout): every third-party package the code imports is one
pyproject.toml declares (a dependency or an extra), and every file under structformer/ that is not Python -- what
the code reads at run time: the recipes, the tile kernel's C++ sources, py.typed -- is matched by the package-data
globs, so the wheel holds it. Checked from pyproject.toml and the source tree, without building a wheel."""
import ast
import re
import sys
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip('tomllib')          # Python >= 3.11 (the suite's); 3.10 has no TOML reader

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'structformer'


def _pyproject() -> dict:
    return tomllib.loads((ROOT / 'pyproject.toml').read_text())


def _normalise(name: str) -> str:
    return re.sub(r'[-_.]+', '-', name).lower()           # PEP 503


def _declared(project: dict) -> set:
    requirements = list(project['dependencies'])
    for extra in project.get('optional-dependencies', {}).values():
        requirements += extra
    return {_normalise(re.match(r'[A-Za-z0-9_.-]+', r).group(0)) for r in requirements}


def _imported_top_levels() -> dict:
    """Each absolute import's top-level name (lazy imports inside functions included) -> a file importing it."""
    found = {}
    for path in sorted(PACKAGE.rglob('*.py')):
        for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split('.')[0], path.relative_to(ROOT))
    return found


def test_every_imported_package_is_a_declared_requirement():
    """A package the code imports but pyproject.toml does not declare arrives only while another requirement
    happens to pull it in (PIL through torchvision): an install that leaves it out fails at that import."""
    declared = _declared(_pyproject()['project'])
    distributions = metadata.packages_distributions()
    undeclared = {}
    for name, where in _imported_top_levels().items():
        if name in sys.stdlib_module_names or name == 'structformer':
            continue
        # an optional package not installed here (onnxruntime without the extra): its import name is its name
        owners = {_normalise(d) for d in distributions.get(name, [name])}
        if not owners & declared:
            undeclared[name] = (sorted(owners), str(where))
    assert not undeclared, f"imported but not in pyproject.toml's dependencies or extras: {undeclared}"


def test_package_data_globs_hold_every_file_the_code_reads():
    """The wheel takes the .py files of the packages found, and of the rest only what
    [tool.setuptools.package-data] matches: a recipe, a C++ source or py.typed outside the globs would be missing
    from an installed copy (recipes unknown, the tile kernel unbuildable)."""
    globs = _pyproject()['tool']['setuptools']['package-data']['structformer']
    files = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob('*')
             if p.is_file() and p.suffix not in ('.py', '.pyc') and '__pycache__' not in p.parts]
    assert {'py.typed', 'csrc/tile_common.h', 'recipes/crate_tiny_in1k.yaml'} <= set(files)
    unmatched = [f for f in files if not any(fnmatch(f, g) and f.count('/') == g.count('/') for g in globs)]
    assert not unmatched, f"not matched by pyproject.toml's package-data {globs}: {unmatched}"
    from structformer.functional import tile_kernel
    from structformer.train import recipes
    for path in (*tile_kernel.SOURCES, *tile_kernel.HEADERS, *recipes.RECIPE_DIR.glob('*.yaml')):
        assert path.is_file() and PACKAGE in path.parents, path


def test_every_extra_the_docs_and_messages_name_exists():
    """`pip install 'structformer[X]'` / `'.[X,Y]'` in the README, docs/ and the code's messages names extras
    pyproject.toml defines (pip only warns about an unknown extra, and installs without it)."""
    extras = set(_pyproject()['project']['optional-dependencies'])
    texts = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md')), *sorted(PACKAGE.rglob('*.py'))]
    named = {}
    for path in texts:
        for group in re.findall(r"(?:structformer|\.)\[([a-z0-9_,-]+)\]'", path.read_text(encoding='utf-8')):
            for extra in group.split(','):
                named.setdefault(extra, path.relative_to(ROOT))
    assert {'onnx', 'wds', 'hf', 'tb'} <= set(named), named
    assert not {e: str(w) for e, w in named.items() if e not in extras}, extras
