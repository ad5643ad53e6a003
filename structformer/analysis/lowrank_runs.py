"""`structformer analyze` for low-rank runs: per-layer effective rank over training and the singular-value
spectra, as the engine logged them in the run's metrics.jsonl (seed 004: effective rank ‖W‖_*/‖W‖_op,
Tables 1 and 5; spectra as in Fig. 4–5).

A run that factorises (`--rank`, `--factorize-at`) logs, every epoch, `effective_rank` and
`singular_values` per linear / conv layer, dense or factorised (`Trainer._spectra_record`). This module
only reads those records back, so it works on any finished or interrupted run without loading a model:
`spectra.json` (the per-epoch effective ranks, the last spectra) and `spectra.png` (effective rank per
layer against the epoch, the factorised layers' mean in bold; the last epoch's singular values per
layer, each divided by its largest, on a log scale).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from ..records import write_json, write_png
from ..train.run_dir import read_metrics


def spectra_history(run: Optional[Path], up_to: Optional[int] = None) -> List[Dict]:
    """The metrics.jsonl records of `run` that carry effective ranks, in file order ([] when none); with `up_to`,
    those of epochs up to that one (the checkpoint analysed: an earlier checkpoint of the run drew the later
    epochs too, its 'last epoch' spectra being another checkpoint's)."""
    if run is None:
        return []
    # the engine's reader: a torn last line of an interrupted run is dropped, not a JSON error
    return _up_to([record for record in read_metrics(Path(run) / 'metrics.jsonl') if record.get('effective_rank')],
                  up_to)


def _up_to(records: List[Dict], epoch: Optional[int]) -> List[Dict]:
    """The records of epochs up to `epoch` (all when None; a record without an epoch is kept)."""
    return [r for r in records if epoch is None or r.get('epoch') is None or r['epoch'] <= epoch]


def summarise(history: List[Dict]) -> Dict:
    """{'epochs', 'effective_rank': {layer: [per epoch]}, 'effective_rank_mean': [per epoch], 'last_epoch',
    'singular_values': {layer: [...] of the last record}}; a layer missing from an epoch reads None there."""
    layers = list(dict.fromkeys(name for record in history for name in record['effective_rank']))
    return {'epochs': [record.get('epoch') for record in history],
            'effective_rank': {name: [record['effective_rank'].get(name) for record in history] for name in layers},
            'effective_rank_mean': [record.get('effective_rank_mean') for record in history],
            'last_epoch': history[-1].get('epoch'),
            'singular_values': history[-1].get('singular_values', {})}


def _draw(summary: Dict, plt):
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    epochs = summary['epochs']
    for name, values in summary['effective_rank'].items():
        points = [(e, v) for e, v in zip(epochs, values) if v is not None]
        if points:
            left.plot(*zip(*points), marker='.', linewidth=0.8, alpha=0.6, label=name)
    mean = [(e, v) for e, v in zip(epochs, summary['effective_rank_mean']) if v is not None]
    if mean:
        left.plot(*zip(*mean), color='black', linewidth=2.5, label='mean of factorised layers')
    left.set_xlabel('epoch')
    left.set_ylabel('effective rank ‖W‖* / ‖W‖op')
    left.grid(True, alpha=0.3)
    for name, values in summary['singular_values'].items():
        if values and values[0] > 0:
            right.plot(range(1, len(values) + 1), [v / values[0] for v in values], linewidth=0.8, label=name)
    right.set_yscale('log')
    right.set_xlabel('index')
    right.set_ylabel('σ_i / σ_1')
    right.set_title(f"singular values at epoch {summary['last_epoch']}")
    right.grid(True, which='both', alpha=0.3)
    handles, labels = left.get_legend_handles_labels()
    if len(labels) <= 16:                     # a legend for a small network; a WRN-28 has too many layers
        left.legend(fontsize=6)
    fig.tight_layout()
    return fig


def run_spectra_analysis(run: Path, out: Path, up_to: Optional[int] = None) -> int:
    """Write spectra.json and spectra.png for `run` into `out`, the epochs up to `up_to` (the checkpoint analysed;
    all when None); returns 0. Raises ValueError when the run logged no effective ranks (it did not factorise)
    or none by epoch `up_to`."""
    logged = spectra_history(run)
    history = _up_to(logged, up_to)
    if not history:
        if logged:
            first = logged[0].get('epoch')
            raise ValueError(f"--checkpoint {run}: the checkpoint is epoch {up_to}, and the run logged effective "
                             f"ranks from epoch {first} on; pass a later checkpoint or the run")
        raise ValueError(f"--checkpoint {run}: its metrics.jsonl holds no effective ranks (the run did not "
                         "factorise: train with --rank)")
    summary = summarise(history)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / 'spectra.json', summary)
    drawn = write_png(out / 'spectra.png', lambda plt: _draw(summary, plt))
    means = [(e, v) for e, v in zip(summary['epochs'], summary['effective_rank_mean']) if v is not None]
    print("effective rank, mean of the factorised layers: "
          + (f"{means[0][1]:.2f} (epoch {means[0][0]}) -> {means[-1][1]:.2f} (epoch {means[-1][0]})"
             if means else 'n/a (no factorised layer logged)'))
    print(f"written: {out / 'spectra.json'}" + (f", {out / 'spectra.png'}" if drawn else ''))
    return 0
