"""Mixed precision on the CPU as a laptop user runs it (docs/precision.md): which dtype a resumed run trains in."""
import argparse

import pytest

from structformer.errors import UsageError


def _saved_run(monkeypatch, precision: str, amp_dtype=None):
    """A checkpoint of a run trained with --amp (amp_dtype as given; None: the device's default), whose state
    records the dtype it trained in."""
    from structformer.train import checkpoint
    from structformer.train.config import TrainConfig
    config = TrainConfig(model='crate_digits', data='digits', epochs=2, amp=True, amp_dtype=amp_dtype).to_dict()
    state = {'config': config, 'epoch': 1, 'precision': precision, 'path': 'run/checkpoints/epoch_0001'}
    monkeypatch.setattr(checkpoint, 'load_checkpoint', lambda source, **kwargs: ({}, state, {}))


@pytest.mark.parametrize('recorded', ['bfloat16', 'float16'])
def test_a_resumed_amp_run_keeps_the_dtype_it_trained_in(monkeypatch, recorded):
    """`--amp` alone resolves to the device's default (bfloat16 on a CPU, float16 on CUDA): resumed on another
    device, the run must go on in the dtype its checkpoint records, not silently switch (a CUDA float16 run,
    resumed on a CPU, trained on in bfloat16 without a word and dropped its loss scale)."""
    from structformer.commands.train import _resume_config
    _saved_run(monkeypatch, recorded)
    args = argparse.Namespace(resume='run')
    assert _resume_config(args, {}, {}, None)['amp_dtype'] == recorded
    # where the recorded dtype cannot run (float16 on a CPU without AMX-FP16) the refusal tells the user to give
    # --amp-dtype bfloat16: a resume must accept it, not call it a change of the saved configuration
    assert _resume_config(args, {'amp_dtype': 'bfloat16', 'device': 'cpu'}, {}, None)['amp_dtype'] == 'bfloat16'


def test_a_resumed_float32_run_still_refuses_amp(monkeypatch):
    from structformer.commands.train import _resume_config
    from structformer.train import checkpoint
    from structformer.train.config import TrainConfig
    state = {'config': TrainConfig(model='crate_digits', data='digits', epochs=2).to_dict(), 'epoch': 1,
             'precision': 'float32', 'path': 'run/checkpoints/epoch_0001'}
    monkeypatch.setattr(checkpoint, 'load_checkpoint', lambda source, **kwargs: ({}, state, {}))
    values = _resume_config(argparse.Namespace(resume='run'), {}, {}, None)
    assert not values['amp'] and values.get('amp_dtype') is None
    with pytest.raises(UsageError, match='--amp cannot change on --resume'):
        _resume_config(argparse.Namespace(resume='run'), {'amp': True}, {}, None)


def test_the_model_card_names_the_autocast_dtype_a_run_trained_in(tmp_path):
    """`--amp` alone records no dtype in the configuration: the exported model card must say the one the run
    trained in (the checkpoint's record), not a bare 'amp: True'."""
    import timm

    from structformer.export.hf import model_card
    from structformer.train.config import TrainConfig
    model = timm.create_model('crate_digits')
    state = {'path': str(tmp_path / 'epoch_0001'), 'model': 'crate_digits', 'epoch': 1, 'precision': 'bfloat16',
             'config': TrainConfig(model='crate_digits', data='digits', epochs=1, amp=True).to_dict()}
    card = model_card(model, state, 'crate_digits')
    assert 'amp: bfloat16 autocast, float32 weights' in card
    state['config']['amp'] = False
    assert 'autocast' not in model_card(model, dict(state, precision='float32'), 'crate_digits')
