"""The GPU suite's runs: one 224-px model per family through `structformer train`, and the image folder they read.

Every family run trains with the paper recipes' switches on at once: channels-last, the weight average
(--model-ema), gradient accumulation over 2 batches, Mixup / CutMix; precision is the one thing that differs
between the float32, float16 (GradScaler) and bfloat16 runs of a family, so their per-step losses compare the same
batches through the same steps. Sizes are the smallest that exercise everything: 8 images a batch, 4 batches
(2 optimiser steps) an epoch, 16 validation images.
"""
import os
from pathlib import Path
from typing import Callable, Dict, Tuple

import numpy as np

DEVICE = os.environ.get('STRUCTFORMER_GPU_SUITE_DEVICE', 'cuda')
CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, SIDE = 4, 16, 4, 40

FAMILIES: Dict[str, dict] = {
    'crate': dict(model='crate_tiny_patch16_224'),
    'soft': dict(model='soft_tiny_224'),
    'soft_official': dict(model='soft_tiny_official_224'),
    # with its dense teacher through both stages (predictor, then joint)
    'sparsifiner': dict(model='sparsifiner_deit_tiny_patch16_224', epochs=2, predictor_epochs=1),
    'mixer': dict(model='rp_mixer_b16_224'),
    # dense for an epoch, then factorised at rank 0.5 (the optimiser and the weight average follow)
    'lowrank': dict(model='vit_small_patch16_224', epochs=2, factorize_rank=0.5, factorize_at=1),
    'wide_resnet': dict(model='wrn_16_4'),                      # a CIFAR network: the folder read at 32 px
}
FEATURES = dict(channels_last=True, model_ema=True, model_ema_decay=0.9, grad_accum_steps=2, mixup=0.8, cutmix=1.0)
PRECISIONS = {'float32': dict(), 'float16': dict(amp=True, amp_dtype='float16'),
              'bfloat16': dict(amp=True, amp_dtype='bfloat16')}


def image_folder_at(root: Path) -> Path:
    """train/ and val/ of CLASSES classes, SIDE-px RGB PNGs whose mean colour depends on the class (so a few
    steps learn something), read at each model's own input size."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, count in (('train', TRAIN_PER_CLASS), ('val', VAL_PER_CLASS)):
        for c in range(CLASSES):
            folder = root / split / f'class{c}'
            folder.mkdir(parents=True)
            tint = np.array([60 * c, 255 - 60 * c, 128], dtype=np.float32)
            for i in range(count):
                pixels = np.clip(tint + rng.normal(0, 40, (SIDE, SIDE, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f'{i}.png')
    return root


def config(output: Path, folder: Path, **overrides):
    """A TrainConfig of the suite's size on DEVICE."""
    from structformer.train import TrainConfig
    values = dict(data=f'imagefolder:{folder}', epochs=1, batch_size=8, eval_batch_size=16, limit_train_batches=4,
                  opt='adamw', lr=1e-4, sched='none', warmup_epochs=0, num_workers=0, log_interval=0, keep_last=1,
                  device=DEVICE, output=str(output))
    values.update(overrides)
    return TrainConfig(**values)


def validation_batch(checkpoint: Path, device: str = DEVICE, ema: bool = False):
    """The run's held-out images and labels, as `structformer eval` reads them (its data, size and normalisation),
    and the trained model (float32, eval mode; `ema`: its weight average) on `device`."""
    import torch

    from structformer.data import build_datasets
    from structformer.train import load_model
    model, state = load_model(checkpoint, ema=ema)
    cfg = state['config']
    _, val, _ = build_datasets(cfg['data'], seed=cfg['seed'], val_fraction=cfg['val_fraction'], **cfg['data_kwargs'])
    images, labels = torch.utils.data.default_collate([val[i] for i in range(len(val))])
    return model.to(device).eval(), images.to(device), labels.to(device)


def train_teacher(output: Path, folder: Path) -> Path:
    """The dense DeiT-T that Sparsifiner's student distils from (one epoch, float32)."""
    from structformer.train import train
    train(config(output, folder, model='deit_tiny_patch16_224'), progress=False)
    return output


class FamilyRuns:
    """Family runs made on first use and kept for the session: `get(family, precision)` -> (TrainResult, the loss
    of every optimiser step)."""

    def __init__(self, root: Path, folder: Path, teacher: Callable[[], Path]):
        self.root, self.folder, self.teacher = root, folder, teacher
        self.done: Dict[Tuple[str, str], tuple] = {}

    def get(self, family: str, precision: str = 'float32'):
        key = (family, precision)
        if key not in self.done:
            from structformer.train import train

            from .checks import recorded_step_losses
            extra = dict(FAMILIES[family])
            if family == 'sparsifiner':
                extra['teacher'] = str(self.teacher())
            with recorded_step_losses() as losses:
                result = train(config(self.root / f'{family}_{precision}', self.folder, **FEATURES, **extra,
                                      **PRECISIONS[precision]), progress=False)
            self.done[key] = (result, list(losses))
        return self.done[key]
