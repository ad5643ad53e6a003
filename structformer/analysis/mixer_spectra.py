"""Largest singular values at initialisation (Mixer paper §4.3, Fig. 4 right).

Mixer: each γS×S token weight W ~ N(0, 1/S) (γC×C channel weight V ~ N(0, 1/C)); by Marchenko–Pastur its
largest singular value tends to c_γ = 1 + √γ, and I⊗W, any permutation of it (RP), share it. SW-MLP: the
γm×m matrix M⊙A with A ~ N(0, 1/m) and M's entries 1/√p with probability p, else 0; at fixed Ω its
largest singular value grows with the width m (Eq. 16–18), since each row keeps only about pm weights.

`largest_singular_value` runs ARPACK (scipy.sparse.linalg.svds) on a scipy sparse or dense matrix; the
tests compare it with numpy's dense 2-norm, the obvious reference.
"""
from typing import Dict, Iterable, List

import numpy as np

from ..models.mixer_design import sw_density, tokens_for_omega
from ..records import label_axes

FIG4_CHANNELS = (4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 64)     # App. C.2, Ω = 2¹⁹, γ = 2


def largest_singular_value(matrix) -> float:
    """σ_max of a dense numpy array or a scipy sparse matrix."""
    from scipy.sparse import issparse
    from scipy.sparse.linalg import svds
    rows, cols = matrix.shape
    if min(rows, cols) <= 2:
        dense = matrix.toarray() if issparse(matrix) else np.asarray(matrix)
        return float(np.linalg.norm(dense, 2))
    value = svds(matrix.astype(np.float64), k=1, return_singular_vectors=False, random_state=0)
    return float(value[0])


def gaussian_weight(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """A Mixer weight at the paper's init: N(0, 1/cols) (fan-in)."""
    return rng.standard_normal((rows, cols)) / np.sqrt(cols)


def sparse_masked_weight(rows: int, cols: int, density: float, rng: np.random.Generator):
    """SW-MLP's M⊙A at the paper's init, built sparse (Ω non-zeros, never the dense rows×cols array):
    each entry kept with probability p, kept entries N(0, 1/cols)/√p."""
    from scipy.sparse import csr_matrix
    counts = rng.binomial(cols, density, size=rows)                  # kept entries per row
    row_index = np.repeat(np.arange(rows), counts)
    col_index = np.concatenate([rng.choice(cols, size=c, replace=False) for c in counts]) if rows else np.array([])
    values = rng.standard_normal(row_index.size) / np.sqrt(cols * density)
    return csr_matrix((values, (row_index, col_index.astype(np.int64))), shape=(rows, cols))


def init_spectrum_sweep(omega_: float = 2 ** 19, gamma: float = 2.0, channels: Iterable[int] = FIG4_CHANNELS,
                        trials: int = 3, seed: int = 0) -> List[Dict[str, float]]:
    """One row per C on the fixed-Ω curve: S, m = SC, and the mean / min / max over `trials` of σ_max of the
    Mixer's token weight W (γS×S), channel weight V (γC×C), and SW-MLP's M⊙A (γm×m at p = Ω/(γm²))."""
    rng = np.random.default_rng(seed)
    rows = []
    for C in channels:
        S = max(1, int(round(tokens_for_omega(omega_, C, gamma))))
        m = S * C
        p = sw_density(omega_, m, gamma)
        token, channel, sw = [], [], []
        for _ in range(trials):
            token.append(largest_singular_value(gaussian_weight(int(round(gamma * S)), S, rng)))
            channel.append(largest_singular_value(gaussian_weight(int(round(gamma * C)), C, rng)))
            sw.append(largest_singular_value(sparse_masked_weight(int(round(gamma * m)), m, p, rng)))
        rows.append({'channels': C, 'tokens': S, 'width': m, 'density': p,
                     'mixer_token': float(np.mean(token)), 'mixer_channel': float(np.mean(channel)),
                     'sw_mlp': float(np.mean(sw)), 'sw_mlp_min': float(np.min(sw)), 'sw_mlp_max': float(np.max(sw)),
                     'marchenko_pastur_edge': 1 + float(np.sqrt(gamma))})
    return rows


def plot_init_spectra(rows: List[Dict[str, float]], plt, gamma: float, omega_: float):
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    width = [r['width'] * gamma for r in rows]
    ax.plot(width, [r['sw_mlp'] for r in rows], 'o-', label='SW-MLP  M⊙A')
    ax.fill_between(width, [r['sw_mlp_min'] for r in rows], [r['sw_mlp_max'] for r in rows], alpha=0.2)
    ax.plot(width, [r['mixer_token'] for r in rows], 's-', label='Mixer / RP token W')
    ax.plot(width, [r['mixer_channel'] for r in rows], '^-', label='Mixer / RP channel V')
    ax.axhline(1 + gamma ** 0.5, color='k', ls='--', lw=1, label='1 + √γ')
    label_axes(ax, 'hidden width γm', 'largest singular value at init', f'Ω = 2^{np.log2(omega_):.0f}, γ = {gamma:g}',
               legend_size=8)
    fig.tight_layout()
    return fig
