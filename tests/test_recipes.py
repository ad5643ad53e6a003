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
from structformer.train.config_checks import CYCLING
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
    for phase, settings in config.phase_settings.items():
        for key, value in settings.items():
            out[f'phase_settings.{phase}.{key}'] = value
    for transform in config.transforms:
        for key, value in transform.get('kwargs', {}).items():
            out[f"{transform['name']}.{key}"] = value
    return out


def _rows(recipe: str, *rows) -> list:
    """(recipe, key, value, source) for each (key, value, source) the paper states for one recipe."""
    return [(recipe, *row) for row in rows]


# (recipe, key, value from the paper, where the paper / public code says it)
CRATE_SIZES = ('tiny', 'small', 'base', 'large')
CRATE_B12, CRATE_FT = 'App. B.1.2', 'App. B.1.2 fine-tuning'
SOFT_MAIN = 'fudan-zvg/SOFT main.py'
SPARSIFINER = 'lim142857/Sparsifiner'
CRATE_FT_PY = 'Ma-Lab-Berkeley/CRATE finetune.py'
STRATEGY = f'{SPARSIFINER} sparsifiner_default_config.yaml TRAIN_STRATEGY'
DEIT_384 = 'facebookresearch/deit README_deit.md: fine-tune at 384 (--lr 5e-6 --weight-decay 1e-8 --epochs 30 --min-lr 5e-6)'
CRATE_TABLE1 = {'tiny': {'cifar10': 95.5, 'cifar100': 78.9, 'flowers102': 84.6, 'pets': 81.4},
                'small': {'cifar10': 96.0, 'cifar100': 81.0, 'flowers102': 87.1, 'pets': 84.9},
                'base': {'cifar10': 96.8, 'cifar100': 82.7, 'flowers102': 88.7, 'pets': 85.3},
                'large': {'cifar10': 97.2, 'cifar100': 83.6, 'flowers102': 88.3, 'pets': 87.4},
                'vit_tiny': {'in1k': 71.5, 'cifar10': 96.6, 'cifar100': 81.8, 'flowers102': 85.1, 'pets': 88.5},
                'vit_small': {'in1k': 72.4, 'cifar10': 97.2, 'cifar100': 83.2, 'flowers102': 88.5, 'pets': 88.6}}
# train images of the public dataset.py's splits: torchvision Flowers102 'train', OxfordIIITPet 'trainval'
FT_DATA = {'cifar10': 50000, 'cifar100': 50000, 'flowers102': 1020, 'pets': 3680}
PAPER_VALUES = (
    [row for s in CRATE_SIZES for row in _rows(
        f'crate_{s}_in1k', ('model', f'crate_{s}_patch16_224', 'Table 1'), ('opt', 'lion', CRATE_B12),
        ('lr', 2.4e-4, CRATE_B12), ('weight_decay', 0.5, CRATE_B12), ('batch', 2048, CRATE_B12),
        ('warmup_epochs', 5, CRATE_B12), ('epochs', 150, CRATE_B12), ('sched', 'cosine', CRATE_B12),
        ('label_smoothing', 0.1, CRATE_B12), ('dataset_size', 1281167, 'ImageNet-1k train'))]
    + [('crate_base_in1k', 'decay_everything', True, 'Ma-Lab-Berkeley/CRATE main.py: Lion(model.parameters())')]
    + [row for s in CRATE_SIZES + ('vit_tiny', 'vit_small') for ds in FT_DATA for row in _rows(
        f'crate_{s}_{ds}_ft', ('opt', 'adamw', CRATE_FT), ('lr', 5e-5, CRATE_FT), ('weight_decay', 0.01, CRATE_FT),
        ('batch', 512, CRATE_FT),
        ('aa', 'tv-rand-n2-m14', f'App. B.1.2: RandAugment n = 2, m = 14; {CRATE_FT_PY}: torchvision RandAugment(2, 14)'),
        ('decay_everything', True, f'{CRATE_FT_PY}: AdamW(net.parameters(), weight_decay=0.01)'),
        # finetune.py: CosineAnnealingLR(optimizer, n_epochs) has eta_min 0 and no warm-up; nn.CrossEntropyLoss()
        ('min_lr', 0.0, f'{CRATE_FT_PY}: CosineAnnealingLR(optimizer, args.n_epochs), eta_min 0'),
        ('warmup_epochs', 0, f'{CRATE_FT_PY}: CosineAnnealingLR, no warm-up'),
        ('label_smoothing', 0.0, f'{CRATE_FT_PY}: nn.CrossEntropyLoss()'),
        ('epochs', 200, 'Ma-Lab-Berkeley/CRATE README: finetune.py --n_epochs 200'),
        ('data_kwargs.crop_pct', 1.0, f'{CRATE_FT_PY}: transform_test = Resize((size, size)), no centre crop'),
        ('data_kwargs.img_size', 224, 'App. B.1.2: resized to 224'), ('dataset_size', FT_DATA[ds], 'data/dataset.py split'),
        ('model', f'crate_{s}_patch16_224' if not s.startswith('vit') else f'{s}_patch16_224', 'Table 1 column'),
        ('initial_checkpoint', f'outputs/crate_{s}_in1k', 'Table 1: fine-tuned from its ImageNet-1k weights'))]
    + [row for s in ('vit_tiny', 'vit_small') for row in _rows(
        f'crate_{s}_in1k', ('model', f'{s}_patch16_224', 'Table 1: ViT-T 5.72M / ViT-S 22.05M'),
        ('model_kwargs.global_pool', 'avg', 'Ma-Lab-Berkeley/CRATE model/vit.py global_pool=True'),
        ('opt', 'lion', 'App. B.1.2: "both CRATE and ViT models"'), ('lr', 2.4e-4, CRATE_B12),
        ('weight_decay', 0.5, CRATE_B12), ('batch', 2048, CRATE_B12), ('warmup_epochs', 5, CRATE_B12),
        ('epochs', 150, CRATE_B12), ('label_smoothing', 0.1, CRATE_B12))]
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
    + [row for name in ('sparsifiner_deit_small_in1k', 'sparsifiner_deit_tiny_384_in1k') for row in _rows(
        name, ('phase_settings.predictor.lr', 3e-4, f'{STRATEGY}.ATTN_RECON.BASE_LR'),
        ('phase_settings.predictor.min_lr', 2e-4, f'{STRATEGY}.ATTN_RECON.FINAL_LR'),
        ('phase_settings.predictor.warmup_epochs', 3, f'{STRATEGY}.ATTN_RECON.WARMUP_EPOCHS'),
        ('phase_settings.predictor.warmup_lr', 0.0, f'{SPARSIFINER} utils.cosine_scheduler start_warmup_value=0'),
        ('phase_settings.predictor.warmup_prefix', True, f'{SPARSIFINER} utils.cosine_scheduler: cosine after warm-up'),
        ('phase_settings.joint.lr', 8e-5, f'{STRATEGY}.CLS_DISTILL.BASE_LR'),
        ('phase_settings.joint.min_lr', 2e-6, f'{STRATEGY}.CLS_DISTILL.FINAL_LR'),
        ('phase_settings.joint.warmup_epochs', 3, f'{STRATEGY}.CLS_DISTILL.WARMUP_EPOCHS'),
        ('phase_settings.joint.warmup_lr', 0.0, f'{SPARSIFINER} utils.cosine_scheduler start_warmup_value=0'))]
    + _rows('linformer_deit_small_in1k', ('model', 'deit_small_patch16_224', '§4 Table 4: Linformer on DeiT-S'),
            ('swap_attention.attn', 'linformer', '§4 Table 4'),
            ('swap_attention.num_landmarks', 50, '§4: Linformer rank = Sparsifiner-S budget (ceil(0.25 x 197))'),
            ('epochs', 45, '§4: identical settings'), ('predictor_epochs', 0, 'no predictor to train'),
            ('phase_settings.joint.lr', 8e-5, f'{STRATEGY}.CLS_DISTILL.BASE_LR'), ('batch', 1344, f'{SPARSIFINER}'))
    + _rows('deit_tiny_384_in1k_ft', ('model_kwargs.img_size', 384, DEIT_384), ('data_kwargs.img_size', 384, DEIT_384),
            ('epochs', 30, DEIT_384), ('lr', 5e-6, f'{DEIT_384}; main.py: lr x batch / 512'), ('batch', 512, DEIT_384),
            ('weight_decay', 1e-8, DEIT_384), ('min_lr', 5e-6, DEIT_384), ('warmup_epochs', 5, 'DeiT main.py'),
            ('initial_checkpoint', 'outputs/deit_tiny_in1k', 'DeiT --finetune from the 224 px weights'))
    + [row for m in ('smixer', 'rp_smixer') for ds in ('cifar10', 'cifar100') for row in _rows(
        f'{m}_{ds}', ('model', f'{m}_cifar', 'App. C.4: S-Mixer / RP S-Mixer, 8 blocks, patch 4'),
        ('opt', 'sgd', 'App. C.4: Nesterov SGD'), ('momentum', 0.9, 'App. C.4'), ('batch', 128, 'App. C.4'),
        ('epochs', 200, 'App. C.4'), ('lr', 0.02, 'App. C.4'))]
    + _rows('rp_mixer_width_cifar10', ('lr', 0.1, 'App. C.5'), ('epochs', 200, 'App. C.5'))
    + _rows('rp_mixer_width_cifar100', ('lr', 0.1, 'App. C.5'), ('epochs', 600, 'App. C.5'))
    + [row for name in ('smixer_depth_cifar10', 'smixer_depth_cifar100', 'smixer_depth_stl10') for row in _rows(
        name, ('model_kwargs.num_tokens', 128, 'App. C.6: S = C = 128'),
        ('model_kwargs.embed_dim', 128, 'App. C.6: S = C = 128'), ('lr', 0.02, 'App. C.4'), ('epochs', 200, 'App. C.4'))]
    + _rows('smixer_stl10', ('lr', 0.02, 'App. C.4'), ('epochs', 200, 'App. C.4'), ('batch', 128, 'App. C.4'),
            ('data_kwargs.img_size', 32, 'App. C.4: resized to 32 x 32 x 3'), ('opt', 'sgd', 'App. C.4: Nesterov SGD'))
    + _rows('rp_mixer_width_stl10', ('lr', 0.1, 'App. C.5'), ('epochs', 2000, 'App. C.5: 2000 epochs on STL-10'))
    + _rows('swmlp_cifar10', ('model_kwargs.depth', 8, 'App. C.4 (ii): eight blocks'), ('lr', 0.02, 'App. C.4'),
            ('epochs', 200, 'App. C.4'), ('model_kwargs.density', 0.1024, 'App. C.4 (ii): p = Omega / m^2 at m = 1,600'))
    + [row for name in ('mixer_fig2_cifar10', 'mixer_fig4_cifar10') for row in _rows(
        name, ('model_kwargs.depth', 3, 'App. C.1: L = 3'), ('model_kwargs.mlp_ratio', 2.0, 'App. C.1: gamma = 2'),
        ('model_kwargs.patch_size', 4, 'App. C.1: patch 4'), ('batch', 128, 'App. C.1'), ('epochs', 600, 'App. C.1'),
        ('lr', 0.01, 'App. C.1'), ('opt', 'adamw', 'App. C.1'))]
    + _rows('mixer_fig2_cifar10', ('model_kwargs.embed_dim', 64, 'App. C.1: S = C = 64'))
    + _rows('mixer_gamma_cifar10', ('lr', 0.02, 'App. C.4 (D.3 states none)'), ('model_kwargs.mlp_ratio', 4.0, 'App. D.2'))
    + [row for name, epochs, patch in (('smixer_patch_cifar10', 200, 4), ('smixer_patch_stl10', 400, 6)) for row in _rows(
        name, ('model_kwargs.depth', 4, 'App. D.6: four blocks'), ('model_kwargs.num_tokens', 64, 'App. D.6: S = C = 64'),
        ('model_kwargs.embed_dim', 64, 'App. D.6'), ('lr', 0.1, 'App. D.6'), ('epochs', epochs, 'App. D.6'),
        ('model_kwargs.patch_size', patch, 'App. D.6'))]
    + _rows('smixer_patch_stl10', ('data_kwargs.img_size', 90, 'App. D.6: STL-10 resized to 90 x 90'))
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
                        ('batch', 128, 'App. A.2'), ('weight_decay', 5e-4, 'App. A.2'),
                        ('lr', 0.1, 'not in the seed: Zagoruyko & Komodakis (WRN)'),
                        ('sched', 'multistep', 'not in the seed: WRN steps the lr'),
                        ('decay_milestones', [60, 120, 160], 'not in the seed: WRN x0.2 at 60, 120, 160'),
                        ('decay_rate', 0.2, 'not in the seed: WRN x0.2'),
                        ('decay_everything', True, 'not in the seed: szagoruyko/wide-residual-networks pytorch/main.py '
                         'SGD(every parameter, weight_decay=5e-4)'))]
    + [row for name in ('resnet50_in1k', 'resnet50_lowrank_in1k', 'resnet50_lowrank_pretrain_in1k') for row in _rows(
        name, ('lr', 0.4, 'App. A.2: He et al. lr 0.1 per 256, at 1,024'),
        ('sched', 'step', 'App. A.2: "the same learning-rate schedule as He et al.": step decay'),
        ('decay_rate', 0.1, 'He et al.: divide by 10'),
        ('decay_epochs', 30, 'not in the seed: the usual 90-epoch form of He et al.\'s plateaus'))]
    + _rows('wrn28_10_lowrank_cifar100', ('factorize_rank', 0.2, 'Table 2 / 5 rank 0.2'),
            ('factorize_init', 'spectral', 'Table 2 spectral'), ('factor_decay', 'frobenius', 'Table 5 Frobenius decay'),
            ('factorize_include', ['vision'], 'App. A.2: every conv but the first'))
    + _rows('wrn28_10_lowrank_pretrain_cifar100', ('factorize_rank', 0.3, 'Table 8'),
            ('factorize_at', 50, 'Table 8: 50 pre-training epochs'))
    # the test images scored whole (timm's 0.875 centre crop upscaled a 32-px image to 36 px and cut its border)
    + [(name, 'data_kwargs.crop_pct', 1.0, 'App. A.2: the standard CIFAR-100 test split') for name in (
        'wrn28_10_cifar100', 'wrn28_10_lowrank_cifar100', 'wrn28_10_lowrank_pretrain_cifar100')]
    + [(name, 'data_kwargs.crop_pct', 1.0, 'App. C.4: images resized to 32 x 32 x 3 (D.6: STL-10 to 90 x 90)')
       for name in ('mixer_ss8_cifar100', 'mixer_ssw_cifar100', 'rp_mixer_width_cifar100', 'rp_mixer_width_stl10',
                    'rp_smixer_cifar100', 'smixer_cifar100', 'smixer_depth_cifar100', 'smixer_depth_stl10',
                    'smixer_patch_stl10', 'smixer_stl10')]
    # the training transform's resampling (timm's --train-interpolation), as each public code sets it
    + [(name, 'train_interpolation', 'bicubic', 'facebookresearch/deit main.py --train-interpolation bicubic; '
        f'{SPARSIFINER} src/main.py --train_interpolation bicubic') for name in (
        'deit_small_in1k', 'deit_tiny_in1k', 'deit_tiny_384_in1k_ft', 'sparsifiner_deit_small_in1k',
        'sparsifiner_deit_tiny_384_in1k', 'linformer_deit_small_in1k')]
    + [(f'{fam}_{s}_in1k', 'train_interpolation', 'random', f'{SOFT_MAIN} --train-interpolation random')
       for fam in ('soft', 'softpp') for s in ('tiny', 'small', 'medium', 'large')]
    + [(name, 'train_interpolation', 'random', "App. C.5 trains with timm: train.py's --train-interpolation random")
       for name in ('mixer_b16_in1k', 'mixer_b_w_in1k')]
    # the held-out images' resize and crop, as each public code evaluates
    + [(name, 'data_kwargs.interpolation', 'bicubic', 'facebookresearch/deit datasets.py: Resize(size, interpolation=3); '
        f'{SPARSIFINER} src/datasets.py the same') for name in (
        'deit_small_in1k', 'deit_tiny_in1k', 'deit_tiny_384_in1k_ft', 'sparsifiner_deit_small_in1k',
        'sparsifiner_deit_tiny_384_in1k', 'linformer_deit_small_in1k')]
    + [('sparsifiner_deit_tiny_384_in1k', 'data_kwargs.crop_pct', 1.0,
        f'{SPARSIFINER} src/datasets.py: at 384 px Resize((384, 384)), no crop')]
    + [row for fam in ('soft', 'softpp') for s in ('tiny', 'small', 'medium', 'large') for row in _rows(
        f'{fam}_{s}_in1k', ('data_kwargs.crop_pct', 0.9, f"{SOFT_MAIN}: eval loader at the default_cfg's crop_pct "
                                                          "(timm ViT _cfg() 0.9)"),
        ('data_kwargs.interpolation', 'bicubic', f"{SOFT_MAIN}: the default_cfg's interpolation (bicubic)"))]
    + _rows('resnet50_in1k', ('model', 'resnet50', 'App. A.2: standard ResNet-50'),
            ('batch', 1024, 'App. A.2: TPU v2-8, 128 per core'))
    + _rows('resnet50_lowrank_in1k', ('factorize_rank', 0.5, 'Table 3 / 6 rank 0.5'), ('factor_decay', 'frobenius', 'Table 6'))
    + _rows('resnet50_lowrank_pretrain_in1k', ('factorize_at', 45, 'Table 9: 45 pre-training epochs'))
    + _rows('gpt2_lm1b', ('data_kwargs.seq_len', 256, 'App. A.2: sequence length 256'))
    + _rows('gpt2_lowrank_lm1b', ('factorize_rank', 0.625, 'App. A.2: rank 62.5% (Tables 4 / 7 print 0.62)'),
            ('factorize_include', ['lm'], 'App. A.2: QKV and both FFN matrices'),
            ('factorize_lr_scale', 0.5, 'App. A.2: halve the base lr'))
    + _rows('gpt2_lowrank_pretrain_lm1b', ('factorize_rank', 0.625, 'App. A.2'),
            ('lr', 5e-4, 'App. A.2: the dense steps at the base lr (gpt2_lm1b)'),
            ('factorize_lr_scale', 0.5, 'App. A.2: halve the lr at the switch'),
            ('factorize_at', 1, 'App. A.2: 40K dense steps'))
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


LOW_RANK_LR = [
    ('wrn28_10_lowrank_cifar100', 'wrn28_10_cifar100', 0.5, 'Table 2 = Table 5 at lr scale 0.5'),
    ('wrn28_10_lowrank_pretrain_cifar100', 'wrn28_10_cifar100', 0.5, 'Table 8 0-epoch rows = Table 2'),
    ('resnet50_lowrank_in1k', 'resnet50_in1k', 1.0, 'Table 3 = Table 6 at lr scale 1.0'),
    ('resnet50_lowrank_pretrain_in1k', 'resnet50_in1k', 1.0, 'Table 9 as Table 3'),
    ('gpt2_lowrank_lm1b', 'gpt2_lm1b', 0.5, 'App. A.2: low-rank transformers halve the base lr'),
    ('gpt2_lowrank_pretrain_lm1b', 'gpt2_lm1b', 0.5, 'App. A.2: halve the lr at the switch'),
]


@pytest.mark.parametrize('low, dense, ratio, source', LOW_RANK_LR)
def test_low_rank_recipes_scale_the_dense_lr_as_the_paper(low, dense, ratio, source):
    """One reading of App. A.2 for every low-rank recipe: its written lr is the dense recipe's (the dense epochs of a
    pre-training run train the baseline's network) and factorize_lr_scale is the factorised steps' lr scale."""
    values, dense_values = _loaded(low), _loaded(dense)
    assert values['lr'] == pytest.approx(dense_values['lr']), source
    assert values['lr'] * values.get('factorize_lr_scale', 1.0) == pytest.approx(ratio * dense_values['lr']), source
    for key in ('sched', 'decay_epochs', 'decay_milestones', 'decay_rate'):    # the dense recipe's schedule
        assert values.get(key) == dense_values.get(key), key


TABLE1 = [(f'crate_{s}_{ds}_ft', f'{acc}%') for s, cells in CRATE_TABLE1.items() for ds, acc in cells.items()
          if ds != 'in1k'] + [(f'crate_{s}_in1k', f"{cells['in1k']}%") for s, cells in CRATE_TABLE1.items() if 'in1k' in cells]


@pytest.mark.parametrize('name, number', TABLE1, ids=[n for n, _ in TABLE1])
def test_crate_table1_cells_are_the_recipes_reported_numbers(name, number):
    """CRATE Table 1, every cell with a recipe: the CRATE and ViT columns, ImageNet and four fine-tunes."""
    assert number in load_recipe(name)[1]['reported']


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
        # a YAML '''text''' keeps the quotes: the dry run printed "expects     'ImageNet-1k ...'"
        assert not str(about[key]).startswith(("'", '"')) and not str(about[key]).endswith(("'", '"')), (name, key)
    assert values['dataset_size'] >= 1 and values['data'] and values['model']
    assert values.get('output') == f'outputs/{name}'
    assert isinstance(about.get('world_size', 1), int)
    import timm
    for model in about.get('models', []):          # the models a sweep trains are registered
        assert timm.is_model(model), (name, model)



# a sweep key that stands for a recipe key (Sparsifiner's budget B is set by keys_per_query or keep_ratio)
_SWEEP_KEY_REPLACES = {'keys_per_query': {'keep_ratio'}}


def _builds(model, kwargs):
    import timm
    import torch
    try:
        with torch.device('meta'):
            timm.create_model(model, **kwargs)
    except (TypeError, ValueError):
        return False
    return True


def test_sweep_model_kwargs_name_every_key_the_recipe_sets():
    """--model-kwargs replaces the recipe's whole model_kwargs (docs/recipes.md), so a sweep row that names only the
    swept key trains the registered defaults for the rest: smixer_patch_* said `--model-kwargs patch_size=P (S = C =
    64 kept)` and trained 8 blocks, not D.6's 4; mixer_gamma_cifar10's gamma rows trained 3 blocks at C = 48, not 8 at
    C = 64; swmlp_cifar10's rows 3 blocks with gamma 2, twice its Omega; mixer_b16_in1k's patch rows a 3-block
    gamma-2 Mixer; and mixer_fig4_cifar10's `--model swmlp_cifar` was refused (the recipe's num_tokens)."""
    import re
    checked = 0
    for name in RECIPES:
        values, about = load_recipe(name)
        recipe_kwargs = values.get('model_kwargs') or {}
        text = ' '.join(str(about.get(k) or '') for k in ('sweep', 'notes'))
        for model in about.get('models', []):       # a row's model takes the recipe's mapping, or the sweep gives its own
            assert _builds(model, recipe_kwargs) or f'--model {model} --model-kwargs' in text, (name, model)
        for clause in re.finditer(r'(?:--model ([a-z0-9_]+)\s+)?--model-kwargs((?:\s+[a-z_]+=\S+)+)', text):
            model = clause.group(1) or values['model']
            given = set(re.findall(r'([a-z_]+)=', clause.group(2)))
            given |= {k for g in given for k in _SWEEP_KEY_REPLACES.get(g, ())}
            wanted = {k for k, v in recipe_kwargs.items() if _builds(model, {k: v})}
            assert wanted <= given, (name, model, clause.group(0), sorted(wanted - given))
            checked += 1
    assert checked >= 30


def test_fig4_sw_mlp_rows_have_the_mixers_omega():
    """mixer_fig4_cifar10's SW-MLP side: m = 64 E (patch 4 on 32 px), gamma = 2, p = 64 / E^2 is Omega = 2^19."""
    from structformer.models.mixer_design import sw_density
    assert 'density=p with m = 64 E and p = 64 / E^2' in ' '.join(load_recipe('mixer_fig4_cifar10')[1]['sweep'].split())
    for E in (8, 16, 64):
        assert sw_density(2 ** 19, 64 * E, 2.0) == pytest.approx(64 / E ** 2)


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
    assert "the recipe's stated size; data not read" in out and "the recipe's placeholder" in out
    assert 'optimiser steps per epoch' in out and 'in total over' in out
    assert 'parameters' in out and 'built on the meta device' in out
    assert about['reported'] in out and f"covers      {about['covers']}" in out
    assert "the recipe's own notes" not in out           # as shipped: its notes describe the plan
    assert list(tmp_path.iterdir()) == [], 'a dry run wrote files'


def test_dry_run_says_which_settings_the_recipes_notes_no_longer_describe(dry_run):
    """The notes say 'no RandAugment, Mixup ...'; with --mixup given (or -c a run's config.yaml) the plan printed
    them unchanged under a line showing mixup 0.8: it now names the settings changed."""
    rc, out, _ = dry_run(['train', '--recipe', 'crate_tiny_in1k', '--dry-run', '--mixup', '0.8', '--model-ema',
                          '--data-kwargs', 'check=decode'])
    assert rc == 0 and 'no RandAugment, Mixup' in out
    assert "(the recipe's own notes: -c / the flags given changed data_kwargs, mixup, model_ema)" in out


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


def test_dry_run_builds_the_model_at_the_size_training_builds_it(dry_run):
    """mixer_b16_in1k builds the mixer_cifar class at 224 px (model_kwargs img_size): the plan says 3x224x224, not
    the class's 32 px default; a language model's input is its context."""
    for name in ('mixer_b16_in1k', 'mixer_b_w_in1k'):
        rc, out, _ = dry_run(['train', '--recipe', name, '--dry-run'])
        assert rc == 0 and 'input       3x224x224, 1000 classes' in out, out
    rc, out, _ = dry_run(['train', '--recipe', 'gpt2_lm1b', '--dry-run'])
    assert rc == 0 and 'input       T=256 tokens' in out


def test_dry_run_prints_the_halved_lr_of_a_factorised_run(dry_run):
    """gpt2_lowrank_lm1b: lr 5e-4, x0.5 while factorised, which is the whole run: the plan names the halved peak
    and every scheduled value is of it; the pre-training recipe halves from its switch on."""
    rc, out, _ = dry_run(['train', '--recipe', 'gpt2_lowrank_lm1b', '--dry-run'], world_size=8)
    assert rc == 0
    assert 'peak 0.0005 (--lr as given); x 0.5 while factorised (the whole run): peak 0.00025' in out
    assert 'end of warm-up (step 2,000): 0.00025 |' in out
    rc, out, _ = dry_run(['train', '--recipe', 'gpt2_lowrank_pretrain_lm1b', '--dry-run'], world_size=8)
    assert rc == 0 and 'x 0.5 while factorised (from epoch 2 on): peak 0.00025' in out
    assert 'end of warm-up (step 2,000): 0.0004999 |' in out     # dense: the full base lr (timm's cosine at t)


def test_dry_run_prints_each_phase_schedule(dry_run):
    """Sparsifiner's stages: each its own optimiser and schedule, stage 1 3e-4 -> 2e-4 after 3 warm-up epochs from 0
    (warmup_prefix), stage 2 8e-5 -> 2e-6, at the recipe's 1,344 images a step (5 x 953 steps, then 40 x 953)."""
    rc, out, _ = dry_run(['train', '--recipe', 'sparsifiner_deit_small_in1k', '--dry-run'], world_size=8)
    assert rc == 0, out
    assert 'every phase its own optimiser (fresh state) and schedule' in out
    assert 'phase predictor (epochs 1-5): adamw, weight decay 0.05, peak 0.0003; cosine, warm-up 3 epochs from 0' in out
    assert 'phase joint (epochs 6-45): adamw, weight decay 0.05, peak 8e-05; cosine, warm-up 3 epochs from 0' in out
    assert 'end of warm-up (step 2,859): 0.0003 | half-way (step 2,382): ' in out
    assert 'end (step 4,765): 0.0002' in out and 'end (step 42,885): 2e-06' in out


def test_dry_run_says_whether_the_starting_weights_exist(tmp_path, dry_run):
    """A fine-tuning recipe names its pre-training run: not found until it exists, then found with its epoch."""
    rc, out, _ = dry_run(['train', '--recipe', 'crate_tiny_cifar10_ft', '--dry-run'])
    assert rc == 0
    assert ("starts from   outputs/crate_tiny_in1k: NOT FOUND here; train `--recipe crate_tiny_in1k` first" in out)
    run = _trained('crate_tiny_in1k', tmp_path / 'runs')
    rc, out, _ = dry_run(['train', '--recipe', 'crate_tiny_cifar10_ft', '--initial-checkpoint', run, '--dry-run'])
    assert rc == 0 and f'starts from   {run}: found, epoch 1 of crate_tiny_patch16_224' in out


def test_dry_run_checks_the_data_path_and_the_device(tmp_path, dry_run):
    """A path given with --data must exist (training needs it); the recipe's placeholder is not looked at; a
    device this machine lacks is refused, as training refuses it. Each refusal is one line naming the flag."""
    missing = tmp_path / 'no_such_folder'
    rc, out, err = dry_run(['train', '--recipe', 'wrn28_10_cifar100', '--data', f'imagefolder:{missing}', '--dry-run'])
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f'--data imagefolder:{missing}' in err and 'does not exist' in err
    (tmp_path / 'imgs').mkdir()
    rc, out, _ = dry_run(['train', '--recipe', 'wrn28_10_cifar100', '--data', f'imagefolder:{tmp_path / "imgs"}',
                          '--dry-run'])
    assert rc == 0 and f'{tmp_path / "imgs"} exists' in out
    import torch
    if not torch.cuda.is_available():
        rc, _, err = dry_run(['train', '--recipe', 'wrn28_10_cifar100', '--device', 'cuda', '--dry-run'])
        assert rc == 2 and len(err.strip().splitlines()) == 1 and '--device cuda' in err and 'CUDA' in err


def test_another_familys_model_is_refused_with_a_recipe(dry_run):
    """--recipe crate_tiny_in1k --model soft_digits: refused naming both and --allow-other-model; with the flag the
    plan runs but never prints CRATE-T's 66.7%; a registered shrink (crate_digits) and a model the recipe's sweep
    trains (mixer_b16_in1k: rp_mixer_cifar) are accepted, their plans without the recipe's number either."""
    rc, _, err = dry_run(['train', '--recipe', 'crate_tiny_in1k', '--model', 'soft_digits', '--dry-run'])
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert '--model soft_digits' in err and '--recipe crate_tiny_in1k' in err and '--allow-other-model' in err
    assert 'crate_digits' in err                                    # the shrink it would take
    rc, _, err = dry_run(['train', '--recipe', 'crate_tiny_in1k', '--model', 'crate_large_patch16_224', '--dry-run'])
    assert rc == 2 and 'of the crate family' in err and '--allow-other-model' in err     # another size
    for argv in (['--model', 'soft_digits', '--allow-other-model'], ['--model', 'crate_digits'],
                 ['--model-kwargs', 'depth=2', 'patch_size=2']):
        rc, out, err = dry_run(['train', '--recipe', 'crate_tiny_in1k', *argv, '--data', 'digits', '--dry-run'])
        assert rc == 0, err
        assert '66.7' not in out and "reported    not shown: the recipe's number is for crate_tiny_patch16_224" in out
    rc, out, err = dry_run(['train', '--recipe', 'mixer_b16_in1k', '--model', 'rp_mixer_cifar', '--dry-run'])
    assert rc == 0, err
    assert "one of the rows in the recipe's sweep" in out and '76.44' not in out



def test_mixer_b16_recipe_takes_the_registered_mixer_b16(dry_run):
    """docs/mixer.md registers sparse_mixer_b16_224 / rp_mixer_b16_224 as App. C.5's Mixer-B/16 and RP-Mixer, yet
    `--recipe mixer_b16_in1k --model sparse_mixer_b16_224` was refused as "another size of the mixer family". They are
    the recipe's model (same class and sizes, same parameter count), so the recipe takes them."""
    import re
    counts = []
    for model in ('mixer_cifar', 'sparse_mixer_b16_224', 'rp_mixer_b16_224'):
        rc, out, err = dry_run(['train', '--recipe', 'mixer_b16_in1k', '--model', model, '--dry-run'])
        assert rc == 0, err
        counts.append(re.search(r'parameters \(([\d,]+);', out).group(1))
    assert counts == ['61,766,872'] * 3


def test_a_second_recipe_is_refused(capsys):
    with pytest.raises(SystemExit) as stop:              # argparse's own error: usage line + one message line
        main(['train', '--recipe', 'crate_tiny_in1k', '--recipe', 'crate_base_in1k', '--dry-run'])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2
    assert '--recipe given twice' in err and 'crate_tiny_in1k' in err and 'crate_base_in1k' in err


def test_phase_settings_flag_merges_over_the_recipes(tmp_path):
    cfg = train_config(build_parser().parse_args(['train', '--recipe', 'sparsifiner_deit_small_in1k',
                                                   '--phase-settings', 'predictor', 'warmup_epochs=0', 'lr=1e-4']))
    assert cfg.phase_settings['predictor'] == {'lr': 1e-4, 'min_lr': 2e-4, 'warmup_epochs': 0, 'warmup_lr': 0.0,
                                               'warmup_prefix': True}
    assert cfg.phase_settings['joint']['lr'] == 8e-5                 # the other phase as the recipe has it


@pytest.mark.parametrize('flags, needle', [
    (['--opt', 'sgd', '--opt-betas', '0.9', '0.99'], '--opt sgd does not take --opt-betas'),
    (['--opt', 'lion', '--opt-eps', '1e-8'], '--opt lion does not take --opt-eps'),
    (['--mixup', '0.8', '--data', 'pysource'], 'language-modelling'),
    (['--mixup', '0.8', '-b', '7'], 'even -b/--batch-size')])
def test_dry_run_refuses_what_training_refuses(flags, needle, dry_run):
    """The plan printed 'sgd ... betas (0.9, 0.99)' and exit 0 for settings the run then refused: it now makes the
    run's optimiser (on the meta model) and Mixup, and stops on their refusals."""
    rc, _, err = dry_run(['train', *flags, '--dry-run'])
    assert rc == 2 and needle in err, err


def test_lr_given_over_a_recipes_lr_base_is_the_peak_lr(dry_run):
    """`--recipe crate_base_in1k --lr 0.01` trained at the recipe's scaled lr_base, the --lr given silently ignored
    (timm's train.py takes --lr when it is given); --lr with --lr-base both as flags is refused."""
    rc, out, _ = dry_run(['train', '--recipe', 'crate_base_in1k', '--lr', '0.01', '--dry-run'])
    assert rc == 0 and 'peak 0.01 (--lr as given)' in out
    rc, _, err = dry_run(['train', '--lr', '0.01', '--lr-base', '0.001', '--dry-run'])
    assert rc == 2 and '--lr 0.01 and --lr-base 0.001' in err


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
    assert 'Table 2' in row['covers'] and 'Table 3' in row['covers'] and 'tied_output=true' in row['sweep']
    assert 'Table 2 and Table 3: every row (sweep)' in out and 'Table 1: CRATE-T, Oxford-IIIT-Pets' in out


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
    'swmlp': ['img_size=8', 'patch_size=2', 'embed_dim=4', 'depth=2', 'density=0.5'],
    'gpt': ['embed_dim=64', 'num_heads=2', 'depth=2'],
    'wrn': ['depth=10', 'widen_factor=2'],
    'resnet': ['layers=(1,1,1,1)', 'stem_width=8', 'channels=(8,16,32,64)'],   # ResNet-50's blocks, 1/8 wide
}
REPRESENTATIVES = ['crate_base_in1k', 'soft_tiny_in1k', 'sparsifiner_deit_small_in1k', 'mixer_b16_in1k',
                   'wrn28_10_lowrank_pretrain_cifar100', 'gpt2_lowrank_lm1b']


def _family(model: str) -> str:
    for prefix, family in (('crate', 'crate'), ('soft', 'soft'), ('deit', 'vit'), ('sparsifiner', 'vit'), ('vit', 'vit'),
                           ('gpt', 'gpt'), ('wrn', 'wrn'), ('resnet', 'resnet'), ('swmlp', 'swmlp')):
        if model.startswith(prefix):
            return family
    return 'mixer'


def _small_argv(name: str, values: dict, output: Path) -> list:
    family = _family(values['model'])
    argv = ['train', '--recipe', name, '--output', str(output), '--no-progress', '--device', 'cpu', '--workers', '0',
            '-b', '8', '--grad-accum-steps', '1', '--warmup-epochs', '0', '--log-interval', '0']
    # batch 8 scales an --lr-base recipe's peak below its floors, which train refuses where the schedule reads them:
    # no warm-up (so its warmup_lr is read by nothing, and --warmup-lr would be refused as idle), and the end of a
    # cosine / tanh / poly schedule at 0 (step and multistep read no --min-lr: there it would be refused as idle)
    if values.get('sched', 'cosine') in CYCLING:
        argv += ['--min-lr', '0']
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
        stages = ['--predictor-epochs', '0' if values.get('predictor_epochs') == 0 else '1']   # Linformer: joint only
        argv += ['--factorize-at', '1'] if values.get('factorize_at') else stages
    else:
        argv += ['--epochs', '1', '--limit-train-batches', '2']
    if values.get('mixup_off_epoch'):
        argv += ['--mixup-off-epoch', '0']
    for phase in values.get('phase_settings', {}):     # a one-epoch phase: no warm-up; the floor below batch 8's peak
        argv += ['--phase-settings', phase, 'warmup_epochs=0', 'min_lr=0']
    for transform in values.get('transforms', []):      # Linformer's k at the 17 tokens of an 8 px image
        if 'num_landmarks' in transform['kwargs']:
            argv += ['--transform', transform['name'], *(f"{k}={v}" for k, v in transform['kwargs'].items()
                                                         if k != 'num_landmarks'), 'num_landmarks=4']
    return argv


def _teacher_recipe(student: str) -> str:
    values = load_recipe(student)[0]
    if values.get('model_kwargs', {}).get('img_size') == 384:
        return 'deit_tiny_384_in1k_ft'                  # DeiT's 384 px fine-tune of the 224 px run
    model = values['model']
    return 'deit_small_in1k' if 'small' in model else 'deit_tiny_in1k'


def _trained(recipe: str, tmp_path: Path) -> str:
    """The run folder of `recipe` trained at the tiny size: the teacher or pre-training run another recipe needs
    (itself started from its own pre-training run where it names one)."""
    values = load_recipe(recipe)[0]
    argv = _small_argv(recipe, values, tmp_path / recipe)
    if values.get('initial_checkpoint'):
        argv += ['--initial-checkpoint', _trained(Path(values['initial_checkpoint']).name, tmp_path)]
    rc, _, err = _run(argv)
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
    """The other recipes too (all 84 take about 45 s on 2 cores at this size); fine-tuning recipes start from
    their pre-training recipe's run."""
    _two_steps(name, tmp_path)


def test_warmup_help_states_the_default_the_config_resolves():
    """`train --help` said --warmup-epochs defaults to 2; a 5-epoch run warms up for 0.5 (min(2, epochs / 10))."""
    from structformer.train.config import TrainConfig
    text = ' '.join(_train_help().split())          # argparse wraps the help at the terminal's width
    assert 'linear warm-up length in epochs (2, or a tenth of --epochs if less)' in text
    assert TrainConfig(epochs=5).resolved_warmup_epochs() == 0.5 and TrainConfig(epochs=300).resolved_warmup_epochs() == 2


def _train_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == '_SubParsersAction')
    return sub.choices['train'].format_help()


def test_dry_run_names_the_weight_decay_each_parameter_gets(dry_run):
    """WRN's code decays every parameter (the WRN recipes' decay_everything); the factors of a Frobenius-decay run
    leave the optimiser's decay (train/parts.py), which the plan's 'on every parameter' did not say."""
    rc, out, _ = dry_run(['train', '--recipe', 'wrn28_10_lowrank_cifar100', '--dry-run'])
    assert rc == 0
    assert 'weight decay 0.0005 on every parameter; the factors by Frobenius decay instead' in out
    rc, out, _ = dry_run(['train', '--recipe', 'wrn28_10_cifar100', '--dry-run'])
    assert rc == 0 and 'weight decay 0.0005 on every parameter, momentum 0.9' in out


def _docs_recipe_rows() -> dict:
    """docs/recipes.md's table of recipes: name -> its cells (covers, number, single node, multi-node, verified)."""
    import re
    text = (Path(__file__).resolve().parents[1] / 'docs' / 'recipes.md').read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip('|').split(' | ')]
        if line.startswith('| `') and len(cells) == 6:
            rows[cells[0].strip('`')] = cells[1:] + [re.findall(r'`([^`]+)`', cells[3]), re.findall(r'`([^`]+)`', cells[4])]
    return rows


def test_docs_recipes_table_is_the_recipes():
    """docs/recipes.md's table, row by row, against the recipe files: its cells, its reported number, and that
    each command trains that recipe on the processes it names at the recipe's global batch (the multi-node
    column's -b x --grad-accum-steps x nodes x GPUs). The table was written by hand and nothing checked it."""
    import shlex

    from structformer.train.config import TrainConfig
    rows = _docs_recipe_rows()
    assert set(rows) == set(RECIPES), set(rows) ^ set(RECIPES)
    for name in RECIPES:
        covers, number, _, _, verified, single, multi = rows[name]
        values, about = load_recipe(name)
        config = TrainConfig.from_dict(values)
        world = int(about.get('world_size', 1))
        assert (covers, number) == (about['covers'], about['reported']), name
        assert verified.startswith('dry run; 2 CPU steps (' + ('default test' if name in REPRESENTATIVES
                                                                else 'all-recipes run') + ')'), name
        argv = shlex.split(single[0])
        expected = ['torchrun', '--nproc_per_node', str(world)] if world > 1 else ['structformer', 'train', '--recipe']
        assert argv[:3] == expected, (name, argv)
        assert argv[argv.index('--recipe') + 1] == name and ('--teacher' in argv) == bool(values.get('teacher')), name
        if world == 1:
            assert not multi, name
            continue
        argv = shlex.split(multi[0])
        flag = lambda f, default: int(argv[argv.index(f) + 1]) if f in argv else default       # noqa: E731
        processes = flag('--nnodes', 1) * flag('--nproc_per_node', 1)
        assert argv[argv.index('--recipe') + 1] == name and ('--teacher' in argv) == bool(values.get('teacher')), name
        assert (flag('-b', config.batch_size) * flag('--grad-accum-steps', config.grad_accum_steps) * processes
                == config.effective_batch(world)), name


def test_fig4_recipe_names_the_command_that_computes_its_right_panel():
    """Fig. 4 (right) is σ_max at init (analysis/mixer_spectra.py, run by `structformer reproduce mixer`); the
    recipe sent users to `structformer analyze`, which refuses a Mixer checkpoint (CRATE / --cka / --interpolate).
    Its (C, S) pairs are the ones the spectra are drawn at."""
    import re
    from structformer.analysis.mixer_spectra import FIG4_CHANNELS
    from structformer.models.mixer_design import fixed_omega_pairs
    about = load_recipe('mixer_fig4_cifar10')[1]
    covers = ' '.join(about['covers'].split())
    assert 'structformer reproduce mixer' in covers and 'structformer analyze' not in covers
    pairs = [tuple(map(int, p)) for p in re.findall(r'\((\d+), (\d+)\)', ' '.join(about['sweep'].split()))]
    assert [c for c, _ in pairs] == list(FIG4_CHANNELS)
    assert pairs == [(r['channels'], r['tokens']) for r in fixed_omega_pairs(2 ** 19, FIG4_CHANNELS, 2.0)]


@pytest.mark.parametrize('name', RECIPES)
def test_the_papers_batch_in_devices_is_the_recipes_effective_batch(name):
    """`about.devices` is printed by the dry run as "paper ran ... batch N"; mixer_fig2_cifar10 and
    mixer_fig4_cifar10 said batch 1,024 (C.3's Table 1 runs) where C.1 / C.2 and the recipes train with 128."""
    import re
    from structformer.train.config import TrainConfig
    values, about = load_recipe(name)
    said = re.findall(r'batch (?:of )?([\d,]+)', str(about['devices']))
    if said:
        world = int(about.get('world_size', 1))
        assert int(said[-1].replace(',', '')) == TrainConfig.from_dict(values).effective_batch(world), about['devices']


@pytest.mark.parametrize('name', ['smixer_cifar10', 'smixer_cifar100'])
def test_fig_s2_rows_give_the_gamma_4_pairs(name):
    """Fig. S.2's gamma = 4 Mixers: the sweep said only "gamma = 4 (mixer_cifar, lr 0.1) at C = 16 ... 173", after the
    gamma = 1 pairs: those S at gamma 4 are the Omega = 2^20 rows only (4 x 2^18), never Fig. S.2's 2^18 ones, and
    `--model mixer_cifar` alone trains its 3 blocks at gamma 2. It now gives the flags and the S that
    `structformer design --gamma 4` computes at both Omega."""
    import re
    from structformer.models.mixer_design import fixed_omega_pairs
    sweep = ' '.join(load_recipe(name)[1]['sweep'].split())
    assert '--model mixer_cifar (rp_mixer_cifar for RP) --model-kwargs depth=8 mlp_ratio=4.0' in sweep
    channels = [16, 32, 48, 64, 83, 113, 173]
    said = [int(s) for s in re.search(r'\(S = ([\d, ]+)\)', sweep).group(1).split(', ')]
    assert said == [r['tokens'] for r in fixed_omega_pairs(2 ** 18, channels, 4.0)]
    assert [r['tokens'] for r in fixed_omega_pairs(2 ** 20, channels, 4.0)] == \
        [r['tokens'] for r in fixed_omega_pairs(2 ** 18, channels, 1.0)] == [173, 113, 83, 64, 48, 32, 16]
