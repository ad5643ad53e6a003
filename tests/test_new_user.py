"""What a new user trips over (issue 9): defaults that make a valid command fail, and logs full of
progress-bar carriage returns when output is redirected."""
import subprocess
import sys

import pytest

from structformer.train import TrainConfig


@pytest.mark.parametrize('epochs, expected', [(1, 0.1), (2, 0.2), (20, 2.0), (30, 2.0)])
def test_default_warmup_fits_the_run(epochs, expected):
    config = TrainConfig(epochs=epochs).validate()
    assert config.warmup_epochs is None and config.resolved_warmup_epochs() == pytest.approx(expected)


def test_an_explicit_bad_warmup_is_still_refused():
    with pytest.raises(ValueError, match=r'--warmup-epochs=2 is out of range: accepted in \[0, epochs=2\)'):
        TrainConfig(epochs=2, warmup_epochs=2).validate()


def test_two_epoch_run_with_defaults_and_a_redirected_log(tmp_path):
    """`structformer train --model crate_digits --data digits --epochs 2` (shortened) succeeds, and with
    stdout and stderr redirected it logs one line per epoch and no carriage-return updates."""
    done = subprocess.run([sys.executable, '-m', 'structformer.cli', 'train', '--model', 'crate_digits', '--data',
                           'digits', '--epochs', '2', '--limit-train-batches', '2', '--output', str(tmp_path / 'run')],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '\r' not in done.stdout + done.stderr
    epoch_lines = [line for line in done.stdout.splitlines() if line.startswith('epoch ')]
    assert [line.split()[1] for line in epoch_lines] == ['1/2', '2/2']
