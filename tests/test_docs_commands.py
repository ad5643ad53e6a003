"""Every `structformer ...` command in a ```bash block of README.md and docs/*.md runs as written, in
order, on the embedded data, all in one folder as a reader working through the pages meets them (README first,
after `make demo`, then the docs pages): a page whose outputs collide with another's fails here. README's
```python block runs too, and README's list of `--data` forms is the code's. Only the length of training is
shortened (see `shorten`): what is checked is that the commands and the API calls work."""
import math
import re
import shlex
from pathlib import Path

import pytest

from structformer.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / 'README.md'] + sorted((ROOT / 'docs').glob('*.md'))


def fenced_blocks(text: str, language: str):
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def commands(path: Path):
    """The structformer command lines of a document's bash blocks, comments stripped."""
    found = []
    for block in fenced_blocks(path.read_text(), 'bash'):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                assert argv[0] == 'structformer', f"{path.name}: a bash block holds a non-structformer line: {line}"
                found.append(argv[1:])
    return found


def make_demo_commands():
    """The structformer command lines of the Makefile's `demo` target, as `make demo` runs them (DEMO_OUT at
    its default): README's commands are read by someone who has just run it."""
    text = (ROOT / 'Makefile').read_text()
    out = re.search(r'^DEMO_OUT \?= (\S+)', text, flags=re.M).group(1)
    recipe = re.search(r'^demo:.*\n((?:\t.*\n)+)', text, flags=re.M).group(1)
    return [shlex.split(line.strip().replace('$(DEMO_OUT)', out))[1:] for line in recipe.splitlines()
            if line.strip().startswith('$(BIN)/structformer ')]


def shorten(argv):
    """`train` runs a tenth of its epochs (rounded up) on 2 batches each; nothing else changes."""
    if not argv or argv[0] != 'train':
        return argv
    argv = list(argv)
    if '--epochs' in argv:
        i = argv.index('--epochs') + 1
        argv[i] = str(math.ceil(int(argv[i]) / 10))
    return argv + ['--limit-train-batches', '2', '--no-progress']


def _run(argv):
    try:
        return main(argv)
    except SystemExit as e:                 # --help exits through argparse
        return e.code


def test_documented_commands_run_in_order_in_one_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)             # outputs/... of the examples land here, in order
    demo = make_demo_commands()             # a newcomer meets README's commands after `make demo`
    assert demo and demo[0][0] == 'train'
    for argv in demo:
        assert _run(shorten(argv)) == 0, f"make demo: structformer {shlex.join(argv)}"
    for path in DOCUMENTS:
        for argv in commands(path):
            assert _run(shorten(argv)) == 0, f"{path.name}: structformer {shlex.join(argv)}"


def test_readme_lists_the_data_forms_of_the_code(capsys):
    """One list: README's `--data` forms and `train --help`'s are the keys of data.spec.DATASET_FORMS, in order."""
    from structformer.data.spec import DATASET_FORMS
    forms = ' | '.join(DATASET_FORMS)
    readme = re.search(r"`--data` takes `([^`]+)`", (ROOT / 'README.md').read_text()).group(1)
    assert readme == forms
    _run(['train', '--help'])
    assert ' '.join(forms.split()) in ' '.join(capsys.readouterr().out.split())


def test_readme_has_the_commands_it_promises():
    argvs = [a[0] for a in commands(ROOT / 'README.md') if a]
    assert {'train', 'eval', 'analyze', 'models'} <= set(argvs)


def test_readme_python_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (block,) = fenced_blocks((ROOT / 'README.md').read_text(), 'python')
    namespace = {}
    exec(compile(block, 'README.md python block', 'exec'), namespace)
    extractor, features = namespace['extractor'], namespace['features']
    assert len(features) == len(extractor.feature_info.channels())
    assert all(f.shape == (2, c, 4, 4) for f, c in zip(features, extractor.feature_info.channels()))
    assert namespace['result'].final['epoch'] == 2
