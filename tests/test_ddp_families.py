"""Every family on two processes (torchrun, gloo): one small model each, Sparsifiner with its teacher through both
stages, low-rank factorised mid-run; evaluation counted over both processes; a resume on the same and on another
process count (CRATE's run: stopped after its first epoch, refused on one process, resumed on two).

Each torchrun starts three Python processes (about 12 s of CPU, mostly imports): the families' runs and CRATE's resume
start their two processes as forks of this one through torch's elastic agent (tests/forking.py's `torchrun_forked`);
CRATE's first run is the real `torchrun -m structformer train`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from structformer.cli import main

from forking import torchrun_forked

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures('one_torch_thread')]
COMMON = ['train', '--data', 'digits', '--warmup-epochs', '0', '--limit-train-batches', '3', '--no-progress',
          '--log-interval', '0']


def _torchrun(*args, nproc=2):
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(ROOT))
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}',
           '-m', 'structformer', *COMMON, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture
def teacher(vit_digits_teacher):
    return vit_digits_teacher              # conftest: trained once per session, read-only


FAMILIES = {   # CRATE: test_crate_stops_resumes_and_is_refused_on_one_process
    'soft': ['--model', 'soft_digits', '--epochs', '1'],
    'mixer': ['--model', 'rp_mixer_digits', '--epochs', '1'],
    'lowrank': ['--model', 'vit_digits', '--epochs', '2', '--rank', '0.5', '--factorize-at', '1'],
    'sparsifiner': ['--model', 'sparsifiner_digits', '--epochs', '2', '--predictor-epochs', '1', '--teacher', '{teacher}'],
}


def _check_run(out: Path, capsys):
    digests = [(out / f'final_params_rank{r}.sha256').read_text() for r in (0, 1)]
    assert digests[0] == digests[1]                  # the processes end with the same weights
    records = [json.loads(line) for line in (out / 'metrics.jsonl').read_text().splitlines()]
    state = json.loads(next((out / 'checkpoints').glob('epoch_0001')).joinpath('state.json').read_text())
    assert state['world_size'] == 2 and state['effective_batch_size'] == 128
    # evaluation ran on both processes over disjoint halves: the summed counts are those of one process on all
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(out), '--json']) == 0
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert records[-1]['val_top1'] == pytest.approx(alone['top1'], abs=1e-9)
    assert records[-1]['val_loss'] == pytest.approx(alone['loss'], rel=1e-5)
    return records


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_family_trains_on_two_processes(tmp_path, family, teacher, capsys):
    out = tmp_path / family
    args = [a.format(teacher=teacher) for a in FAMILIES[family]]
    proc = torchrun_forked(main, [*COMMON, *args, '--output', str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _check_run(out, capsys)
    if family == 'sparsifiner':
        assert [r['phase'] for r in records] == ['predictor', 'joint']
    if family == 'lowrank':
        assert 'factorized_val_top1' in records[1]


def test_crate_stops_resumes_and_is_refused_on_one_process(tmp_path, capsys):
    """CRATE with dropout (each process draws its own masks; the all-reduced gradients keep the weights equal):
    epoch 1 on two processes, a refused resume on one, epoch 2 resumed on two; the weights trained."""
    out = tmp_path / 'run'
    first = _torchrun('--model', 'crate_digits', '--epochs', '2', '--stop-after', '1', '--model-kwargs',
                      'drop_rate=0.1', '--output', str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    capsys.readouterr()
    before = sorted(p.name for p in (out / 'checkpoints').iterdir())
    assert main(['train', '--resume', '--output', str(out), '--no-progress']) == 2
    err = capsys.readouterr().err
    assert 'trained on 2 process(es), this is 1' in err and '--allow-world-size-change' in err
    assert sorted(p.name for p in (out / 'checkpoints').iterdir()) == before
    # the first run was the real torchrun; the resume forks its processes from this one (the same agent)
    resumed = torchrun_forked(main, ['train', '--resume', '--output', str(out), '--no-progress'])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert 'resumed from epoch 1 of 2' in resumed.stdout
    _check_run(out, capsys)
    init, last = (load_file(str(out / 'checkpoints' / f'epoch_{e:04d}' / 'model.safetensors')) for e in (0, 2))
    assert not torch.equal(init['head.weight'], last['head.weight'])
