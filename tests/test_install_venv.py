"""tools/install_venv.py (the Makefile's install step): pip's configuration reaches uv, uv's failure falls back to
pip, and the choice of installer is the user's. No package is installed here: the commands are recorded."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location('install_venv', ROOT / 'tools' / 'install_venv.py')
install_venv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_venv)

# `pip config list` as pip 23 prints it: an environment variable's entry first, then the files' (global., site.)
LISTED = """:env:.cert='/etc/ssl/certs/ca.crt'
:env:.find-links='/opt/wheels'
:env:.default-timeout='180'
global.cert='/etc/other.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/srv/ignored-by-the-env'
site.index-url='https://mirror.example/simple'
"""


def _listed(text):
    return lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, stdout=text, stderr='')


def test_pips_settings_reach_uv_with_the_environment_over_the_files(monkeypatch):
    monkeypatch.setattr(install_venv.subprocess, 'run', _listed(LISTED))
    settings = install_venv.pip_settings(sys.executable)
    assert settings == {'cert': ['/etc/ssl/certs/ca.crt'], 'find-links': ['/opt/wheels'],
                        'constraint': ['/etc/xdg/pip/constraints.txt'],
                        'extra-index-url': ['file:///opt/pypi/simple', 'file:///opt/pypi-more/simple'],
                        'index-url': ['https://mirror.example/simple']}
    assert install_venv.uv_arguments(settings) == [
        '--index-url', 'https://mirror.example/simple', '--extra-index-url', 'file:///opt/pypi/simple',
        '--extra-index-url', 'file:///opt/pypi-more/simple', '--find-links', '/opt/wheels',
        '--constraint', '/etc/xdg/pip/constraints.txt']
    assert install_venv.uv_arguments({'no-index': ['true']}) == ['--no-index']
    assert install_venv.uv_arguments({}) == []


class _Calls:
    """subprocess.call recorded; the commands whose first words match `fail` exit 1."""

    def __init__(self, fail=()):
        self.commands, self.fail = [], fail

    def __call__(self, command, env=None):
        self.commands.append((command, env))
        return 1 if any(f in ' '.join(command) for f in self.fail) else 0


@pytest.fixture
def in_a_venv(monkeypatch, tmp_path):
    monkeypatch.setattr(install_venv.sys, 'prefix', str(tmp_path / 'venv'))
    monkeypatch.setattr(install_venv.sys, 'base_prefix', '/usr')
    monkeypatch.setattr(install_venv.subprocess, 'run', _listed(LISTED))
    monkeypatch.delenv('STRUCTFORMER_INSTALLER', raising=False)
    monkeypatch.delenv('SSL_CERT_FILE', raising=False)
    return tmp_path / 'venv'


def test_uv_installs_with_pips_settings_its_cache_in_the_venv(monkeypatch, in_a_venv):
    calls = _Calls()
    monkeypatch.setattr(install_venv.subprocess, 'call', calls)
    assert install_venv.main() == 0
    (get_uv, _), (install, env) = calls.commands
    assert get_uv[-1] == 'uv' and get_uv[1:4] == ['-m', 'pip', 'install']
    assert install[0] == str(in_a_venv / 'bin' / 'uv') and install[1:3] == ['pip', 'install']
    assert install[install.index('--cache-dir') + 1] == str(in_a_venv / 'uv-cache')
    assert '--compile-bytecode' in install and install[install.index('--index-strategy') + 1] == 'unsafe-best-match'
    assert install[install.index('--find-links') + 1] == '/opt/wheels'
    constraints = [install[i + 1] for i, a in enumerate(install) if a == '--constraint']
    assert constraints == ['/etc/xdg/pip/constraints.txt', str(ROOT / 'constraints.txt')]
    assert install[-2:] == ['-e', f'{ROOT}[test]'] and env['SSL_CERT_FILE'] == '/etc/ssl/certs/ca.crt'


@pytest.mark.parametrize('fail', ['pip install --disable-pip-version-check -qq uv', 'uv pip install'])
def test_a_failed_uv_falls_back_to_pip(monkeypatch, in_a_venv, capsys, fail):
    calls = _Calls(fail=[fail])
    monkeypatch.setattr(install_venv.subprocess, 'call', calls)
    assert install_venv.main() == 0
    last, _ = calls.commands[-1]
    assert last[1:4] == ['-m', 'pip', 'install'] and last[-2:] == ['-e', f'{ROOT}[test]']
    assert last[last.index('-c') + 1] == str(ROOT / 'constraints.txt')
    assert 'uv' in capsys.readouterr().err


def test_the_installer_is_the_users_choice(monkeypatch, in_a_venv, capsys):
    calls = _Calls(fail=['uv pip install'])
    monkeypatch.setattr(install_venv.subprocess, 'call', calls)
    monkeypatch.setenv('STRUCTFORMER_INSTALLER', 'pip')
    assert install_venv.main() == 0 and len(calls.commands) == 1 and calls.commands[0][0][-1] == f'{ROOT}[test]'
    calls.commands.clear()
    monkeypatch.setenv('STRUCTFORMER_INSTALLER', 'uv')                 # uv or nothing: its failure is the exit
    assert install_venv.main() == 1 and len(calls.commands) == 2
    monkeypatch.setenv('STRUCTFORMER_INSTALLER', 'conda')
    assert install_venv.main() == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "install_venv: STRUCTFORMER_INSTALLER='conda': accepted auto, uv or pip")
