"""`TrainConfig.compile` (`structformer train --compile`): the model trains compiled, and its checkpoint
loads into a plain, uncompiled model with the same weights and outputs."""
import torch

from structformer.train import TrainConfig, load_model, train
from structformer.train.engine import Trainer


def test_compiled_training_saves_plain_loadable_checkpoints(tmp_path):
    torch._dynamo.reset()
    config = TrainConfig(model='crate_digits', data='digits', epochs=1, limit_train_batches=2, compile='eager',
                         output=str(tmp_path / 'run'))
    trainer = Trainer(config, progress=False)
    result = trainer.fit()
    assert trainer.model._compiled_call_impl is not None            # it did run compiled
    model, _ = load_model(result.last_checkpoint)
    assert model._compiled_call_impl is None
    assert model.state_dict().keys() == trainer.model.state_dict().keys()
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        # eager backend: the same kernels through dynamo's graph, so only rounding could differ
        torch.testing.assert_close(trainer.model.eval()(x), model.eval()(x), rtol=1e-5, atol=1e-5)


def test_compile_backend_is_checked():
    import pytest
    with pytest.raises(ValueError, match='--compile'):
        TrainConfig(compile='no_such_backend').validate()
