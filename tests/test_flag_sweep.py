"""Every real-valued flag of every command, given nan, is refused in one line naming it (exit 2): a sweep over the
parsers `structformer --help` builds, so a flag added later is swept too. nan is never a setting; before the sweep,
`reproduce mixer --lr nan` trained (its spectra first, for minutes) and `compare --gpu-tflops nan` was taken.

Each command starts from arguments that are otherwise valid and cheap (the shared digits run for eval and analyze,
the real MNIST folder for the reproductions), so the refusal is the flag's, not a missing argument's."""
import argparse

import pytest
from PIL import Image

from structformer.cli import build_parser, main

# otherwise-valid arguments of each command ({run}: a finished run folder, {mnist}: an MNIST folder, {images}: an
# image folder of two classes, {tmp}: scratch)
BASES = {
    'train': ['--model', 'crate_digits', '--data', 'digits', '--epochs', '1', '--limit-train-batches', '1',
              '--output', '{tmp}/train', '--no-progress'],
    'eval': ['--checkpoint', '{run}'],
    'analyze': ['--checkpoint', '{run}', '--data', 'digits', '--output', '{tmp}/analysis', '--num-samples', '16'],
    'bench models': ['--steps', '1', '--rounds', '1'],
    'bench attention': ['--base-tokens', '64', '--multipliers', '1', '--repeats', '1'],
    'bench lowrank': ['--tokens', '16', '--in-features', '8', '--out-features', '8', '--depth', '0', '--steps', '1',
                      '--rounds', '1'],
    'bench mlp': ['--rounds', '1', '--repeats', '1'],
    'bench sparse-attention': ['--tokens', '64', '--repeats', '1'],
    'bench data': ['--images', '16', '--batch-size', '4', '--img-size', '16'],
    'bench gpu': ['--device', 'cpu'],
    'reproduce soft': ['--data', '{mnist}', '--epochs', '1', '--limit-train-batches', '1', '--output', '{tmp}/r'],
    'reproduce lowrank': ['--data', '{mnist}', '--epochs', '2', '--limit-train-batches', '1', '--output', '{tmp}/r'],
    'reproduce mixer': ['--data', '{mnist}', '--epochs', '1', '--limit-train-batches', '1', '--output', '{tmp}/r'],
    'reproduce crate': ['--data', '{mnist}', '--epochs', '1', '--limit-train-batches', '1', '--output', '{tmp}/r'],
    'reproduce sparsifiner': ['--data', '{mnist}', '--epochs', '2', '--predictor-epochs', '1', '--teacher-epochs',
                              '1', '--limit-train-batches', '1', '--output', '{tmp}/r'],
    'compare': ['--models', 'vit', '--dry-run', '--output', '{tmp}/grid'],
    'design': ['--omega', '100000'],
    'data shard': ['{images}', '{tmp}/shards'],
    'models': ['--filter', 'crate_digits'],
}


def _commands(parser, path=()):
    """(command words, parser) of every leaf command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield ' '.join(path), parser
        return
    for name, sub in subs[0].choices.items():
        yield from _commands(sub, path + (name,))


def _real_valued_flags():
    """(command, flag, its other names, values of one use) for each flag whose type is float."""
    for command, parser in _commands(build_parser()):
        for action in parser._actions:
            if action.option_strings and action.type is float:
                count = action.nargs if isinstance(action.nargs, int) else 1
                yield command, action.option_strings[-1], tuple(action.option_strings), count


FLAGS = list(_real_valued_flags())


def _integer_flags():
    """(command, flag, its other names, values of one use) for each flag that takes integers."""
    for command, parser in _commands(build_parser()):
        for action in parser._actions:
            kind = getattr(action.type, '__qualname__', '')
            if action.option_strings and (action.type is int or kind.startswith('bounded_int')):
                count = action.nargs if isinstance(action.nargs, int) else 1
                yield command, action.option_strings[-1], tuple(action.option_strings), count


INTEGER_FLAGS = list(_integer_flags())


def test_the_sweep_covers_every_command_with_such_a_flag():
    """A command with a float flag and no base here would be swept from arguments it refuses first."""
    swept = {f[0] for f in FLAGS + INTEGER_FLAGS}
    assert swept <= set(BASES), swept - set(BASES)
    assert len(FLAGS) > 60                      # train's alone are dozens: the walk found the parsers' actions


def _ids(flags):
    return [f"{command.replace(' ', '-')}{flag}" for command, flag, _, _ in flags]


@pytest.mark.parametrize('command, flag, names, count', FLAGS, ids=_ids(FLAGS))
def test_nan_is_refused_in_one_line_naming_the_flag(command, flag, names, count, crate_digits_run, shared_mnist,
                                                    tmp_path, capsys):
    _refused(command, flag, names, ['nan'] * count, crate_digits_run, shared_mnist, tmp_path, capsys)


@pytest.mark.parametrize('command, flag, names, count', INTEGER_FLAGS, ids=_ids(INTEGER_FLAGS))
def test_a_negative_count_is_refused_in_one_line_naming_the_flag(command, flag, names, count, crate_digits_run,
                                                                 shared_mnist, tmp_path, capsys):
    """No integer setting here takes -1 (seeds, sizes, counts, epochs: all from 0 or 1 up)."""
    _refused(command, flag, names, ['-1'] * count, crate_digits_run, shared_mnist, tmp_path, capsys)


def _refused(command, flag, names, values, crate_digits_run, shared_mnist, tmp_path, capsys):
    images = tmp_path / 'images'
    for label in ('a', 'b'):
        (images / label).mkdir(parents=True)
        for i in range(2):
            Image.new('RGB', (8, 8), (60 * i, 0, 0)).save(images / label / f'{i}.png')
    base = [a.format(run=crate_digits_run, mnist=shared_mnist, images=images, tmp=tmp_path) for a in BASES[command]]
    if flag in base:                            # the base's own value of this flag: replaced
        at = base.index(flag)
        del base[at:at + 2]
    argv = command.split() + base + [flag] + values
    try:
        status = main(argv)
    except SystemExit as e:                     # argparse's own errors
        status = e.code
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, (argv, status, err)
    assert any(n in err or n.lstrip('-').replace('-', '_') in err for n in names), (flag, err)
