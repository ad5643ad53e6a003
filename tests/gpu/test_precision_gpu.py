"""float16 (with GradScaler) and bfloat16 autocast on the GPU, one 224-px model per family through `structformer
train`: the loss of every optimiser step within the band `checks.step_tolerance` derives from the dtype (its
docstring has the derivation) of float32's on the same batches; the checkpoints float32; and, op by op, nothing
computed off the GPU and no custom op or layer in another dtype than docs/precision.md states."""
import json

import pytest
import torch
from safetensors.torch import load_file

from structformer.cli import main

from .checks import (first_failure, forward_band, loss_sensitivity, module_dtype_violations, parity_failures,
                     skipped_steps, unit_roundoff)
from .runs import DEVICE, FAMILIES, FEATURES, validation_batch

BATCH = 8                                     # the family runs' batch (tests/gpu/runs.py)
# the images behind one logged step loss: the step log averages every accumulated batch of an optimiser step
STEP_IMAGES = BATCH * FEATURES['grad_accum_steps']

HALF = ['float16', 'bfloat16']
CASES = [pytest.param(family, dtype, marks=pytest.mark.xdist_group(family), id=f'{family}-{dtype}')
         for family in FAMILIES for dtype in HALF]


def _needs(dtype: str) -> None:
    if DEVICE == 'cpu' and dtype == 'float16':
        pytest.skip('float16 autocast is refused on a CPU without AMX-FP16 (the rehearsal runs on a CPU)')


def _measured(result, dtype: str, ema: bool = False):
    """The trained model's (`ema`: its weight average's) products under `dtype` (one forward of the held-out images,
    counted op by op) and the loss's sensitivity to its logits (float32, hard labels); the model and the batch."""
    model, images, labels = validation_batch(result.last_checkpoint, ema=ema)
    _, log = module_dtype_violations(model, images, getattr(torch, dtype), DEVICE)
    with torch.no_grad():
        sensitivity = loss_sensitivity(model(images), labels)
    return log.products(getattr(torch, dtype)), sensitivity, model, images


@pytest.mark.parametrize('family, dtype', CASES)
def test_half_precision_training_follows_float32(family_runs, family, dtype, capsys):
    _needs(dtype)
    reference, reference_losses = family_runs.get(family, 'float32')
    result, losses = family_runs.get(family, dtype)
    state = json.loads((result.last_checkpoint / 'state.json').read_text())
    assert state['precision'] == dtype
    skipped = 0
    if dtype == 'float16':                     # the scaler's state is checkpointed; a skipped step halved it
        skipped = skipped_steps(state['grad_scaler']['scale'])
        assert skipped < len(losses), f"GradScaler skipped all {len(losses)} steps"
    for name in ('model.safetensors', 'ema.safetensors'):         # master weights and their average stay float32
        weights = load_file(str(result.last_checkpoint / name))
        assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}, name
    products, sensitivity, _, _ = _measured(reference, dtype)
    assert products > 0
    half = getattr(torch, dtype)
    failures = parity_failures(reference_losses, losses, half, products, sensitivity, STEP_IMAGES, skipped)
    assert not failures, first_failure(failures)
    # evaluation ran under the same autocast: the last epoch's held-out loss (its weights are the checkpoint's) is
    # float32's on the same images within the forward's band and the loss's own rounding (checks.py), float32
    # scored by `structformer eval --no-amp` (without it eval takes the run's precision: bfloat16 autocast on the
    # CPU, the same computation as the run's on a CPU, so the check compared a path with itself there)
    for ema in (False, True):
        products, sensitivity, _, images = _measured(result, dtype, ema)
        capsys.readouterr()
        weights = ['--ema'] if ema else []
        assert main(['eval', '--checkpoint', str(result.output), '--json', '--no-amp'] + weights) == 0
        full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert full['precision'] == 'float32'
        under_autocast = result.final['ema_val_loss' if ema else 'val_loss']
        band = forward_band(half, products, sensitivity, len(images)) + unit_roundoff(half) * full['loss']
        assert abs(under_autocast - full['loss']) <= band, (ema, under_autocast, full['loss'], band)


@pytest.mark.parametrize('family, dtype', CASES)
def test_ops_stay_on_the_gpu_in_their_policy_dtype(family_runs, family, dtype):
    """A forward (eval, no_grad) of the float32-trained model under autocast, every module and op logged: the layers
    whose policy is 'the autocast dtype out' return it, the float32 islands stay inside their ops, and no op
    computes on the CPU. Then a training forward and backward for the families whose custom ops have a backward of
    their own (CRATE's shared-QKV attention, SOFT's Newton–Schulz) checks those too."""
    _needs(dtype)
    result, _ = family_runs.get(family, 'float32')
    model, images, _ = validation_batch(result.last_checkpoint)
    wrong, log = module_dtype_violations(model, images[:4], getattr(torch, dtype), DEVICE)
    assert not wrong, first_failure(wrong)
    assert log.products(getattr(torch, dtype)) > 0
    if family in ('crate', 'soft', 'soft_official'):
        wrong, log = module_dtype_violations(model.train(), images[:4], getattr(torch, dtype), DEVICE, backward=True)
        assert not wrong, first_failure(wrong)
