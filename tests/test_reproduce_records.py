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
