"""The tree follows docs/design.md's rule: code lives by kind, a family's code is a module named for the
family inside its kind, and imports only point down the stack (functional → layers → models → train →
analysis / bench / reproduce). The package's import graph, lazy imports included, has no circle, and no library
module imports a command module; each of those two checks is shown to fail on a planted fake package."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / 'structformer'
FAMILIES = {'crate', 'soft', 'sparsifiner', 'mixer', 'lowrank'}
# a kind may import the kinds listed for it (and anything not listed here, such as records or errors)
BELOW = {'functional': set(),
         'layers': {'functional'},
         'models': {'functional', 'layers'},
         'data': set(),
         'weights': {'functional', 'layers', 'models'},
         'train': {'functional', 'layers', 'models', 'data', 'weights'}}
# the named exceptions, each a bridge that a rule without it would have to route through a worse place
BRIDGES = {'data/sizing.py': {'models'},        # the image size follows the model: its default input size
           'models/base.py': {'data', 'weights'}}  # pixel statistics for pretrained_cfg; timm's pretrained filter
STACK = {'functional', 'layers', 'models', 'data', 'weights', 'train', 'analysis', 'bench', 'reproduce', 'export',
         'compare'}


def test_no_family_packages():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / '__init__.py').exists()}
    assert not packages & FAMILIES, packages & FAMILIES


def _imported_kinds(path: Path) -> set:
    kind_of_file = path.relative_to(PACKAGE).parts[0]
    kinds = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or '').split('.')
                if parts[0] == 'structformer' and len(parts) > 1:
                    kinds.add(parts[1])
            elif node.level == 1:
                kinds.add(kind_of_file if path.parent != PACKAGE else (node.module or '').split('.')[0])
            elif node.level == 2 and node.module:
                kinds.add(node.module.split('.')[0])
    return kinds & STACK


@pytest.mark.parametrize('kind', sorted(BELOW))
def test_imports_point_down(kind):
    wrong = {}
    for path in (PACKAGE / kind).rglob('*.py'):
        name = str(path.relative_to(PACKAGE))
        if path.name == 'cli.py':                # a command sits on top of everything
            continue
        up = _imported_kinds(path) - BELOW[kind] - {kind} - BRIDGES.get(name, set())
        if up:
            wrong[name] = sorted(up)
    assert not wrong, wrong


# ----------------------------------------------------------------------------- the import graph
# A module imports another when an `import` statement names it, at module level or inside a function (a lazy
# import is still a dependency: it runs the first time the function does), relative or absolute; `from P import
# name` is an edge to the module P.name where that is a module, else to P. The packages Python runs before the
# named module are not edges. Imports under `if TYPE_CHECKING:` never run and are not edges.

# The function-level edges that close a circle on purpose, each with its reason. Nothing else may.
ALLOWED_EDGES = {
    ('structformer.models.base', 'structformer.weights.filters'):
        "timm's pretrained=True calls the family's checkpoint filter from build_model_with_cfg; the filters know "
        "every family's layout (weights imports models), so models/base.py hands timm the filter at build time",
}


def module_names(root: Path, package: str) -> dict:
    """Dotted module name -> file, for every .py under `root` (a package's __init__.py is the package)."""
    names = {}
    for path in root.rglob('*.py'):
        parts = list(path.relative_to(root).with_suffix('').parts)
        if parts[-1] == '__init__':
            parts = parts[:-1]
        names['.'.join([package, *parts])] = path
    return names


def _runtime_imports(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and 'TYPE_CHECKING' in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str) -> dict:
    """Module name -> set of the package's modules it imports."""
    modules = module_names(root, package)
    graph = {}
    for name, path in modules.items():
        here = name.split('.') if path.name == '__init__.py' else name.split('.')[:-1]   # the importer's package
        edges = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:               # `import a.b.c`: the deepest of them that is ours
                    parts = alias.name.split('.')
                    while parts and '.'.join(parts) not in modules:
                        parts.pop()
                    if parts:
                        edges.add('.'.join(parts))
                continue
            if node.level:
                base = here[:len(here) - node.level + 1]
                target = '.'.join(base + (node.module.split('.') if node.module else []))
            else:
                target = node.module or ''
            for alias in node.names:
                if f'{target}.{alias.name}' in modules:
                    edges.add(f'{target}.{alias.name}')
                elif target in modules:
                    edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def import_cycles(graph: dict) -> list:
    """Each circle of imports, as a closed path 'a -> b -> ... -> a': one per strongly connected component
    (Tarjan), the shortest way round from its first module."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    paths = []
    for component in components:
        start = min(component)
        came_from, frontier = {start: None}, [start]
        while start not in [w for v in frontier for w in graph[v]]:      # breadth first, inside the component
            step = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in came_from:
                        came_from[w] = v
                        step.append(w)
            frontier = step
        last = next(v for v in frontier if start in graph[v])
        path = [start]
        while last is not None and last != start:
            path.insert(1, last)
            last = came_from[last]
        paths.append(' -> '.join(path + [start]))
    return sorted(paths)


def is_command(module: str, package: str) -> bool:
    """A command module: cli.py and *_cli.py anywhere (design_cli.py, analysis/cka_cli.py), __main__.py, and
    the verbs of `commands/`."""
    last = module.split('.')[-1]
    return (last in ('cli', '__main__') or last.endswith('_cli')
            or module == f'{package}.commands' or module.startswith(f'{package}.commands.'))


def library_imports_of_commands(graph: dict, package: str) -> list:
    return sorted(f'{v} -> {w}' for v, ws in graph.items() if not is_command(v, package)
                  for w in ws if is_command(w, package))


def _without_allowed(graph: dict) -> dict:
    return {v: {w for w in ws if (v, w) not in ALLOWED_EDGES} for v, ws in graph.items()}


def test_no_import_cycle():
    graph = import_graph(PACKAGE, 'structformer')
    stale = [edge for edge in ALLOWED_EDGES if edge[1] not in graph.get(edge[0], ())]
    assert not stale, f"allowed edges that no longer exist (drop them from ALLOWED_EDGES): {stale}"
    assert import_cycles(_without_allowed(graph)) == []


def test_no_library_module_imports_a_command_module():
    assert library_imports_of_commands(import_graph(PACKAGE, 'structformer'), 'structformer') == []


def _fake_package(tmp_path: Path, files: dict) -> Path:
    root = tmp_path / 'fake'
    for name, text in {'__init__.py': '', **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_checker_names_a_planted_cycle(tmp_path):
    """A circle through a relative module-level import, a lazy import inside a function and an absolute one is
    found and named; an import under TYPE_CHECKING and the allowed way out are not circles."""
    root = _fake_package(tmp_path, {
        'low/__init__.py': '',
        'low/a.py': 'from . import b\n',
        'low/b.py': 'def f():\n    from ..high import c\n',
        'high/__init__.py': '',
        'high/c.py': 'import fake.low.a\n',
        'typed.py': 'from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import c\n',
        'leaf.py': 'from .typed import TYPE_CHECKING\n',
    })
    graph = import_graph(root, 'fake')
    assert graph['fake.low.b'] == {'fake.high.c'} and graph['fake.typed'] == set()
    assert import_cycles(graph) == ['fake.high.c -> fake.low.a -> fake.low.b -> fake.high.c']
    assert import_cycles({**graph, 'fake.low.b': set()}) == []      # without the lazy edge: no circle


def test_checker_names_a_library_module_importing_a_command(tmp_path):
    root = _fake_package(tmp_path, {
        'cli.py': 'from .commands import train\n',
        'commands/__init__.py': '', 'commands/train.py': 'from ..lib import run\n',
        'lib.py': 'def run():\n    from .cli import main\n    import fake.helper_cli\n', 'helper_cli.py': '',
        'tool/__init__.py': '', 'tool/cli.py': 'from ..lib import run\n',
        'tool/core.py': 'from . import cli\nfrom ..commands.train import x\n',
    })
    assert library_imports_of_commands(import_graph(root, 'fake'), 'fake') == [
        'fake.lib -> fake.cli', 'fake.lib -> fake.helper_cli', 'fake.tool.core -> fake.commands.train', 'fake.tool.core -> fake.tool.cli']


# ----------------------------------------------------------------------------- the requirement floors

def test_requirement_floors_agree_across_pyproject_readme_and_the_import_check():
    """pyproject.toml's `torch>=` / `timm>=`, the README's sentence and `requirements.MINIMUM` name the same
    floors, and each floor is at most the version constraints.txt pins (the one CI tests)."""
    import re
    from structformer.requirements import MINIMUM, release
    root = PACKAGE.parent
    pyproject, readme = (root / 'pyproject.toml').read_text(), (root / 'README.md').read_text()
    constraints = (root / 'constraints.txt').read_text()
    for package, floor in MINIMUM.items():
        text = '.'.join(map(str, floor))
        assert re.search(rf'"{package}>={re.escape(text)}"', pyproject), (package, text)
        assert f'{package} ≥ {text}' in readme, (package, text)
        pinned = re.search(rf'^{package}==(\S+)$', constraints, re.M)[1]
        assert release(pinned) >= floor, (package, pinned, floor)


def test_an_older_timm_or_torch_is_named_with_its_floor(monkeypatch):
    from structformer import requirements
    assert requirements.release('2.8.0+cu128') == (2, 8, 0) and requirements.release('1.0.32.dev0') == (1, 0, 32)
    assert requirements.too_old('timm', '1.0.31') is None and requirements.too_old('torch', '2.14.1+cpu') is None
    line = requirements.too_old('timm', '1.0.23')
    assert line == ("structformer needs timm >= 1.0.31, found 1.0.23: models and commands may fail; "
                    "pip install -U 'timm>=1.0.31'")
    assert 'torch >= 2.10' in requirements.too_old('torch', '2.9.1+cu128')
    monkeypatch.setattr(requirements.metadata, 'version', lambda name: {'timm': '1.0.20', 'torch': '2.14.1'}[name])
    with pytest.warns(UserWarning, match=r"timm >= 1\.0\.31, found 1\.0\.20") as caught:
        requirements.warn_if_too_old()
    assert len(caught) == 1                            # torch is recent enough: no second warning
