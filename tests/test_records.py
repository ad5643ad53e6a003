"""`structformer.records` is the one home of records, figures, the environment record and output checks:
bench/, reproduce/, analysis/ and train/ import them from there instead of from one another."""
import re
from pathlib import Path

import pytest

from structformer.records import check_output_file, check_writable

PACKAGE = Path(__file__).resolve().parents[1] / 'structformer'
SHARED = ('write_json', 'write_png', 'write_text', 'environment', 'cpu_model', 'check_writable',
          'check_output_file')


@pytest.mark.parametrize('name', SHARED)
def test_defined_only_in_records(name):
    pattern = re.compile(rf'^\s*def {name}\(', re.M)
    homes = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob('*.py') if pattern.search(p.read_text()))
    assert homes == ['records.py'], homes


def test_no_utility_imported_across_packages():
    """analysis/ never takes a helper from train/ or bench/ (it neither trains nor benchmarks)."""
    for path in (PACKAGE / 'analysis').rglob('*.py'):
        text = path.read_text()
        assert 'train.engine import check_writable' not in text, path
        assert not re.search(r'bench\.harness import [^\n]*(write_|environment)', text), path


def test_check_output_file(tmp_path):
    check_output_file(tmp_path / 'new' / 'out.json', '--output')      # a missing folder is created later
    with pytest.raises(ValueError, match='--output .*is a folder'):
        check_output_file(tmp_path, '--output')
    (tmp_path / 'file').write_text('x')
    with pytest.raises(ValueError, match='--json .*is a file, not a folder'):
        check_output_file(tmp_path / 'file' / 'out.json', '--json')
    check_writable(tmp_path, '--output')


def test_every_record_names_the_commit_that_made_it():
    """environment() carries the release and, in a git checkout, the commit HEAD points at (a `+dirty` suffix when
    the tree has changes), so a committed number can be traced to its code."""
    import subprocess

    import structformer
    from structformer.records import environment
    root = Path(structformer.__file__).resolve().parents[1]
    env = environment()
    assert env['structformer'] == structformer.__version__
    if not (root / '.git').exists():
        pytest.skip('not a git checkout')
    head = subprocess.run(['git', '-C', str(root), 'rev-parse', 'HEAD'], capture_output=True, text=True).stdout.strip()
    assert env['commit'] and head.startswith(env['commit'].removesuffix('+dirty'))
