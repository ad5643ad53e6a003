"""Layer-wise white-box measurements of CRATE (Yu et al., 2023, §3.1, Fig. 3–4 and Fig. 6).

For layer ℓ (Eq. 18) the hooks documented in `structformer.models.crate` give
    Z^ℓ      the input of `blocks[ℓ]`            (ℓ = 0: embedded tokens, cls + positions added),
    Z^{ℓ+½}  the input of `blocks[ℓ].norm2`      (after MSSA and its residual),
    Z^{ℓ+1}  the output of `blocks[ℓ].mlp`       (after ISTA, no residual),
and U^ℓ = `blocks[ℓ].attn.subspace_bases()` ([K, d, p], the raw qkv rows, not re-orthonormalised:
R_c is measured against the subspaces the layer actually projects on).

Per sample we compute R_c(Z^{ℓ+½}; U^ℓ) (Eq. 8), R(Z^{ℓ+½}) (Eq. 7), ΔR = R − R_c and the sparsity
‖Z^{ℓ+1}‖₀/(d·N) (§3.1), plus R_c(Z^ℓ; U^ℓ) and ‖Z^ℓ‖₀/(d·N) of the layer input so a curve can start
at the embedding. Mean and std (population, so B = 1 gives 0) over the B samples.

Tokens: by default all N+1 tokens, cls included, because the paper's Z = [z_cls, z_1 … z_N] is what
every layer processes (Alg. 1); `include_cls=False` drops the prefix token(s) instead.
"""
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..functional.coding_rate import coding_rate, compression_rate, sparsity
from ..hooks import capture

__all__ = ['check_crate', 'layer_hooks', 'capture_layers', 'measure_layers', 'token_heatmaps',
           'layer_bases']

METRICS = ('R_c', 'R', 'delta_R', 'sparsity', 'input_R_c', 'input_sparsity')


def check_crate(model: nn.Module) -> None:
    """Raise ValueError unless `model` has CRATE blocks with the white-box hook points."""
    blocks = getattr(model, 'blocks', None)
    ok = isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) > 0 and all(
        callable(getattr(getattr(b, 'attn', None), 'subspace_bases', None))
        and isinstance(getattr(b, 'norm2', None), nn.Module) and isinstance(getattr(b, 'mlp', None), nn.Module)
        for b in blocks)
    if not ok:
        raise ValueError(
            f"white-box analysis needs a CRATE model (blocks[i].attn.subspace_bases(), blocks[i].norm2, "
            f"blocks[i].mlp); got {type(model).__name__}, which has no such blocks")


def layer_bases(model: nn.Module) -> List[torch.Tensor]:
    """U^ℓ of every layer as detached [K, d, p] tensors."""
    check_crate(model)
    return [b.attn.subspace_bases().detach() for b in model.blocks]


@contextmanager
def layer_hooks(model: nn.Module, callback: Callable[[int, str, torch.Tensor], None]):
    """Call `callback(ℓ, stage, tokens)` for Z^ℓ ('input'), Z^{ℓ+½} ('half'), Z^{ℓ+1} ('output'),
    read through `structformer.hooks.capture` (read-only hooks, removed on exit even after an exception)."""
    check_crate(model)
    stage_of = {}
    for i in range(len(model.blocks)):
        stage_of.update({('input', f'blocks.{i}'): (i, 'input'), ('input', f'blocks.{i}.norm2'): (i, 'half'),
                         ('output', f'blocks.{i}.mlp'): (i, 'output')})

    def route(kind: str, name: str, tensor: torch.Tensor) -> None:
        i, stage = stage_of[(kind, name)]
        callback(i, stage, tensor)

    with capture(model, outputs='blocks.*.mlp', inputs=['blocks.*', 'blocks.*.norm2'], callback=route):
        yield


@contextmanager
def _eval_no_grad(model: nn.Module):
    """Eval mode and no autograd for the duration; the caller's training flags are restored."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes.items():
            m.train(mode)


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device('cpu')


def capture_layers(model: nn.Module, images: torch.Tensor) -> List[Dict[str, torch.Tensor]]:
    """One eval forward; returns per layer {'input': Z^ℓ, 'half': Z^{ℓ+½}, 'output': Z^{ℓ+1}}, each
    [B, N+1, d] (cls included). Keeps every tensor: use `measure_layers` for large batches."""
    check_crate(model)
    out: List[Dict[str, torch.Tensor]] = [dict() for _ in model.blocks]

    def keep(i, stage, z):
        out[i][stage] = z.detach().clone()

    with layer_hooks(model, keep), _eval_no_grad(model):
        model(images.to(_device(model)))
    return out


def _check_images(images: torch.Tensor) -> None:
    if not torch.is_tensor(images) or images.ndim != 4 or len(images) == 0:
        shape = list(images.shape) if torch.is_tensor(images) else type(images).__name__
        raise ValueError(f"images must be a non-empty [B, C, H, W] tensor; got {shape}")


def _stats(values: torch.Tensor) -> Dict[str, float]:
    return {'mean': float(values.mean()), 'std': float(values.std(correction=0))}


def measure_layers(model: nn.Module, images: torch.Tensor, eps: float = 0.5, *, include_cls: bool = True,
                   batch_size: int = 64) -> Dict:
    """Per-layer R_c (Eq. 8), R (Eq. 7), ΔR and sparsity over the samples in `images` (Fig. 3–4).

    Returns {'eps', 'num_samples', 'num_tokens', 'dim', 'include_cls', 'layers': [...], 'samples'}:
    `layers[ℓ]` holds {'layer': ℓ+1, metric: {'mean', 'std'}} for the metrics
    R_c = R_c(Z^{ℓ+½}; U^ℓ), R = R(Z^{ℓ+½}), delta_R = R − R_c, sparsity = ‖Z^{ℓ+1}‖₀/(dN),
    input_R_c = R_c(Z^ℓ; U^ℓ), input_sparsity = ‖Z^ℓ‖₀/(dN);
    `samples[metric]` is the [L, B] tensor of per-sample values. Computed in float64 by streaming
    over mini-batches, so only scalars per sample are kept.
    """
    check_crate(model)
    _check_images(images)
    if not (isinstance(eps, (int, float)) and np.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0; got {eps!r}")
    bases = [u.double() for u in layer_bases(model)]
    skip = 0 if include_cls else int(getattr(model, 'num_prefix_tokens', 1))
    depth = len(bases)
    values: Dict[str, List[List[torch.Tensor]]] = {m: [[] for _ in range(depth)] for m in METRICS}
    shape = {}

    def measure(i, stage, z):
        z = z.detach()[:, skip:].double()
        shape['tokens'], shape['dim'] = z.shape[-2:]
        u = bases[i].to(z.device)
        if stage == 'input':
            values['input_R_c'][i].append(compression_rate(z, u, eps).cpu())
            values['input_sparsity'][i].append(sparsity(z).cpu())
        elif stage == 'half':
            rc, r = compression_rate(z, u, eps).cpu(), coding_rate(z, eps).cpu()
            values['R_c'][i].append(rc)
            values['R'][i].append(r)
            values['delta_R'][i].append(r - rc)
        else:
            values['sparsity'][i].append(sparsity(z).cpu())

    device = _device(model)
    with layer_hooks(model, measure), _eval_no_grad(model):
        for start in range(0, len(images), batch_size):
            model(images[start:start + batch_size].to(device))

    samples = {m: torch.stack([torch.cat(v) for v in per_layer]) for m, per_layer in values.items()}
    layers = [{'layer': i + 1, **{m: _stats(samples[m][i]) for m in METRICS}} for i in range(depth)]
    return {'eps': float(eps), 'num_samples': len(images), 'num_tokens': int(shape['tokens']),
            'dim': int(shape['dim']), 'include_cls': include_cls, 'layers': layers, 'samples': samples}


def token_heatmaps(model: nn.Module, image: torch.Tensor, layers: Optional[Sequence[int]] = None,
                   size: int = 50, seed: int = 0) -> Dict[int, np.ndarray]:
    """|Z^ℓ| of one sample as a tokens × features array (Fig. 6), keyed by ℓ (0 = embedded input,
    ℓ ≥ 1 = output of layer ℓ's ISTA block). Larger than `size` × `size`: the same random rows and
    columns (fixed `seed`) for every layer, kept in their original order, so panels are comparable.
    `layers` defaults to up to 4 evenly spaced values of 0 … L."""
    check_crate(model)
    if image.ndim == 3:
        image = image[None]
    _check_images(image)
    depth = len(model.blocks)
    if layers is None:
        layers = sorted({int(round(x)) for x in np.linspace(0, depth, min(depth + 1, 4))})
    bad = [ell for ell in layers if not 0 <= ell <= depth]
    if bad:
        raise ValueError(f"token heat map layers must be in 0..{depth}; got {bad}")
    captured = capture_layers(model, image[:1])
    gen = torch.Generator().manual_seed(seed)
    z0 = captured[0]['input'][0]
    n, d = z0.shape
    rows = torch.randperm(n, generator=gen)[:size].sort().values if n > size else torch.arange(n)
    cols = torch.randperm(d, generator=gen)[:size].sort().values if d > size else torch.arange(d)
    maps = {}
    for ell in layers:
        z = z0 if ell == 0 else captured[ell - 1]['output'][0]
        maps[ell] = z[rows][:, cols].abs().cpu().numpy()
    return maps
