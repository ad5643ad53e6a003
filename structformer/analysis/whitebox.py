"""Layer-wise white-box measurements of CRATE (Yu et al., 2023, §3.1, Fig. 3–5).

For layer ℓ (Eq. 18) the hooks documented in `structformer.models.crate` give
    Z^ℓ      the input of `blocks[ℓ]`            (ℓ = 0: embedded tokens, cls + positions added),
    Z^{ℓ+½}  the input of `blocks[ℓ].norm2`      (after MSSA and its residual),
    Z^{ℓ+1}  the output of `blocks[ℓ].mlp`       (after ISTA, no residual),
and U^ℓ = `blocks[ℓ].attn.subspace_bases()` ([K, d, p], the qkv rows of each head).

R_c is measured where MSSA looks: on LN1^ℓ(·), the layer's own first LayerNorm (γ, β included), against
U^ℓ, with one of two estimators (`ESTIMATORS`):
- `official` (default): the estimator of the public CRATE code that drew the paper's Fig. 3–5: every
  projected token U_kᵀ LN1(z) scaled to unit norm within its head, ε = 0.1 (ε² = 0.01), see
  `functional.coding_rate.official_rate_per_head`. Scale-invariant; bounded (`official_rate_bounds`).
- `paper`: Eq. 8 as written, ε = 0.5, with U_k orthonormalised (QR) on LN1(·) tokens.
Both ignore the norms of the residual stream and of U; those are reported beside R_c instead
(`token_norm*`, `U_norm`), because an R_c on raw tokens and raw U mostly tracks them.

Per sample and layer (`METRICS`):
    R_c                   R_c(LN1^ℓ(Z^ℓ); U^ℓ), the MSSA input: where the official code measures (its qkv hook)
    R_c_after_mssa        R_c(LN1^ℓ(Z^{ℓ+½}); U^ℓ): same LN and U after the MSSA step
    mssa_delta            R_c_after_mssa − R_c: < 0 when the MSSA step compresses
    sparsity_before_ista  ‖LN2^ℓ(Z^{ℓ+½})‖₀/(dN), the ISTA input
    sparsity              ‖Z^{ℓ+1}‖₀/(dN), the ISTA output (§3.1; the official code reports 1 − this)
    token_norm, token_norm_half, token_norm_out   mean ‖z‖₂ per token of Z^ℓ, Z^{ℓ+½}, Z^{ℓ+1}
Mean and std (population, so B = 1 gives 0) over the B samples.

Tokens: by default all N+1 tokens, cls included, as the official hook sees them; `include_cls=False` drops
the prefix token(s).

Precision: every measurement (the model's forward included) runs with autocast off (`full_precision`), so it gives
the same numbers inside an autocast context as outside: a logdet or a sparsity count of bf16 activations would
measure the rounding, not the network.
"""
import numbers
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..functional.coding_rate import (OFFICIAL_EPS, official_rate_bounds, official_rate_per_head,
                                      paper_rate_per_head, sparsity)
from ..functional.precision import full_precision
from ..hooks import capture

__all__ = ['ESTIMATORS', 'EPS_RANGE', 'check_eps', 'check_crate', 'layer_hooks', 'capture_layers', 'measure_layers',
           'token_heatmaps', 'layer_bases', 'rate', 'default_eps']

ESTIMATORS = ('official', 'paper')
_DEFAULT_EPS = {'official': OFFICIAL_EPS, 'paper': 0.5}

METRICS = ('R_c', 'R_c_after_mssa', 'mssa_delta', 'sparsity_before_ista', 'sparsity',
           'token_norm', 'token_norm_half', 'token_norm_out')


EPS_RANGE = (1e-100, 1e100)
"""ε the measurements take: its square and p/(N ε²) stay finite and non-zero in float64 (ε = 1e-300 squared to 0, a
ZeroDivisionError; 1e300 overflowed), far beyond any ε that means something (the paper's 0.5, the code's 0.1)."""


def check_eps(eps, name: str = 'eps') -> float:
    """`eps` if it is a number in EPS_RANGE, else ValueError naming `name` and the range."""
    low, high = EPS_RANGE
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not np.isfinite(eps) or not low <= eps <= high:
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}] (the coding rate's precision ε, squared "
                         f"in p/(N ε²)); got {eps!r}")
    return eps


def default_eps(estimator: str) -> float:
    """ε of an estimator when none is given: 0.1 for `official` (its code's ε² = 0.01), 0.5 for `paper`."""
    _check_estimator(estimator)
    return _DEFAULT_EPS[estimator]


def _check_estimator(estimator: str) -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}; got {estimator!r}")


@full_precision
def rate(z: torch.Tensor, u_heads: torch.Tensor, estimator: str = 'official', eps: Optional[float] = None,
         norm: Optional[nn.Module] = None) -> torch.Tensor:
    """R_c of tokens z [..., N, d] against U [K, d, p] with `estimator`, after `norm` (the layer's LN1) when
    given; one value per sample. Invariant to scaling z (through the norm, or always for `official`) and U."""
    _check_estimator(estimator)
    eps = default_eps(estimator) if eps is None else eps
    if norm is not None:
        z = torch.nn.functional.layer_norm(z, norm.normalized_shape, None if norm.weight is None else norm.weight.to(z),
                                           None if norm.bias is None else norm.bias.to(z), norm.eps)
    per_head = official_rate_per_head if estimator == 'official' else paper_rate_per_head
    return per_head(z, u_heads.to(z), eps).sum(-1)


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


def _to_model(images: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """`images` on the model's device and, being floats, in its dtype (a float64 or bf16 model takes the float32
    images a caller has)."""
    p = next(model.parameters(), None)
    if p is None:
        return images
    return images.to(p.device, p.dtype if images.is_floating_point() and p.is_floating_point() else None)


@full_precision
def capture_layers(model: nn.Module, images: torch.Tensor) -> List[Dict[str, torch.Tensor]]:
    """One eval forward; returns per layer {'input': Z^ℓ, 'half': Z^{ℓ+½}, 'output': Z^{ℓ+1}}, each
    [B, N+1, d] (cls included). Keeps every tensor: use `measure_layers` for large batches."""
    check_crate(model)
    out: List[Dict[str, torch.Tensor]] = [dict() for _ in model.blocks]

    def keep(i, stage, z):
        out[i][stage] = z.detach().clone()

    with layer_hooks(model, keep), _eval_no_grad(model):
        model(_to_model(images, model))
    return out


def _check_images(images: torch.Tensor) -> None:
    if not torch.is_tensor(images) or images.ndim != 4 or len(images) == 0:
        shape = list(images.shape) if torch.is_tensor(images) else type(images).__name__
        raise ValueError(f"images must be a non-empty [B, C, H, W] tensor; got {shape}")


def _stats(values: torch.Tensor) -> Dict[str, float]:
    return {'mean': float(values.mean()), 'std': float(values.std(correction=0))}


@full_precision
def measure_layers(model: nn.Module, images: torch.Tensor, eps: Optional[float] = None, *,
                   estimator: str = 'official', include_cls: bool = True, batch_size: int = 64) -> Dict:
    """Per-layer R_c, per-operator deltas, sparsity and norms over the samples in `images` (Fig. 3–5).

    Returns {'estimator', 'eps', 'num_samples', 'num_tokens', 'dim', 'num_heads', 'dim_head', 'include_cls',
    'R_c_bounds', 'layers': [...], 'samples'}: `layers[ℓ]` holds {'layer': ℓ+1, metric: {'mean', 'std'} for
    every metric of `METRICS`, 'U_norm': {'per_head': [‖U_k‖_F], 'mean'}}; `samples[metric]` is the [L, B]
    tensor of per-sample values; `R_c_bounds` the (min, max) the official estimator can take at these shapes
    (None for `paper`). Float64, streamed over mini-batches: only scalars per sample are kept.
    """
    check_crate(model)
    _check_images(images)
    _check_estimator(estimator)
    eps = check_eps(default_eps(estimator) if eps is None else eps)
    bases = [u.double() for u in layer_bases(model)]
    norms1 = [b.norm1 for b in model.blocks]
    norms2 = [b.norm2 for b in model.blocks]
    skip = 0 if include_cls else int(getattr(model, 'num_prefix_tokens', 1))
    depth = len(bases)
    values: Dict[str, List[List[torch.Tensor]]] = {m: [[] for _ in range(depth)] for m in METRICS}
    shape = {}

    def layer_norm(norm, z):
        # in float32, or float64 for a float64 model (a bf16 or float64 model's LN weights cast alike: torch's
        # layer_norm refuses mixed dtypes), then float64 for the rates
        dtype = torch.promote_types(z.dtype, torch.float32)
        weight, bias = (None if t is None else t.to(dtype) for t in (norm.weight, norm.bias))
        return torch.nn.functional.layer_norm(z.to(dtype), norm.normalized_shape, weight, bias, norm.eps).double()

    def measure(i, stage, z):
        z = z.detach()
        shape['tokens'], shape['dim'] = z.shape[-2:]
        u = bases[i].to(z.device)
        keep = lambda name, v: values[name][i].append(v.cpu())      # noqa: E731
        if stage == 'input':
            keep('R_c', rate(layer_norm(norms1[i], z)[:, skip:], u, estimator, eps))
            keep('token_norm', z[:, skip:].double().norm(dim=-1).mean(-1))
        elif stage == 'half':
            keep('R_c_after_mssa', rate(layer_norm(norms1[i], z)[:, skip:], u, estimator, eps))
            keep('sparsity_before_ista', sparsity(layer_norm(norms2[i], z)[:, skip:]).double())
            keep('token_norm_half', z[:, skip:].double().norm(dim=-1).mean(-1))
        else:
            keep('sparsity', sparsity(z[:, skip:]).double())
            keep('token_norm_out', z[:, skip:].double().norm(dim=-1).mean(-1))

    with layer_hooks(model, measure), _eval_no_grad(model):
        for start in range(0, len(images), batch_size):
            model(_to_model(images[start:start + batch_size], model))

    samples = {m: torch.stack([torch.cat(v) for v in per_layer]) for m, per_layer in values.items() if per_layer[0]}
    samples['mssa_delta'] = samples['R_c_after_mssa'] - samples['R_c']
    num_heads, _, dim_head = bases[0].shape
    tokens = int(shape['tokens']) - skip
    layers = []
    for i in range(depth):
        head_norms = bases[i].norm(dim=(1, 2))
        layers.append({'layer': i + 1, **{m: _stats(samples[m][i]) for m in METRICS},
                       'U_norm': {'per_head': [float(x) for x in head_norms], 'mean': float(head_norms.mean())}})
    bounds = list(official_rate_bounds(num_heads, tokens, dim_head, eps)) if estimator == 'official' else None
    return {'estimator': estimator, 'eps': float(eps), 'num_samples': len(images), 'num_tokens': tokens,
            'dim': int(shape['dim']), 'num_heads': int(num_heads), 'dim_head': int(dim_head),
            'include_cls': include_cls, 'R_c_bounds': bounds, 'layers': layers, 'samples': samples}


@full_precision
def token_heatmaps(model: nn.Module, image: torch.Tensor, layers: Optional[Sequence[int]] = None,
                   size: int = 50, seed: int = 0, include_cls: bool = True) -> Dict[int, np.ndarray]:
    """|Z^ℓ| of one sample as a tokens × features array (Fig. 6), keyed by ℓ (0 = embedded input,
    ℓ ≥ 1 = output of layer ℓ's ISTA block). Larger than `size` × `size`: the same random rows and
    columns (fixed `seed`) for every layer, kept in their original order, so panels are comparable.
    `layers` defaults to up to 4 evenly spaced values of 0 … L. `include_cls=False` leaves out the prefix
    token(s), as `measure_layers` does (analyze --exclude-cls)."""
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
    skip = 0 if include_cls else int(getattr(model, 'num_prefix_tokens', 1))
    z0 = captured[0]['input'][0][skip:]
    n, d = z0.shape
    rows = torch.randperm(n, generator=gen)[:size].sort().values if n > size else torch.arange(n)
    cols = torch.randperm(d, generator=gen)[:size].sort().values if d > size else torch.arange(d)
    maps = {}
    for ell in layers:
        z = z0 if ell == 0 else captured[ell - 1]['output'][0][skip:]
        maps[ell] = z[rows][:, cols].abs().to(torch.promote_types(z.dtype, torch.float32)).cpu().numpy()   # no bf16 in numpy
    return maps
