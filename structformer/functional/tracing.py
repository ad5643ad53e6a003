"""Whether a graph is being recorded (export, ONNX, TorchScript tracing, FX), and input checks a graph keeps.

The fast paths of this package are opaque to graph recorders: a custom operator with no ONNX translation
(`structformer::newton_schulz`, the shared-QKV SSA ops), a host-side loop whose `.tolist()` a tracer would
freeze into constants (Newton–Schulz's per-matrix freeze), a backward-only speed-up (shared-QKV SSA). While a
graph is recorded they take their plain-torch reference instead, which computes the same function
(`recording_graph`); under `torch.compile` (not an export) they stay as they are.

Shape checks in `forward` are Python `if`s on the input's shape, which FX's symbolic tracing cannot evaluate.
`checked_images` runs such a check and returns its input; each model file that calls it declares it
`torch.fx.wrap('checked_images')`, so an FX trace (timm's `feature_cls='fx'`, torchvision's
`create_feature_extractor`, `torch.fx.symbolic_trace`) records one call node that checks the real tensor when
the traced module runs. (No timm import here: importing timm imports structformer.models, which imports this.)
Modules whose forward FX cannot trace (einops patterns, autocast blocks on the input's device) are registered
with timm's `register_notrace_module` where they are defined, and are leaves of timm's FX traces.
"""
from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

import torch
from torch.fx import _symbolic_trace

# torch 2.9 split FX's flag in two: `is_fx_tracing` became true under make_fx (and so inside torch.compile) too,
# `is_fx_symbolic_tracing` kept the old meaning. Before the split, `is_fx_tracing` is symbolic tracing alone.
is_fx_symbolic_tracing = getattr(_symbolic_trace, 'is_fx_symbolic_tracing', _symbolic_trace.is_fx_tracing)

__all__ = ['recording_graph', 'graph_constant', 'checked_images', 'checked_token_ids']


def _exporting() -> bool:
    """`torch.compiler.is_exporting()`, read from the flag it returns: in torch 2.8 to 2.11 (not 2.14; 2.12 and
    2.13 not tried) dynamo folded the call into a constant True inside every `torch.compile`, so a compiled model
    took the export path (and dynamo then failed on it: the Nyström baseline under `fullgraph=True`). The flag
    itself is set only while `torch.export` runs, and dynamo reads a module attribute as it is."""
    flag = getattr(torch.compiler, '_is_exporting_flag', None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def recording_graph() -> bool:
    """True inside `torch.export.export` (and so `torch.onnx.export(dynamo=True)`), the TorchScript tracer
    (`torch.onnx.export(dynamo=False)`, `torch.jit.trace`) and FX symbolic tracing; False in eager code and under
    `torch.compile`."""
    return (_exporting() or torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()
            or is_fx_symbolic_tracing())


@contextmanager
def graph_constant() -> Iterator[None]:
    """Run the block eagerly, on real tensors, even while a graph is recorded: for a value that is a function of the
    module's configuration alone (a seeded draw), which the graph should hold as a constant. Recorded instead, a
    `torch.randperm(n, generator=...)` became a graph op without its generator, a fresh draw on every call. Lifts
    torch.export's (non-strict) fake and proxy modes and the TorchScript tracer for the block; under dynamo
    (torch.compile, strict export), which cannot step out of its trace, it is a plain block."""
    if torch.compiler.is_dynamo_compiling() or not recording_graph():
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes      # private: no public way out of a trace
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            yield
    finally:
        torch._C._set_tracing_state(state)


def checked_images(x: torch.Tensor, owner: str, in_chans: int, img_size: Optional[Tuple[int, int]] = None
                   ) -> torch.Tensor:
    """`x` if it is a batch of images [B, in_chans, H, W] (of side `img_size` when given), else a ValueError
    naming `owner`'s expected shape. An FX leaf: traced, it is one node that checks the real input."""
    if x.ndim != 4 or x.shape[1] != in_chans or (img_size is not None and tuple(x.shape[2:]) != tuple(img_size)):
        if img_size is None:
            raise ValueError(f"{owner} expects images [B, {in_chans}, H, W], got {list(x.shape)}")
        h, w = img_size
        raise ValueError(f"{owner} expects images [B, {in_chans}, {h}, {w}] (in_chans={in_chans}, "
                         f"img_size={(h, w)}), got {list(x.shape)}; build the model with matching img_size= / in_chans=")
    return x


torch.fx.wrap('checked_images')


def checked_token_ids(tokens: torch.Tensor, owner: str, context: int) -> torch.Tensor:
    """`tokens` if it is a batch of token ids [B, T] (int64 or int32) with T <= `context`, else a ValueError
    naming `owner`. An FX leaf, as `checked_images` (the language model's input check)."""
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{owner} expects token ids [B, T] (int64), got {tuple(tokens.shape)} {tokens.dtype}")
    if tokens.shape[1] > context:
        raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than the context img_size={context}")
    return tokens


torch.fx.wrap('checked_token_ids')
