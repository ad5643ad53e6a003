"""Seed 004 App. A.2 halves the base lr of factorised transformer runs, and again at the switch from dense
pre-training to factorised training (issue 34, item 4): --factorize-lr-scale, the LM recipes' and the
reproduction's defaults."""
import pytest

from structformer.errors import UsageError
from structformer.train import TrainConfig, Trainer

VIT = dict(img_size=8, patch_size=2, depth=2, embed_dim=32, num_heads=2)


def _trainer(tmp_path, **overrides):
    values = dict(model='vit_tiny_patch16_224', model_kwargs=dict(VIT), data='digits', epochs=4, batch_size=64,
                  lr=1e-3, warmup_epochs=0, min_lr=0.0, limit_train_batches=4, output=str(tmp_path / 'run'),
                  factorize_rank=0.25, factorize_at=1, factorize_lr_scale=0.5)
    values.update(overrides)
    trainer = Trainer(TrainConfig(**values), progress=False)
    trainer._build()
    trainer.global_step = 0
    return trainer


def _lr(trainer, step):
    trainer.scheduler.step_update(num_updates=step)
    return trainer.optimizer.param_groups[0]['lr']


def _cosine(peak, step, total):
    import math
    return peak * (1 + math.cos(math.pi * step / total)) / 2


def test_the_lr_halves_at_the_switch_and_the_schedule_continues(tmp_path):
    trainer = _trainer(tmp_path)
    total = 4 * trainer.steps_per_epoch
    step = trainer.steps_per_epoch                               # the switch, after the dense epoch
    assert _lr(trainer, step) == pytest.approx(_cosine(1e-3, step, total))
    trainer.lowrank.before_epoch(trainer, 2)                     # factorise, as the loop does before epoch 2
    trainer.global_step = step
    assert _lr(trainer, step) == pytest.approx(0.5 * _cosine(1e-3, step, total))
    assert _lr(trainer, step + 3) == pytest.approx(0.5 * _cosine(1e-3, step + 3, total))


def test_from_the_start_the_whole_run_is_scaled_and_one_keeps_the_dense_lr(tmp_path):
    scaled = _trainer(tmp_path / 'a', factorize_at=0)
    assert _lr(scaled, 0) == pytest.approx(0.5e-3)
    plain = _trainer(tmp_path / 'b', factorize_at=0, factorize_lr_scale=1.0)
    assert _lr(plain, 0) == pytest.approx(1e-3)
    dense = _trainer(tmp_path / 'c', factorize_rank=None, factorize_at=None, factorize_lr_scale=1.0)
    assert _lr(dense, 0) == pytest.approx(1e-3)
    by_transform = _trainer(tmp_path / 'd', factorize_rank=None, factorize_at=None,    # factorised the other way
                            transforms=[{'name': 'factorize', 'kwargs': {'rank': 0.25}}])
    assert _lr(by_transform, 0) == pytest.approx(0.5e-3)


@pytest.mark.parametrize('settings, named', [
    (dict(factorize_lr_scale=0.5), '--factorize-lr-scale 0.5'), (dict(factor_decay='frobenius'), '--factor-decay'),
    (dict(factorize_init='he'), '--init he'), (dict(factorize_include=['*qkv']), '--factorize-include'),
    (dict(factorize_rank=0.25, factorize_at=1, transforms=[{'name': 'factorize', 'kwargs': {'rank': 0.25}}]),
     '--factorize-at=1 with --transform factorize'),
    # He draws fresh factors: the dense epochs (or loaded weights) it would factorise were silently thrown away
    (dict(factorize_rank=0.25, factorize_at=1, factorize_init='he'), '--init he with --factorize-at'),
    (dict(factorize_rank=0.25, factorize_init='he', initial_checkpoint='run'), '--init he with --initial-checkpoint')])
def test_low_rank_settings_with_nothing_to_act_on_are_refused(tmp_path, settings, named):
    """Without --rank (or, for the settings that act on factors, --transform factorize) these were silently
    ignored: a run with --factor-decay frobenius and no factorised layer trained as plain weight decay; with
    --transform factorize, --factorize-at never switched."""
    values = dict(model='vit_tiny_patch16_224', data='digits', epochs=2, output=str(tmp_path / 'x'))
    with pytest.raises(UsageError, match=named):
        TrainConfig(**dict(values, **settings)).validate()
    if 'transforms' not in settings and settings.keys() & {'factorize_lr_scale', 'factor_decay'}:
        TrainConfig(**dict(values, **settings, transforms=[{'name': 'factorize', 'kwargs': {'rank': 0.25}}])).validate()


@pytest.mark.parametrize('decay, term, named', [('frobenius', 'frobenius_decay', 'count twice'),
                                                ('l2', 'frobenius_decay', 'already decays the factors'),
                                                ('l2', 'factor_l2', 'already decays the factors')])
def test_a_phase_term_on_factors_the_weight_decay_already_decays_is_refused(tmp_path, decay, term, named):
    """lowrank_decay's terms in a config's phases came on top of --factor-decay's own decay of U and V, silently: a
    decay counted twice (or Frobenius decay plus L2 on the same factors, which its docstring says must not be)."""
    values = dict(model='vit_tiny_patch16_224', data='digits', epochs=2, output=str(tmp_path / 'x'), factorize_rank=0.25,
                  factor_decay=decay, weight_decay=0.05, phases=[{'name': 'p', 'epochs': 2,
                                                                 'losses': {'ce': 1.0, term: 5e-4}}])
    with pytest.raises(UsageError, match=f"phase 'p': loss term {term}.*{named}"):
        TrainConfig(**values).validate()
    TrainConfig(**dict(values, weight_decay=0.0)).validate()            # the term alone: what the phases are for
    if decay == 'l2':
        TrainConfig(**dict(values, factor_decay='frobenius', phases=[
            {'name': 'p', 'epochs': 2, 'losses': {'ce': 1.0, 'factor_l2': 5e-4}}])).validate()


@pytest.mark.parametrize('bad', [0, 1.5, -0.5, True])
def test_the_scale_is_a_factor_in_0_1(tmp_path, bad):
    with pytest.raises(UsageError, match=r'--factorize-lr-scale'):
        TrainConfig(model='vit_tiny_patch16_224', data='digits', factorize_rank=0.25, factorize_lr_scale=bad,
                    output=str(tmp_path / 'x')).validate()


def test_the_lm_recipes_halve_as_the_seed_does():
    from structformer.train.recipes import load_recipe
    (scratch, _), (pretrain, _) = load_recipe('gpt2_lowrank_lm1b'), load_recipe('gpt2_lowrank_pretrain_lm1b')
    dense, _ = load_recipe('gpt2_lm1b')
    lr = lambda r: r['lr'] if 'lr' in r else r['lr_base']        # noqa: E731
    # factorised from the start: the dense run's lr, halved while factorised (the whole run)
    assert scratch['factorize_lr_scale'] == 0.5 and lr(scratch) == lr(dense)
    # pre-trained: App. A.2's one halving, of the factorised steps (issue 42): the dense steps at the dense run's
    # lr, halved from the switch on, as the WRN pre-training recipe
    assert pretrain['factorize_lr_scale'] == 0.5 and lr(pretrain) == lr(dense)
    # and docs/lowrank.md says so (it said 2.5e-4 for the dense steps, the pre-issue-42 reading)
    from pathlib import Path
    doc = ' '.join((Path(__file__).parents[1] / 'docs' / 'lowrank.md').read_text().split())
    def short(value):                       # 0.0005 -> '5e-4', as the page writes it
        mantissa, exponent = f"{value:e}".split('e')
        return f"{float(mantissa):g}e{int(exponent)}"
    assert (f"`gpt2_lowrank_pretrain_lm1b` the dense baseline's {short(lr(dense))} for its dense steps, "
            f"× 0.5 ({short(lr(dense) * 0.5)}) after the switch") in doc


def test_the_reproduction_halves_the_lm_lr():
    import argparse

    from structformer.reproduce import lowrank
    p = argparse.ArgumentParser()
    lowrank.add_arguments(p)
    args = p.parse_args(['--parts', 'lm'])
    configs = {run['name']: lowrank._config(run, args, __import__('pathlib').Path('/tmp/unused'))
               for run in lowrank._plan(args)}
    assert configs['dense'].lr == lowrank.LM_LR and configs['dense'].factorize_lr_scale == 1.0
    assert configs['r0.62_spectral'].lr == lowrank.LM_LR and configs['r0.62_spectral'].factorize_lr_scale == 0.5
    pre = next(c for n, c in configs.items() if 'pretrain' in n)
    assert pre.lr == lowrank.LM_LR / 2 and pre.factorize_lr_scale == 0.5


def test_every_factorisation_setting_is_refused_without_a_factor(tmp_path):
    """compare strips FACTORISATION_SETTINGS from its dense rows because the checks refuse each of them there: a
    setting added to one list and not the other would either crash compare's dense rows or be stripped for nothing."""
    from structformer.train.config_checks import FACTORISATION_SETTINGS
    not_default = {'factorize_include': ['*qkv'], 'factorize_init': 'spectral_ones', 'factor_decay': 'frobenius',
                   'factorize_lr_scale': 0.5}
    assert set(not_default) == set(FACTORISATION_SETTINGS)
    values = dict(model='vit_tiny_patch16_224', data='digits', epochs=2, output=str(tmp_path / 'x'))
    for key, value in not_default.items():
        with pytest.raises(UsageError):
            TrainConfig(**dict(values, **{key: value})).validate()
        TrainConfig(**dict(values, **{key: value}, factorize_rank=0.25)).validate()
