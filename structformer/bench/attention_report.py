"""What `structformer bench attention` prints and draws: the sweep's table, the paired rounds, the two goal
ratios (SOFT Fig. 1b's memory growth, SDPA / SOFT forward time) and the Fig. 1b-style plot. The measuring is in
`attention.py`; this module only reads its rows."""
from __future__ import annotations

from typing import Optional

from .kinds import print_header

# SOFT folds its value and output projections into the attention products (soft.py), so its counted "core"
# (whole layer minus an ordinary qkv/proj budget) is not a tally of attention ops: marked † in the table
FOLDED_PROJECTIONS = ('soft', 'softpp')


def _fmt(v, spec, width):
    return format(v, f'>{width}{spec}') if v is not None else f"{'n/a':>{width}}"


def print_report(rows, goals, args, env: dict, paired: Optional[dict] = None) -> None:
    device = env['cpu'] if env['device'] == 'cpu' else f"{env['device']} (CPU {env['cpu']})"
    print()
    print_header(env)
    print(f"batch 1, dim {args.dim}, {args.heads} heads, m = {args.landmarks}, {args.device}, "
          f"{rows[0].get('threads', '?') if rows else '?'} threads, {device}, torch {env['torch']}")
    print("FLOPs (forward, G): counted = FlopCounterMode on the whole layer (matmul/conv only, multiply-add = 2); "
          "core = counted − qkv/proj Linear; analytic = closed-form core (softmax: 4n²d per head; "
          "SOFT: §3 complexity, unit constants)")
    compiled = any('forward_ms_compiled' in r for r in rows)
    if compiled:
        print(f"(c): the same layer under torch.compile ({args.compile}), timed after its first, compiling call")
    print(f"{'attention':<14} {'n':>6} {'grid':>8} {'m':>3} {'fwd ms':>9} {'fwd+bwd ms':>11} {'peak MiB':>9} "
          f"{'counted':>8} {'core':>8} {'analytic':>9}"
          + (f" {'fwd ms (c)':>11} {'f+b ms (c)':>11} {'compile s':>9}" if compiled else ''))
    for r in rows:
        head = f"{r['attention']:<14} {r['tokens']:>6} {'×'.join(map(str, r['grid'])):>8}"
        if r.get('skipped'):
            print(f"{head}  skipped: {r['reason']}")
            continue
        if 'error' in r:
            print(f"{head}  FAILED: {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        g = 1e9
        print(f"{head} {r['landmarks'] if r['attention'] not in ('softmax', 'softmax_naive') else '-':>3} "
              f"{r['forward_ms']:>9.2f} {r['forward_backward_ms']:>11.2f} {_fmt(r['peak_mib'], '.1f', 9)} "
              f"{r['flops_counted_forward'] / g:>8.3f} {r['flops_counted_core_forward'] / g:>7.3f}"
              f"{'*' if r.get('flops_counter_missed') else '†' if r['attention'] in FOLDED_PROJECTIONS else ' '} "
              f"{_fmt(r['flops_analytic_core_forward'] and r['flops_analytic_core_forward'] / g, '.3f', 9)}"
              + (f" {r['forward_ms_compiled']:>11.2f} {r['forward_backward_ms_compiled']:>11.2f} {r['compile_s']:>9.1f}"
                 if compiled else ''))
    if any(r.get('flops_counter_missed') for r in rows):
        print("* counted core < half the analytic count: FlopCounterMode has no formula for an op here "
              "(on CPU, SDPA's fused flash kernel), so 'counted' misses it; trust 'analytic' for that row")
    if any(r['attention'] in FOLDED_PROJECTIONS for r in rows if not r.get('skipped')):
        print("† SOFT folds its value and output projections into the attention products where that needs fewer "
              "multiply-adds: 'core' is its counted total minus an ordinary qkv/proj budget, not a tally of "
              "attention ops, and can be below zero at small n")
    if paired:
        ref = paired['reference']
        print(f"\npaired forward at {paired['tokens']} tokens, {args.pairs} back-to-back rounds "
              f"(speed-up = time of {ref} / time of the attention, median and quartiles of the rounds):")
        for name, p in paired['ratios'].items():
            print(f"  {name:<14} {p['median_s'] * 1e3:>9.2f} ms  {p['ratio']:>8.2f}×  "
                  f"({p['ratio_q1']:.2f}–{p['ratio_q3']:.2f})")
    a, b = goals.get('soft_memory_growth'), goals.get('sdpa_over_soft_forward_time')
    print("\ngoal ratios (measured in this run; reported, not asserted):")
    if a:
        print(f"  (a) SOFT peak memory at {a['tokens'][1]} / at {a['tokens'][0]} tokens: {a['ratio']:.2f} "
              f"(goal <= {a['goal_max']:g}, linear growth)  {'PASS' if a['pass'] else 'MISS'}")
    else:
        print("  (a) SOFT memory growth: n/a (needs 'soft' at two token counts, with a memory growth above zero "
              "measured at both: tiny inputs stay within the few pages the reader can resolve)")
    if b:
        note = '' if b['tokens'] == 12544 else ' [goal stated at 12544 tokens]'
        spread = f", quartiles {b['quartiles'][0]:.2f}–{b['quartiles'][1]:.2f}" if b['quartiles'] else ''
        print(f"  (b) SDPA / SOFT forward time at {b['tokens']} tokens: {b['ratio']:.2f}× ({b['source']}{spread}; "
              f"sweep medians {b['sweep_ratio']:.2f}×) (goal >= {b['goal_min']:g}×){note}  "
              f"{'PASS' if b['pass'] else 'MISS'}")
    else:
        print("  (b) SDPA / SOFT forward time: n/a (needs 'softmax' and 'soft' measured at the largest n)")


def plot(rows, plt):
    """Fig. 1b-style: peak memory and forward(+backward) time vs tokens, log-log, one line per attention."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [('peak_mib', 'peak memory, fwd+bwd (MiB)'), ('forward_ms', 'forward time (ms)'),
              ('forward_backward_ms', 'forward+backward time (ms)')]
    for ax, (key, label) in zip(axes, panels):
        for name in dict.fromkeys(r['attention'] for r in rows):
            pts = [(r['tokens'], r[key]) for r in rows if r['attention'] == name and not r.get('skipped')
                   and 'error' not in r and r.get(key)]
            if pts:
                ax.plot(*zip(*pts), marker='o', label=name)
        ax.set_xscale('log', base=2)
        tokens = sorted({r['tokens'] for r in rows})
        ax.set_xticks(tokens, [str(t) for t in tokens], fontsize=7)   # label the measured n, not powers of 2
        ax.minorticks_off()
        ax.set_yscale('log')
        ax.set_xlabel('tokens n')
        ax.set_ylabel(label)
        ax.grid(True, which='both', alpha=0.3)
    axes[1].legend(fontsize=8)                          # time is measured in every mode
    fig.suptitle('attention cost vs tokens (cf. SOFT Fig. 1b)')
    fig.tight_layout()
    return fig
