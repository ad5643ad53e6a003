"""`structformer.records` is the one home of records, figures, the environment record and output checks:
bench/, reproduce/, analysis/ and train/ import them from there instead of from one another."""
import re
from pathlib import Path

import pytest

from structformer.records import check_output_file, check_writable, removed_on_failure

PACKAGE = Path(__file__).resolve().parents[1] / 'structformer'
SHARED = ('write_json', 'write_png', 'write_text', 'environment', 'cpu_model', 'check_writable',
          'check_output_file', 'removed_on_failure')


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


def test_a_failed_command_leaves_no_output_folder_it_made(tmp_path):
    """The folders a failing block created are removed (the first new one and all below it); a folder that was
    there before stays, and nothing is removed when the block succeeds."""
    out = tmp_path / 'new' / 'analysis'
    with pytest.raises(ValueError):
        with removed_on_failure(out):
            out.mkdir(parents=True)
            (out / 'figure.png').write_bytes(b'x')
            raise ValueError('the measurement failed')
    assert list(tmp_path.iterdir()) == []
    (tmp_path / 'kept').mkdir()
    with pytest.raises(KeyboardInterrupt):
        with removed_on_failure(tmp_path / 'kept'):
            raise KeyboardInterrupt
    assert (tmp_path / 'kept').is_dir()
    with removed_on_failure(out):
        out.mkdir(parents=True)
    assert out.is_dir()


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
