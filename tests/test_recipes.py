"""Recipes (structformer/recipes/*.yaml, structformer/train/recipes.py), `structformer train --recipe NAME`,
`--dry-run` and `structformer recipes`.

PAPER_VALUES is written from the papers (../shared/seeds/, SPEC.md) and, where a paper leaves a value to its
code, from the public code it names; it is compared with the loaded recipes, not copied from them.

Training: `test_recipe_trains_two_steps` (one recipe per family, REPRESENTATIVES, with its values checked) and
`test_every_recipe_trains_two_steps` (the rest) run two optimiser steps on the CPU at a tiny size.
"""
import contextlib
import io
import json
from pathlib import Path

import pytest

from structformer.cli import build_parser, main
from structformer.commands.train import train_config
from structformer.train.recipes import ABOUT_REQUIRED, list_recipes, load_recipe

RECIPES = list_recipes()


def _loaded(name):
    """The recipe's values with what the papers state in other terms: the global batch and the peak lr at the
    process count the recipe is sized for (about.world_size), and model_kwargs entries as `model_kwargs.KEY`."""
    from structformer.train.config import TrainConfig
    values, about = load_recipe(name)
    config = TrainConfig.from_dict(values)
    world = int(about.get('world_size', 1))
    out = dict(values)
    out['batch'] = config.effective_batch(world)
    out['lr'] = config.resolved_lr(world)
    for key, value in config.model_kwargs.items():
        out[f'model_kwargs.{key}'] = value
    for key, value in config.data_kwargs.items():
        out[f'data_kwargs.{key}'] = value
    return out


def _rows(recipe: str, *rows) -> list:
    """(recipe, key, value, source) for each (key, value, source) the paper states for one recipe."""
    return [(recipe, *row) for row in rows]


# (recipe, key, value from the paper, where the paper / public code says it)
CRATE_SIZES = ('tiny', 'small', 'base', 'large')
CRATE_B12, CRATE_FT = 'App. B.1.2', 'App. B.1.2 fine-tuning'
SOFT_MAIN = 'fudan-zvg/SOFT main.py'
SPARSIFINER = 'lim142857/Sparsifiner'
PAPER_VALUES = (
    [row for s in CRATE_SIZES for row in _rows(
        f'crate_{s}_in1k', ('model', f'crate_{s}_patch16_224', 'Table 1'), ('opt', 'lion', CRATE_B12),
        ('lr', 2.4e-4, CRATE_B12), ('weight_decay', 0.5, CRATE_B12), ('batch', 2048, CRATE_B12),
        ('warmup_epochs', 5, CRATE_B12), ('epochs', 150, CRATE_B12), ('sched', 'cosine', CRATE_B12),
        ('label_smoothing', 0.1, CRATE_B12), ('dataset_size', 1281167, 'ImageNet-1k train'))]
    + [row for s in CRATE_SIZES for ds in ('cifar10', 'cifar100') for row in _rows(
        f'crate_{s}_{ds}_ft', ('opt', 'adamw', CRATE_FT), ('lr', 5e-5, CRATE_FT), ('weight_decay', 0.01, CRATE_FT),
        ('batch', 512, CRATE_FT), ('aa', 'rand-m14-n2', 'App. B.1.2: RandAugment n = 2, m = 14'),
        ('data_kwargs.img_size', 224, 'App. B.1.2: resized to 224'))]
    + [row for fam in ('soft', 'softpp') for s in ('tiny', 'small', 'medium', 'large') for row in _rows(
        f'{fam}_{s}_in1k', ('model', f'{fam}_{s}_224', 'Table 1'), ('opt', 'adamw', '§4.1'),
        ('weight_decay', 0.05, '§4.1'), ('warmup_epochs', 10, '§4.1'), ('epochs', 300, '§4.1'),
        ('batch', 1024, '§4.1: all variants at batch 1024'), ('mixup', 0.8, f'§4.1 mixup; 0.8 {SOFT_MAIN}'),
        ('cutmix', 1.0, f'§4.1 cutmix; 1.0 {SOFT_MAIN}'),
        ('label_smoothing', 0.1, f'§4.1 label smoothing; 0.1 {SOFT_MAIN}'),
        ('min_lr', 5e-5, 'fudan-zvg/SOFT config/SOFT_*.yaml'), ('clip_grad', 1.0, 'fudan-zvg/SOFT config/SOFT_*.yaml'))]
    + [('soft_tiny_in1k', 'lr', 1e-3, 'fudan-zvg/SOFT config/SOFT_Tiny.yaml (lr x batch / 1024)'),
       ('soft_small_in1k', 'lr', 1e-3, 'fudan-zvg/SOFT config/SOFT_Small.yaml'),
       ('soft_medium_in1k', 'lr', 3.5e-4, 'fudan-zvg/SOFT config/SOFT_Medium.yaml'),
       ('soft_large_in1k', 'lr', 3.3e-4, 'fudan-zvg/SOFT config/SOFT_Large.yaml'),
       ('softpp_medium_in1k', 'lr', 4e-4, 'fudan-zvg/SOFT config/SOFT_Medium_norm.yaml'),
       ('soft_tiny_official_in1k', 'model', 'soft_tiny_official_224', 'fudan-zvg/SOFT README SOFT-Tiny')]
    + [row for s, lr in (('tiny', 1e-3), ('small', 1e-3), ('medium', 3.5e-4), ('large', 3.3e-4)) for row in _rows(
        f'soft_{s}_official_in1k', ('model', f'soft_{s}_official_224', 'fudan-zvg/SOFT README'),
        *((key, value, f'fudan-zvg/SOFT config/SOFT_{s.title()}.yaml')
          for key, value in (('lr', lr), ('epochs', 300), ('warmup_epochs', 10))))]
    + [row for attn in ('softmax', 'linformer', 'performer', 'nystrom') for row in _rows(
        f'soft_tiny_{attn}_in1k', ('model', f'soft_tiny_{attn}_224', 'Table 2: attention swapped on Tiny'),
        ('epochs', 300, '§4.1'), ('batch', 1024, '§4.1'), ('lr', 1e-3, 'fudan-zvg/SOFT config/SOFT_Tiny.yaml'))]
    + _rows('deit_small_in1k', ('model', 'deit_small_patch16_224', 'seed 002 §4: DeiT-S teacher'),
            ('lr', 1e-3, 'DeiT main.py: 5e-4 x 1024 / 512'), ('epochs', 300, 'DeiT main.py'),
            ('aug_repeats', 3, 'DeiT main.py --repeated-aug'))
    + _rows('deit_tiny_in1k', ('model', 'deit_tiny_patch16_224', 'DeiT-T, the dense model of Sparsifiner-T'),
            ('lr', 1e-3, 'DeiT main.py: 5e-4 x 1024 / 512'))
    + _rows('sparsifiner_deit_small_in1k', ('model', 'sparsifiner_deit_small_patch16_224', '§4: DeiT-S backbone'),
            ('predictor_epochs', 5, '§4 stage 1: 5 epochs'), ('epochs', 45, '§4: 5 + 40 epochs'),
            ('weight_decay', 0.05, 'Eq. 12: weight decay 0.05'),
            ('model_kwargs.keep_ratio', 0.25, f'{SPARSIFINER} sparsifiner_default_config.yaml ATTN_KEEP_RATE'),
            ('batch', 1344, f'{SPARSIFINER}: 168 x 8 GPUs'), ('lr', 8e-5, f'{SPARSIFINER} CLS_DISTILL.BASE_LR'))
    + _rows('sparsifiner_deit_tiny_384_in1k', ('model', 'sparsifiner_deit_tiny_patch16_224', '§4 Table 3: DeiT-T'),
            ('model_kwargs.img_size', 384, '§4 Table 3: 384 x 384'), ('predictor_epochs', 5, '§4'), ('epochs', 45, '§4'))
    + [row for m in ('smixer', 'rp_smixer') for ds in ('cifar10', 'cifar100') for row in _rows(
        f'{m}_{ds}', ('model', f'{m}_cifar', 'App. C.4: S-Mixer / RP S-Mixer, 8 blocks, patch 4'),
        ('opt', 'sgd', 'App. C.4: Nesterov SGD'), ('momentum', 0.9, 'App. C.4'), ('batch', 128, 'App. C.4'),
        ('epochs', 200, 'App. C.4'), ('lr', 0.02, 'App. C.4'))]
    + _rows('rp_mixer_width_cifar10', ('lr', 0.1, 'App. C.5'), ('epochs', 200, 'App. C.5'))
    + _rows('rp_mixer_width_cifar100', ('lr', 0.1, 'App. C.5'), ('epochs', 600, 'App. C.5'))
    + _rows('smixer_depth_cifar10', ('model_kwargs.num_tokens', 128, 'App. C.6: S = C = 128'),
            ('model_kwargs.embed_dim', 128, 'App. C.6: S = C = 128'))
    + [row for kind, ds, lr in (('ss8', 'cifar10', 0.04), ('ss8', 'cifar100', 0.06), ('ssw', 'cifar10', 0.04),
                                ('ssw', 'cifar100', 0.04)) for row in _rows(
        f'mixer_{kind}_{ds}', ('opt', 'adamw', 'App. C.3'), ('batch', 1024, 'App. C.3'), ('epochs', 4000, 'App. C.3'),
        ('lr', lr, 'App. C.3: 0.06 for Mixer-SS/8 on CIFAR-100, else 0.04'), ('model_kwargs.depth', 2, 'App. C.3: L = 2'),
        ('model_kwargs.mlp_ratio', 4.0, 'App. C.3: gamma = 4'),
        ('model_kwargs.patch_size', 8 if kind == 'ss8' else 4, 'App. C.3'),
        ('model_kwargs.num_tokens', 16 if kind == 'ss8' else 64, 'App. C.3'),
        ('model_kwargs.embed_dim', 986 if kind == 'ss8' else 487, 'App. C.3'))]
    + [row for name in ('mixer_b16_in1k', 'mixer_b_w_in1k') for row in _rows(
        name, *((key, value, 'App. C.5') for key, value in (
            ('opt', 'adamw'), ('lr', 1e-3), ('epochs', 300), ('batch', 4096), ('warmup_epochs', 5), ('warmup_lr', 1e-6),
            ('min_lr', 1e-5), ('weight_decay', 0.05), ('reprob', 0.25), ('aa', 'rand-m9-mstd0.5-inc1'), ('mixup', 0.8),
            ('cutmix', 1.0), ('mixup_switch_prob', 0.5), ('label_smoothing', 0.1))))]
    + _rows('mixer_b16_in1k', ('model_kwargs.num_tokens', 196, 'App. C.5: (S, C) = (196, 768), P = 16'),
            ('model_kwargs.embed_dim', 768, 'App. C.5'))
    + _rows('mixer_b_w_in1k', ('model_kwargs.depth', 8, 'App. C.3: Mixer-B-W L = 8'),
            ('model_kwargs.patch_size', 14, 'App. C.3: p = 14'), ('model_kwargs.num_tokens', 256, 'App. C.3: S = 256'),
            ('model_kwargs.embed_dim', 588, 'App. C.3: C = 588'), ('model_kwargs.mlp_ratio', 4.57, 'App. C.3: gamma = 4.57'))
    + [row for name in ('wrn28_10_cifar100', 'wrn28_10_lowrank_cifar100', 'wrn28_10_lowrank_pretrain_cifar100')
       for row in _rows(name, ('model', 'wrn_28_10', 'App. A.2 / Table 2'), ('epochs', 200, 'App. A.2'),
                        ('opt', 'momentum', 'App. A.2: SGD with momentum'), ('momentum', 0.9, 'App. A.2'),
                        ('batch', 128, 'App. A.2'), ('weight_decay', 5e-4, 'App. A.2'))]
    + _rows('wrn28_10_lowrank_cifar100', ('factorize_rank', 0.2, 'Table 2 / 5 rank 0.2'),
            ('factorize_init', 'spectral', 'Table 2 spectral'), ('factor_decay', 'frobenius', 'Table 5 Frobenius decay'),
            ('factorize_include', ['vision'], 'App. A.2: every conv but the first'))
    + _rows('wrn28_10_lowrank_pretrain_cifar100', ('factorize_rank', 0.3, 'Table 8'),
            ('factorize_at', 50, 'Table 8: 50 pre-training epochs'))
    + _rows('resnet50_in1k', ('model', 'resnet50', 'App. A.2: standard ResNet-50'),
            ('batch', 1024, 'App. A.2: TPU v2-8, 128 per core'))
    + _rows('resnet50_lowrank_in1k', ('factorize_rank', 0.5, 'Table 3 / 6 rank 0.5'), ('factor_decay', 'frobenius', 'Table 6'))
    + _rows('resnet50_lowrank_pretrain_in1k', ('factorize_at', 45, 'Table 9: 45 pre-training epochs'))
    + _rows('gpt2_lm1b', ('data_kwargs.seq_len', 256, 'App. A.2: sequence length 256'))
    + _rows('gpt2_lowrank_lm1b', ('factorize_rank', 0.62, 'App. A.2: rank 62.5%'),
            ('factorize_include', ['lm'], 'App. A.2: QKV and both FFN matrices'))
    + _rows('gpt2_lowrank_pretrain_lm1b', ('factorize_rank', 0.62, 'App. A.2'))
)


@pytest.mark.parametrize('name, key, expected, source', PAPER_VALUES,
                         ids=[f'{n}-{k}' for n, k, _, _ in PAPER_VALUES])
def test_recipe_values_match_the_papers(name, key, expected, source):
    values = _loaded(name)
    assert key in values, f"{name} does not set {key} ({source})"
    got = values[key]
    if isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-9), f"{name} {key} = {got}, {source} says {expected}"
    else:
        assert got == expected, f"{name} {key} = {got!r}, {source} says {expected!r}"


@pytest.mark.parametrize('low, dense, ratio, source', [
    ('wrn28_10_lowrank_cifar100', 'wrn28_10_cifar100', 0.5, 'Table 2 = Table 5 at lr scale 0.5'),
    ('resnet50_lowrank_in1k', 'resnet50_in1k', 1.0, 'Table 3 = Table 6 at lr scale 1.0'),
    ('gpt2_lowrank_lm1b', 'gpt2_lm1b', 0.5, 'App. A.2: low-rank transformers halve the base lr'),
])
def test_low_rank_recipes_scale_the_dense_lr_as_the_paper(low, dense, ratio, source):
    # the lr while factorised: the recipe's lr times factorize_lr_scale (the LM's halving, issue 34)
    values = _loaded(low)
    assert values['lr'] * values.get('factorize_lr_scale', 1.0) == pytest.approx(ratio * _loaded(dense)['lr']), source


def test_lm_pretraining_is_40k_of_240k_steps():
    """App. A.2: 40K dense steps of 240K; the recipe's epochs are sized so (and the dry run counts them)."""
    values, about = load_recipe('gpt2_lowrank_pretrain_lm1b')
    assert values['factorize_at'] / values['epochs'] == pytest.approx(40 / 240)
    world = about['world_size']
    steps = values['dataset_size'] // (values['batch_size'] * world) * values['epochs']
    assert steps == 240_000


def test_every_paper_and_recipe_is_covered():
    checked = {name for name, *_ in PAPER_VALUES}
    assert set(RECIPES) == checked, set(RECIPES) ^ checked
    papers = {load_recipe(n)[1]['paper'].split(' ')[0] for n in RECIPES}
    assert {'CRATE', 'SOFT', 'Sparsifiner', 'Mixer', 'Low-rank', 'DeiT'} <= papers


@pytest.mark.parametrize('name', RECIPES)
def test_recipe_states_where_its_values_come_from(name):
    values, about = load_recipe(name)
    for key in ABOUT_REQUIRED:
        assert str(about[key]).strip(), (name, key)
    assert values['dataset_size'] >= 1 and values['data'] and values['model']
    assert values.get('output') == f'outputs/{name}'
    assert isinstance(about.get('world_size', 1), int)


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def dry_run(tmp_path, monkeypatch):
    """`_run` from an empty folder (a dry run must leave it empty) as one process, or under torchrun's
    WORLD_SIZE."""
    monkeypatch.chdir(tmp_path)

    def run(argv, world_size=None):
        if world_size is None:
            monkeypatch.delenv('WORLD_SIZE', raising=False)
        else:
            monkeypatch.setenv('WORLD_SIZE', str(world_size))
        return _run(argv)
    return run


@pytest.mark.parametrize('name', RECIPES)
def test_dry_run_resolves_every_recipe_without_data_or_writes(name, tmp_path, dry_run):
    rc, out, err = dry_run(['train', '--recipe', name, '--dry-run'])
    assert rc == 0, err
    values, about = load_recipe(name)
    assert f"recipe        {name}" in out
    assert "the recipe's stated size; path" in out and 'does not exist here' in out
    assert 'optimiser steps per epoch' in out and 'in total over' in out
    assert 'parameters' in out and 'built on the meta device' in out
    assert about['reported'] in out
    assert list(tmp_path.iterdir()) == [], 'a dry run wrote files'


def test_dry_run_counts_steps_and_lr_at_the_recipes_world_size(dry_run):
    """crate_base_in1k under torchrun with 8 processes: 128 x 2 x 8 = 2,048 a step, ceil(ceil(1,281,167 / 8) /
    128) = 1,252 batches, 626 steps an epoch; peak lr 2.4e-4; warm-up ends at step 5 x 626."""
    rc, out, _ = dry_run(['train', '--recipe', 'crate_base_in1k', '--dry-run'], world_size=8)
    assert rc == 0
    assert '= 2,048 per optimiser step' in out
    assert '626 optimiser steps per epoch (1,252 batches per process)' in out and '93,900 in total' in out
    assert 'peak 0.00024 ' in out
    assert 'end of warm-up (step 3,130): ' in out and 'end (step 93,900): 1e-06' in out
    assert 'the recipe is sized for' not in out


def test_dry_run_reads_data_at_hand_and_shows_stages_and_factorisation(tmp_path, dry_run):
    rc, out, _ = dry_run(['train', '--recipe', 'wrn28_10_lowrank_pretrain_cifar100', '--data', 'digits',
                          '--data-kwargs', '--dry-run'])
    assert rc == 0
    assert 'read from the data: 10 classes, 1x8x8' in out and 'is not used: the data is at hand' in out
    assert 'after 50 dense epoch(s)' in out and 'after factorisation' in out
    rc, out, _ = dry_run(['train', '--recipe', 'sparsifiner_deit_small_in1k', '--dry-run', '--teacher', 'some/run'])
    assert rc == 0
    assert 'teacher: some/run' in out and 'stage predictor: 5 epochs' in out and 'stage joint: 40 epochs' in out
    assert list(tmp_path.iterdir()) == []


def test_flags_override_config_file_override_recipe(tmp_path):
    """Priority: defaults < recipe < -c FILE < flags; the run records the recipe's name."""
    config = tmp_path / 'c.yaml'
    config.write_text('epochs: 7\nweight_decay: 0.25\n')
    parser = build_parser()
    cfg = train_config(parser.parse_args(['train', '--recipe', 'crate_base_in1k', '-c', str(config),
                                           '--weight-decay', '0.125', '--data', 'digits']))
    assert cfg.recipe == 'crate_base_in1k'
    assert (cfg.opt, cfg.lr_base, cfg.warmup_epochs) == ('lion', 2.4e-4, 5)     # the recipe's
    assert cfg.epochs == 7                                                       # -c over the recipe
    assert cfg.weight_decay == 0.125 and cfg.data == 'digits'                    # flags over both
    assert cfg.momentum == 0.9 and cfg.keep_last == 2                            # defaults where no one says
    cfg = train_config(parser.parse_args(['train', '--recipe', 'soft_tiny_in1k', '--no-model-ema', '--mixup', '0']))
    assert cfg.model_ema is False and cfg.mixup == 0 and cfg.cutmix == 1.0


def test_unknown_recipe_is_one_line_naming_the_flag(capsys):
    rc = main(['train', '--recipe', 'crate_bse_in1k', '--dry-run'])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert '--recipe' in err and 'crate_base_in1k' in err and '`structformer recipes`' in err
    rc = main(['train', '--recipe', '../../etc/passwd', '--dry-run'])
    assert rc == 2 and '--recipe' in capsys.readouterr().err


def test_recipes_command_lists_them_all(capsys):
    assert main(['recipes']) == 0
    out = capsys.readouterr().out
    for name in RECIPES:
        assert f'\n{name} ' in out
    assert f'{len(RECIPES)} recipes' in out
    assert main(['recipes', '--json']) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r['name'] for r in rows] == RECIPES
    row = next(r for r in rows if r['name'] == 'crate_base_in1k')
    assert row['model'] == 'crate_base_patch16_224' and '70.8%' in row['reported'] and 'B.1.2' in row['source']


def test_recipes_ship_as_package_data():
    pyproject = (Path(__file__).resolve().parents[1] / 'pyproject.toml').read_text()
    assert '"recipes/*.yaml"' in pyproject


# ------------------------------------------------------------------------------------- two CPU steps
# Overrides that make each family's model small enough for a CPU (the recipe's training settings stay).
_SMALL = {
    'crate': ['img_size=8', 'patch_size=2', 'depth=2', 'embed_dim=64', 'num_heads=2', 'dim_head=32'],
    'soft': ['img_size=8', 'stem_strides=(1,1,1)', 'sampling_ratios=(2,2,1,1)', 'depths=(1,1,1,1)',
             'dims=(32,32,64,64)', 'num_heads=(1,1,2,2)'],
    'vit': ['img_size=8', 'patch_size=2', 'depth=2', 'embed_dim=64', 'num_heads=2'],
    'mixer': ['img_size=8', 'patch_size=2', 'num_tokens=16', 'embed_dim=16', 'depth=2'],
    'gpt': ['embed_dim=64', 'num_heads=2', 'depth=2'],
    'wrn': ['depth=10', 'widen_factor=2'],
    'resnet': ['layers=(1,1,1,1)'],
}
REPRESENTATIVES = ['crate_base_in1k', 'soft_tiny_in1k', 'sparsifiner_deit_small_in1k', 'mixer_b16_in1k',
                   'wrn28_10_lowrank_pretrain_cifar100', 'gpt2_lowrank_lm1b']


def _family(model: str) -> str:
    for prefix, family in (('crate', 'crate'), ('soft', 'soft'), ('deit', 'vit'), ('sparsifiner', 'vit'),
                           ('gpt', 'gpt'), ('wrn', 'wrn'), ('resnet', 'resnet')):
        if model.startswith(prefix):
            return family
    return 'mixer'


def _small_argv(name: str, values: dict, output: Path) -> list:
    family = _family(values['model'])
    argv = ['train', '--recipe', name, '--output', str(output), '--no-progress', '--device', 'cpu', '--workers', '0',
            '-b', '8', '--grad-accum-steps', '1', '--warmup-epochs', '0', '--log-interval', '0',
            '--min-lr', '0']       # batch 8 scales an --lr-base recipe's peak below its floor, which train refuses
    kwargs = list(_SMALL[family])
    if 'keep_ratio' in values.get('model_kwargs', {}):
        kwargs.append(f"keep_ratio={values['model_kwargs']['keep_ratio']}")
    if kwargs:
        argv += ['--model-kwargs', *kwargs]
    if family == 'gpt':
        argv += ['--data', 'pysource', '--data-kwargs', 'seq_len=32', 'max_bytes=20000']
    else:
        argv += ['--data', 'digits', '--data-kwargs']
    if values.get('factorize_at') or values.get('teacher'):       # two epochs of one step: dense then low rank,
        argv += ['--epochs', '2', '--limit-train-batches', '1']   # or stage 1 then stage 2
        argv += ['--factorize-at', '1'] if values.get('factorize_at') else ['--predictor-epochs', '1']
    else:
        argv += ['--epochs', '1', '--limit-train-batches', '2']
    if values.get('mixup_off_epoch'):
        argv += ['--mixup-off-epoch', '0']
    return argv


def _teacher_recipe(student: str) -> str:
    return 'deit_small_in1k' if 'small' in load_recipe(student)[0]['model'] else 'deit_tiny_in1k'


def _trained(recipe: str, tmp_path: Path) -> str:
    """The run folder of `recipe` trained at the tiny size: the teacher or pre-training run another recipe needs."""
    rc, _, err = _run(_small_argv(recipe, load_recipe(recipe)[0], tmp_path / recipe))
    assert rc == 0, err
    return str(tmp_path / recipe)


def _two_steps(name: str, tmp_path: Path):
    from structformer.train.checkpoint import load_checkpoint
    values, _ = load_recipe(name)
    argv = _small_argv(name, values, tmp_path / name)
    if values.get('teacher'):
        argv += ['--teacher', _trained(_teacher_recipe(name), tmp_path)]
    if values.get('initial_checkpoint'):             # a fine-tuning recipe: its pre-training recipe's run first
        argv += ['--initial-checkpoint', _trained(Path(values['initial_checkpoint']).name, tmp_path)]
    rc, out, err = _run(argv)
    assert rc == 0, err[-3000:]
    _, state, _ = load_checkpoint(tmp_path / name)
    assert state['global_step'] == 2, state['global_step']
    assert state['config']['recipe'] == name
    return state


@pytest.mark.parametrize('name', REPRESENTATIVES)
def test_recipe_trains_two_steps(name, tmp_path):
    """One recipe per family, two optimiser steps on the CPU at a tiny size, with the recipe's optimiser,
    schedule, augmentation, EMA, stages and factorisation."""
    state = _two_steps(name, tmp_path)
    values, _ = load_recipe(name)
    for key in ('opt', 'weight_decay', 'mixup', 'model_ema', 'factorize_rank', 'factor_decay'):
        if key in values:
            assert state['config'][key] == values[key], key


@pytest.mark.parametrize('name', [n for n in RECIPES if n not in REPRESENTATIVES])
def test_every_recipe_trains_two_steps(name, tmp_path):
    """The other recipes too (all 54 take about 25 s on 2 cores at this size); fine-tuning recipes start from
    their pre-training recipe's run."""
    _two_steps(name, tmp_path)
