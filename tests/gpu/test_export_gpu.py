"""Export of weights trained on the GPU: the float32 family runs' checkpoints, loaded onto the GPU, exported from
there with torch.export and to ONNX (export/graphs.py, the code `structformer export` runs), against the eager
model on the GPU. The bound is export/graphs.py's: max |y − y_eager| / max |y_eager| ≤ 1e-4 for float32 outputs of
depth-12 models (float32 reordered, TF32 off); ONNX Runtime computes on the CPU.

Not Sparsifiner: its trained predictor's scores agree across devices to float32 rounding, not bit for bit, and a
near-tie at the top-k boundary then keeps another key (tens of rows in a batch of 224-px images), which moves that
row's output by far more than 1e-4; its export is checked on one device by tests/test_export.py."""
import pytest
import torch

from structformer.export.graphs import onnx_error, program_error, to_onnx, to_program

from .runs import DEVICE

EXPORTED = ['crate', 'soft', 'lowrank', 'wide_resnet']
BOUND = 1e-4


# Each export in a group of its own, not its family's: SOFT-T's export alone took 173 s on an H200 (2026-11-27), and in
# the family's group it held back the family's other tests past the suite's limit. The price: that worker trains
# the family's float32 run again (about 10 s).
@pytest.mark.parametrize('family', [pytest.param(f, marks=pytest.mark.xdist_group(f'{f}-export'), id=f)
                                    for f in EXPORTED])
def test_export_of_gpu_trained_weights_matches_eager_gpu(family_runs, family, tmp_path, no_tf32):
    from structformer.export.graphs import example_input
    from structformer.train import load_model
    result, _ = family_runs.get(family, 'float32')
    model, _ = load_model(result.last_checkpoint)
    model = model.to(DEVICE).eval()
    example = example_input(model, batch=2).to(DEVICE)
    checks = [example_input(model, batch=b, seed=b).to(DEVICE) for b in (3, 5)]   # other batch sizes than traced
    with torch.no_grad():
        program = to_program(model, example)
        assert program_error(program, model, checks) <= BOUND
        path = to_onnx(model, example, tmp_path / f'{family}.onnx')
    pytest.importorskip('onnxruntime')
    assert onnx_error(path, model, checks) <= BOUND
