"""Every example in a `--help` text parses as written (flags that exist, values of the right type), and
every `train` example gives a configuration that validates: a help text that no longer matches its
command is what a new user copies first. (Running them is the job of tests/test_docs_commands.py for
the documents; help examples are parsed, not run, to keep the suite short.)"""
import argparse
import shlex

import pytest

from structformer.cli import build_parser
from structformer.commands.train import train_config


def _subparsers(parser: argparse.ArgumentParser, path=()):
    """(command path, parser) for every parser under `parser`, itself included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _subparsers(child, path + (name,))


def _examples(parser: argparse.ArgumentParser):
    """The `structformer ...` command lines of a parser's epilog, continuation lines joined."""
    lines, pending = [], ''
    for raw in (parser.epilog or '').splitlines():
        line = pending + raw.strip()
        pending = ''
        if line.endswith('\\'):
            pending = line[:-1] + ' '
            continue
        argv = shlex.split(line, comments=True)
        if argv[:1] == ['structformer']:
            lines.append(argv[1:])
    return lines


EXAMPLES = sorted({tuple(argv) for _, p in _subparsers(build_parser()) for argv in _examples(p)})


def test_every_command_has_examples():
    commands = {argv[0] for argv in EXAMPLES}
    assert {'train', 'eval', 'analyze', 'bench', 'reproduce', 'design', 'models'} <= commands
    assert len(EXAMPLES) >= 30


@pytest.mark.parametrize('argv', EXAMPLES, ids=[' '.join(a)[:80] for a in EXAMPLES])
def test_help_example_parses(argv):
    args = build_parser().parse_args(list(argv))     # argparse exits (SystemExit) on an unknown flag or value
    if argv[0] == 'train' and not args.resume and getattr(args, 'config', None) is None:
        train_config(args).validate()


@pytest.mark.parametrize('argv', [a for a in EXAMPLES if a[0] == 'reproduce'],
                         ids=[' '.join(a)[:80] for a in EXAMPLES if a[0] == 'reproduce'])
def test_reproduce_examples_give_the_data_they_need(argv):
    """Six `reproduce` examples had no --data, which every part on MNIST requires: copied as written, each ended
    in '--data PATH is required' (only lowrank's LM part and mixer's --report-only read no MNIST)."""
    args = build_parser().parse_args(list(argv))
    needs_mnist = not (args.target == 'lowrank' and args.parts == ['lm']) and not getattr(args, 'report_only', False)
    assert args.data or not needs_mnist, argv
