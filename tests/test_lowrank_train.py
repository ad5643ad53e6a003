"""Low-rank training through the engine: pre-train then factorise (resume across the switch, the loss
at the switch equals what the truncated SVD predicts), Frobenius decay's parameter groups, spectra logged."""
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from structformer.data import build_datasets
from structformer.layers.linear.factorized import spectral_factors
from structformer.train.lowrank_decay import factor_parameter_names
from structformer.train import TrainConfig, Trainer, evaluate, load_model, train

VIT = dict(img_size=8, patch_size=2, depth=2, embed_dim=32, num_heads=2)


def _config(tmp_path, **overrides):
    values = dict(model='vit_tiny_patch16_224', model_kwargs=dict(VIT), data='digits', epochs=3, batch_size=64,
                  lr=1e-3, warmup_epochs=0, limit_train_batches=8, keep_last=3, output=str(tmp_path / 'run'),
                  factorize_rank=0.25, factorize_at=1, factorize_init='spectral')
    values.update(overrides)
    return TrainConfig(**values)


def _metrics(run):
    return [json.loads(line) for line in (run / 'metrics.jsonl').read_text().splitlines()]


def test_pretrain_then_factorise_resumes_across_the_switch_bit_exact(tmp_path):
    straight = train(_config(tmp_path / 'a'), progress=False)
    train(_config(tmp_path / 'b'), progress=False, stop_after=1)          # dense checkpoint at epoch 1
    train(_config(tmp_path / 'b'), progress=False, resume=True, stop_after=1)   # factorises, epoch 2
    resumed = train(_config(tmp_path / 'b'), progress=False, resume=True)      # factorised checkpoint -> 3
    a = load_file(str(straight.last_checkpoint / 'model.safetensors'))
    b = load_file(str(resumed.last_checkpoint / 'model.safetensors'))
    assert a.keys() == b.keys() and 'blocks.0.attn.qkv.U' in a and 'blocks.0.attn.qkv.weight' not in a
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert ([r['train_loss'] for r in _metrics(tmp_path / 'a' / 'run')]
            == [r['train_loss'] for r in _metrics(tmp_path / 'b' / 'run')])
    # the dense epoch-1 checkpoint rebuilds dense, the later ones factorised: each recipe says what it is
    dense, state = load_model(tmp_path / 'a' / 'run' / 'checkpoints' / 'epoch_0001')
    assert [t['name'] for t in state['recipe']['transforms']] == []
    model, state = load_model(tmp_path / 'a' / 'run')
    assert [t['name'] for t in state['recipe']['transforms']] == ['factorize']
    assert state['recipe']['transforms'][0]['kwargs'] == {'rank': 0.25, 'init': 'spectral'}


def test_loss_at_the_switch_is_what_the_truncated_svd_predicts(tmp_path):
    """The factorised model's loss right after the switch equals the loss of the dense model with each
    chosen weight replaced by its rank-r truncated SVD; no optimiser step happens in between."""
    train(_config(tmp_path, epochs=2), progress=False)
    run = tmp_path / 'run'
    records = _metrics(run)
    dense, _ = load_model(run / 'checkpoints' / 'epoch_0001')
    _, val, _ = build_datasets('digits', seed=0, val_fraction=0.2)
    loader = torch.utils.data.DataLoader(val, batch_size=256)
    before = evaluate(dense, loader, 'cpu')
    assert before['loss'] == pytest.approx(records[0]['val_loss'], rel=1e-6)
    with torch.no_grad():
        for name, module in dense.named_modules():
            if name.endswith(('attn.qkv', 'mlp.fc1', 'mlp.fc2')):
                u, v = spectral_factors(module.weight, max(1, round(0.25 * min(module.weight.shape))))
                module.weight.copy_(u @ v.T)
    predicted = evaluate(dense, loader, 'cpu')
    after = records[1]
    assert after['factorized_val_loss'] == pytest.approx(predicted['loss'], rel=1e-4, abs=1e-5)
    assert after['factorized_val_top1'] == pytest.approx(predicted['top1'], abs=0.3)   # one image of 360
    assert after['effective_rank_mean'] > 0 and 'blocks.0.attn.qkv' in after['singular_values']
    assert 'blocks.0.attn.qkv' in after['effective_rank'] and 'effective_rank' in records[0]


def test_optimiser_state_of_surviving_parameters_is_kept_across_the_switch(tmp_path):
    trainer = Trainer(_config(tmp_path, epochs=2), progress=False)
    trainer._build()
    trainer.global_step = 0
    head = trainer.model.head.weight
    trainer.optimizer.state[head]['marker'] = torch.tensor(1.0)
    trainer.lowrank.before_epoch(trainer, trainer.config.factorize_at + 1)     # the switch, as the loop makes it
    assert 'marker' in trainer.optimizer.state[head]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    in_optimizer = {names[id(p)] for g in trainer.optimizer.param_groups for p in g['params']}
    assert 'blocks.0.mlp.fc1.U' in in_optimizer and in_optimizer == set(names.values())


@pytest.mark.parametrize('decay_everything', [False, True])
def test_frobenius_decay_takes_the_factors_out_of_weight_decay(tmp_path, decay_everything):
    groups = {}
    for kind in ('l2', 'frobenius'):
        trainer = Trainer(_config(tmp_path / kind, factorize_at=0, factor_decay=kind, weight_decay=0.1,
                                  decay_everything=decay_everything), progress=False)
        trainer._build()
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        groups[kind] = {names[id(p)]: g['weight_decay'] for g in trainer.optimizer.param_groups for p in g['params']}
        factors = factor_parameter_names(trainer.model)
        assert len(factors) == 12
        assert trainer.frobenius_weight == (0.1 if kind == 'frobenius' else 0.0)
    assert all(groups['l2'][n] == 0.1 for n in factors)
    assert all(groups['frobenius'][n] == 0.0 for n in factors)
    others = [n for n in groups['l2'] if n not in factors]
    assert all(groups['l2'][n] == groups['frobenius'][n] for n in others)   # nothing else changes


def test_frobenius_decay_run_logs_the_term(tmp_path):
    result = train(_config(tmp_path, epochs=1, factorize_at=0, factor_decay='frobenius'), progress=False)
    assert result.final['train_frobenius_decay'] > 0
    assert result.final['train_loss'] == pytest.approx(result.final['train_ce'] + result.final['train_frobenius_decay'])


def test_factorised_from_the_start_is_recorded_as_a_transform(tmp_path):
    train(_config(tmp_path, epochs=1, factorize_at=None, factorize_init='he'), progress=False)
    model, state = load_model(tmp_path / 'run')
    assert state['recipe']['transforms'][0]['kwargs']['init'] == 'he'
    assert isinstance(model.blocks[0].mlp.fc1, nn.Module) and hasattr(model.blocks[0].mlp.fc1, 'factors')


def test_analyze_reads_back_the_logged_ranks_and_spectra(tmp_path):
    """`structformer analyze` on a low-rank run (not CRATE) writes spectra.json / spectra.png from the
    effective ranks and singular values the engine logged: the same numbers, epoch by epoch."""
    import argparse

    from structformer.analysis.cli import add_analyze_arguments, run_analyze
    train(_config(tmp_path, epochs=2, factorize_at=1), progress=False)
    run = tmp_path / 'run'
    parser = add_analyze_arguments(argparse.ArgumentParser())
    assert run_analyze(parser.parse_args(['--checkpoint', str(run)])) == 0
    summary = json.loads((run / 'analysis' / 'spectra.json').read_text())
    logged = _metrics(run)
    assert summary['epochs'] == [1, 2] and summary['last_epoch'] == 2
    layer = 'blocks.0.mlp.fc1'
    assert summary['effective_rank'][layer] == [m['effective_rank'][layer] for m in logged]
    assert summary['effective_rank_mean'][0] is None                    # epoch 1 is dense: nothing factorised
    assert summary['effective_rank_mean'][1] == logged[1]['effective_rank_mean'] > 0
    assert summary['singular_values'][layer] == logged[-1]['singular_values'][layer]
    assert len(summary['singular_values'][layer]) == 8                  # rank 0.25 of min(32, 128)
    assert (run / 'analysis' / 'spectra.png').stat().st_size > 0


def test_a_recovery_point_in_the_switch_epoch_keeps_what_the_switch_cost(tmp_path, monkeypatch):
    """Stopped inside the epoch that factorises (after a recovery point) and resumed from that point: the weights
    and the epoch's record equal the straight run's, `factorized_val_*` (measured before the epoch's first step)
    included; the resumed record lacked them, as the part's metrics of the epoch under way were not in the point."""
    cfg = dict(factorize_at=1, epochs=2, recovery_interval=2)
    straight = train(_config(tmp_path / 'a', **cfg), progress=False)
    monkeypatch.setenv('STRUCTFORMER_TEST_KILL_AT', 'epoch 2:step 5')
    monkeypatch.setenv('STRUCTFORMER_TEST_KILL_WITH', 'SIGINT')
    with pytest.raises(KeyboardInterrupt):
        train(_config(tmp_path / 'b', **cfg), progress=False)
    monkeypatch.delenv('STRUCTFORMER_TEST_KILL_AT')
    assert list((tmp_path / 'b' / 'run' / 'checkpoints').glob('recovery_0002_*'))
    resumed = train(_config(tmp_path / 'b', **cfg), progress=False, resume=True)
    a = load_file(str(straight.last_checkpoint / 'model.safetensors'))
    b = load_file(str(resumed.last_checkpoint / 'model.safetensors'))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first, second = _metrics(tmp_path / 'a' / 'run')[1], _metrics(tmp_path / 'b' / 'run')[1]
    assert 'factorized_val_top1' in first
    for key in first:
        if not key.endswith(('_per_s', '_s')):
            assert first[key] == second.get(key), key


def test_the_weight_averages_decay_warm_up_restarts_with_it_at_the_switch(tmp_path, monkeypatch):
    """--model-ema restarts its average from the factorised network at the switch (another architecture); timm's
    ModelEmaV3 warms its decay up from `step`, so the restarted average must get the steps since the restart: the
    decays of the factorised epoch are the dense epoch's, from the warm-up's first value (decay 0: a copy) on.
    Given the global step instead, the restarted average started at the decay the run had reached. The steps are
    the loop's (global_step, then the parts' after_step), without the training between them."""
    from timm.utils import ModelEmaV3
    used = []
    get_decay = ModelEmaV3.get_decay
    monkeypatch.setattr(ModelEmaV3, 'get_decay', lambda self, step=None: used.append(get_decay(self, step)) or used[-1])
    trainer = Trainer(_config(tmp_path, epochs=2, limit_train_batches=4, val_fraction=0.05, model_ema=True,
                              model_ema_warmup=True, model_ema_decay=0.99), progress=False)
    trainer._build()
    trainer.global_step = 0
    average = trainer.parts[-1]
    assert trainer.steps_per_epoch == 4 and type(average).__name__ == 'WeightAveragePart'

    def epoch():
        used.clear()
        for _ in range(trainer.steps_per_epoch):
            trainer.global_step += 1
            average.after_step(trainer)
        return list(used)

    dense = epoch()
    assert dense[0] == 0.0 and 0 < dense[1] < dense[2] < dense[3] < 0.99
    trainer.lowrank.before_epoch(trainer, trainer.config.factorize_at + 1)     # the switch, as the loop makes it
    assert 'blocks.0.mlp.fc1.U' in average.average.module.state_dict()          # the average restarted on it
    assert epoch() == dense
