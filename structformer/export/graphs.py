"""ONNX and torch.export graphs of a model, with a batch dimension left free, and their checks against eager torch.

Both go through `torch.export` (the ONNX file through `torch.onnx.export(dynamo=True)`, which writes it with
onnxscript). While the graph is recorded the layers take their plain-torch paths (`functional/tracing.py`):
MSSA's shared-QKV custom op becomes SDPA, SOFT's opaque Newton–Schulz operator its device loop, the Sparsifiner
tile kernel its gathered tiles, the oneDNN linear `F.linear`; each computes the same function. Sparsifiner's
top-k breaks ties by index (`functional.sparsifiner.topk_indices`), so ONNX Runtime keeps the same keys.

The error measure is the one the tests bound: max |y − y_torch| / max |y_torch| over the batch (1e-4 for
float32 outputs of depth-12 models; typical values are 1e-7 to 1e-5).
"""
import importlib.util
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch

from ..errors import UsageError

__all__ = ['example_input', 'to_onnx', 'onnx_error', 'to_program', 'program_error', 'relative_error',
           'require_onnx', 'randomised_constants']

_EXTERNAL_DATA_BYTES = 1_800_000_000    # protobuf's 2 GiB limit: larger weights go beside the .onnx file


def require_onnx(runtime: bool = False) -> None:
    """One line naming the extra when the ONNX packages are missing."""
    needed = ('onnx', 'onnxscript') + (('onnxruntime',) if runtime else ())
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"--format onnx needs {', '.join(missing)}: pip install 'structformer[onnx]'")


def example_input(model: torch.nn.Module, batch: int = 2, seed: int = 0) -> torch.Tensor:
    """A batch at the model's default input size (`pretrained_cfg['input_size']`, which `load_model` sets to the
    training data's): standard-normal images, or token ids for a language model (a model with `vocab_size`)."""
    generator = torch.Generator().manual_seed(seed)
    if hasattr(model, 'vocab_size') and hasattr(model, 'context'):
        return torch.randint(0, model.vocab_size, (batch, model.context), generator=generator)
    size = tuple((getattr(model, 'pretrained_cfg', None) or {}).get('input_size') or ())
    if len(size) != 3:
        raise UsageError(f"{type(model).__name__} has no input size in its pretrained_cfg; export needs one")
    return torch.randn(batch, *size, generator=generator)


def randomised_constants(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """`model` in eval mode with noise (0.02, seeded) on every parameter whose entries are all equal (zero-initialised
    heads, unit LayerNorm gains), so that an export check's output depends on every weight: a zero head would hide
    a wrong graph."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
    return model.eval()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| / max |want| (a scale-free bound on the whole output), on the CPU whichever device
    either was computed on."""
    got, want = torch.as_tensor(got).detach().cpu().double(), want.detach().cpu().double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(torch.finfo(torch.float64).tiny)).item()


def _batch_dim(example: torch.Tensor):
    # min 1: a free batch size; the example itself should have batch >= 2 (torch.export specialises 0 and 1).
    # max 65,535, not 65,536: traced on a CUDA device, convolution and batch-norm kernels guard the batch below
    # CUDA's 2**16 grid-dimension limit, and a range past it fails the export (found on an H200, docs/gpu.md)
    dims = {0: torch.export.Dim('batch', min=1, max=(1 << 16) - 1)}
    if not example.is_floating_point() and example.dim() == 2 and example.shape[1] >= 2:
        # token ids [B, T] at the full context: a language model takes any T up to it (a prompt, generation), and
        # a graph fixed at the traced T took the full context only
        dims[1] = torch.export.Dim('tokens', min=1, max=int(example.shape[1]))
    return (dims,)


def to_onnx(model: torch.nn.Module, example: torch.Tensor, path, opset: Optional[int] = None) -> Path:
    """Write `model` as an ONNX file at `path` (input 'input' with a free batch dimension, output 'output'),
    through torch.export and onnxscript (`opset`: None = the exporter's default). Runs under the caller's grad
mode: the recorded graph is the same."""
    require_onnx()
    path = Path(path)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')           # the exporter's deprecation and dynamic-shape chatter
        program = torch.onnx.export(model, (example,), dynamo=True, dynamic_shapes=_batch_dim(example),
                                    input_names=['input'], output_names=['output'], opset_version=opset,
                                    external_data=weights > _EXTERNAL_DATA_BYTES, verbose=False)
    program.save(str(path), external_data=weights > _EXTERNAL_DATA_BYTES)
    return path


def onnx_error(path, model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> float:
    """The largest `relative_error` of ONNX Runtime's output (CPU provider) against eager torch over `inputs` (the
    model and `inputs` on any device: ONNX Runtime reads a CPU copy)."""
    require_onnx(runtime=True)
    import onnxruntime
    session = onnxruntime.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    worst = 0.0
    for x in inputs:
        with torch.no_grad():
            want = model(x)
        got = session.run(None, {session.get_inputs()[0].name: x.detach().cpu().numpy()})[0]
        worst = max(worst, relative_error(torch.from_numpy(got), want))
    return worst


def to_program(model: torch.nn.Module, example: torch.Tensor) -> 'torch.export.ExportedProgram':
    """`torch.export.export` with a free batch dimension (the program holds only aten operators: none of this
    package's custom ops, see the module docstring)."""
    return torch.export.export(model, (example,), dynamic_shapes=_batch_dim(example))


def program_error(program, model: torch.nn.Module, inputs: Sequence[torch.Tensor],
                  module: Optional[torch.nn.Module] = None) -> float:
    """The largest `relative_error` of the exported program against eager torch over `inputs`."""
    run = module or program.module()
    worst = 0.0
    with torch.no_grad():
        for x in inputs:
            worst = max(worst, relative_error(run(x), model(x)))
    return worst
