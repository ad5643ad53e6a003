"""A run folder is one run, wherever it is opened from (issue 35): resuming another run into it is refused,
an --overwrite stopped by Ctrl-C or SIGTERM before its first epoch puts the old run back byte for byte, data
paths are stored absolute, benchmarks check their output before measuring, a full disk and a corrupt
latest.json end in one line that says what is intact."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from structformer.cli import main

from forking import run_forked

pytestmark = pytest.mark.usefixtures('one_torch_thread')

ROOT = Path(__file__).resolve().parents[1]
TINY = ['--model', 'crate_digits', '--model-kwargs', 'depth=1', '--data', 'digits', '--warmup-epochs', '0',
        '--limit-train-batches', '2', '--no-progress']


def _tree(folder: Path):
    """Every path under `folder` with its kind, size, modification time and mode."""
    return {str(p.relative_to(folder)): (p.is_dir(), p.lstat().st_size, p.lstat().st_mtime_ns, p.lstat().st_mode)
            for p in [folder, *sorted(folder.rglob('*'))]}


def _bytes(folder: Path):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob('*')) if p.is_file()}


def _train(output, *extra, epochs=2):
    assert main(['train', *TINY, '--epochs', str(epochs), '--output', str(output), *extra]) == 0


def _one_error(capsys, argv, *needles):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if 'error:' in line]
    assert len(lines) == 1 and 'Traceback' not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope='module')
def two_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp('two_runs')
    _train(base / 'a')
    _train(base / 'b', '--seed', '3')
    return base / 'a', base / 'b'


# ---------------------------------------------------------------- 1. one folder, one run

def test_resume_from_another_run_into_a_folder_that_holds_a_run_is_refused(two_runs, capsys):
    a, b = two_runs
    before = _tree(a)
    _one_error(capsys, ['train', '--resume', str(b), '--output', str(a), '--epochs', '3', '--no-progress'],
               '--output', 'another run', '--resume')
    _one_error(capsys, ['train', '--resume', str(b / 'checkpoints' / 'epoch_0002'), '--output', str(a),
                        '--no-progress'], 'another run')
    _one_error(capsys, ['train', '--resume', '--overwrite', '--output', str(a), '--no-progress'],
               '--resume', '--overwrite')
    assert _tree(a) == before


def test_resume_from_another_run_goes_into_a_new_folder_or_its_own(two_runs, tmp_path):
    a, b = two_runs
    copy = tmp_path / 'b_copy'
    shutil.copytree(b, copy)
    assert main(['train', '--resume', str(copy), '--output', str(copy), '--epochs', '3', '--no-progress']) == 0
    assert main(['train', '--resume', str(a), '--output', str(tmp_path / 'new'), '--epochs', '3',
                 '--no-progress']) == 0
    lines = (tmp_path / 'new' / 'metrics.jsonl').read_text().splitlines()
    assert [json.loads(line)['epoch'] for line in lines] == [3]          # only what this folder trained


def test_resume_from_an_older_checkpoint_of_the_run_into_its_own_folder_is_refused(two_runs, tmp_path, capsys):
    """Continuing from epoch 1 inside a run that has trained epoch 2 mixed two timelines: metrics.jsonl held
    epoch 2 twice (the old line and the new one), and a stop before the old epochs were passed left them as the
    newest checkpoint. Refused by name; into a new folder it goes on from there."""
    a, _ = two_runs
    copy = tmp_path / 'a_copy'
    shutil.copytree(a, copy)
    before = _tree(copy)
    _one_error(capsys, ['train', '--resume', str(copy / 'checkpoints' / 'epoch_0001'), '--output', str(copy),
                        '--epochs', '3', '--no-progress'], '--resume', 'trained to epoch 2', '(epoch 1)', 'new --output')
    assert _tree(copy) == before
    assert main(['train', '--resume', str(copy / 'checkpoints' / 'epoch_0001'), '--output', str(tmp_path / 'new'),
                 '--epochs', '3', '--no-progress']) == 0
    lines = (tmp_path / 'new' / 'metrics.jsonl').read_text().splitlines()
    assert [json.loads(line)['epoch'] for line in lines] == [2, 3]


# ---------------------------------------------------------------- 2. an interrupted --overwrite

def _interrupted(output, kill_at, signal_name=None, seed=5):
    """`structformer train --overwrite` in a process of its own (forked: tests/forking.py; Ctrl-C and SIGTERM
    there as Python sets them up), stopped at test hook `kill_at` by `signal_name` sent to itself (None: ended on
    the spot, as kill -9)."""
    env = {'STRUCTFORMER_TEST_KILL_AT': kill_at}
    if signal_name:
        env['STRUCTFORMER_TEST_KILL_WITH'] = signal_name
    return run_forked(main, ['train', *TINY, '--epochs', '2', '--seed', str(seed), '--output', str(output),
                             '--overwrite'], env=env)


def _eval(run, capsys):
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(run), '--json']) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize('kill_at, signal_name, status', [
    ('epoch 1:step 1', 'SIGINT', 130), ('epoch 1:step 1', 'SIGTERM', 143),     # in the first epoch's training
    ('epoch_0001:weights', 'SIGTERM', 143)])                                   # in its checkpoint's commit
def test_overwrite_stopped_in_its_first_epoch_puts_the_old_run_back(two_runs, tmp_path, capsys, kill_at, signal_name,
                                                                    status):
    run = tmp_path / 'run'
    shutil.copytree(two_runs[0], run)
    before = _bytes(run)
    done = _interrupted(run, kill_at, signal_name)
    assert done.returncode == status, done.stderr[-2000:]
    assert 'Traceback' not in done.stderr
    assert 'the run it was replacing is back' in done.stderr
    assert _bytes(run) == before and not list(run.glob('.replaced-*'))
    scored = _eval(run, capsys)
    summary = json.loads((run / 'summary.json').read_text())
    assert scored['epoch'] == 2 and scored['top1'] == pytest.approx(summary['final_val_top1'])


def test_overwrite_killed_outright_is_read_as_the_old_run_until_the_next_start(two_runs, tmp_path, capsys):
    """kill -9 runs no handler: the old run waits in RUN/.replaced-PID. eval and --resume read it (not the new
    run's random init), and the next start puts it back."""
    run = tmp_path / 'run'
    shutil.copytree(two_runs[0], run)
    before = _bytes(run)
    assert _interrupted(run, 'epoch 1:step 1').returncode == 137
    assert list(run.glob('.replaced-*'))
    scored = _eval(run, capsys)
    old_summary = json.loads((next(run.glob('.replaced-*')) / 'summary.json').read_text())
    assert scored['epoch'] == 2 and scored['top1'] == pytest.approx(old_summary['final_val_top1'])
    assert main(['train', '--resume', '--output', str(run), '--no-progress']) == 0
    out = capsys.readouterr().out
    assert 'resumed from epoch 2 of 2' in out
    assert _bytes(run).keys() == before.keys()
    assert {k: v for k, v in _bytes(run).items() if k.startswith('checkpoints/')} == \
        {k: v for k, v in before.items() if k.startswith('checkpoints/')}


# ---------------------------------------------------------------- 3. a run opened from another folder

def _images(root: Path, classes=('a', 'b')):
    from PIL import Image
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(root / c / f'{i}.png')


def test_a_run_is_evaluated_resumed_and_rerun_from_another_folder(tmp_path, monkeypatch, capsys):
    work, elsewhere = tmp_path / 'work', tmp_path / 'elsewhere'
    _images(work / 'imgs')
    elsewhere.mkdir()
    monkeypatch.chdir(work)
    assert main(['train', '--model', 'crate_digits', '--model-kwargs', 'depth=1', '--data', 'imagefolder:imgs',
                 '--data-kwargs', 'img_size=8', '--workers', '0', '--epochs', '1', '--warmup-epochs', '0',
                 '--output', 'run', '--no-progress']) == 0
    config = yaml.safe_load((work / 'run' / 'config.yaml').read_text())
    assert config['data'] == f"imagefolder:{work / 'imgs'}" and config['data_as_given'] == 'imagefolder:imgs'
    monkeypatch.chdir(elsewhere)
    run = str(work / 'run')
    assert _eval(run, capsys)['epoch'] == 1
    assert main(['train', '--resume', '--output', run, '--epochs', '2', '--no-progress']) == 0
    assert main(['train', '-c', f'{run}/config.yaml', '--epochs', '1', '--output', 'again', '--no-progress']) == 0
    (work / 'imgs').rename(work / 'moved')                  # the data moves: the error names it and the flag
    _one_error(capsys, ['eval', '--checkpoint', run], str(work / 'imgs'), 'given as imagefolder:imgs', '--data')
    _one_error(capsys, ['train', '--resume', '--output', run, '--epochs', '3', '--no-progress'],
               str(work / 'imgs'), '--data')
    assert main(['eval', '--checkpoint', run, '--data', f"imagefolder:{work / 'moved'}"]) == 0
    assert main(['train', '--resume', '--output', run, '--epochs', '3', '--data', f"imagefolder:{work / 'moved'}",
                 '--no-progress']) == 0


def test_one_class_image_folder_is_refused(tmp_path, capsys):
    _images(tmp_path / 'imgs', classes=('only',))
    _one_error(capsys, ['train', '--data', f"imagefolder:{tmp_path / 'imgs'}", '--output', str(tmp_path / 'run'),
                        '--no-progress'], '--data', 'one class', 'at least two')
    assert not (tmp_path / 'run').exists()


# ---------------------------------------------------------------- 4. benchmarks check their output first

BENCH_MEASURES = [('models', 'structformer.bench.models', '_plan', '--output'),
                  ('attention', 'structformer.bench.attention', 'run_sweep', '--output'),
                  ('lowrank', 'structformer.bench.lowrank', '_measure', '--output'),
                  ('sparse-attention', 'structformer.bench.sparse_attention', 'measure', '--json')]


@pytest.mark.parametrize('target, module, measure, flag', BENCH_MEASURES, ids=[b[0] for b in BENCH_MEASURES])
def test_benchmark_with_an_unwritable_output_fails_before_measuring(target, module, measure, flag, tmp_path,
                                                                    monkeypatch, capsys):
    import importlib
    blocker = tmp_path / 'a_file'
    blocker.write_text('not a folder\n')

    def measured(*args, **kwargs):
        raise AssertionError('measured before checking the output')
    monkeypatch.setattr(importlib.import_module(module), measure, measured)
    _one_error(capsys, ['bench', target, flag, str(blocker / 'out.json')], flag, 'is a file')
    _one_error(capsys, ['bench', target, flag, str(tmp_path)], flag, 'is a folder')


# ---------------------------------------------------------------- 5. the last tracebacks

def test_a_full_disk_during_a_checkpoint_says_what_is_intact(two_runs, tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    import structformer.train.checkpoint as checkpoint
    real = checkpoint.save_file

    def save_file(tensors, path):
        if 'epoch_0003' in path:
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                  'message: "No space left on device" })')
        return real(tensors, path)
    run = tmp_path / 'run'
    shutil.copytree(two_runs[0], run)
    monkeypatch.setattr(checkpoint, 'save_file', save_file)
    line = _one_error(capsys, ['train', '--resume', '--output', str(run), '--epochs', '4', '--no-progress'],
                      'disk is full', 'last intact checkpoint is epoch 2', '--resume')
    assert str(run) in line
    assert not list((run / 'checkpoints').glob('*.tmp-*')) and not (run / 'checkpoints' / 'epoch_0003').exists()
    monkeypatch.setattr(checkpoint, 'save_file', real)
    assert main(['train', '--resume', '--output', str(run), '--epochs', '4', '--no-progress']) == 0
    # a new run whose first trained epoch cannot be written: nothing of it is kept
    monkeypatch.setattr(checkpoint, 'save_file', lambda t, p: save_file(t, p.replace('epoch_0001', 'epoch_0003')))
    _one_error(capsys, ['train', *TINY, '--epochs', '2', '--output', str(tmp_path / 'new')],
               'disk is full', 'nothing of this new run was kept')
    assert not (tmp_path / 'new').exists()


def test_a_corrupt_latest_json_falls_back_to_the_newest_complete_checkpoint(two_runs, tmp_path, capsys):
    run = tmp_path / 'run'
    shutil.copytree(two_runs[0], run)
    (run / 'checkpoints' / 'latest.json').write_text('{"checkpoint": ')
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(run)]) == 0
    out, err = capsys.readouterr()
    assert 'epoch 2' in out and 'latest.json is unreadable' in err and 'epoch_0002' in err
    (run / 'checkpoints' / 'latest.json').write_text('{"checkpoint": "epoch_0007"}')
    assert main(['eval', '--checkpoint', str(run)]) == 0
    assert 'epoch 2' in capsys.readouterr().out



def test_a_checkpoint_that_lost_or_damaged_a_file_is_one_line_on_resume(tmp_path, capsys):
    """A checkpoint folder cut short after it committed (a partial copy, a file removed by hand): a missing
    train_state.safetensors or ema.safetensors and a truncated ema.safetensors are one line naming the folder and
    the file (they were a KeyError and a SafetensorError traceback), and so is --resume from a weights-only
    save (average_last_N), naming the run's checkpoint before it; an intact copy still resumes."""
    run = tmp_path / 'run'
    _train(run, '--model-ema', '--keep-last', '2', '--avg-last', '2')
    for name, damage, needle in [('train_state.safetensors', 'remove', 'train_state.safetensors is missing'),
                                 ('ema.safetensors', 'remove', 'ema.safetensors is missing'),
                                 ('ema.safetensors', 'truncate', 'ema.safetensors is corrupt')]:
        copy = tmp_path / f'{damage}_{name}'
        shutil.copytree(run, copy)
        target = copy / 'checkpoints' / 'epoch_0002' / name
        target.unlink() if damage == 'remove' else target.write_bytes(target.read_bytes()[:100])
        earlier = copy / 'checkpoints' / 'epoch_0001'
        _one_error(capsys, ['train', *TINY, '--model-ema', '--epochs', '3', '--output', str(copy), '--resume'],
                   'epoch_0002', needle, f'the checkpoint before it, {earlier}', f'--resume {earlier} --output')
    # the hint's command runs: the earlier checkpoint continues into a new folder
    _train(tmp_path / 'continued', '--model-ema', '--resume', str(earlier), epochs=3)
    _one_error(capsys, ['train', *TINY, '--epochs', '3', '--output', str(tmp_path / 'fresh'), '--resume',
                        str(run / 'checkpoints' / 'average_last_2')], 'weights only', '--initial-checkpoint')
    _train(run, '--model-ema', '--keep-last', '2', '--resume', epochs=3)


def test_a_run_stopped_after_its_last_epoch_makes_its_average_on_resume(tmp_path, monkeypatch, capsys):
    """Stopped after the last epoch's checkpoint and metrics line, before --avg-last's average: --resume found no
    epoch to train, took the run as unfinished, never made checkpoints/average_last_2 and wrote a summary.json
    without its metrics; now the resume makes the average as the uninterrupted run does."""
    straight, stopped = tmp_path / 'straight', tmp_path / 'stopped'
    flags = ['--keep-last', '2', '--avg-last', '2']
    _train(straight, *flags)
    monkeypatch.setenv('STRUCTFORMER_TEST_KILL_AT', 'epoch 2:metrics')
    monkeypatch.setenv('STRUCTFORMER_TEST_KILL_WITH', 'SIGINT')
    assert main(['train', *TINY, '--epochs', '2', '--output', str(stopped), *flags]) == 130
    monkeypatch.delenv('STRUCTFORMER_TEST_KILL_AT')
    assert not (stopped / 'checkpoints' / 'average_last_2').exists()
    _train(stopped, *flags, '--resume')
    assert _bytes(stopped / 'checkpoints' / 'average_last_2')['model.safetensors'] == \
        _bytes(straight / 'checkpoints' / 'average_last_2')['model.safetensors']
    summary = json.loads((stopped / 'summary.json').read_text())
    assert summary['average_last_2_val_top1'] == json.loads((straight / 'summary.json').read_text())['average_last_2_val_top1']

# ---------------------------------------------------------------- 6. the tile kernel's first build

def test_tile_kernel_build_says_it_compiles_and_remembers_a_failure(tmp_path, monkeypatch, capsys):
    """The first build says so (once); a failed build is not retried on every run, only once the compiler (or
    the sources, which name the folder) change."""
    from structformer.functional import tile_kernel
    calls = tmp_path / 'calls'
    compiler = tmp_path / 'fake-c++'
    compiler.write_text(f"#!/bin/sh\necho run >> {calls}\necho 'x.cpp:1: error: no such compiler' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv('STRUCTFORMER_KERNEL_DIR', str(tmp_path / 'kernels'))
    with pytest.raises(RuntimeError, match='error: no such compiler'):
        tile_kernel._build(str(compiler))
    assert capsys.readouterr().err.count('compiling the Sparsifiner CPU tile kernel') == 1
    runs = len(calls.read_text().splitlines())
    with pytest.raises(RuntimeError, match='earlier build with this compiler failed.*no such compiler'):
        tile_kernel._build(str(compiler))
    assert len(calls.read_text().splitlines()) == runs and 'compiling' not in capsys.readouterr().err
    compiler.write_text(compiler.read_text() + '# upgraded\n')          # another compiler: tried again
    with pytest.raises(RuntimeError, match='error: no such compiler'):
        tile_kernel._build(str(compiler))
    assert len(calls.read_text().splitlines()) > runs


@pytest.mark.parametrize('kill_at', ['epoch_0001:renamed', 'epoch_0001:latest'])
def test_a_stop_right_after_the_first_epoch_commits_keeps_that_epoch(two_runs, tmp_path, capsys, kill_at):
    """Ctrl-C in the window between the first trained checkpoint's commit (its rename) and the run noting it: the
    epoch is on disk, so the new run is kept to --resume (not undone), and the run it replaced is gone."""
    run = tmp_path / 'run'
    shutil.copytree(two_runs[0], run)
    done = _interrupted(run, kill_at, 'SIGINT', seed=11)
    assert done.returncode == 130, done.stderr[-2000:]
    assert 'Traceback' not in done.stderr and 'is back' not in done.stderr
    assert not list(run.glob('.replaced-*'))
    assert _eval(run, capsys)['epoch'] == 1
    assert main(['train', '--resume', '--output', str(run), '--no-progress']) == 0
    assert 'resumed from epoch 1 of 2' in capsys.readouterr().out
    assert [json.loads(line)['epoch'] for line in (run / 'metrics.jsonl').read_text().splitlines()] == [1, 2]


def test_undoing_a_new_run_spares_a_sibling_run_under_the_folders_both_made(tmp_path):
    """Two runs started together into siblings under a folder that did not exist (`compare --jobs 2` starts its
    cells so; or two `train` commands into outputs/a/x and outputs/a/y) may both count that folder as made by their
    lock. One of them then fails before its first epoch: its undo removes its own run folder and the shared folders
    only while empty, never the other run's committed checkpoint (it took the whole tree before; found as a flaky
    `compare` SIGTERM test that lost every cell)."""
    from structformer.train.run_dir import RunLock, undo_new_run
    shared = tmp_path / 'grid' / 'cells'
    committed, failed = shared / 'vit' / 'seed_0', shared / 'swmlp' / 'seed_0'
    with RunLock(committed) as first, RunLock(failed) as second:
        assert first.created and second.created
        second.created_root = first.created_root         # the race: both saw `grid` missing
        assert second.created_root == (tmp_path / 'grid').absolute()
        (committed / 'checkpoints' / 'epoch_0001').mkdir(parents=True)
        (committed / 'checkpoints' / 'epoch_0001' / 'model.safetensors').write_bytes(b'weights')
        (failed / 'config.yaml').write_text('model: x\n')
        undo_new_run(failed, None, second)
    assert not (shared / 'swmlp').exists()               # its own folder and the empty one above it: gone
    assert (committed / 'checkpoints' / 'epoch_0001' / 'model.safetensors').read_bytes() == b'weights'
    # the first run failing as well leaves the tree as it found it: nothing above tmp_path
    undo_new_run(committed, None, first)
    assert not (tmp_path / 'grid').exists() and tmp_path.exists()


def test_a_dry_run_of_resume_names_the_checkpoint_and_where_training_goes_on(tmp_path, monkeypatch, capsys):
    """`train --dry-run --resume` printed the plan without a word of where it would resume from. Now one line names
    the checkpoint --resume takes (a recovery point inside the next epoch before the epoch checkpoint) and the epoch
    (and batch) training goes on at, and the run folder stays as it was."""
    run = tmp_path / 'run'
    monkeypatch.setenv('STRUCTFORMER_TEST_KILL_AT', 'epoch 1:recovery 1')
    monkeypatch.setenv('STRUCTFORMER_TEST_KILL_WITH', 'SIGINT')
    main(['train', *TINY, '--epochs', '1', '--output', str(run), '--recovery-interval', '1'])
    monkeypatch.delenv('STRUCTFORMER_TEST_KILL_AT')
    point = run / 'checkpoints' / 'recovery_0001_00000001'
    assert point.is_dir()
    before = _tree(run)
    capsys.readouterr()
    assert main(['train', '--dry-run', '--resume', '--output', str(run)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith('resume ')]
    assert len(lines) == 1 and str(point) in lines[0], lines
    assert 'inside epoch 1 of 1, after 1 of its 2 batches' in lines[0] and 'at epoch 1, batch 2' in lines[0], lines
    # --resume CHECKPOINT into another folder: that epoch checkpoint, the epoch after it; nothing written anywhere
    assert main(['train', '--dry-run', '--resume', str(run / 'checkpoints' / 'epoch_0000'),
                 '--output', str(tmp_path / 'other')]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith('resume ')]
    assert len(lines) == 1 and str(run / 'checkpoints' / 'epoch_0000') in lines[0], lines
    assert 'epoch 0 of 1' in lines[0] and 'training goes on at epoch 1' in lines[0], lines
    assert _tree(run) == before and not (tmp_path / 'other').exists()
