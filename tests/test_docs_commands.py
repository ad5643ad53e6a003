"""Every `structformer ...` command in a ```bash block of README.md and docs/*.md runs as written, in
order, on the embedded data, all in one folder as a reader working through the pages meets them (README first,
after `make demo`, then the docs pages): a page whose outputs collide with another's fails here. README's
```python block runs too, and README's list of `--data` forms is the code's. Only the length of training is
shortened (see `shorten`): what is checked is that the commands and the API calls work."""
import math
import re
import shlex
import sys
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


# ------------------------------------------------------------------ every command line the pages show, parsed
# The test above runs the ```bash blocks; the ```text blocks (longer jobs, the papers' scale) and the commands
# quoted in prose are what a reader copies next. Each is parsed here against the parsers the CLI builds (verb,
# target, every flag and its value) without running it; `train` lines are validated as a configuration, their
# models and recipes looked up, and those on bundled or generated data planned with --dry-run (which builds the
# model, on the meta device).

# placeholders the pages explain beside their command -> a value of the type the flag takes
PLACEHOLDER_VALUES = {'T': '1'}
BUNDLED_DATA = ('digits', 'synthetic-subspaces', 'pysource')


def documented_lines():
    """(page, line, in a block?) for every line of every fenced block but Python's (continuation lines joined)
    and every `inline code` span of the prose (its whitespace made single spaces)."""
    for path in DOCUMENTS:
        text = path.read_text()
        for language, block in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
            if language == 'python':
                continue
            pending = ''
            for raw in block.splitlines():
                line = pending + raw.strip()
                pending = ''
                if line.endswith('\\'):
                    pending = line[:-1] + ' '
                    continue
                yield path.name, line, True
        prose = re.sub(r"^```.*?^```", '', text, flags=re.S | re.M)
        for span in re.findall(r"`([^`]+)`", prose):
            yield path.name, ' '.join(span.split()), False


def as_command(line: str):
    """(program, argv after it) for a command line a reader would type: `structformer ...`, `torchrun ... -m
    structformer ...` and `python -m structformer ...` as ('structformer', argv), `make ...`, `torchrun ...` and
    `python -m MODULE ...` as themselves; environment assignments before it dropped. None for anything else (prose,
    a quoted error message)."""
    try:
        argv = shlex.split(line, comments=True)
    except ValueError:                          # an apostrophe of prose
        return None
    while argv and re.fullmatch(r'[A-Z_]+=\S*', argv[0]):
        argv = argv[1:]
    if len(argv) < 2 or argv[1].endswith(':'):  # a bare name, or `structformer convert: error: ...`
        return None
    module = argv[argv.index('-m') + 1:] if argv[0] == 'torchrun' and '-m' in argv else []
    if module[:1] == ['structformer']:
        return 'structformer', module[1:]
    if argv[:3] == ['python', '-m', 'structformer']:
        return 'structformer', argv[3:]
    if argv[:2] == ['python', '-m'] and len(argv) > 2:
        return 'python -m', argv[2:]
    if argv[0] in ('structformer', 'torchrun', 'make'):
        return argv[0], argv[1:]
    return None


def documented(program: str):
    """Sorted, without repeats: (page, argv, whole?) of every `program` command of the pages. A prose span that
    names a verb or flag without the rest (`structformer analyze --cka`), or a line ending in `...`, is not whole:
    its words and flags must exist, but the arguments it leaves out are not asked for."""
    found = set()
    for page, line, in_block in documented_lines():
        command = as_command(line)
        if command and command[0] == program and command[1]:
            argv = command[1]
            whole = in_block and '...' not in argv
            found.add((page, tuple(PLACEHOLDER_VALUES.get(a, a) for a in argv if a != '...'), whole))
    return sorted(found)


def _parse(parser, argv):
    """(namespace, None); (None, None) for --help; or (None, argparse's error line)."""
    import contextlib
    import io
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(list(argv)), None
    except SystemExit as e:
        return None, (said.getvalue().strip().splitlines()[-1] if e.code else None)


def _verb_parser(parser, argv):
    """The parser of the verb / target / action that `argv` names, going down the sub-parsers."""
    import argparse
    for word in argv:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            break
        parser = sub.choices[word]
    return parser


STRUCTFORMER = documented('structformer')


def test_the_pages_show_the_commands_of_every_kind():
    """The collector finds what the pages hold (a change that hid the lines from it would pass everything else)."""
    verbs = {argv[0] for _, argv, whole in STRUCTFORMER if whole}
    assert {'train', 'eval', 'analyze', 'bench', 'reproduce', 'compare', 'data', 'design', 'models', 'convert',
            'export', 'recipes'} <= verbs
    assert len(STRUCTFORMER) > 150
    assert any(page == 'training.md' and not whole for page, _, whole in STRUCTFORMER)     # `train ...`
    assert documented('make') and documented('python -m') and list(torchrun_lines())


@pytest.mark.parametrize('page, argv, whole', STRUCTFORMER,
                         ids=[f"{p}: {' '.join(a)[:70]}" for p, a, _ in STRUCTFORMER])
def test_documented_command_parses(page, argv, whole):
    """A line of a block parses as a whole (every flag the verb's, every value of the type it takes, no
    argument missing); a fragment of prose names a verb that exists and flags of that verb."""
    from structformer.cli import build_parser
    parser = build_parser()
    args, error = _parse(parser, argv)
    if whole:
        assert error is None, f"{page}: structformer {shlex.join(argv)}: {error}"
    else:
        verb = _verb_parser(parser, argv)
        assert verb is not parser or argv[0].startswith('-'), \
            f"{page}: structformer {shlex.join(argv)}: no such command"
        flags = [a.split('=', 1)[0] for a in argv if a.startswith('--')]
        unknown = [f for f in flags if f not in verb._option_string_actions]
        assert not unknown, f"{page}: structformer {shlex.join(argv)}: {unknown} not flags of `{verb.prog}`"
        if error is not None:                      # the parts it leaves out, and nothing else, are missing
            assert 'required' in error or 'expected one argument' in error, f"{page}: {shlex.join(argv)}: {error}"


TRAIN_LINES = [(page, argv) for page, argv, whole in STRUCTFORMER if whole and argv[0] == 'train']


@pytest.mark.parametrize('page, argv', TRAIN_LINES, ids=[f"{p}: {' '.join(a)[:70]}" for p, a in TRAIN_LINES])
def test_documented_training_is_a_valid_configuration(page, argv):
    """Each documented `train` line gives a configuration that validates, of a model timm can build and a
    recipe that ships (a renamed model or recipe fails here before a reader meets it)."""
    import timm

    from structformer.cli import build_parser
    from structformer.commands.train import train_config
    from structformer.train.recipes import list_recipes
    args = build_parser().parse_args(list(argv))
    if args.resume or getattr(args, 'config', None) is not None:
        return                                     # a run folder's configuration: the run test makes and uses it
    config = train_config(args).validate()
    assert timm.is_model(config.model), f"{page}: --model {config.model} is not registered"
    assert config.recipe is None or config.recipe in list_recipes(), f"{page}: no recipe {config.recipe}"


def _without_data(argv):
    """A recipe's line with its --data left out: README's '--dry-run with --data left out prints the plan'."""
    i = argv.index('--data')
    return argv[:i] + argv[i + 2:]


PLANNED = [(page, argv) for page, argv in TRAIN_LINES
           if '--data' in argv and argv[argv.index('--data') + 1] in BUNDLED_DATA
           and '--resume' not in argv and '-c' not in argv]
PLANNED += [(page, _without_data(argv) if '--data' in argv else argv) for page, argv in TRAIN_LINES
            if '--recipe' in argv and (page, argv) not in PLANNED]


@pytest.mark.parametrize('page, argv', PLANNED, ids=[f"{p}: {' '.join(a)[:70]}" for p, a in PLANNED])
def test_documented_training_plans_with_dry_run(page, argv, capsys):
    """--dry-run of each such line (a recipe's with its --data left out, as README says) resolves its plan (the
    model built on the meta device; nothing written). A ViT given SOFT attention by name (README) shapes its lazy
    sampler there: that raised torch's 'unknown device type for autocast' traceback."""
    argv = list(argv) + (['--dry-run'] if '--dry-run' not in argv else [])
    assert _run(argv) == 0, f"{page}: structformer {shlex.join(argv)}"
    assert 'nothing is trained or written' in capsys.readouterr().out


def torchrun_lines():
    """(page, torchrun's argv) of every torchrun line of the pages, its `...` dropped."""
    for page, line, _ in documented_lines():
        if line.startswith('torchrun ') and as_command(line):
            yield page, [a for a in shlex.split(line, comments=True)[1:] if a != '...']


def test_documented_torchrun_make_and_module_lines_exist():
    """torchrun's options are torchrun's (and it runs the module), `make` targets are the Makefile's, `python -m`
    modules exist."""
    import importlib.util

    from torch.distributed.run import get_args_parser
    for page, argv in torchrun_lines():
        args, error = _parse(get_args_parser(), argv)
        assert error is None and args.module and args.training_script == 'structformer', \
            f"{page}: torchrun {shlex.join(argv)}: {error}"
    targets = set(re.findall(r'^([a-z][\w-]*):', (ROOT / 'Makefile').read_text(), flags=re.M))
    for page, argv, _ in documented('make'):
        assert argv[0] in targets, f"{page}: make {argv[0]}: no such target"
    for page, argv, _ in documented('python -m'):
        assert importlib.util.find_spec(argv[0]) is not None, f"{page}: python -m {argv[0]}: no such module"


def _anchors(path: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r'^#+\s+(.*)$', re.sub(r"^```.*?^```", '', path.read_text(), flags=re.S | re.M), flags=re.M)
    return {re.sub(r'[^\w\- ]', '', h.strip().lower()).replace(' ', '-') for h in heads}


def test_links_and_named_files_resolve():
    """Every relative link of the pages reaches a file (and a heading, for #anchor), and every repository path
    the pages name in code (docs/..., structformer/..., tools/..., tests/...) exists; a path with a placeholder
    (KIND, NAME, <device>, *) is a pattern, not looked up."""
    checked = 0
    for path in DOCUMENTS:
        text = re.sub(r"^```.*?^```", '', path.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r'[a-z]+:', target):
                continue
            file, _, anchor = target.partition('#')
            linked = (path.parent / file) if file else path
            assert linked.exists(), f"{path.name}: link {target}: no such file"
            if anchor and linked.suffix == '.md':
                assert anchor in _anchors(linked), f"{path.name}: link {target}: no such heading"
            checked += 1
        for named in re.findall(r"(?<![\w/.~$-])((?:docs|structformer|tools|tests)/[\w./<>{}*-]*)", path.read_text()):
            named = named.rstrip('.')
            if re.search(r'[A-Z<>{}*]', named) or not re.search(r'[\w/]$', named):
                continue
            assert (ROOT / named).exists(), f"{path.name}: {named}: no such file in the repository"
            checked += 1
    assert checked > 100


class _DataChecked(Exception):
    """A reproduction got past its data check: the documented line would start training here."""


def _reproduce_help_examples():
    """('reproduce TARGET --help', argv) of each example in the reproductions' help texts (continuations joined)."""
    import argparse

    from structformer.cli import build_parser
    reproduce = _verb_parser(build_parser(), ['reproduce'])
    (targets,) = [a for a in reproduce._actions if isinstance(a, argparse._SubParsersAction)]
    found = []
    for target, parser in targets.choices.items():
        for line in re.sub(r'\\\n\s*', ' ', parser.epilog or '').splitlines():
            argv = shlex.split(line, comments=True)
            if argv[:2] == ['structformer', 'reproduce']:
                found.append((f'reproduce {target} --help', tuple(argv[1:])))
    return found


REPRODUCE_LINES = [(page, argv) for page, argv, whole in STRUCTFORMER
                   if argv[0] == 'reproduce' and (whole or any(a.startswith('--') for a in argv))]
REPRODUCE_LINES += _reproduce_help_examples()


@pytest.mark.parametrize('page, argv', REPRODUCE_LINES, ids=[f"{p}: {' '.join(a)[:70]}" for p, a in REPRODUCE_LINES])
def test_documented_reproductions_name_their_data(page, argv, monkeypatch, tmp_path, capsys):
    """Each documented reproduction (a block's line, or a prose span with flags) gets past the checks of its
    arguments, where the data is the first thing looked at: stopped there, before anything trains. README's
    `reproduce soft` / `mixer` / `sparsifiner` and crate.md's, mixer.md's and soft.md's lines had no --data, which
    every MNIST reproduction requires (there is no default folder): copied, each ended in '--data PATH is
    required'; so did 8 of the 10 examples of `reproduce TARGET --help`. A --data given is taken as the reader's
    copy (the pages' /data/mnist, DIR), not looked up."""
    import structformer.reproduce as reproduce
    from structformer.reproduce import lowrank, mixer, soft
    real_spec, real_check = reproduce.mnist_spec, lowrank._check

    def spec(data):
        real_spec(data) if not data else None          # its refusal of a missing --data, word for word
        raise _DataChecked

    def lowrank_check(args):
        if args.data:
            args.data = str(tmp_path)
        real_check(args)
        raise _DataChecked

    for module in (reproduce, mixer, soft):
        monkeypatch.setattr(module, 'mnist_spec', spec)
    monkeypatch.setattr(lowrank, '_check', lowrank_check)
    monkeypatch.chdir(tmp_path)
    try:
        status = _run(list(argv))
    except _DataChecked:
        return
    error = capsys.readouterr().err
    assert status == 2 and '--data' not in error, f"{page}: structformer {shlex.join(argv)}: {error}"


def test_models_recipes_and_filters_the_pages_name_exist():
    """Every model or recipe name the pages quote in code (`soft_tiny_224`, `crate_base_in1k`, ...) is registered
    with timm or ships as a recipe, and every documented `models --filter` (and `--img-size` without `--flops`,
    which it refuses) finds models: a renamed model leaves no dangling name on a page."""
    import timm

    from structformer.commands.models import matches
    from structformer.models import list_structformer_language_models, list_structformer_models
    from structformer.train.recipes import list_recipes
    known = set(list_recipes())
    named = {(path.name, name) for path in DOCUMENTS for name in re.findall(
        r"`([a-z][a-z0-9_]*_(?:224|384|digits|mnist|cifar|cifar10|cifar100|synthetic|tiny|in1k|ft|lm1b))`",
        path.read_text())}
    assert len(named) > 100
    for page, name in sorted(named):
        assert timm.is_model(name) or name in known, f"{page}: `{name}` is neither a registered model nor a recipe"
    ours = list_structformer_models() + list_structformer_language_models()
    filters = 0
    for page, argv, _ in STRUCTFORMER:
        if argv[0] == 'models' and '--filter' in argv:
            pattern = argv[argv.index('--filter') + 1]
            assert any(matches(n, pattern) for n in ours), f"{page}: models --filter {pattern} matches no model"
            assert '--img-size' not in argv or '--flops' in argv, f"{page}: {shlex.join(argv)}"
            filters += 1
    assert filters >= 5


def test_design_md_transform_example_runs_and_rebuilds_only_once_imported(tmp_path, monkeypatch):
    """design.md's `scale_head` example registers, trains through TrainConfig(transforms=...) as the page says, and
    a process that has not imported its module is told to (the page said rebuilding imported it: loading runs no
    code a checkpoint names, so it never did)."""
    from structformer.models import transforms
    from structformer.train import TrainConfig, load_model, train
    (block,) = [b for b in fenced_blocks((ROOT / 'docs' / 'design.md').read_text(), 'python') if 'scale_head' in b]
    module = tmp_path / 'my_transforms.py'
    module.write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transforms, 'TRANSFORMS', dict(transforms.TRANSFORMS))   # the registration stays here
    import importlib
    importlib.import_module('my_transforms')
    train(TrainConfig(model='crate_digits', data='digits', epochs=1, limit_train_batches=1, output='run',
                      transforms=[{'name': 'scale_head', 'kwargs': {'factor': 0.5}}]))
    assert load_model('run')[0] is not None
    del transforms.TRANSFORMS['scale_head']                  # a fresh process, the module not imported
    with pytest.raises(ValueError, match=r"'scale_head' \(it was registered by module 'my_transforms': import it"):
        load_model('run')
    assert 'my_transforms' in sys.modules and 'never imports it' in (ROOT / 'docs' / 'design.md').read_text()
