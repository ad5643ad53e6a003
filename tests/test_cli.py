"""The command line: help texts, a train → eval → config round trip, and clear errors on bad input."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import yaml

from structformer.cli import build_parser, main
from structformer.commands.models import human_count

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
    assert rows == [{'name': 'crate_tiny_patch16_224', 'params': 6090856, 'effective_params': 6090856,
                     'input_size': [3, 224, 224], 'task': 'image classification'}]


def test_models_says_how_many_weights_a_masked_model_keeps(capsys):
    """SW-MLP stores dense weights of which its static masks keep a share p: the table's count is timm's (every
    weight stored), and a line says how many the masks keep, as the comparison counts them; 113.33M for swmlp_cifar
    alone read as a model 50 times the Mixers' size at the same Ω."""
    from structformer.models.inventory import effective_parameter_count
    assert main(['models', '--filter', 'swmlp_digits']) == 0
    out = capsys.readouterr().out
    kept = effective_parameter_count(timm.create_model('swmlp_digits'))        # the real masks, not their density
    stored = sum(p.numel() for p in timm.create_model('swmlp_digits').parameters())
    assert kept < stored and f"swmlp_digits: {human_count(kept)} of its {human_count(stored)} weights are kept" in out
    assert main(['models', '--filter', 'mixer_digits']) == 0
    assert 'kept' not in capsys.readouterr().out


def test_models_filter_takes_timms_wildcards(capsys):
    """`--filter 'crate*_224'` as timm.list_models takes it: the whole name against the pattern, not a substring
    (which matched nothing and printed an empty table, exit 0)."""
    assert main(['models', '--filter', 'crate_*_patch16_224', '--json']) == 0
    names = [row['name'] for row in json.loads(capsys.readouterr().out)]
    assert names == [f'crate_{size}_patch16_224' for size in ('tiny', 'small', 'base', 'large')]


def test_models_lists_language_models_apart_and_counts_at_the_asked_size(capsys):
    assert main(['models', '--filter', 'gpt2_byte', '--json']) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r['name'] for r in rows} == {'gpt2_byte_tiny', 'gpt2_byte_small'}
    assert all(r['task'] == 'language model' for r in rows)
    assert main(['models', '--filter', 'gpt2_byte_tiny', '--flops']) == 0
    assert 'T=128' in capsys.readouterr().out
    # --img-size: the parameters of the model built at that size (CRATE's position embedding grows)
    assert main(['models', '--filter', 'crate_digits', '--flops', '--img-size', '16', '--json']) == 0
    row, = json.loads(capsys.readouterr().out)
    built = timm.create_model('crate_digits', img_size=16)
    assert row['input_size'] == [1, 16, 16] and row['params'] == sum(p.numel() for p in built.parameters())


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


def test_resume_with_more_epochs_extends_the_run(tmp_path, capsys):
    """--resume --epochs N continues a finished run to N (the schedule is rebuilt for N epochs); a changed
    training flag is refused by name, and the run is left as it was."""
    out = tmp_path / 'run'
    common = ['--output', str(out), '--no-progress']
    assert main(['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '1', '--warmup-epochs', '0',
                 '--limit-train-batches', '2', *common]) == 0
    assert main(['train', '--resume', '--epochs', '2', *common]) == 0
    assert 'resumed from epoch 1 of 2' in capsys.readouterr().out
    records = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    assert [r['epoch'] for r in records] == [1, 2] and records[1]['step'] == 4
    assert (out / 'checkpoints' / 'epoch_0002').is_dir()
    assert yaml.safe_load((out / 'config.yaml').read_text())['epochs'] == 2

    before = (out / 'metrics.jsonl').read_text()
    assert main(['train', '--resume', '--epochs', '3', '--lr', '0.01', *common]) == 2
    err = capsys.readouterr().err
    assert err.startswith('structformer train: error: --lr cannot change on --resume (saved 0.001, given 0.01)')
    assert main(['train', '--resume', '--epochs', '1', *common]) == 2
    assert '--epochs 1: this run has already trained 2 epochs' in capsys.readouterr().err
    assert (out / 'metrics.jsonl').read_text() == before and not (out / 'checkpoints' / 'epoch_0003').exists()


def test_range_errors_name_the_flag_as_typed(tmp_path, capsys):
    assert main(['train', '--smoothing', '1.5', '--output', str(tmp_path / 'x'), '--no-progress']) == 2
    assert 'error: --smoothing=1.5 is out of range: accepted in [0, 1)' in capsys.readouterr().err


def test_scoring_options_are_the_runs_on_its_own_data_only(tmp_path, monkeypatch):
    """eval / analyze: a run's data options on its own data (also spelled relative), only the model's trained image
    size on other data whose size follows the model, nothing of the run's on data with a size of its own."""
    from structformer.train.scoring_data import checkpoint_data_options
    (tmp_path / 'imgs').mkdir()
    monkeypatch.chdir(tmp_path)
    own = {'check': 'decode', 'img_size': 8}
    state = {'config': {'data': f"imagefolder:{tmp_path / 'imgs'}", 'data_kwargs': own},
             'recipe': {'input_size': [3, 8, 8]}}
    assert checkpoint_data_options(state, None) == own
    assert checkpoint_data_options(state, 'imagefolder:imgs') == own
    assert checkpoint_data_options(state, 'wds:/data/shards', {'holdout': 'samples'}) == {'holdout': 'samples',
                                                                                           'img_size': 8}
    assert checkpoint_data_options(state, 'digits') == {}


def test_resume_help_names_every_flag_a_resume_may_change():
    """--resume's help said any flag but eight was refused; --workers, --device, --log-interval, --keep-best ...
    were taken too. The help is now written from the one list the resume check reads, by each key's own flag."""
    import argparse

    from structformer.cli import build_parser
    from structformer.commands.train import _RESUME_MAY_CHANGE
    from structformer.train.config import flag_name
    train = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices['train']
    text = next(a.help for a in train._actions if '--resume' in a.option_strings)
    listed = text.split('--epochs may extend it, ', 1)[1].split(' may change', 1)[0].split(', ')
    assert listed == list(_RESUME_MAY_CHANGE.values())
    assert all(flag_name(key) == flag for key, flag in _RESUME_MAY_CHANGE.items())


def test_every_config_key_names_its_train_flag():
    """Error messages name a configuration key by its flag (flag_name): each of those flags exists."""
    import dataclasses

    from structformer.train.config import TrainConfig, flag_name
    train = build_parser()._subparsers._group_actions[0].choices['train']
    flags = {s for action in train._actions for s in action.option_strings}
    for field in dataclasses.fields(TrainConfig):
        flag = flag_name(field.name)
        assert flag is None or flag.split('/')[-1] in flags, (field.name, flag)


def test_config_file_values_are_coerced_or_refused(tmp_path):
    from structformer.errors import UsageError
    from structformer.train.config import load_config_file
    path = tmp_path / 'c.yaml'
    path.write_text("epochs: '3'\nlr: 1e-3\nwarmup_epochs: 1\nclip_grad: null\n")      # YAML reads 1e-3 as a string
    assert load_config_file(path) == {'epochs': 3, 'lr': 0.001, 'warmup_epochs': 1.0, 'clip_grad': None}
    for text, needle in [('epochs: 2.5', 'epochs (--epochs) must be an integer'), ('lr: fast', 'lr (--lr) must be a number'),
                         ('model: 3', 'model (--model) must be a string'), ('epohcs: 3', "did you mean 'epochs'"),
                         ('label_smoothing: [0.1]', 'label_smoothing (--smoothing) must be a number')]:
        path.write_text(text + '\n')
        with pytest.raises(UsageError, match=re.escape(needle)):
            load_config_file(path)


@pytest.mark.parametrize('count, text', [(0, '0'), (812, '812'), (4_100, '4.1K'), (999_999, '1.00M'),
                                         (3_600_000, '3.60M'), (6_090_856, '6.09M'), (1_200_000_000, '1.20G')])
def test_parameter_counts_read_by_people(count, text):
    from structformer.commands.models import human_count
    assert human_count(count) == text


def test_models_table_shows_small_counts(capsys):
    assert main(['models', '--filter', 'crate_digits']) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert '0.00M' not in row and re.search(r'\s\d+(\.\d)?K\s', row), row


@pytest.mark.slow
def test_runs_with_a_model_transform_are_scored_by_eval_in_a_fresh_process(tmp_path):
    """An attention swap, sparsify and a mid-run factorisation are rebuilt from the checkpoint's record alone: a new
    interpreter's `structformer eval` scores each run exactly as its last epoch recorded (same weights, same data)."""
    base = ['train', '--model', 'vit_digits', '--data', 'digits', '--limit-train-batches', '2', '--no-progress',
            '--log-interval', '0']
    runs = {'swap': ['--epochs', '1', '--transform', 'swap_attention', 'attn=linformer', 'num_landmarks=8'],
            'sparse': ['--epochs', '1', '--transform', 'sparsify', 'keep_ratio=0.5'],
            'factorised': ['--epochs', '2', '--rank', '0.5', '--factorize-at', '1']}
    for name, extra in runs.items():
        assert main(base + extra + ['--output', str(tmp_path / name)]) == 0
    code = ("import json, sys\nfrom structformer.cli import main\n"
            "for run in sys.argv[1:]:\n    assert main(['eval', '--checkpoint', run, '--json']) == 0\n")
    done = subprocess.run([sys.executable, '-c', code, *(str(tmp_path / n) for n in runs)], capture_output=True,
                          text=True, cwd=tmp_path, env={**__import__('os').environ, 'PYTHONPATH': str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    scores = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{')]
    assert len(scores) == 3
    for name, score in zip(runs, scores):
        last = [json.loads(line) for line in (tmp_path / name / 'metrics.jsonl').read_text().splitlines()][-1]
        assert score['epoch'] == last['epoch'] and score['images'] == 360
        assert score['top1'] == pytest.approx(last['val_top1'], abs=1e-9)
        assert score['loss'] == pytest.approx(last['val_loss'], rel=1e-5), name


def _readme_count(text: str) -> tuple:
    """'52.8K' -> (52800, 50): the value and half its last digit's unit (the rounding it allows); '113M', '0.18M'."""
    number, unit = text[:-1], text[-1]
    scale = {'K': 1e3, 'M': 1e6, 'G': 1e9}[unit]
    digits = len(number.split('.')[1]) if '.' in number else 0
    return float(number) * scale, 0.5 * scale * 10 ** -digits


def test_the_readme_model_table_counts_what_the_models_have():
    """README's Models table: each row's counts (one per name, or the smallest – largest) are the registered models'
    parameter counts at the shown rounding. The S-Mixers on CIFAR said 72.5K (they have 71,498) and the smallest
    small-image Mixer 21.4K (smixer_mnist: 20,990)."""
    import itertools

    from structformer.models.inventory import model_inventory
    from structformer.models.soft_variants import BASELINES
    text = (Path(__file__).resolve().parents[1] / 'README.md').read_text()
    table = text.split('## Models', 1)[1].split('\n\n', 2)[1]
    rows = [line for line in table.splitlines() if line.startswith('| `')]
    assert len(rows) >= 10, rows
    for line in rows:
        names_cell, _, counts_cell = [c.strip() for c in line.strip('|').split('|')]
        names = []
        for name in re.findall(r'`([^`]+)`', names_cell):
            if '…' in name:                 # softpp_…: the same sizes as the row's first names
                continue
            name = name.replace('<attn>', '{' + ','.join(BASELINES) + '}')
            parts = re.split(r'\{([^}]*)\}', name)
            for choice in itertools.product(*[p.split(',') for p in parts[1::2]]):
                names.append(''.join(sum(zip(parts[::2], list(choice) + ['']), ())))
        counts = [row['params'] for row in model_inventory(names)]
        if '–' in counts_cell:
            shown = [_readme_count(t.strip()) for t in counts_cell.split('–')]
            counts = [min(counts), max(counts)]
        else:
            shown = [_readme_count(t.strip()) for t in counts_cell.split('/')]
        assert len(shown) == len(counts), line
        for name, count, (value, allowed) in zip(names if len(names) == len(counts) else ['min', 'max'], counts, shown):
            assert abs(count - value) <= allowed, (line, name, count, value)


def test_eval_scores_the_train_split_without_its_augmentation(trained_run, capsys):
    """--split train reads the training images with the evaluation transform (timm's validate.py): the run's
    augment=true (digits' random shift; image folders, MNIST and CIFAR-10 augment by default) made each call score
    other random images."""
    scores = []
    for kwargs in (['augment=true'], ['augment=true'], ['augment=false']):
        assert main(['eval', '--checkpoint', str(trained_run), '--split', 'train', '--json',
                     '--data-kwargs', *kwargs]) == 0
        metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        scores.append((metrics['images'], metrics['loss'], metrics['top1']))
    assert scores[0] == scores[1] == scores[2]


def test_eval_takes_timms_validation_spelling_of_the_held_out_split(trained_run, capsys):
    """timm's validate.py and readers spell the held-out split 'validation' as well as 'val': the same split, and
    the record says 'val' either way (it was refused as an invalid choice)."""
    scores = []
    for split in ('val', 'validation'):
        assert main(['eval', '--checkpoint', str(trained_run), '--split', split, '--json']) == 0
        scores.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert scores[1]['split'] == 'val' and scores[0] == scores[1]


def test_eval_json_prints_only_the_json_object(tmp_path, monkeypatch, capsys):
    """--json prints one JSON object on stdout: an image folder's note (its header check reused from the cache, on
    the second read) went to stdout before it, so `eval --json | jq` failed."""
    import numpy as np
    from PIL import Image

    from structformer.weights import save_weights_folder
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tmp_path / 'cache'))
    rng = np.random.default_rng(0)
    for c in ('a', 'b'):
        (tmp_path / 'imgs' / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / 'imgs' / c / f'{i}.png')
    kwargs = {'in_chans': 3, 'num_classes': 2}
    save_weights_folder(timm.create_model('vit_digits', **kwargs), tmp_path / 'w', kwargs)
    argv = ['eval', '--checkpoint', str(tmp_path / 'w'), '--data', f"imagefolder:{tmp_path / 'imgs'}",
            '--data-kwargs', 'img_size=8', 'crop_pct=0.9', 'interpolation=bicubic', '--json']
    assert main(argv) == 0 and main(argv) == 0         # the second reads the header check from the cache
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all(json.loads(line)['images'] == 2 for line in out)
    # and it names the geometry the images were read at (an image form's resize and centre crop)
    assert {k: json.loads(out[0])[k] for k in ('img_size', 'crop_pct', 'interpolation')} == \
        {'img_size': 8, 'crop_pct': 0.9, 'interpolation': 'bicubic'}


def _rgb_folder(root, per_class=3):
    """A tiny image folder of 8x8 RGB PNGs, two classes."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in ('a', 'b'):
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(root / c / f'{i}.png')
    return root


def test_eval_on_unreadable_images_names_its_own_option(tmp_path, monkeypatch, capsys):
    """eval on an image folder with a file that is no image said '... pass --data-kwargs bad_images=skip to train
    without them': eval trains nothing. The line names the option (eval takes --data-kwargs too) in words that fit
    every command, and the option does what it says there."""
    from structformer.weights import save_weights_folder
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tmp_path / 'cache'))
    images = _rgb_folder(tmp_path / 'imgs')
    (images / 'a' / 'broken.png').write_bytes(b'not an image')
    kwargs = {'in_chans': 3, 'num_classes': 2}
    save_weights_folder(timm.create_model('vit_digits', **kwargs), tmp_path / 'w', kwargs)
    argv = ['eval', '--checkpoint', str(tmp_path / 'w'), '--data', f'imagefolder:{images}', '--data-kwargs', 'img_size=8']
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if 'error:' in line]
    assert len(lines) == 1 and 'broken.png' in lines[0] and 'Traceback' not in err, err
    assert 'pass --data-kwargs bad_images=skip to leave them out' in lines[0] and 'train' not in lines[0], lines[0]
    assert main(argv + ['bad_images=skip']) == 0 and 'skipped 1 unreadable image' in capsys.readouterr().out


@pytest.mark.parametrize('name', ['vit_digits', 'crate_digits'])
def test_a_one_channel_model_on_rgb_images_is_one_line_naming_both_channel_counts(name, tmp_path, monkeypatch,
                                                                                  capsys):
    """A 1-channel model (digits-sized) and an image folder of RGB images: train refuses a model built with
    in_chans=1 for them, and so does eval; each said only what the model's forward raised (torch's conv message, or
    CRATE's 'build the model with matching in_chans=', no remedy for a trained checkpoint). Now both lines name
    --data, the images' 3 channels and the model's in_chans=1, and what to do in that command."""
    from structformer.weights import save_weights_folder
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tmp_path / 'cache'))
    images = _rgb_folder(tmp_path / 'imgs')
    kwargs = {'in_chans': 1, 'num_classes': 2}
    save_weights_folder(timm.create_model(name, **kwargs), tmp_path / 'w', kwargs)
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(tmp_path / 'w'), '--data', f'imagefolder:{images}',
                 '--data-kwargs', 'img_size=8']) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if 'error:' in line]
    assert len(lines) == 1 and 'Traceback' not in err, err
    for needle in (f'--data imagefolder:{images}', 'images have 3 channels', 'in_chans=1',
                   '--initial-checkpoint'):
        assert needle in lines[0], (needle, lines[0])
    assert main(['train', '--model', name, '--model-kwargs', 'in_chans=1', '--data', f'imagefolder:{images}',
                 '--data-kwargs', 'img_size=8', '--output', str(tmp_path / 'run'), '--no-progress']) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if 'error:' in line]
    assert len(lines) == 1 and 'Traceback' not in err, err
    for needle in (f'--data imagefolder:{images}', 'images have 3 channels', 'in_chans=1', 'in_chans=3'):
        assert needle in lines[0], (needle, lines[0])
    assert not (tmp_path / 'run').exists()


def test_eval_stopped_by_an_image_that_fails_to_decode_names_data_and_the_skip_option(tmp_path, monkeypatch, capsys):
    """A PNG cut after its header passes the header check and fails when eval decodes it: the line was 'image X
    cannot be read: image file is truncated' alone (imagenet:PATH's names --data and bad_images=skip). Now the image
    folder's names them too, and bad_images=skip leaves the image out of the score."""
    import numpy as np
    from PIL import Image

    from structformer.weights import save_weights_folder
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tmp_path / 'cache'))
    _rgb_folder(tmp_path / 'imgs' / 'train')
    _rgb_folder(tmp_path / 'imgs' / 'val', per_class=2)
    cut = tmp_path / 'imgs' / 'val' / 'a' / 'cut.png'
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(cut)
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    kwargs = {'in_chans': 3, 'num_classes': 2}
    save_weights_folder(timm.create_model('vit_digits', **kwargs), tmp_path / 'w', kwargs)
    argv = ['eval', '--checkpoint', str(tmp_path / 'w'), '--data', f"imagefolder:{tmp_path / 'imgs'}",
            '--data-kwargs', 'img_size=8']
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if 'error:' in line]
    assert len(lines) == 1 and 'Traceback' not in err, err
    for needle in (f"--data 'imagefolder:{tmp_path / 'imgs'}'", 'cut.png cannot be read', 'bad_images=skip'):
        assert needle in lines[0], (needle, lines[0])
    assert main(argv + ['bad_images=skip']) == 0
    assert '(val, 4 images, 1 unreadable left out)' in capsys.readouterr().out
