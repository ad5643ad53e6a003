"""What every `structformer reproduce` results.json says about how it was made: the command that repeats it."""
import shlex

import pytest

from structformer.cli import build_parser
from structformer.reproduce import command_line

ARGVS = {
    'soft': ['--data', 'd', '--attn', 'soft', 'softpp', '--width', 'quarter', '--epochs', '1',
             '--model-kwargs', 'depths=(1,1,2,1)', "attn_kwargs={'newton_iters': 3}"],
    'crate': ['--data', 'my data', '--depth', '2', '--lr', '1e-3', '--estimator', 'paper'],
    'sparsifiner': ['--data', 'd', '--keep', '0.25', '0.5', '--teacher-epochs', '1'],
    'mixer': ['--data', 'd', '--omega', '2^12', '--channels', '8', '16', '--sw-densities', '0.5', '--report-only'],
    'lowrank': ['--parts', 'lm', '--ranks', '0.2', '--groups', 'init', 'decay'],
}


@pytest.mark.parametrize('target', sorted(ARGVS))
def test_the_recorded_command_repeats_the_run(target):
    """The records named no command (only some kept `args`, a namespace no shell can run): `command_line` spells out
    every flag, and parsing it again gives the same arguments, defaults included."""
    parser = build_parser()
    args = parser.parse_args(['reproduce', target, *ARGVS[target]])
    command = command_line(args, target)
    words = shlex.split(command)
    assert words[:3] == ['structformer', 'reproduce', target]
    again = parser.parse_args(words[1:])
    assert vars(again) == vars(args)


@pytest.mark.parametrize('argv, flag', [
    (['mixer', '--channels', '8', '8', '32', '32', '--seeds', '1'], '--channels names 8, 32 more than once'),
    (['mixer', '--depths', '2', '2'], '--depths names 2 more than once'),
    (['mixer', '--sw-densities', '0.5', '0.5'], '--sw-densities names 0.5 more than once'),
    (['mixer', '--sw-densities', '0.25', '0.26'], '--sw-densities 0.25 and 0.26 give the same SW-MLP (width 343'),
    (['sparsifiner', '--keep', '0.25', '0.25'], '--keep names 0.25 more than once'),
    (['lowrank', '--ranks', '0.1', '0.1'], '--ranks names 0.1 more than once'),
    (['lowrank', '--ranks', '0.1', '0.1000001'], '--ranks names 0.1 more than once'),   # one folder, r0.1_he
    (['soft', '--attn', 'soft', 'soft'], '--attn names soft more than once')])
def test_a_value_named_twice_is_refused_before_any_work(argv, flag, tmp_path, capsys):
    """`--channels 8 8 32 32 --seeds 1` trained each C twice into one folder, and the verdicts read the two identical
    rows as two seeds that agree exactly: standard error 0, so any difference counted as beyond the noise."""
    from structformer.cli import main
    out = tmp_path / 'out'
    assert main(['reproduce', *argv, '--output', str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and err[0].startswith(f'structformer reproduce {argv[0]}: error: ')
    assert not out.exists()
