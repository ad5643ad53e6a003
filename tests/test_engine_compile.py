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


def test_compile_mode_is_checked_against_inductor():
    import pytest
    from structformer.errors import UsageError
    with pytest.raises(UsageError, match=r"--compile-mode='fast' is not an inductor mode: accepted .*reduce-overhead"):
        TrainConfig(compile='inductor', compile_mode='fast').validate()
    with pytest.raises(UsageError, match=r"--compile-mode='reduce-overhead' is a mode of the inductor backend.*eager"):
        TrainConfig(compile_mode='reduce-overhead').validate()
    with pytest.raises(UsageError, match=r"not with --compile='eager'"):
        TrainConfig(compile='eager', compile_mode='default').validate()
    TrainConfig(compile='inductor', compile_mode='max-autotune-no-cudagraphs').validate()


def test_timm_flag_names_reach_the_config(tmp_path, capsys):
    """timm's --torchcompile / --torchcompile-mode spell --compile / --compile-mode; a mode without inductor is
    refused in one line, before anything is written."""
    from structformer.cli import main
    out = tmp_path / 'run'
    assert main(['train', '--model', 'crate_digits', '--torchcompile-mode', 'reduce-overhead', '--output', str(out),
                 '--no-progress']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and '--compile-mode' in err[0] and 'inductor' in err[0]
    assert not out.exists()


def test_the_mode_reaches_torch_compile(tmp_path, monkeypatch):
    """--compile inductor --compile-mode M compiles the model with mode M (the spy stands in for inductor, which
    would take minutes here; the run then trains eager)."""
    calls = []
    monkeypatch.setattr(torch.nn.Module, 'compile', lambda self, **kwargs: calls.append(kwargs))
    config = TrainConfig(model='crate_digits', data='digits', epochs=1, limit_train_batches=1, compile='inductor',
                         compile_mode='max-autotune-no-cudagraphs', output=str(tmp_path / 'run'))
    train(config, progress=False)
    assert calls == [{'backend': 'inductor', 'mode': 'max-autotune-no-cudagraphs'}]


def test_tf32_switches_are_set_for_a_cuda_run_and_restored():
    """--tf32 sets timm's three switches for a run on CUDA and puts torch's back after it; off CUDA or without the
    flag it touches nothing (the switches are process state: no GPU is needed to read them)."""
    from structformer.train.precision import tf32_switches

    def state():
        return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                torch.backends.cudnn.benchmark)

    before = state()
    with tf32_switches(torch.device('cuda'), True):
        assert state() == (True, True, True)
    assert state() == before
    for device, on in ((torch.device('cpu'), True), (torch.device('cuda'), False)):
        with tf32_switches(device, on):
            assert state() == before
    try:                                                 # restored after a failure too
        with tf32_switches(torch.device('cuda'), True):
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert state() == before


def test_tf32_on_a_cpu_run_says_it_changes_nothing(tmp_path, capsys):
    config = TrainConfig(model='crate_digits', data='digits', epochs=1, limit_train_batches=1, tf32=True,
                         output=str(tmp_path / 'run'))
    trainer = Trainer(config, progress=False)
    trainer.fit()
    assert '--tf32 ignored (a CUDA switch)' in trainer._describe_plan()
    assert torch.backends.cuda.matmul.allow_tf32 is False
