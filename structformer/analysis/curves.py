"""White-box measurements over training (CRATE Fig. 4): R_c and sparsity per layer at every saved epoch.

`measure_checkpoints` runs `whitebox.measure_layers` on each checkpoint with the same held-out images;
`plot_curves` draws one figure, R_c and sparsity against the layer, one line per epoch (colour = epoch),
as the paper does; `curves_table` is the markdown table of the first (init) and last checkpoints with the
per-operator deltas and norms.
"""
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ['run_checkpoints', 'measure_checkpoints', 'measure_run', 'plot_curves', 'curves_table']


def run_checkpoints(run_dir) -> List[Path]:
    """Every `checkpoints/epoch_NNNN` of a run, oldest first (keep them all with `train --save-every 1`)."""
    from ..train.checkpoint import checkpoint_folders      # by name: not a temporary or a copy (epoch_0003.tmp-*)
    folder = Path(run_dir) / 'checkpoints'
    found = [p for p in checkpoint_folders(folder) if (p / 'model.safetensors').is_file()]
    if not found:
        raise FileNotFoundError(f"{folder}: no epoch_NNNN checkpoints (train with --save-every 1 to keep every epoch)")
    return found


def measure_checkpoints(paths: Sequence[Path], images, estimator: str = 'official', eps: Optional[float] = None,
                        include_cls: bool = True) -> Dict:
    """{'epochs': [...], 'per_epoch': [{'epoch', 'path', 'layers', ...measure_layers fields}]}."""
    from ..train.checkpoint import load_model
    from .whitebox import measure_layers
    per_epoch = []
    for path in paths:
        model, state = load_model(path)
        measure = measure_layers(model, images, eps, estimator=estimator, include_cls=include_cls)
        measure.pop('samples')
        per_epoch.append(dict(measure, epoch=state.get('epoch'), path=str(path)))
    return {'epochs': [m['epoch'] for m in per_epoch], 'per_epoch': per_epoch}


def measure_run(run_dir, images, estimator: str = 'official', eps: Optional[float] = None) -> Dict:
    return measure_checkpoints(run_checkpoints(run_dir), images, estimator, eps)


def plot_curves(curves: Dict, path, title: str) -> Path:
    from .plots import plot_training_curves
    return plot_training_curves(curves['per_epoch'], path, title)


def _f(x: float, digits: int = 2) -> str:
    return f'{x:.{digits}f}'


def curves_table(curves: Dict) -> str:
    """Markdown: per layer, init vs last epoch: R_c (MSSA input), the MSSA step's ΔR_c, sparsity before and
    after ISTA, mean token norm ‖Z^ℓ‖ and mean ‖U_k‖_F."""
    init, last = curves['per_epoch'][0], curves['per_epoch'][-1]
    a, b = f"epoch {init['epoch']}", f"epoch {last['epoch']}"
    bounds = last.get('R_c_bounds')
    head = (f"R_c estimator `{last['estimator']}`, ε = {last['eps']:g}"
            + (f" (range {bounds[0]:.1f} … {bounds[1]:.1f} at K={last['num_heads']}, N={last['num_tokens']}, "
               f"p={last['dim_head']})" if bounds else '') + f"; {a} = init, {b} = trained.")
    lines = [head, '',
             f'| layer | R_c {a} | R_c {b} | MSSA ΔR_c {a} | MSSA ΔR_c {b} | sparsity in→out {a} '
             f'| sparsity in→out {b} | ‖Z^ℓ‖ {a} / {b} | ‖U_k‖ {a} / {b} |',
             '|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
    for r0, r1 in zip(init['layers'], last['layers']):
        lines.append(
            f"| {r1['layer']} | {_f(r0['R_c']['mean'])} | {_f(r1['R_c']['mean'])} "
            f"| {r0['mssa_delta']['mean']:+.2f} | {r1['mssa_delta']['mean']:+.2f} "
            f"| {r0['sparsity_before_ista']['mean']:.3f}→{r0['sparsity']['mean']:.3f} "
            f"| {r1['sparsity_before_ista']['mean']:.3f}→{r1['sparsity']['mean']:.3f} "
            f"| {r0['token_norm']['mean']:.1f} / {r1['token_norm']['mean']:.1f} "
            f"| {r0['U_norm']['mean']:.2f} / {r1['U_norm']['mean']:.2f} |")
    return '\n'.join(lines)
