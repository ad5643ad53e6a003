"""`structformer reproduce mixer`: "MLP-Mixer as a wide sparse MLP" Fig. 4 (right), 5, 6 and 7 at MNIST scale.

The paper trains on CIFAR-10/100 and STL-10 (32 px, patch 4, S₀ = 64, 8 blocks, 600 epochs); this runs on the
real MNIST in --data (e.g. its 10,000 images: the first 8,000 train, the last 2,000 held out; 28 px, patch 4,
so S₀ = 49 and C₀ = 16, no resizing) with one AdamW recipe for every row:

  width   S-Mixer and RP S-Mixer (SkipLayer in the first block, as the paper's S sweeps) at every (S, C) pair
          on a fixed-Ω curve (γ = 1), and SW-MLP at the same Ω for several densities; test error against the
          effective width m and against C (Fig. 5–6), several seeds;
  depth   S = C = C* (the widest pair), normal vs RP at several depths (Fig. 7);
  spectra largest singular values at init at the paper's Ω = 2¹⁹, γ = 2 (Fig. 4 right), no training.

It ends with the verdicts, computed from the numbers: is the best C the one nearest C = S, and does RP
close its gap to the normal Mixer as depth grows; a difference of mean errors counts beyond two standard errors
over seeds, and inside that (or with one seed) the verdict says it cannot tell. "Error falls as the width grows" is
a one-sided Spearman test at 5 % (`rank_trend`, exact up to 8 runs): holds on a significant fall, does not hold on
a significant rise, and otherwise cannot tell.

Each run is a `structformer train` run in --output/runs/<name>; a finished one of the same settings, trained by this
code (`reproduce.finished_run`: its config.yaml and the code stamp in its checkpoints), is reused, so an interrupted
study continues where it stopped; another setting or other code trains anew.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Dict, List

from . import check_distinct, command_line, finished_run, mnist_spec, start
from ..records import environment, label_axes, write_json, write_png, write_text

EXAMPLES = """examples:
  structformer reproduce mixer --data /data/mnist                                # the whole study (~15 min)
  structformer reproduce mixer --data /data/mnist --epochs 1 --seeds 1 --channels 8 32 --depths 2 --sw-densities 0.25 \\
      --limit-train-batches 5 --output /tmp/mixer_quick                          # a smoke run"""

from ..cli_args import bounded_int, parse_omega, thread_count  # noqa: E402  (the --omega type, shared with `design`)

# a run per seed and configuration: 10**9 seeds filled memory with the plan; as `compare --seeds`
MAX_SEEDS = 1000
# one draw per width is about 20 s of SVDs (Ω = 2^19): 10**9 drew for centuries before training began
MAX_SPECTRA_TRIALS = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument('--data', default=None, help='a folder of MNIST IDX files (required; see `structformer train --help` or docs/data.md for where to get them)')
    p.add_argument('--omega', type=parse_omega, default=2 ** 15,
                   help='connections per layer Ω of the width sweep (default 2^15: C* = S* = 32)')
    p.add_argument('--channels', type=int, nargs='+', default=[8, 16, 32, 64, 128],
                   help='C values on the fixed-Ω curve (S follows from Ω)')
    p.add_argument('--sw-densities', type=float, nargs='+', default=[0.5, 0.125, 0.03125],
                   help='SW-MLP densities p at the same Ω (width m = √(Ω/p), rounded to a multiple of S₀; the run '
                        'uses and reports the realised density Ω/m²)')
    p.add_argument('--depth', type=int, default=4, help='blocks of the width sweep (default 4)')
    p.add_argument('--depths', type=int, nargs='+', default=[2, 4, 8], help='depths of the RP-vs-normal sweep')
    p.add_argument('--seeds', type=bounded_int('--seeds', 1, MAX_SEEDS), default=2,
                   help=f'seeds per configuration (1 … {MAX_SEEDS}; default 2)')
    p.add_argument('--epochs', type=int, default=15)
    p.add_argument('--batch-size', type=int, default=128)
    p.add_argument('--lr', type=float, default=3e-3)
    p.add_argument('--weight-decay', type=float, default=0.05)
    p.add_argument('--limit-train-batches', type=int, default=0, help='0 = every batch')
    p.add_argument('--spectra-trials', type=bounded_int('--spectra-trials', 0, MAX_SPECTRA_TRIALS), default=3,
                   help=f'random draws per width for Fig. 4 right (0 … {MAX_SPECTRA_TRIALS}, about 20 s each; default 3; '
                        '0 skips the spectra)')
    p.add_argument('--report-only', action='store_true',
                   help='train nothing: rebuild report.md, the figures and the verdicts from --output/results.json')
    p.add_argument('--threads', type=thread_count, default=0,
                   help="torch threads (default: torch's own; 1 trains these small models almost as fast and "
                        "shares a busy machine better)")
    p.add_argument('--output', default='outputs/reproduce_mixer')


def _check(args) -> None:
    from ..train.config import TrainConfig      # --lr, --weight-decay as train names them: before any work
    TrainConfig(lr=args.lr, weight_decay=args.weight_decay).check_ranges()
    if not 0 <= args.spectra_trials <= MAX_SPECTRA_TRIALS:      # the parser's range, for a Namespace built by hand
        raise ValueError(f"--spectra-trials must be an integer in [0, {MAX_SPECTRA_TRIALS}], got {args.spectra_trials}")
    if args.seeds > MAX_SEEDS:
        raise ValueError(f"--seeds must be an integer in [1, {MAX_SEEDS}], got {args.seeds}")
    for flag in ('depth', 'seeds', 'epochs', 'batch_size'):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if any(c < 1 for c in args.channels) or any(d < 1 for d in args.depths):
        raise ValueError("--channels and --depths must be integers >= 1")
    if any(not 0 < p <= 1 for p in args.sw_densities):     # before their widths are worked out (1 / p)
        raise ValueError(f"--sw-densities must lie in (0, 1], got {' '.join(f'{p:g}' for p in args.sw_densities)}")
    for flag in ('channels', 'depths', 'sw_densities'):
        check_distinct(getattr(args, flag), f"--{flag.replace('_', '-')}")
    by_width: Dict[int, List[float]] = {}
    for p in args.sw_densities:              # two densities whose width rounds alike are one run, counted twice
        by_width.setdefault(sw_channels(args.omega, p) * 49, []).append(p)
    same = [ps for ps in by_width.values() if len(ps) > 1]
    if same:
        raise ValueError(f"--sw-densities {' and '.join(f'{p:g}' for p in same[0])} give the same SW-MLP (width "
                         f"{sw_channels(args.omega, same[0][0]) * 49}, rounded to a multiple of 49 tokens) at --omega "
                         f"{args.omega}: give densities further apart")
    from ..models.mixer_design import OFF_CURVE, fixed_omega_pairs, optimal_width
    off = [r['channels'] for r in fixed_omega_pairs(args.omega, args.channels, 1.0) if not r['on_curve']]
    if off:                  # S = 1 already spends more than 1.5 × Ω: not a point of the fixed-Ω sweep
        limit = int(math.sqrt(2 * OFF_CURVE * args.omega)) + 1          # (C + C²)/2 > 1.5 Ω beyond it
        largest = max(r['channels'] for r in fixed_omega_pairs(args.omega, range(1, limit + 1), 1.0) if r['on_curve'])
        raise ValueError(f"--channels {' '.join(map(str, off))}: off the fixed-Ω curve at --omega {args.omega} (even "
                         f"S = 1 spends more than {OFF_CURVE} × Ω); accepted C up to {largest} here, or a larger "
                         f"--omega (C* = S* = {optimal_width(args.omega)['channels']:.1f})")
    if args.limit_train_batches < 0:
        raise ValueError(f"--limit-train-batches must be >= 0, got {args.limit_train_batches}")
    if args.output:          # before any work: a long run never dies at its first write
        from ..records import check_writable
        check_writable(Path(args.output), '--output')
    mnist_spec(args.data)


def sw_channels(omega_: float, density: float, patch_tokens: int = 49) -> int:
    """The SW-MLP's channels C at density p and Ω: width m = √(Ω/p) rounded to a multiple of S₀ = patch_tokens."""
    return max(1, round(math.sqrt(omega_ / density) / patch_tokens))


def plan(args, patch_tokens: int = 49) -> List[Dict]:
    """Every run of the study: (group, label, model, model_kwargs, seed) plus its design numbers."""
    from ..models.mixer_design import fixed_omega_pairs, optimal_width
    runs = []
    for seed in range(args.seeds):
        for pair in fixed_omega_pairs(args.omega, args.channels, 1.0):
            for kind, model in (('S-Mixer', 'smixer_mnist'), ('RP S-Mixer', 'rp_smixer_mnist')):
                runs.append(dict(group='width', kind=kind, model=model, seed=seed, tokens=pair['tokens'],
                                 channels=pair['channels'], width=pair['width'], omega=pair['omega'],
                                 kwargs=dict(num_tokens=pair['tokens'], embed_dim=pair['channels'], depth=args.depth,
                                             skip_layer=True, perm_seed=seed)))
        for p in args.sw_densities:
            channels = sw_channels(args.omega, p, patch_tokens)
            width = channels * patch_tokens
            density = min(1.0, args.omega / width ** 2)
            runs.append(dict(group='width', kind='SW-MLP', model='swmlp_mnist', seed=seed, tokens=patch_tokens,
                             channels=channels, width=width, omega=density * width ** 2, density=density,
                             kwargs=dict(embed_dim=channels, depth=args.depth, density=density, mask_seed=seed)))
        side = max(1, round(optimal_width(args.omega)['channels']))
        for depth in args.depths:
            for kind, model in (('S-Mixer', 'smixer_mnist'), ('RP S-Mixer', 'rp_smixer_mnist')):
                runs.append(dict(group='depth', kind=kind, model=model, seed=seed, tokens=side, channels=side,
                                 width=side * side, depth=depth,
                                 kwargs=dict(num_tokens=side, embed_dim=side, depth=depth, skip_layer=True,
                                             perm_seed=seed)))
    return runs


def _preflight(runs: List[Dict], spec: str, omega_: int) -> None:
    """Every distinct model of the plan built once for the data, before the first trains: one that cannot be
    (an SW-MLP whose dense m×m weights do not fit, as a tiny --sw-densities asks) is refused by name rather than
    after the runs before it have trained."""
    from ..data import build_datasets
    from ..models.factory import build_model
    info = build_datasets(spec, seed=0, val_fraction=0.2)[2]
    seen = set()
    for r in runs:
        key = (r['model'], json.dumps(r['kwargs'], sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        try:
            build_model(r['model'], r['kwargs'], info, kwargs_flag=None)     # this command has no --model-kwargs
        except ValueError as e:
            reason = str(e)
            # the flag that set this run: the depth sweep's C = S = C* is no --channels value (it was blamed on one)
            flag = (f"--sw-densities: density {r['density']:.3g} at --omega {omega_} is a width-{r['width']} SW-MLP"
                    if r['kind'] == 'SW-MLP'
                    else f"--depths {r['kwargs']['depth']}: C = S = {r['channels']}" if r['group'] == 'depth'
                    else f"--channels {r['channels']} at --depth {r['kwargs']['depth']}: C = {r['channels']}, "
                         f"S = {r['tokens']}")
            raise ValueError(f"{flag}, which this machine cannot build: {reason}") from None


def _run_name(r: Dict) -> str:
    depth = r['kwargs'].get('depth')
    return f"{r['group']}_{r['model']}_C{r['channels']}_S{r['tokens']}_L{depth}_seed{r['seed']}"


def summarise(rows: List[Dict], group: str, key: str) -> Dict:
    """{kind: {key value: (mean error, min, max, n)}} over seeds."""
    out: Dict[str, Dict] = {}
    for r in rows:
        if r['group'] != group:
            continue
        out.setdefault(r['kind'], {}).setdefault(r[key], []).append(100 - r['val_top1'])
    return {kind: {k: (statistics.mean(v), min(v), max(v), len(v)) for k, v in sorted(by.items())}
            for kind, by in out.items()}


def _errors(rows: List[Dict], group: str, key: str) -> Dict[str, Dict]:
    """{kind: {key value: [error of each seed]}}."""
    out: Dict[str, Dict] = {}
    for r in rows:
        if r['group'] == group:
            out.setdefault(r['kind'], {}).setdefault(r[key], []).append(100 - r['val_top1'])
    return out


def _se(errors: List[float]):
    """Standard error of the mean over seeds (sample standard deviation, n − 1); None for one seed."""
    return statistics.stdev(errors) / math.sqrt(len(errors)) if len(errors) >= 2 else None


def _apart(a: List[float], b: List[float]):
    """Mean error a minus mean error b against two standard errors of the difference: 'lower', 'higher',
    'no clear difference', or None where either has one seed only (no standard error to read it against)."""
    se_a, se_b = _se(a), _se(b)
    if se_a is None or se_b is None:
        return None
    delta, margin = statistics.mean(a) - statistics.mean(b), 2 * math.sqrt(se_a ** 2 + se_b ** 2)
    return 'lower' if delta < -margin else 'higher' if delta > margin else 'no clear difference'


CANNOT_TELL = 'CANNOT TELL at this scale'
TREND_LEVEL = 0.05               # a rank trend counts when its one-sided p-value is below this
EXACT_UP_TO = 8                  # runs up to which a rank test enumerates every pairing (8! = 40,320)


def rank_trend(x: List[float], y: List[float], alternative: str):
    """Spearman's ρ of y against x and its one-sided p-value (`alternative` 'less': y falls as x grows), and how
    the p-value was found. Up to `EXACT_UP_TO` points it is exact, over every pairing of x with y
    (`scipy.stats.permutation_test`): scipy's `spearmanr` p-value is a t approximation that calls a perfect
    ordering of 3 or 4 points p = 0, where its chance is 1/6 or 1/24. p is None when x or y is constant (no
    ranking, ρ undefined)."""
    import numpy as np
    from scipy.stats import permutation_test, rankdata, spearmanr
    if len(set(x)) < 2 or len(set(y)) < 2:
        return float('nan'), None, 'constant'
    if len(x) > EXACT_UP_TO:
        test = spearmanr(x, y, alternative=alternative)
        return float(test.statistic), float(test.pvalue), 'Spearman, t approximation'

    rx = rankdata(x)
    rx = rx - rx.mean()

    def rho(b, axis=-1):            # x stays in place; each permutation of y is one pairing
        rb = rankdata(b, axis=axis)
        rb = rb - rb.mean(axis=axis, keepdims=True)
        return (rx * rb).sum(axis=axis) / np.sqrt((rx ** 2).sum() * (rb ** 2).sum(axis=axis))

    test = permutation_test((np.asarray(y, float),), rho, permutation_type='pairings', alternative=alternative,
                            n_resamples=math.inf, vectorized=True)
    return float(test.statistic), float(test.pvalue), f'exact over all {math.factorial(len(x)):,} pairings'
ONE_SEED = f'{CANNOT_TELL}: one seed gives no standard error (run --seeds 2 or more)'


def verdicts(rows: List[Dict], omega_: float) -> Dict[str, str]:
    """Each claim against the numbers. A difference of two mean errors counts only beyond two standard errors of
    the difference over seeds (as the leaderboard reads its table); inside that, or with one seed, the verdict
    says it cannot tell rather than read noise as a result."""
    from ..models.mixer_design import optimal_width
    c_star = optimal_width(omega_)['channels']
    out = {}
    by_c = _errors(rows, 'width', 'channels')
    for kind in ('S-Mixer', 'RP S-Mixer'):
        table = {c: (statistics.mean(v), v) for c, v in sorted(by_c.get(kind, {}).items())}
        if len(table) < 2:
            continue
        best_c = min(table, key=lambda c: table[c][0])
        nearest = min(table, key=lambda c: abs(math.log(c / c_star)))
        against = {c: _apart(table[nearest][1], v[1]) for c, v in table.items() if c != nearest}
        if any(r is None for r in against.values()):
            verdict = ONE_SEED
        elif all(r == 'lower' for r in against.values()):
            verdict = 'HOLDS'
        elif any(r == 'higher' for r in against.values()):
            beaten = ', '.join(f'C = {c}' for c, r in against.items() if r == 'higher')
            verdict = f'DOES NOT HOLD ({beaten} lower beyond two standard errors)'
        else:
            tied = ', '.join(f'C = {c}' for c, r in against.items() if r == 'no clear difference')
            verdict = f'{CANNOT_TELL} ({tied} within two standard errors of C = {nearest})'
        out[f'best_near_c_equals_s_{kind}'] = (
            f"{kind}: lowest mean error {table[best_c][0]:.2f}% at C = {best_c}; the tried C nearest "
            f"C* = S* = {c_star:.1f} is {nearest} ({table[nearest][0]:.2f}%). 'Best near C = S' {verdict} here.")
    for kind in ('S-Mixer', 'RP S-Mixer', 'SW-MLP'):
        points = [(r['width'], 100 - r['val_top1']) for r in rows if r['group'] == 'width' and r['kind'] == kind]
        if len({m for m, _ in points}) < 3:
            continue
        widths, errors = [m for m, _ in points], [e for _, e in points]
        rho, falls, how = rank_trend(widths, errors, 'less')
        _, rises, _ = rank_trend(widths, errors, 'greater')
        if falls is None:
            verdict = f'{CANNOT_TELL} (every run has the same error: no ranking to test)'
        elif math.factorial(len(points)) * TREND_LEVEL < 1:      # even a perfect ordering has chance ≥ 1/n!
            verdict = (f'{CANNOT_TELL} ({len(points)} runs cannot show a trend at the {TREND_LEVEL:.0%} level: '
                       'run more --seeds)')
        elif falls < TREND_LEVEL:
            verdict = 'HOLDS'
        elif rises < TREND_LEVEL:
            verdict = f'DOES NOT HOLD (error rises with m: one-sided p = {rises:.2g})'
        else:
            verdict = f'{CANNOT_TELL} (no trend either way at the {TREND_LEVEL:.0%} level)'
        out[f'wider_is_better_{kind}'] = (
            f"{kind}: rank correlation of error with effective width m {rho:+.2f} over {len(points)} runs "
            f"(one-sided p = {falls if falls is not None else float('nan'):.2g}, {how}). 'Error falls as the width "
            f"grows at fixed Ω' {verdict} here.")
    by_depth = _errors(rows, 'depth', 'depth')
    normal, rp = by_depth.get('S-Mixer', {}), by_depth.get('RP S-Mixer', {})
    depths = sorted(set(normal) & set(rp))
    if len(depths) >= 2:
        gaps = {d: statistics.mean(rp[d]) - statistics.mean(normal[d]) for d in depths}
        shown = ', '.join(f"L={d}: {gaps[d]:+.2f}" for d in depths)
        ses = {d: (_se(rp[d]), _se(normal[d])) for d in depths}
        first, last = depths[0], depths[-1]
        if any(None in pair for pair in ses.values()):
            verdict = ONE_SEED
        else:
            se_gap = {d: math.sqrt(a ** 2 + b ** 2) for d, (a, b) in ses.items()}
            shrink_margin = 2 * math.sqrt(se_gap[first] ** 2 + se_gap[last] ** 2)
            if gaps[first] <= 2 * se_gap[first]:
                verdict = (f"DOES NOT APPLY here: RP is not behind beyond two standard errors at the shallowest depth "
                           f"(L={first}), so there is no gap to close")
            elif gaps[first] - gaps[last] > shrink_margin:
                verdict = f"HOLDS here: the gap shrinks from L={first} to L={last} beyond two standard errors"
            elif gaps[last] - gaps[first] > shrink_margin:
                verdict = f"DOES NOT HOLD here: the gap grows from L={first} to L={last} beyond two standard errors"
            else:
                verdict = (f"{CANNOT_TELL}: the gap at L={last} is within two standard errors "
                           f"(±{shrink_margin:.2f}) of the gap at L={first}")
        out['rp_catches_up_with_depth'] = (
            f"RP minus normal error by depth ({shown} points; negative: RP better). 'RP catches up with depth' "
            f"{verdict}.")
    return out


def predicted_sw_sigma(row: Dict, gamma: float = 2.0) -> float:
    """Eq. 17 to first order: λ²_max ≈ c_γ² (1 + 3√γ (1 − p)/q²), c_γ = 1 + √γ, q² = p·m."""
    p, m = row['density'], row['width']
    return (1 + gamma ** 0.5) * (1 + 3 * gamma ** 0.5 * (1 - p) / (p * m)) ** 0.5


def spectra_verdict(spectra: List[Dict]) -> Dict[str, str]:
    """§4.3: SW-MLP's largest singular value grows with width at fixed Ω, the Mixer's does not. A trend is a
    one-sided Spearman rank test of σ_max against m at the 5 % level (no threshold of our own)."""
    if len(spectra) < 3:
        return {}
    from scipy.stats import spearmanr
    edge = spectra[0]['marchenko_pastur_edge']
    widths = [r['width'] for r in spectra]
    sw = spearmanr(widths, [r['sw_mlp'] for r in spectra], alternative='greater')
    token = spearmanr(widths, [r['mixer_token'] for r in spectra], alternative='greater')
    deviation = {k: max(abs(r[k] - edge) / edge for r in spectra) for k in ('mixer_token', 'mixer_channel')}
    holds = sw.pvalue < 0.05 and token.pvalue >= 0.05
    first, last = spectra[0], spectra[-1]
    return {'spectra': (
        f"Init spectra: SW-MLP's σ_max goes from {first['sw_mlp']:.3f} (m = {first['width']}) to {last['sw_mlp']:.3f} "
        f"(m = {last['width']}); Eq. 17 predicts {predicted_sw_sigma(first):.3f} to {predicted_sw_sigma(last):.3f}; "
        f"rank correlation with m {sw.correlation:+.2f} (one-sided p = {sw.pvalue:.3g}). The Mixer's token weight W "
        f"stays within {100 * deviation['mixer_token']:.1f}% of 1 + √γ = {edge:.3f} (rank correlation "
        f"{token.correlation:+.2f}, p = {token.pvalue:.2g}); the channel weight V within "
        f"{100 * deviation['mixer_channel']:.1f}% (a γC×C matrix, as small as {2 * first['channels']}×"
        f"{first['channels']}, far from the Marchenko–Pastur limit). 'SW-MLP's largest singular value grows with "
        f"width, the Mixer's does not' {'HOLDS' if holds else 'DOES NOT HOLD'} here.")}


def _plots(rows: List[Dict], spectra: List[Dict], args, out: Path) -> List[str]:
    from ..analysis.mixer_spectra import plot_init_spectra
    written = []
    markers = {'S-Mixer': 'o-', 'RP S-Mixer': 's-', 'SW-MLP': '^-'}

    def by(group, key):
        def draw(plt):
            fig, ax = plt.subplots(figsize=(5.5, 3.8))
            for kind, table in summarise(rows, group, key).items():
                if key == 'channels' and kind == 'SW-MLP':
                    continue                  # SW-MLP's C only sets its width m = S₀C: no (S, C) pair to place
                xs = list(table)
                ax.plot(xs, [table[x][0] for x in xs], markers.get(kind, 'o-'), label=kind)
                ax.fill_between(xs, [table[x][1] for x in xs], [table[x][2] for x in xs], alpha=0.15)
            if key != 'depth':
                ax.set_xscale('log', base=2)
            label_axes(ax, {'width': 'effective width m', 'channels': 'C (S from fixed Ω)', 'depth': 'blocks L'}[key],
                       'held-out error %',
                       {'width': f'Fig. 5 analogue, Ω = {args.omega}', 'channels': f'Fig. 6 analogue, Ω = {args.omega}',
                        'depth': 'Fig. 7 analogue, S = C = C*'}[key], legend_size=8)
            fig.tight_layout()
            return fig
        return draw

    for name, group, key in (('error_vs_width.png', 'width', 'width'), ('error_vs_channels.png', 'width', 'channels'),
                             ('error_vs_depth.png', 'depth', 'depth')):
        if summarise(rows, group, key) and write_png(out / name, by(group, key)):
            written.append(name)
    if spectra and write_png(out / 'init_spectra.png', lambda plt: plot_init_spectra(spectra, plt, 2.0, 2 ** 19)):
        written.append('init_spectra.png')
    return written


def _report(rows, spectra, found, recipe, figures) -> str:
    lines = ['# MLP-Mixer as a wide sparse MLP, at MNIST scale', '',
             f"Recipe (every run): {json.dumps(recipe)}", '',
             '## Width at fixed Ω (Fig. 5–6)', '',
             '| model | C | S | m | Ω | density p | held-out error % (mean, min–max over seeds) |',
             '|---|---|---|---|---|---|---|']
    width_rows = {}
    for r in rows:
        if r['group'] == 'width':
            # SW-MLP's realised density Ω/m², not the requested one: m is rounded to a multiple of S₀
            key = (r['kind'], r['channels'], r['tokens'], r['width'], round(r['omega']), r.get('density', 1.0))
            width_rows.setdefault(key, []).append(100 - r['val_top1'])
    for (kind, c, s, m, om, p), errs in sorted(width_rows.items()):
        lines.append(f"| {kind} | {c} | {s} | {m} | {om} | {p:.3f} | {statistics.mean(errs):.2f} "
                     f"({min(errs):.2f}–{max(errs):.2f}) |")
    lines += ['', '## Depth, S = C = C* (Fig. 7)', '', '| model | L | held-out error % (mean, min–max) |', '|---|---|---|']
    for kind, table in summarise(rows, 'depth', 'depth').items():
        for d, (mean, lo, hi, _) in table.items():
            lines.append(f"| {kind} | {d} | {mean:.2f} ({lo:.2f}–{hi:.2f}) |")
    if spectra:
        lines += ['', '## Largest singular value at init, Ω = 2^19, γ = 2 (Fig. 4 right)', '',
                  '| C | S | m | SW-MLP p | Mixer W (γS×S) | Mixer V (γC×C) | SW-MLP M⊙A (γm×m) | 1 + √γ |',
                  '|---|---|---|---|---|---|---|---|']
        for r in spectra:
            lines.append(f"| {r['channels']} | {r['tokens']} | {r['width']} | {r['density']:.4f} | {r['mixer_token']:.3f} | "
                         f"{r['mixer_channel']:.3f} | {r['sw_mlp']:.3f} | {r['marchenko_pastur_edge']:.3f} |")
    lines += ['', '## Verdicts', ''] + [f"- {v}" for v in found.values()]
    lines += ['', 'Figures: ' + ', '.join(f'[{f}]({f})' for f in figures)]
    return '\n'.join(lines) + '\n'


def run(args: argparse.Namespace) -> int:
    if args.report_only:
        previous = Path(args.output) / 'results.json'
        if not previous.is_file():
            raise FileNotFoundError(f"--report-only: {previous} not found; run without --report-only first")
        from ..records import read_record
        saved = read_record(previous, 'the results.json of `reproduce mixer`', ('recipe', 'omega', 'rows', 'spectra'),
                            'run without --report-only to make it')
        args.omega = saved['omega']
        return _finish(saved, args, Path(args.output))
    _check(args)
    spec, out = start(args)
    from ..analysis.mixer_spectra import init_spectrum_sweep
    from ..train import TrainConfig, train
    recipe = dict(epochs=args.epochs, batch_size=args.batch_size, opt='adamw', lr=args.lr,
                  weight_decay=args.weight_decay, sched='cosine', warmup_epochs=min(1.0, args.epochs / 5),
                  label_smoothing=0.0, val_fraction=0.2, limit_train_batches=args.limit_train_batches)
    runs = plan(args)
    _preflight(runs, spec, args.omega)        # before the spectra: a model this machine cannot build is refused first
    spectra = init_spectrum_sweep(trials=args.spectra_trials) if args.spectra_trials else []
    if spectra:
        print("init spectra (Ω = 2^19, γ = 2): C, m, Mixer W σ_max, SW-MLP σ_max:", flush=True)
    for r in spectra:
        print(f"  C={r['channels']:>3} m={r['width']:>5}  {r['mixer_token']:.3f}  {r['sw_mlp']:.3f}", flush=True)
    rows = []
    for i, r in enumerate(runs):
        run_dir = out / 'runs' / _run_name(r)
        settings = dict(model=r['model'], model_kwargs=r['kwargs'], seed=r['seed'], keep_last=1, **recipe)
        if finished_run(run_dir, settings, spec):         # an interrupted study takes up where it stopped
            print(f'reusing the finished run in {run_dir}', flush=True)
        else:
            train(TrainConfig(data=spec, output=str(run_dir), **settings), progress=False, overwrite=True)
        summary = json.loads((run_dir / 'summary.json').read_text())
        row = dict(r, depth=r['kwargs'].get('depth'), val_top1=summary['final_val_top1'],
                   best_val_top1=summary['best_val_top1'], run=str(run_dir))
        rows.append(row)
        print(f"[{i + 1}/{len(runs)}] {r['group']:<5} {r['kind']:<10} C={r['channels']:<4} S={r['tokens']:<4} "
              f"m={r['width']:<5} L={row['depth']} seed {r['seed']}: error {100 - row['val_top1']:.2f}%", flush=True)
    record = {'command': command_line(args, 'mixer'), 'recipe': recipe, 'omega': args.omega, 'rows': rows,
              'spectra': spectra, 'environment': environment('cpu'),
              'args': {k: v for k, v in vars(args).items() if k != 'func'}}
    return _finish(record, args, out)


def _finish(record: Dict, args, out: Path) -> int:
    """Verdicts, figures, results.json (the run's own record, verdicts refreshed) and report.md."""
    rows, spectra, recipe = record['rows'], record['spectra'], record['recipe']
    found = dict(verdicts(rows, record['omega']), **spectra_verdict(spectra))
    figures = _plots(rows, spectra, args, out)
    write_json(out / 'results.json', dict(record, verdicts=found))
    write_text(out / 'report.md', _report(rows, spectra, found, recipe, figures))
    print('\n'.join(found.values()))
    print(f"wrote {out / 'results.json'} and {out / 'report.md'}")
    return 0
