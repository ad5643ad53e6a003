"""Centered kernel alignment between hidden features (Kornblith et al. 2019), and its mini-batch form
(Nguyen et al. 2021) that the Mixer paper uses to compare a Mixer with sparse MLPs (Fig. 2).

Linear kernel K = XXᵀ on features X [n, d]. `linear_cka` is the plain full-batch estimate with the biased
HSIC; `MinibatchCKA` accumulates the unbiased HSIC_1 estimator (Song et al. 2012) over mini-batches,

    HSIC_1(K, L) = [tr(K̃L̃) + 1ᵀK̃1·1ᵀL̃1 / ((n−1)(n−2)) − 2/(n−2)·1ᵀK̃L̃1] / (n(n−3)),  K̃ = K − diag(K),

and reports Σ HSIC_1(K, L) / √(Σ HSIC_1(K, K) · Σ HSIC_1(L, L)), which does not depend on the batch size in
expectation. `hsic_unbiased_reference` is the U-statistic written out over distinct index quadruples, the
slow reference the tests compare the closed form with.

Features: `block` outputs (timm's `forward_intermediates`, after each residual add; any model), or with
`features='branches'` the residual branches the Mixer paper compares in Fig. 2 (App. C.1: "the layer just before
the skip-connection in each block", token- and channel-mixing counted as separate blocks, labelled 1 … 2L; an
SW-MLP block's one branch): the output of every `mlp_tokens` and `mlp_channels` of a Mixer (ours or timm's
`MlpMixer` with `MixerBlock`s), the last activation of every SW-MLP block (`branch_modules`).

Precision: HSIC in float64; the models' forward passes run with autocast off (`full_precision`), so CKA does not
depend on whether the caller sits inside an autocast context.
"""
import itertools
from typing import Dict, List, Sequence

import torch

from ..functional.precision import full_precision
from ..hooks import capture
from .whitebox import _eval_no_grad

FEATURES = ('blocks', 'branches')


def _gram(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(x.shape[0], -1).to(torch.float64)
    return x @ x.t()


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Full-batch linear CKA with the biased HSIC: ‖YᵀX‖²_F / (‖XᵀX‖_F ‖YᵀY‖_F) on centred features."""
    x = x.reshape(x.shape[0], -1).to(torch.float64)
    y = y.reshape(y.shape[0], -1).to(torch.float64)
    x, y = x - x.mean(0), y - y.mean(0)
    return float((y.t() @ x).square().sum() / ((x.t() @ x).norm() * (y.t() @ y).norm()))


def hsic_unbiased(k: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """HSIC_1 of two [n, n] Gram matrices (n ≥ 4), closed form."""
    n = k.shape[0]
    if n < 4:
        raise ValueError(f"the unbiased HSIC needs at least 4 samples per batch, got {n}")
    k = k - torch.diag_embed(torch.diagonal(k))
    l = l - torch.diag_embed(torch.diagonal(l))
    ones = torch.ones(n, 1, dtype=k.dtype, device=k.device)
    trace = (k * l.t()).sum()
    middle = (ones.t() @ k @ ones) * (ones.t() @ l @ ones) / ((n - 1) * (n - 2))
    cross = 2 / (n - 2) * (ones.t() @ k @ l @ ones)
    return (trace + middle - cross).squeeze() / (n * (n - 3))


def hsic_unbiased_reference(k: torch.Tensor, l: torch.Tensor) -> float:
    """The U-statistic itself: mean over distinct (i, j, q, r) of k_ij l_ij + k_ij l_qr − 2 k_ij l_iq."""
    n = k.shape[0]
    total, count = 0.0, 0
    for i, j, q, r in itertools.permutations(range(n), 4):
        total += float(k[i, j] * l[i, j] + k[i, j] * l[q, r] - 2 * k[i, j] * l[i, q])
        count += 1
    return total / count


class MinibatchCKA:
    """Accumulate CKA between every pair of (layer of model A, layer of model B) over mini-batches."""

    def __init__(self, layers_a: int, layers_b: int):
        self.cross = torch.zeros(layers_a, layers_b, dtype=torch.float64)
        self.self_a = torch.zeros(layers_a, dtype=torch.float64)
        self.self_b = torch.zeros(layers_b, dtype=torch.float64)
        self.batches = 0

    def update(self, features_a: Sequence[torch.Tensor], features_b: Sequence[torch.Tensor]) -> None:
        grams_a = [_gram(f) for f in features_a]
        grams_b = [_gram(f) for f in features_b]
        for i, ka in enumerate(grams_a):
            self.self_a[i] += hsic_unbiased(ka, ka)
            for j, lb in enumerate(grams_b):
                self.cross[i, j] += hsic_unbiased(ka, lb)
        for j, lb in enumerate(grams_b):
            self.self_b[j] += hsic_unbiased(lb, lb)
        self.batches += 1

    def compute(self) -> torch.Tensor:
        if not self.batches:
            raise ValueError("MinibatchCKA.compute() before any update()")
        # HSIC_1(K, K) estimates ‖C_xx‖²_F ≥ 0 but, being unbiased, is not itself non-negative: for a feature with
        # (numerically) no variance over the samples its sum can fall to zero or below, where CKA is 0/0,
        # undefined. NaN there (a clamped root turned it into ±1e150); the product of roots cannot underflow.
        defined = (self.self_a[:, None] > 0) & (self.self_b[None, :] > 0)
        roots = self.self_a.clamp_min(0).sqrt()[:, None] * self.self_b.clamp_min(0).sqrt()[None, :]
        return torch.where(defined, self.cross / torch.where(defined, roots, 1.0), float('nan'))


@torch.no_grad()
@full_precision
def block_features(model: torch.nn.Module, images: torch.Tensor) -> List[torch.Tensor]:
    """Every block's output for a batch, via timm's `forward_intermediates` in the NLC layout where a
    model offers it (any structformer or timm ViT/Mixer), flattened per sample."""
    if not hasattr(model, 'forward_intermediates'):
        raise ValueError(f"--cka: {type(model).__name__} has no forward_intermediates (timm's feature interface), "
                         "so its block outputs cannot be compared")
    weight = next(model.parameters(), None)
    if weight is not None:        # the model's device, and its dtype for float images (a float64 or bf16 model)
        images = images.to(weight.device, weight.dtype if images.is_floating_point() else None)
    with _eval_no_grad(model):        # each module's own mode back after: measuring is no side effect
        try:
            maps = model.forward_intermediates(images, intermediates_only=True, output_fmt='NLC')
        except TypeError:
            maps = model.forward_intermediates(images, intermediates_only=True)
    return [m.reshape(m.shape[0], -1) for m in maps]


def branch_modules(model: torch.nn.Module) -> List[str]:
    """Names of the modules whose output is a residual branch just before its skip connection, in forward order:
    `blocks.i.mlp_tokens`, `blocks.i.mlp_channels` of a Mixer, `blocks.i.act` of an SW-MLP (called last on the
    branch). ValueError naming the model where it has no such branches this function knows."""
    from ..models.mixer import SWMLP
    blocks = getattr(model, 'blocks', None)
    if isinstance(model, SWMLP):
        return [f'blocks.{i}.act' for i in range(len(blocks))]
    if isinstance(blocks, (torch.nn.ModuleList, torch.nn.Sequential)) and len(blocks) and all(
            isinstance(getattr(b, 'mlp_tokens', None), torch.nn.Module)
            and isinstance(getattr(b, 'mlp_channels', None), torch.nn.Module) for b in blocks):
        return [f'blocks.{i}.{part}' for i in range(len(blocks)) for part in ('mlp_tokens', 'mlp_channels')]
    raise ValueError(f"CKA on residual branches reads Mixer blocks (mlp_tokens, mlp_channels) and SW-MLP blocks; "
                     f"{type(model).__name__} has neither (compare its block outputs instead)")


@torch.no_grad()
@full_precision
def branch_features(model: torch.nn.Module, images: torch.Tensor) -> List[torch.Tensor]:
    """Every residual branch's output for a batch (`branch_modules`), flattened per sample; eval mode for the
    forward, the caller's mode back after."""
    names = branch_modules(model)
    weight = next(model.parameters(), None)
    if weight is not None:
        images = images.to(weight.device, weight.dtype if images.is_floating_point() else None)
    with _eval_no_grad(model), capture(model, outputs=names) as seen:
        model(images)
    # the last call of each: an SW-MLP block with a hidden layer calls its activation twice, the branch is the 2nd
    return [seen.outputs[name][-1].reshape(len(images), -1) for name in names]


@full_precision
def minibatch_cka(model_a: torch.nn.Module, model_b: torch.nn.Module, batches,
                  features: str = 'blocks') -> Dict[str, object]:
    """CKA between the block outputs (or with `features='branches'` the residual branches, Fig. 2's features)
    of two models over an iterable of image batches."""
    if features not in FEATURES:
        raise ValueError(f"features must be one of {', '.join(FEATURES)}; got {features!r}")
    read = block_features if features == 'blocks' else branch_features
    meter = None
    for images in batches:
        features_a, features_b = read(model_a, images), read(model_b, images)
        if meter is None:
            meter = MinibatchCKA(len(features_a), len(features_b))
        meter.update(features_a, features_b)
    if meter is None:
        raise ValueError("minibatch_cka needs at least one batch")
    return {'cka': meter.compute(), 'batches': meter.batches, 'features': features}
