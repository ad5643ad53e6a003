"""Markdown report of a white-box analysis: figures, one table per checkpoint, and trend sentences
computed from the numbers (CRATE §3.1 claims R_c and sparsity fall with depth after training; the
report only states what the measurements show)."""
from pathlib import Path
from typing import Dict

__all__ = ['trend_sentence', 'render_report', 'write_report']

_NAMES = {'R_c': 'R_c', 'sparsity': 'sparsity'}


def _num(x: float) -> str:
    return f'{x:.4g}'


def trend_sentence(measure: Dict, metric: str) -> str:
    """'R_c falls from X at layer 1 to Y at layer L (−p%); it decreases at k of L−1 steps.'"""
    values = [row[metric]['mean'] for row in measure['layers']]
    first, last, depth = values[0], values[-1], len(values)
    name = _NAMES.get(metric, metric)
    if depth == 1:
        return f'{name} is {_num(first)} at layer 1 (a single layer: no trend to report).'
    verb = 'falls' if last < first else 'rises' if last > first else 'stays'
    change = f' ({(last - first) / abs(first) * 100:+.1f}%)' if first != 0 else ''
    if verb == 'stays':
        text = f'{name} stays at {_num(first)} from layer 1 to layer {depth}'
    else:
        text = f'{name} {verb} from {_num(first)} at layer 1 to {_num(last)} at layer {depth}{change}'
    drops = sum(b < a for a, b in zip(values, values[1:]))
    return f'{text}; it decreases at {drops} of {depth - 1} layer-to-layer steps.'


def _table(measure: Dict) -> str:
    lines = ['| layer | R_c mean ± std | R mean ± std | ΔR = R − R_c | sparsity mean ± std |',
             '|---:|---:|---:|---:|---:|']
    first = measure['layers'][0]
    lines.append(f"| input (Z^0) | {_num(first['input_R_c']['mean'])} ± {_num(first['input_R_c']['std'])} "
                 f"| | | {first['input_sparsity']['mean']:.3f} ± {first['input_sparsity']['std']:.3f} |")
    for row in measure['layers']:
        lines.append(
            f"| {row['layer']} | {_num(row['R_c']['mean'])} ± {_num(row['R_c']['std'])} "
            f"| {_num(row['R']['mean'])} ± {_num(row['R']['std'])} "
            f"| {_num(row['delta_R']['mean'])} ± {_num(row['delta_R']['std'])} "
            f"| {row['sparsity']['mean']:.3f} ± {row['sparsity']['std']:.3f} |")
    return '\n'.join(lines)


def _recovery_table(recovery: Dict) -> str:
    lines = ['| layer | learned: mean angle (°) | per head: head→true mean (°) | random baseline: mean angle (°) |',
             '|---:|---:|---|---:|']
    for row in recovery['layers']:
        heads = ', '.join(f"{p['head']}→{p['true']} {p['mean_deg']:.1f}" for p in row['learned']['pairs'])
        lines.append(f"| {row['layer']} | {row['learned']['mean_deg']:.1f} | {heads} "
                     f"| {row['random']['mean_deg']:.1f} |")
    return '\n'.join(lines)


def render_report(analysis: Dict) -> str:
    """Markdown text; figure paths in `analysis` are relative to the report's folder."""
    tokens = 'all tokens, cls included' if analysis['include_cls'] else 'patch tokens only (cls excluded)'
    out = [
        '# White-box analysis (CRATE §3.1)', '',
        f"Data: `{analysis['data']}` (options {analysis['data_kwargs'] or 'none'}, split seed "
        f"{analysis['data_seed']}), B = {analysis['num_samples']} validation samples, ε = {analysis['eps']:g}, "
        f"{tokens}.", '',
        'Per layer ℓ: R_c = R_c(Z^{ℓ+½}; U^ℓ) (Eq. 8) and R = R(Z^{ℓ+½}) (Eq. 7) on the MSSA block output '
        '(after the residual), ΔR = R − R_c, sparsity = ‖Z^{ℓ+1}‖₀/(d·N) on the ISTA output; mean ± std over '
        'the B samples. The "input" row is Z^0, the embedded tokens, measured with U of layer 1.', '',
        '## Compression and sparsity across layers (Fig. 3–4)', '',
        f"![R_c per layer]({analysis['figures']['R_c']})", '',
        f"![sparsity per layer]({analysis['figures']['sparsity']})", '',
    ]
    for ck in analysis['checkpoints']:
        measure = ck['measure']
        out += [f"## {ck['label']}", '',
                f"Checkpoint `{ck['path']}` (model `{ck['model']}`, epoch {ck['epoch']}).", '',
                f"- {trend_sentence(measure, 'R_c')}",
                f"- {trend_sentence(measure, 'sparsity')}", '',
                _table(measure), '']
        coh = ck['coherence']
        out += [f"Subspace coherence (Fig. 7): |cos| between columns of different heads, mean per layer "
                + ', '.join(f"{c['mean_between_heads']:.3f}" for c in coh)
                + '; max ' + ', '.join(f"{c['max_between_heads']:.3f}" for c in coh) + '.', '',
                f"![coherence]({ck['figures']['coherence']})", '',
                f"![token heat maps]({ck['figures']['tokens']})", '']
        if ck.get('subspace_recovery'):
            rec = ck['subspace_recovery']
            out += ['Recovery of the true subspaces (principal angles after Hungarian matching of heads to the '
                    f"{rec['num_true']} true {rec['true_dim']}-dim subspaces, carried into feature space through "
                    f"{rec['mapping']}; 0° = recovered; the random orthonormal baseline shows no recovery):", '',
                    _recovery_table(rec), '',
                    f"![principal angles]({ck['figures']['angles']})", '']
    return '\n'.join(out)


def write_report(analysis: Dict, path) -> Path:
    path = Path(path)
    path.write_text(render_report(analysis))
    return path
