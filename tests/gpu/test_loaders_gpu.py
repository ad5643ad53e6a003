"""Loaders feeding the GPU: worker processes and pinned memory, from an image folder and from webdataset shards,
through `structformer train` (the engine pins host memory when it trains on CUDA, train/engine.py)."""
import pytest
import torch

from .runs import DEVICE, config

pytestmark = pytest.mark.xdist_group('loaders')


def _check_feeding(trainer, workers: int) -> None:
    loader = getattr(trainer.train_loader, 'loader', trainer.train_loader)     # a stream's loader is cut per epoch
    assert loader.num_workers == workers
    images, targets = next(iter(trainer.train_loader))
    assert images.shape[-1] == 224 and targets.dtype == torch.int64
    if DEVICE == 'cuda':
        assert loader.pin_memory and images.is_pinned() and targets.is_pinned()
        eval_images, _ = next(iter(trainer.eval_loader))
        assert eval_images.is_pinned()


def test_image_folder_with_workers_and_pinned_memory(tmp_path, image_folder):
    from structformer.train.engine import Trainer
    trainer = Trainer(config(tmp_path / 'run', image_folder, model='vit_tiny_patch16_224', num_workers=2,
                             data_kwargs={'augment': True}, amp=True, amp_dtype='bfloat16'), progress=False)
    result = trainer.fit()
    assert result.final['step'] == 4 and torch.isfinite(torch.tensor(result.final['train_loss']))
    _check_feeding(trainer, 2)


def test_shards_with_workers_and_pinned_memory(tmp_path, image_folder):
    pytest.importorskip('webdataset')
    from structformer.data.shard_writer import shard_patterns, write_shards
    from structformer.train.engine import Trainer
    info = write_shards(str(image_folder), str(tmp_path / 'shards'), shard_size=16)
    data = shard_patterns(str(tmp_path / 'shards'), info)
    trainer = Trainer(config(tmp_path / 'run', image_folder, data=data, model='vit_tiny_patch16_224', num_workers=2,
                             amp=True, amp_dtype='bfloat16'), progress=False)
    result = trainer.fit()
    assert result.final['step'] >= 1 and torch.isfinite(torch.tensor(result.final['train_loss']))
    _check_feeding(trainer, 2)
