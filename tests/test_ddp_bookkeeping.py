"""What a run on several processes leaves in its folder for the next part of the run on another count."""
from structformer.cli import main


def test_a_resume_on_fewer_processes_removes_the_earlier_digests(tmp_path, monkeypatch, capsys):
    """final_params_rankR.sha256 describe the weights each process ended with; a run stopped on two processes and
    resumed on one (--allow-world-size-change) ended with other weights, so the two files must not stay."""
    out = tmp_path / 'run'
    common = ['--model', 'crate_digits', '--data', 'digits', '--epochs', '2', '--warmup-epochs', '0',
              '--limit-train-batches', '1', '--no-progress', '--output', str(out)]
    monkeypatch.setenv('STRUCTFORMER_WRITE_DIGEST', '1')
    assert main(['train', *common, '--stop-after', '1']) == 0
    (out / 'final_params_rank1.sha256').write_text('0' * 64 + '\n')      # as a two-process first part leaves it
    first = (out / 'final_params_rank0.sha256').read_text()
    assert main(['train', '--resume', '--output', str(out), '--no-progress']) == 0
    assert not (out / 'final_params_rank1.sha256').exists()
    assert (out / 'final_params_rank0.sha256').read_text() != first          # the final weights' digest
    monkeypatch.delenv('STRUCTFORMER_WRITE_DIGEST')      # one process writes none: none of the old ones stays
    assert main(['train', '--resume', '--output', str(out), '--no-progress']) == 0
    assert not list(out.glob('final_params_rank*'))


def test_default_workers_share_this_machines_cores_among_its_own_processes(monkeypatch):
    """4 machines x 8 processes, 64 cores each: 8 workers a process (64 / 8 local), not 64 / 32 = 2."""
    from types import SimpleNamespace

    from structformer.train.loaders import LoaderSetup
    setup = LoaderSetup()
    setup.config = SimpleNamespace(num_workers=None)
    setup.info = SimpleNamespace(name='imagefolder')
    setup.train_ds, setup.world_size = object(), 32
    monkeypatch.setattr('os.cpu_count', lambda: 64)
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '8')
    assert setup._workers() == 8
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '32')              # all 32 on one machine
    assert setup._workers() == 2


def test_dry_run_counts_a_shard_epoch_as_the_stream_batches_it(tmp_path, monkeypatch, capsys):
    """Shards: each process takes N // P samples and each of its loader workers batches its own share, so 8 samples
    on 2 processes x 3 workers at -b 2 are 3 batches a process (2 + 1 + 1 samples), not ceil(4 / 2) = 2."""
    from structformer.data.shards import worker_batches
    monkeypatch.setenv('WORLD_SIZE', '2')
    assert main(['train', '--data', f'wds:{tmp_path}/train-{{000000..000001}}.tar', '--model', 'crate_digits',
                 '-b', '2', '--workers', '3', '--dataset-size', '8', '--epochs', '2', '--dry-run',
                 '--output', str(tmp_path / 'run')]) == 0
    assert 'steps         3 optimiser steps per epoch (3 batches per process)' in capsys.readouterr().out
    assert worker_batches(4, 2, 3, drop_last=False) == 3 and worker_batches(4, 2, 3, drop_last=True) == 1


def test_a_resume_on_another_process_count_says_what_it_changes(tmp_path, capsys):
    """--allow-world-size-change went on with another effective batch and a recomputed schedule step without a word.
    A checkpoint made as a two-process run leaves it (world size, effective batch, global step edited; two steps a
    process an epoch there would be one here for the same images, so the run had made 1), resumed on one: the line
    names both counts, both effective batches and where the schedule goes on (epoch 1 x 2 steps here)."""
    import json
    out = tmp_path / 'run'
    assert main(['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '2', '--warmup-epochs', '0',
                 '-b', '16', '--limit-train-batches', '2', '--no-progress', '--log-interval', '0', '--output', str(out),
                 '--stop-after', '1']) == 0
    state_file = out / 'checkpoints' / 'epoch_0001' / 'state.json'
    state = json.loads(state_file.read_text())
    state.update(world_size=2, effective_batch_size=32, global_step=1)
    state_file.write_text(json.dumps(state))
    capsys.readouterr()
    assert main(['train', '--resume', '--output', str(out), '--no-progress', '--allow-world-size-change']) == 0
    said = capsys.readouterr().out
    assert ('note: --allow-world-size-change: trained on 2 process(es), continuing on 1: effective batch 32 -> 16, '
            'peak lr ') in said, said
    assert 'the schedule continues at optimiser step 2 (1 epoch(s) x 2 steps on this count; it had made 1)' in said
    assert json.loads((out / 'metrics.jsonl').read_text().splitlines()[-1])['step'] == 4
