"""The command line: help texts, a train → eval → config round trip, and clear errors on bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from structformer.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize('argv', [[], ['train'], ['eval'], ['analyze'], ['bench'], ['bench', 'models'], ['bench', 'attention'], ['reproduce'], ['reproduce', 'soft'], ['models']])
def test_help_has_examples(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv + ['--help'])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert 'usage: structformer' in text
    if argv and argv != ['bench']:
        assert 'structformer ' + argv[0] in text.split('usage:', 1)[1].split('\n', 1)[1]   # an example line


def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, '-m', 'structformer', '--help'], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0 and 'train' in proc.stdout


@pytest.fixture(scope='module')
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('cli') / 'run'
    rc = main(['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '2', '--warmup-epochs', '0',
               '--lr', '3e-3', '--limit-train-batches', '3', '--output', str(out), '--no-progress',
               '--model-kwargs', 'eta=0.2', 'lambd=0.05'])
    assert rc == 0
    return out


def test_train_writes_config_metrics_checkpoints(trained_run):
    config = yaml.safe_load((trained_run / 'config.yaml').read_text())
    assert config['model'] == 'crate_digits' and config['model_kwargs'] == {'eta': 0.2, 'lambd': 0.05}
    assert len((trained_run / 'metrics.jsonl').read_text().splitlines()) == 2
    state = json.loads((trained_run / 'checkpoints' / 'epoch_0002' / 'state.json').read_text())
    assert state['epoch'] == 2 and state['model_kwargs']['eta'] == 0.2


def test_config_file_round_trip(trained_run, tmp_path):
    """-c config.yaml with the same seed reproduces the run's metrics exactly; flags override the file."""
    out = tmp_path / 'again'
    assert main(['train', '-c', str(trained_run / 'config.yaml'), '--output', str(out), '--no-progress']) == 0
    assert (out / 'metrics.jsonl').read_text() .count('\n') == 2
    first = [json.loads(l)['train_loss'] for l in (trained_run / 'metrics.jsonl').read_text().splitlines()]
    again = [json.loads(l)['train_loss'] for l in (out / 'metrics.jsonl').read_text().splitlines()]
    assert first == again


def test_eval_prints_accuracy(trained_run, capsys):
    assert main(['eval', '--checkpoint', str(trained_run), '--json']) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    last_epoch = json.loads((trained_run / 'metrics.jsonl').read_text().splitlines()[-1])
    assert metrics['images'] == 360 and metrics['top5'] >= metrics['top1']
    # the checkpoint on the same held-out images: the engine's own end-of-epoch evaluation, a whole count
    assert metrics['top1'] == pytest.approx(last_epoch['val_top1'], abs=1e-9)
    assert metrics['top1'] * 360 / 100 == pytest.approx(round(metrics['top1'] * 360 / 100), abs=1e-6)


def test_models_lists_parameter_counts(capsys):
    assert main(['models', '--filter', 'crate_tiny', '--json']) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [{'name': 'crate_tiny_patch16_224', 'params': 6090856, 'input_size': [3, 224, 224]}]


@pytest.mark.parametrize('argv,needle', [
    (['train', '--model', 'no_such_model', '--data', 'digits'], "--model 'no_such_model'"),
    (['train', '--data', 'imagenet'], '--data'),
    (['train', '--data', 'mnist:/definitely/not/here'], '/definitely/not/here'),
    (['train', '--epochs', '0'], '--epochs'),
    (['train', '--lr', '-1'], '--lr'),
    (['train', '-c', '/no/such/config.yaml'], '-c/--config'),
    (['eval', '--checkpoint', '/no/such/checkpoint'], '--checkpoint'),
    (['analyze', '--checkpoint', '/no/such/checkpoint'], '/no/such/checkpoint'),
])
def test_bad_input_gives_clear_error_not_a_traceback(argv, needle, capsys, tmp_path):
    if argv[0] == 'train':
        argv = argv + ['--output', str(tmp_path / 'x'), '--no-progress']
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and 'Traceback' not in err


def test_corrupt_checkpoint_is_reported(trained_run, tmp_path, capsys):
    import shutil
    broken = tmp_path / 'broken'
    shutil.copytree(trained_run / 'checkpoints' / 'epoch_0002', broken)
    (broken / 'model.safetensors').write_bytes(b'\x00garbage' * 10)
    assert main(['eval', '--checkpoint', str(broken)]) == 2
    assert 'corrupt' in capsys.readouterr().err
    (broken / 'state.json').unlink()
    assert main(['eval', '--checkpoint', str(broken)]) == 2
    err = capsys.readouterr().err
    assert 'missing' in err or 'not a structformer' in err


def test_resume_of_finished_run_changes_nothing(trained_run, capsys):
    before = (trained_run / 'checkpoints' / 'epoch_0002' / 'model.safetensors').read_bytes()
    assert main(['train', '--output', str(trained_run), '--resume', '--no-progress']) == 0
    assert (trained_run / 'checkpoints' / 'epoch_0002' / 'model.safetensors').read_bytes() == before
