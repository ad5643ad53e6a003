"""PNG figures of the white-box analysis, in the style of CRATE Fig. 3–4 (curves), 6 (tokens), 7 (coherence).

Figures are built on `matplotlib.figure.Figure` with the Agg canvas, never pyplot: no global backend
switch, no open-figure state, safe in threads and headless runs.
"""
import math
from pathlib import Path
from typing import Dict, List, Mapping

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ['plot_layer_curves', 'plot_training_curves', 'plot_coherence', 'plot_token_heatmaps', 'plot_principal_angles']

_CURVES = {
    'R_c': ('R_c(LN1(Z^ℓ); U^ℓ) at the MSSA input', 'compression term R_c (lower = more compressed)'),
    'sparsity': ('‖Z^{ℓ+1}‖₀ / (d·N) at the ISTA output', 'fraction of non-zero entries (lower = sparser)'),
}


def _save(fig: Figure, path) -> Path:
    """Save atomically (a temporary beside it, then a rename), as every record: a failure or a kill mid-write
    leaves the previous figure of a re-run analysis in place, never half a PNG."""
    from ..atomic import write_atomically
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    write_atomically(path, lambda f: fig.savefig(f, format='png', dpi=110, bbox_inches='tight'), binary=True)
    return path


def layer_curve(measure: Dict, metric: str):
    """(x, mean, std) with x = ℓ = 1 … L."""
    layers = measure['layers']
    mean = [row[metric]['mean'] for row in layers]
    std = [row[metric]['std'] for row in layers]
    return np.arange(1, len(mean) + 1), np.array(mean), np.array(std)


def _estimator_note(measure: Dict) -> str:
    bounds = measure.get('R_c_bounds')
    note = f"{measure.get('estimator', '?')} estimator, ε={measure['eps']:g}"
    return note + (f', range {bounds[0]:.0f}…{bounds[1]:.0f}' if bounds else '')


def plot_layer_curves(measures: Mapping[str, Dict], metric: str, path) -> Path:
    """One line per checkpoint with ±std error bars over samples (Fig. 3)."""
    if metric not in _CURVES:
        raise ValueError(f"metric must be one of {sorted(_CURVES)}; got {metric!r}")
    title, ylabel = _CURVES[metric]
    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    depth = 0
    for label, measure in measures.items():
        x, mean, std = layer_curve(measure, metric)
        depth = max(depth, len(x))
        ax.errorbar(x, mean, yerr=std, marker='o', capsize=3, label=label)
    ax.set_xticks(range(1, depth + 1))
    ax.set_xlabel('layer ℓ')
    ax.set_ylabel(ylabel)
    any_m = next(iter(measures.values()))
    note = _estimator_note(any_m) if metric == 'R_c' else 'cls included' if any_m['include_cls'] else 'patch tokens'
    ax.set_title(f"{title}\nmean ± std over B={any_m['num_samples']} samples, {note}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_training_curves(per_epoch: List[Dict], path, title: str) -> Path:
    """R_c and sparsity against the layer, one line per saved epoch coloured by epoch (Fig. 4), one figure."""
    import matplotlib
    fig = Figure(figsize=(11, 4), layout='constrained')
    axes = fig.subplots(1, 2)
    cmap = matplotlib.colormaps['viridis']
    epochs = [m.get('epoch') or 0 for m in per_epoch]
    top = max(max(epochs), 1)
    step = max(1, len(epochs) // 6)              # a legend of about 6 entries however many epochs
    labelled = set(epochs[::step]) | {epochs[0], epochs[-1]}
    depth = max(len(m['layers']) for m in per_epoch)
    for ax, metric in zip(axes, ('R_c', 'sparsity')):
        for m, epoch in zip(per_epoch, epochs):
            x, mean, _ = layer_curve(m, metric)
            label = f'epoch {epoch}' + (' (init)' if epoch == 0 else '') if epoch in labelled else None
            ax.plot(x, mean, marker='o', ms=3, color=cmap(epoch / top), lw=2 if epoch in (0, top) else 1,
                    label=label)
        ax.set_xticks(range(1, depth + 1))       # every layer of the deepest (the last line drawn may be shallower)
        ax.set_xlabel('layer ℓ')
        ax.set_ylabel(_CURVES[metric][1])
        ax.set_title(_CURVES[metric][0] + ('\n' + _estimator_note(per_epoch[0]) if metric == 'R_c' else ''),
                     fontsize=9)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{title} (B={per_epoch[0]['num_samples']} held-out samples)", fontsize=10)
    return _save(fig, path)


def _grid(n: int):
    cols = min(n, 4)
    return math.ceil(n / cols), cols


def plot_coherence(coherences: List[torch.Tensor], num_heads: int, path, title: str) -> Path:
    """Heat maps of |UᵀU| per layer (Fig. 7), head boundaries marked."""
    rows, cols = _grid(len(coherences))
    fig = Figure(figsize=(3.2 * cols, 3.0 * rows), layout='constrained')
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(coherences):
            ax.axis('off')
            continue
        c = coherences[i].cpu().numpy()
        im = ax.imshow(c, vmin=0, vmax=1, cmap='viridis', interpolation='nearest')
        p = c.shape[0] // num_heads
        for b in range(1, num_heads):            # thin lines between heads
            ax.axhline(b * p - 0.5, color='w', lw=0.4)
            ax.axvline(b * p - 0.5, color='w', lw=0.4)
        ax.set_title(f'layer {i + 1}', fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_token_heatmaps(maps: Mapping[int, np.ndarray], path, title: str) -> Path:
    """|Z^ℓ| of one sample, tokens × features, for a few layers (Fig. 6); shared colour scale."""
    vmax = max(float(m.max()) for m in maps.values()) or 1.0
    fig = Figure(figsize=(3.2 * len(maps), 3.4), layout='constrained')
    axes = fig.subplots(1, len(maps), squeeze=False)[0]
    for ax, (ell, m) in zip(axes, maps.items()):
        im = ax.imshow(m, vmin=0, vmax=vmax, cmap='magma', aspect='auto', interpolation='nearest')
        ax.set_title('Z^0 (embedding)' if ell == 0 else f'Z^{ell} (after layer {ell})', fontsize=9)
        ax.set_xlabel('feature')
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel('token')
    fig.colorbar(im, ax=list(axes), shrink=0.8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_principal_angles(recovery: Dict, path, title: str) -> Path:
    """Mean principal angle of matched heads per layer, learned vs random baseline; dots = heads."""
    layers = recovery['layers']
    x = np.arange(len(layers))
    fig = Figure(figsize=(1.2 * len(layers) + 3, 3.6))
    ax = fig.add_subplot()
    for offset, key, colour in ((-0.2, 'learned', 'C0'), (0.2, 'random', 'C7')):
        means = [row[key]['mean_deg'] for row in layers]
        ax.bar(x + offset, means, width=0.38, color=colour, label=f'{key} U_k')
        for xi, row in zip(x, layers):
            heads = [p['mean_deg'] for p in row[key]['pairs']]
            ax.plot([xi + offset] * len(heads), heads, 'k.', ms=4)
    ax.set_xticks(x, [str(row['layer']) for row in layers])
    ax.set_xlabel('layer')
    ax.set_ylabel('mean principal angle to matched true subspace (°)')
    ax.set_ylim(0, 90)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return _save(fig, path)
