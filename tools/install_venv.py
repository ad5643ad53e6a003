"""Install structformer (editable) with its test extras into the virtual environment this Python runs in, pinned by
constraints.txt: with uv where it can be had, else with pip (the Makefile's `venv` step).

Why uv: the environment is 87 packages and 6 GB (torch's CUDA build and its NVIDIA libraries), and pip unpacks and
byte-compiles them one after another: 162 s on a 2-core AMD EPYC Zen 1, against 59 s for `uv pip install` (parallel
unpacking, hard links from its cache, byte-compiling on every core), the same 87 packages at the same versions. The
byte-compiling is kept: where PYTHONDONTWRITEBYTECODE is set, the .pyc files written at install are the only ones.

uv reads no pip configuration, so what pip is configured with (`pip config list`: its files and PIP_* variables) is
handed over: index-url, extra-index-url, find-links, constraint, no-index, and the certificate bundle (as
SSL_CERT_FILE). `--index-strategy unsafe-best-match` takes the newest allowed version over all indexes, as pip does.
uv itself comes from pip (so from the same indexes); where that or the uv install fails, pip installs everything, over
whatever uv left. STRUCTFORMER_INSTALLER=pip skips uv; =uv refuses the fallback.
"""
import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ['-e', f'{ROOT}[test]']
CONSTRAINTS = ROOT / 'constraints.txt'
PASSED_ON = ('index-url', 'extra-index-url', 'find-links', 'constraint', 'no-index', 'cert')


def pip_settings(python: str) -> dict:
    """{setting: [values]} of the PASSED_ON settings pip would use here (an environment variable over a file)."""
    listed = subprocess.run([python, '-m', 'pip', 'config', 'list'], capture_output=True, text=True).stdout
    settings, from_env = {}, set()
    for line in listed.splitlines():
        key, _, value = line.partition('=')
        origin, _, name = key.rpartition('.')
        if name not in PASSED_ON or (name in from_env and origin != ':env:'):
            continue
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            continue
        settings[name] = str(value).split()
        if origin == ':env:':
            from_env.add(name)
    return settings


def uv_arguments(settings: dict) -> list:
    args = []
    for name, flag in (('index-url', '--index-url'), ('extra-index-url', '--extra-index-url'),
                       ('find-links', '--find-links'), ('constraint', '--constraint')):
        for value in settings.get(name, []):
            args += [flag, value]
    if settings.get('no-index', ['0'])[0].lower() in ('1', 'true', 'yes', 'on'):
        args.append('--no-index')
    return args


def with_pip(python: str) -> int:
    return subprocess.call([python, '-m', 'pip', 'install', '--disable-pip-version-check', '-q', '-c', str(CONSTRAINTS),
                            *TARGET])


def with_uv(python: str) -> int:
    if subprocess.call([python, '-m', 'pip', 'install', '--disable-pip-version-check', '-qq', 'uv']):
        print('install_venv: uv could not be installed', file=sys.stderr)
        return 1
    settings = pip_settings(python)
    env = dict(os.environ)
    if settings.get('cert'):
        env.setdefault('SSL_CERT_FILE', settings['cert'][0])
    venv = Path(sys.prefix)
    command = [str(venv / 'bin' / 'uv'), 'pip', 'install', '--python', python, '--quiet',
               '--cache-dir', str(venv / 'uv-cache'),          # inside the venv: hard links, gone with it
               '--index-strategy', 'unsafe-best-match', '--compile-bytecode', *uv_arguments(settings),
               '--constraint', str(CONSTRAINTS), *TARGET]
    return subprocess.call(command, env=env)


def main() -> int:
    if sys.prefix == sys.base_prefix:
        print('install_venv: run it with a virtual environment\'s python', file=sys.stderr)
        return 2
    python, choice = sys.executable, os.environ.get('STRUCTFORMER_INSTALLER', 'auto')
    if choice not in ('auto', 'uv', 'pip'):
        print(f"install_venv: STRUCTFORMER_INSTALLER={choice!r}: accepted auto, uv or pip", file=sys.stderr)
        return 2
    if choice != 'pip':
        code = with_uv(python)
        if code == 0 or choice == 'uv':
            return code
        print(f'install_venv: uv failed (exit {code}); installing with pip', file=sys.stderr)
    return with_pip(python)


if __name__ == '__main__':
    sys.exit(main())
