"""The tree follows docs/design.md's rule: code lives by kind, a family's code is a module named for the
family inside its kind, and imports only point down the stack (functional → layers → models → train →
analysis / bench / reproduce)."""
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
