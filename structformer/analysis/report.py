"""Markdown report of a white-box analysis: figures, one table per checkpoint, and trend sentences
computed from the numbers (CRATE §3.1 claims R_c and sparsity fall with depth after training; the
report only states what the measurements show)."""
from pathlib import Path
from typing import Dict

__all__ = ['trend_sentence', 'estimator_sentence', 'render_report', 'write_report']

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
    lines = ['| layer | R_c (MSSA in) | R_c (MSSA out) | MSSA ΔR_c | sparsity (ISTA in → out) '
             '| ‖Z^ℓ‖ → ‖Z^{ℓ+½}‖ → ‖Z^{ℓ+1}‖ | mean ‖U_k‖_F |',
             '|---:|---:|---:|---:|---:|---:|---:|']
    for row in measure['layers']:
        lines.append(
            f"| {row['layer']} | {_num(row['R_c']['mean'])} ± {_num(row['R_c']['std'])} "
            f"| {_num(row['R_c_after_mssa']['mean'])} | {row['mssa_delta']['mean']:+.3g} ± {row['mssa_delta']['std']:.2g} "
            f"| {row['sparsity_before_ista']['mean']:.3f} → {row['sparsity']['mean']:.3f} ± {row['sparsity']['std']:.3f} "
            f"| {row['token_norm']['mean']:.3g} → {row['token_norm_half']['mean']:.3g} → {row['token_norm_out']['mean']:.3g} "
            f"| {row['U_norm']['mean']:.3g} |")
    return '\n'.join(lines)


def estimator_sentence(measure: Dict) -> str:
    """Which R_c estimator, its ε and, for `official`, the range it can take at these shapes."""
    est, eps = measure.get('estimator', 'official'), measure['eps']
    if est == 'official':
        lo, hi = measure['R_c_bounds']
        return (f"R_c estimator `official` (CRATE's public code): U_kᵀ LN1(Z) with every token scaled to unit norm "
                f"within each head, ε = {eps:g} (ε² = {eps ** 2:g}); with K = {measure['num_heads']}, "
                f"N = {measure['num_tokens']}, p = {measure['dim_head']} it lies in [{lo:.1f}, {hi:.1f}] "
                f"(all tokens parallel … spread evenly).")
    return (f"R_c estimator `paper` (Eq. 8 as written): orthonormalised U_k on LN1(Z), ε = {eps:g}; "
            f"K = {measure['num_heads']}, N = {measure['num_tokens']}, p = {measure['dim_head']}.")


def _recovery_table(recovery: Dict) -> str:
    lines = ['| layer | learned: mean angle (°) | per head: head→true mean (°) | random baseline: mean angle (°) |',
             '|---:|---:|---|---:|']
    for row in recovery['layers']:
        heads = ', '.join(f"{p['head']}→{p['true']} {p['mean_deg']:.1f}" for p in row['learned']['pairs'])
        lines.append(f"| {row['layer']} | {row['learned']['mean_deg']:.1f} | {heads} "
                     f"| {row['random']['mean_deg']:.1f} |")
    return '\n'.join(lines)


def _energy_lines(e: Dict) -> list:
    k, j = len(e['matrix']), len(e['matrix'][0])
    lines = [f"Layer-1 energy share per head and subspace (rows: {k} heads, columns: {j} true subspaces; "
             f"uniform = {e['uniform']:.3f}): Hungarian-matched mean share {e['matched_share']:.3f}, against "
             f"{e['permutation_matched_share']['mean']:.3f} (95th percentile "
             f"{e['permutation_matched_share']['p95']:.3f}) with the tokens' subspace labels permuted "
             f"({e['permutation_matched_share']['count']} permutations, p = {e['p_value']:.3f}).", '',
             '| head | ' + ' | '.join(f'S{c}' for c in range(j)) + ' |', '|---:|' + '---:|' * j]
    lines += [f'| {h} | ' + ' | '.join(f'{v:.3f}' for v in row) + ' |' for h, row in enumerate(e['matrix'])]
    a = e['attention_within_subspace']
    lines += ['', "Layer-1 attention that stays within a token's own subspace: "
              + ', '.join(f'{v:.3f}' for v in a['per_head']) + f" per head (mean {a['mean']:.3f}); "
              f"uniform attention would give {a['chance']:.3f}.", '']
    return lines


def render_report(analysis: Dict) -> str:
    """Markdown text; figure paths in `analysis` are relative to the report's folder."""
    tokens = 'all tokens, cls included' if analysis['include_cls'] else 'patch tokens only (cls excluded)'
    out = [
        '# White-box analysis (CRATE §3.1)', '',
        f"Data: `{analysis['data']}` (options {analysis['data_kwargs'] or 'none'}, split seed "
        f"{analysis['data_seed']}), B = {analysis['num_samples']} validation samples, {tokens}."
        + (' Weights: the weight average each run kept with --model-ema (--ema).'
           if analysis.get('weights') == 'ema' else ''), '',
        estimator_sentence(analysis['checkpoints'][0]['measure']), '',
        'Per layer ℓ, with the layer\'s own LN1 and U^ℓ: R_c at the MSSA input LN1(Z^ℓ) (where the official code '
        'measures) and at LN1(Z^{ℓ+½}) after the MSSA step, their difference (< 0: the step compresses); the '
        'fraction of non-zero entries ‖·‖₀/(d·N) of the ISTA input LN2(Z^{ℓ+½}) and output Z^{ℓ+1} (the official '
        'code reports 1 − this); the mean token norms of the residual stream and ‖U_k‖_F, which the estimators '
        'ignore by design. Mean ± std over the B samples.', '',
        '## Compression and sparsity across layers (Fig. 3–4)', '',
        f"![R_c per layer]({analysis['figures']['R_c']})", '',
        f"![sparsity per layer]({analysis['figures']['sparsity']})", '',
    ]
    if analysis['figures'].get('training'):
        out += ['Every measured epoch in one figure (Fig. 4):', '', f"![over training]({analysis['figures']['training']})", '']
    for ck in analysis['checkpoints']:
        measure = ck['measure']
        out += [f"## {ck['label']}", '',
                f"Checkpoint `{ck['path']}` (model `{ck['model']}`, epoch {ck['epoch']}).", '',
                f"- {trend_sentence(measure, 'R_c')}",
                f"- {trend_sentence(measure, 'sparsity')}", '',
                _table(measure), '']
        coh = ck['coherence']
        out += ["Subspace coherence (Fig. 7): |cos| between columns of different heads, mean per layer "
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
        if ck.get('subspace_energy'):
            out += _energy_lines(ck['subspace_energy'])
    return '\n'.join(out)


def write_report(analysis: Dict, path) -> Path:
    from ..records import write_text
    path = Path(path)
    write_text(path, render_report(analysis))         # atomically: never half a report
    return path
