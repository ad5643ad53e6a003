"""The paper recipes' switches on the GPU: channels-last, the weight average, gradient accumulation and Mixup /
CutMix (every family run has them all on, tests/gpu/runs.py), and torch.compile: one graph per shape and no graph
break for every family's training step, and a whole `structformer train --compile inductor` run."""
import json

import pytest
import torch
from safetensors.torch import load_file
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from .runs import DEVICE, FAMILIES, config

GROUPED = [pytest.param(family, marks=pytest.mark.xdist_group(family), id=family) for family in FAMILIES]


@pytest.mark.parametrize('family', GROUPED)
def test_family_run_took_every_switch(family_runs, family):
    """The float32 run of the family: 2 optimiser steps an epoch (4 batches accumulated in pairs), a weight average
    that moved away from the weights and was evaluated, finite metrics; Sparsifiner through both stages and the
    low-rank run factorised at its second epoch."""
    result, losses = family_runs.get(family, 'float32')
    epochs = FAMILIES[family].get('epochs', 1)
    assert [r['step'] for r in result.history] == [2 * e for e in range(1, epochs + 1)]
    assert len(losses) == 2 * epochs and all(torch.isfinite(torch.tensor(losses)))
    assert all('ema_val_top1' in r for r in result.history)
    model, ema = (load_file(str(result.last_checkpoint / n)) for n in ('model.safetensors', 'ema.safetensors'))
    assert model.keys() == ema.keys() and any(not torch.equal(model[k], ema[k]) for k in model)
    state = json.loads((result.last_checkpoint / 'state.json').read_text())
    assert state['config']['channels_last'] and state['config']['mixup'] == 0.8
    if family == 'sparsifiner':
        assert [r['phase'] for r in result.history] == ['predictor', 'joint']
    if family == 'lowrank':
        assert 'factorized_val_top1' in result.history[1]
        assert 'blocks.0.mlp.fc1.U' in model and 'blocks.0.mlp.fc1.weight' not in model     # W = U Vᵀ from epoch 2


@pytest.mark.parametrize('family', GROUPED)
def test_training_step_compiles_to_one_graph_per_shape(family_runs, family):
    """dynamo (its CompileCounter backend: graphs counted, run eagerly) over the trained model's training step on
    the GPU, channels-last images: no graph break (fullgraph), one graph however often the same shape comes, one more
    for another batch size."""
    from structformer.models.sparsifiner import predictor_parameter_names
    from structformer.train import load_model
    result, _ = family_runs.get(family, 'float32')
    model, _ = load_model(result.last_checkpoint)
    model = model.to(DEVICE).to(memory_format=torch.channels_last).train()
    side = model.pretrained_cfg['input_size'][-1]
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for batch in (4, 4, 4):
        x = torch.randn(batch, 3, side, side, device=DEVICE).contiguous(memory_format=torch.channels_last)
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(compiled(x), torch.arange(batch, device=DEVICE) % 4)
        loss.backward()
    assert backend.frame_count == 1
    assert not counters['graph_break'], dict(counters['graph_break'])
    distilled = predictor_parameter_names(model)
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad and n not in distilled)


def test_train_compiled_with_inductor(tmp_path, image_folder, no_tf32):
    """`structformer train --compile inductor` on the GPU (CRATE-T at depth 2, so the compile stays short): the
    training graph and the evaluation graph and nothing more, no graph break, and the checkpoint loads into a plain
    model that gives the compiled model's outputs."""
    from structformer.train import load_model
    from structformer.train.engine import Trainer
    counters.clear()
    trainer = Trainer(config(tmp_path / 'run', image_folder, model='crate_tiny_patch16_224', model_kwargs={'depth': 2},
                             compile='inductor', channels_last=True, amp=True, amp_dtype='bfloat16'), progress=False)
    result = trainer.fit()
    assert trainer.model._compiled_call_impl is not None
    assert not counters['graph_break'], dict(counters['graph_break'])
    assert 1 <= counters['stats']['unique_graphs'] <= 2, dict(counters['stats'])     # train mode, eval mode
    plain, _ = load_model(result.last_checkpoint)
    plain = plain.to(DEVICE).eval()
    x = torch.randn(4, 3, 224, 224, device=DEVICE)
    with torch.no_grad():
        # inductor fuses and reorders float32 arithmetic: equal to float32 rounding over a depth-2 network
        torch.testing.assert_close(trainer.model.eval()(x), plain(x), rtol=1e-3, atol=1e-4)


def test_train_with_cuda_graphs(tmp_path, image_folder, no_tf32):
    """`structformer train --compile inductor --compile-mode reduce-overhead` (CUDA graphs; what made SOFT's attention
    forward 7.1 -> 0.60 ms in `bench gpu` on an H200): SOFT-T at one block a stage trains with the Newton–Schulz op
    inside the replayed graphs, its metrics are finite, and its checkpoint loads into a plain model that gives the
    compiled model's outputs."""
    import math

    from structformer.train import load_model
    from structformer.train.engine import Trainer
    counters.clear()
    trainer = Trainer(config(tmp_path / 'run', image_folder, model='soft_tiny_224',
                             model_kwargs={'depths': (1, 1, 1, 1)}, compile='inductor',
                             compile_mode='reduce-overhead', amp=True, amp_dtype='bfloat16'), progress=False)
    result = trainer.fit()
    assert trainer.model._compiled_call_impl is not None
    assert not counters['graph_break'], dict(counters['graph_break'])
    last = result.history[-1]
    assert all(math.isfinite(v) for v in last.values() if isinstance(v, float)), last
    plain, _ = load_model(result.last_checkpoint)
    plain = plain.to(DEVICE).eval()
    x = torch.randn(4, 3, 224, 224, device=DEVICE)
    with torch.no_grad():
        compiled = trainer.model.eval()(x).clone()       # a replayed graph's output is overwritten by the next replay
        # float32 (no autocast here), fused and reordered by inductor: equal to float32 rounding, amplified by the
        # conditioning of SOFT's kernel matrices through the Newton–Schulz iteration
        torch.testing.assert_close(compiled, plain(x), rtol=1e-3, atol=1e-3)
