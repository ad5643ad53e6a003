"""tools/mutants.py, the check that the tests catch a wrong equation: every mutant still applies to the code it
names and names tests that exist (a mutant that no longer applies would be counted as nothing), and one run on
its CPU path kills a mutant in a throw-away copy, records it and leaves the tree as it was."""
import ast
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location('mutants_tool', ROOT / 'tools' / 'mutants.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _test_names(path: Path) -> set:
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}


def test_every_mutant_applies_and_names_tests_that_exist():
    mutants = _tool().MUTANTS
    assert len({m[0] for m in mutants}) == len(mutants)
    for name, what, edits, tests in mutants:
        assert what and edits and tests, name
        for rel, old, new, count in edits:
            assert old != new and (ROOT / rel).read_text().count(old) == count, (name, rel, old)
        for entry in tests:
            module, _, test = entry.partition('::')
            path = ROOT / 'tests' / f'{module}.py'
            assert path.exists(), (name, entry)
            assert not test or test in _test_names(path), (name, entry)


def test_an_unknown_mutant_is_one_line_and_exit_2(capsys):
    assert _tool().main(['--only', 'no_such_mutant']) == 2
    err = capsys.readouterr().err
    assert err.startswith('--only: no mutant named no_such_mutant; accepted: crate_') and err.count('\n') == 1



def test_an_output_that_cannot_be_written_is_refused_before_any_run(tmp_path, capsys):
    assert _tool().main(['--output', str(tmp_path)]) == 2              # a folder, not a file
    err = capsys.readouterr().err
    assert err.startswith('--output') and err.count('\n') == 1
    assert 'structformer-mutants-' not in subprocess.run(['git', '-C', str(ROOT), 'worktree', 'list'],
                                                         capture_output=True, text=True).stdout

@pytest.mark.slow
def test_a_run_kills_a_wrong_equation_in_a_copy_and_records_it(tmp_path, monkeypatch, capsys):
    if subprocess.run(['git', '-C', str(ROOT), 'rev-parse', 'HEAD'], capture_output=True).returncode != 0:
        pytest.skip('the tool copies the git HEAD; this tree is not a git checkout')
    tool = _tool()
    test = 'test_lowrank::test_resolve_rank_int_and_fraction'
    monkeypatch.setattr(tool, 'MUTANTS', [
        ('rounding', 'a fractional rank truncated',
         [('structformer/layers/linear/factorized.py', 'int(round(rank * full))', 'int(rank * full)', 1)], [test])])
    out = tmp_path / 'record.json'
    assert tool.main(['--output', str(out)]) == 0                  # every mutant killed
    record = json.loads(out.read_text())
    assert [(r['name'], r['outcome']) for r in record['results']] == [('rounding', 'killed')]
    assert record['results'][0]['killed_by'] == f'tests/{test.replace("::", ".py::")}'
    assert record['commit'] and record['environment']['cpu']
    assert '1 of 1 mutants killed' in capsys.readouterr().out
    listed = subprocess.run(['git', '-C', str(ROOT), 'worktree', 'list'], capture_output=True, text=True).stdout
    assert 'structformer-mutants-' not in listed                    # the throw-away tree is gone
    assert 'int(round(rank * full))' in (ROOT / 'structformer/layers/linear/factorized.py').read_text()

