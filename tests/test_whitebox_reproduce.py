"""`structformer reproduce crate` (issue 10): a smoke run end to end, finished runs reused, the verdict rule."""
import argparse
import json
from pathlib import Path

import pytest

from structformer.reproduce import crate

MNIST = Path(__file__).resolve().parents[1] / '..' / 'shared' / 'data' / 'mnist'


def _args(*argv):
    parser = argparse.ArgumentParser()
    crate.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.skipif(not MNIST.is_dir(), reason='needs the MNIST test set in ../shared/data/mnist')
def test_smoke_run_and_reuse(tmp_path, capsys):
    out = tmp_path / 'crate'
    argv = ['--data', str(MNIST), '--depth', '2', '--epochs', '2', '--limit-train-batches', '2',
            '--num-samples', '12', '--threads', '1', '--output', str(out)]
    assert crate.run(_args(*argv)) == 0
    results = json.loads((out / 'results.json').read_text())
    assert results['command'].startswith('structformer reproduce crate --data ') and '--depth 2 ' in results['command']
    assert results['epochs'] == [0, 1, 2]                    # every epoch kept (save_every 1), init first
    assert results['recipe']['opt'] == 'lion' and results['recipe']['weight_decay'] == 0.5
    assert results['recipe']['label_smoothing'] == 0.1 and results['recipe']['decay_everything']
    last = results['curves']['per_epoch'][-1]
    assert len(last['layers']) == 2 and last['num_samples'] == 12 and last['estimator'] == 'official'
    assert (out / 'curves.png').read_bytes()[:4] == b'\x89PNG'
    report = (out / 'report.md').read_text()
    assert '**Verdict: ' in report and 'MSSA ΔR_c' in report
    capsys.readouterr()
    assert crate.run(_args(*argv)) == 0                      # the finished run is reused, not retrained
    assert 'reusing the finished run' in capsys.readouterr().out
    other = tmp_path / 'other_mnist'                         # another --data folder: never the old run's numbers
    other.symlink_to(MNIST.resolve(), target_is_directory=True)
    argv[argv.index('--data') + 1] = str(other)
    assert crate.run(_args(*argv)) == 0
    assert 'reusing the finished run' not in capsys.readouterr().out
    assert f'data: mnist:{other}' in (out / 'run' / 'config.yaml').read_text()


def _layers(rc, sp, rc_std=1.0, sp_std=0.01):
    return [{'R_c': {'mean': r, 'std': rc_std}, 'sparsity': {'mean': s, 'std': sp_std}} for r, s in zip(rc, sp)]


def test_verdict_rule():
    init = _layers([200, 200, 200], [0.5, 0.4, 0.4])
    assert crate._verdict(_layers([195, 180, 170], [0.5, 0.3, 0.2]), init, 100)['text'].startswith('reproduces')
    v = crate._verdict(_layers([195, 180, 170], [0.5, 0.4, 0.45]), init, 100)
    assert v['R_c_falls'] and not v['sparsity_falls'] and v['text'].startswith('partly')
    assert crate._verdict(_layers([195, 199, 201], [0.5, 0.5, 0.6]), init, 100)['text'].startswith('does not')


def test_verdict_does_not_read_noise_as_a_fall():
    """A fall smaller than two standard errors of the difference of the means is no fall (seen: 1e-5 lr for 4 steps
    moved the last layer's R_c 196.84 -> 196.84 below init's, and the verdict said 'partly reproduces')."""
    init = _layers([199.2, 196.84], [0.49, 0.39], rc_std=2.0)
    barely = _layers([199.2, 196.836], [0.49, 0.389], rc_std=2.0)
    v = crate._verdict(barely, init, 64)
    assert not v['R_c_falls'] and not v['sparsity_falls'] and v['text'].startswith('does not reproduce')
    # 2 SE of the difference here: 2·√((2² + 2²)/63) = 0.713; a fall of 0.8 below init and layer 1 counts, 0.6 not
    assert crate._verdict(_layers([199.2, 196.04], [0.49, 0.39], rc_std=2.0), init, 64)['R_c_falls']
    assert not crate._verdict(_layers([199.2, 196.24], [0.49, 0.39], rc_std=2.0), init, 64)['R_c_falls']
    # one measured image has no standard error: a fall of any size cannot be told from noise, either way
    big = _layers([195, 100], [0.5, 0.1], rc_std=0.0, sp_std=0.0)
    assert crate._verdict(big, init, 1)['text'].startswith('cannot tell at this scale: one measured image')
    assert crate._verdict(big, init, 2)['text'].startswith('reproduces')


def test_a_network_that_did_not_learn_cannot_tell():
    """A run too short to learn (3 batches: 11.00 % held-out top-1, the share of MNIST's most frequent class) was
    read as 'does not reproduce': a refutation of the paper by a network that had not trained."""
    labels = [1] * 23 + [0] * 19 + [2] * 18 + [3] * 20 + [4] * 20       # 100 images, the largest class 23 %
    idle = crate.learned(24.0, labels)
    assert idle['majority_class'] == 23.0 and not idle['learned']
    assert idle['two_standard_errors'] == pytest.approx(200 * (0.23 * 0.77 / 100) ** 0.5)
    assert crate.learned(40.0, labels)['learned']
    init = _layers([200, 200, 200], [0.5, 0.4, 0.4])
    flat = _layers([200, 200, 200], [0.5, 0.4, 0.4])
    v = crate._verdict(flat, init, 100, idle)
    assert v['text'].startswith('cannot tell at this scale: the network did not learn') and not v['testable']
    assert '24.00%' in v['text'] and '23.00%' in v['text']
    v = crate._verdict(flat, init, 100, crate.learned(40.0, labels))
    assert v['text'].startswith('does not reproduce') and v['testable']
