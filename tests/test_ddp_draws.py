"""Two processes (torchrun, gloo) on a BatchNorm network with the weight average, Mixup, dropout and a mid-run
factorisation: what each process draws and what they must share.

- each process draws its own dropout masks and Mixup (timm's train.py seeds seed + rank); they had one RNG;
- --dist-bn makes the average's BatchNorm statistics one as well as the model's (timm does both), so the
  recorded `ema_val_*` is what `structformer eval --ema` gives for the saved average (rank 0's);
- the model factorised mid-run starts as rank 0's on every process (it is broadcast: a factorisation that drew
  random numbers would differ per process; `--init he` at a switch is refused since, spectral is what runs);
- the epoch's train_* metrics are summed over the processes (as timm reduces its logged loss), not rank 0's;
- --avg-last: rank 0 averages the checkpoints it wrote and hands the average on (a process that did not see
  them, on another machine, skipped the shared evaluation: the others hung);
- one SGD step on two processes with accumulation equals the one-process step on the same 36 samples;
- a loss not finite on one process stops both with the line (no gloo error); the step log's loss is the mean.

Six runs on two processes: the non-finite loss one through the real torchrun (about 12 s of CPU, mostly three
interpreters' imports), the others with their processes forked from this one by torch's elastic agent
(tests/forking.py's `torchrun_forked`); slow."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from structformer.cli import main

from forking import torchrun_forked

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures('one_torch_thread')]


def _probe_run(out):
    """Each process's draws, weight average and epoch metrics after each epoch, in probe_rank{R}.json (a worker)."""
    import hashlib

    import numpy as np

    from structformer.train import TrainConfig, Trainer
    from structformer.train.evaluation import parameter_digest
    records = []
    if int(os.environ['RANK']):                  # as if on another machine: rank 0's files unseen
        import structformer.train.save_resume as save_resume
        save_resume.committed_checkpoints = lambda folder: []

    def probe(trainer, epoch, record):
        ema = next(p for p in trainer.parts if hasattr(p, 'average')).average.module
        records.append({'epoch': epoch, 'rank': trainer.rank,
                        'torch_rng': hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
                        'numpy_rng': hashlib.sha256(np.random.get_state()[1].tobytes()).hexdigest(),
                        'ema': parameter_digest(ema), 'train': {k: v for k, v in record.items()
                                                                 if k in ('train_loss', 'train_ce', 'train_top1')}})
        with open(f'{out}/probe_rank{trainer.rank}.json', 'w') as f:
            json.dump(records, f)

    config = TrainConfig(model='wrn_10_2_digits', data='digits', epochs=2, batch_size=16, warmup_epochs=0,
                         limit_train_batches=3, log_interval=0, model_ema=True, model_ema_decay=0.5, mixup=0.8,
                         model_kwargs={'drop_rate': 0.2}, factorize_at=1, factorize_rank=0.5,
                         factorize_init='spectral', avg_last=1, output=str(out))
    Trainer(config, progress=False, callbacks=[probe]).fit()
    return 0


def test_processes_draw_their_own_and_share_the_average(tmp_path, capsys):
    out = tmp_path / 'run'
    # the two processes fork from this one (tests/forking.py); one that hangs in a collective the other skipped
    # is killed with its agent at the timeout
    proc = torchrun_forked(_probe_run, out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f'probe_rank{r}.json').read_text()) for r in (0, 1)]
    for first, second in zip(*ranks):
        # the processes' training draws differ (they were one stream: the same masks and Mixup on both)
        assert first['torch_rng'] != second['torch_rng'] and first['numpy_rng'] != second['numpy_rng']
        # the weight average, BatchNorm statistics included, is one (and, after the factorisation at epoch 2,
        # restarted from the same model on both)
        assert first['ema'] == second['ema'], first['epoch']
        # the epoch's training metrics are over both processes' batches (they were each process's own)
        assert first['train'] == second['train'] and len(first['train']) == 3
    assert (out / 'final_params_rank0.sha256').read_text() == (out / 'final_params_rank1.sha256').read_text()
    records = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(out), '--ema', '--json']) == 0
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert records[-1]['ema_val_top1'] == pytest.approx(alone['top1'], abs=1e-9)
    assert records[-1]['ema_val_loss'] == pytest.approx(alone['loss'], rel=1e-5)
    # --avg-last 1 on rank 0's checkpoints, which rank 1 did not see: it took the average from rank 0
    summary = json.loads((out / 'summary.json').read_text())
    assert summary['average_last_1_val_top1'] == pytest.approx(records[-1]['val_top1'], abs=1e-9)


def _torchrun(*args, env=None):
    """`torchrun --standalone --nproc_per_node=2 -m structformer train ARGS`, its workers forked from this process."""
    return torchrun_forked(main, ['train', *args], env=env)


def test_a_recovery_point_on_two_processes_keeps_both_processes_sums(tmp_path):
    """Killed after a recovery point inside epoch 1 and resumed on two processes: the epoch's train_* metrics are
    the straight run's (the point holds the sums of both processes so far; rank 0 carries them on), and so are the
    weights, bit for bit, with dropout on (each process's draws are keyed by its batch, not by its RNG state,
    which the point keeps for rank 0 only). So is the weight average of a BatchNorm network: each process's average
    follows its own BatchNorm statistics until --dist-bn makes them one at the epoch's end; the point held rank 0's
    alone, so the resumed rank 1 averaged from rank 0's (ema_val_* and the saved average's statistics differed)."""
    common = ['--model', 'wrn_10_2_digits', '--data', 'digits', '--epochs', '1', '--warmup-epochs', '0', '-b', '16',
              '--limit-train-batches', '4', '--recovery-interval', '2', '--no-progress', '--log-interval', '0',
              '--model-kwargs', 'drop_rate=0.2', '--model-ema', '--model-ema-decay', '0.9']
    straight = _torchrun(*common, '--output', str(tmp_path / 'straight'))
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _torchrun(*common, '--output', str(tmp_path / 'run'),
                       env={'STRUCTFORMER_TEST_KILL_AT': 'epoch 1:recovery 2'})
    assert killed.returncode != 0 and list((tmp_path / 'run' / 'checkpoints').glob('recovery_*'))
    resumed = _torchrun('--resume', '--output', str(tmp_path / 'run'), '--no-progress')
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = (json.loads((tmp_path / r / 'metrics.jsonl').read_text().splitlines()[-1]) for r in ('straight', 'run'))
    for key in ('train_loss', 'train_top1', 'val_loss', 'val_top1', 'ema_val_loss', 'ema_val_top1'):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    from safetensors.torch import load_file
    averages = [load_file(str(tmp_path / r / 'checkpoints' / 'epoch_0001' / 'ema.safetensors'))
                for r in ('straight', 'run')]
    assert all(torch.equal(averages[0][k], averages[1][k]) for k in averages[0])
    digests = {r: [(tmp_path / r / f'final_params_rank{k}.sha256').read_text() for k in (0, 1)]
               for r in ('straight', 'run')}
    assert digests['run'] == digests['straight'] and digests['run'][0] == digests['run'][1]


def test_one_step_on_two_processes_with_accumulation_is_the_one_process_step(tmp_path, capsys):
    """36 training samples, one optimiser step (SGD: the update is linear in the gradient): two processes of 9 x 2
    accumulated, one process of 36, one of 18 x 2 all take the mean gradient over the same 36 samples, so they end
    with the same weights (float32 rounding) and record the same training loss; held-out counts are identical."""
    from safetensors.torch import load_file
    common = ['--model', 'crate_synthetic', '--data', 'synthetic-subspaces', '--data-kwargs', 'num_samples=48',
              '--val-fraction', '0.25', '--epochs', '1', '--warmup-epochs', '0', '--opt', 'sgd', '--lr', '0.5',
              '--weight-decay', '0', '--sched', 'none', '--no-progress', '--log-interval', '0']
    ddp = _torchrun(*common, '-b', '9', '--grad-accum-steps', '2', '--output', str(tmp_path / 'ddp'))
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert main(['train', *common, '-b', '36', '--output', str(tmp_path / 'one')]) == 0
    assert main(['train', *common, '-b', '18', '--grad-accum-steps', '2', '--output', str(tmp_path / 'accum')]) == 0
    runs = {}
    for name in ('ddp', 'one', 'accum'):
        record = json.loads((tmp_path / name / 'metrics.jsonl').read_text().splitlines()[-1])
        weights = load_file(str(tmp_path / name / 'checkpoints' / 'epoch_0001' / 'model.safetensors'))
        runs[name] = record, weights
        assert record['step'] == 1
    init = load_file(str(tmp_path / 'one' / 'checkpoints' / 'epoch_0000' / 'model.safetensors'))
    one_record, one_weights = runs['one']
    assert any((one_weights[k] - init[k]).abs().max() > 1e-3 for k in init)          # the step moved the weights
    for name in ('ddp', 'accum'):
        record, weights = runs[name]
        for key, value in one_weights.items():
            assert torch.allclose(weights[key], value, rtol=1e-5, atol=1e-6), (name, key)
        assert record['train_loss'] == pytest.approx(one_record['train_loss'], rel=1e-5), name
        assert record['train_top1'] == pytest.approx(one_record['train_top1'], abs=1e-9), name
        assert record['val_top1'] == pytest.approx(one_record['val_top1'], abs=1e-9), name


NAN_ON_RANK_1 = r'''
import os, sys
import structformer.train.step as step
from structformer.cli import main

calls, Context = [], step.LossContext

def context(model, images, targets, logits, *rest):
    calls.append(1)
    if os.environ['RANK'] == '1' and len(calls) == int(os.environ['NAN_AT']):      # this process's batch NAN_AT
        logits = logits * float('nan')
    return Context(model, images, targets, logits, *rest)

step.LossContext = context
sys.exit(main(['train', *sys.argv[1:]]))
'''


def test_a_loss_not_finite_on_one_process_stops_every_process_with_the_line(tmp_path, capsys):
    """Rank 1's loss becomes NaN at its second batch (the second optimiser step; 9 samples a batch): both processes
    stop with TrainingDiverged's line (exit 1), the other saying that another process diverged, and neither with a
    gloo error from a collective the first had left. Before that, the step log's loss at step 1 (--log-interval 1,
    printed by rank 0) is the mean over both processes' 18 images: the one-process run at -b 18 prints the same,
    since the two first batches of 9 are its first batch of 18 (one model, one sampler order); rank 0's own 9 gave
    another number."""
    common = ['--model', 'crate_synthetic', '--data', 'synthetic-subspaces', '--data-kwargs', 'num_samples=48',
              '--val-fraction', '0.25', '--epochs', '1', '--warmup-epochs', '0', '--opt', 'sgd', '--lr', '0.5',
              '--weight-decay', '0', '--sched', 'none', '--no-progress', '--log-interval', '1']
    probe = tmp_path / 'probe.py'
    probe.write_text(NAN_ON_RANK_1)
    # torchrun ends the other process once one has failed: a monitor interval of 2 s lets each say its own line
    ddp = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                          '--monitor-interval=2', str(probe), *common, '-b', '9', '--output', str(tmp_path / 'ddp')], capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(ROOT),
                                                          NAN_AT='2'))
    stopped = [line for line in ddp.stderr.splitlines() if 'structformer train: stopped: ' in line]
    assert len(stopped) == 2 and ddp.returncode != 0, ddp.stderr[-3000:]
    assert sum('loss became nan at epoch 1, batch 2/2 (optimiser step 2) ' in line for line in stopped) == 1, stopped
    assert sum('loss became non-finite on another of the 2 processes by epoch 1, batch 2/2 (optimiser step 2) ' in line
               for line in stopped) == 1, stopped
    ours = ddp.stderr.split('torch/distributed/elastic')[0]          # before torchrun's report of the exits
    assert 'gloo' not in ddp.stderr.lower() and 'Traceback' not in ours, ddp.stderr[-3000:]
    assert not (tmp_path / 'ddp').exists()            # a new run stopped before its first epoch leaves nothing
    capsys.readouterr()
    assert main(['train', *common, '-b', '18', '--limit-train-batches', '1', '--output', str(tmp_path / 'one')]) == 0
    one = capsys.readouterr()          # run in this process: a fresh interpreter spent ~7 s importing torch and timm

    def step_1_loss(out):
        line = next(line for line in out.splitlines() if ' step 1 ' in line and ' loss ' in line)
        return float(line.split(' loss ')[1].split()[0])
    assert step_1_loss(ddp.stdout) == pytest.approx(step_1_loss(one.out), abs=2e-4), (ddp.stdout, one.out)
