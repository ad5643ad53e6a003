"""`structformer design`: Mixer widths at a fixed number of connections Ω (Mixer paper §4.2, Eq. 13–15)."""
from __future__ import annotations

import argparse
import json

from .cli_args import OMEGA_MAX_LOG2, parse_omega

DESCRIPTION = '(S, C) pairs on a fixed-Ω curve, C* = S*, effective widths, SW-MLP widths.'

EXAMPLES = """examples:
  structformer design --omega 2^18                              # App. C's (C, S) pairs, C* = S*, SW-MLP widths
  structformer design --omega 2^19 --gamma 2 --channels 4 16 64 --json"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument('--omega', type=parse_omega, required=True, help='connections per layer, e.g. 262144 or 2^18')
    p.add_argument('--gamma', type=float, default=1.0, help='expansion factor γ (1: S-Mixer; default 1)')
    p.add_argument('--channels', type=int, nargs='+', default=None,
                   help="C values to pair with S on the fixed-Ω curve (default: App. C's 16 32 48 83 113 173 and C*)")
    p.add_argument('--sw-densities', type=float, nargs='+', default=[0.9, 0.7, 0.5, 0.3, 0.1],
                   help='SW-MLP densities p to size at the same Ω (width m = √(Ω/(pγ)))')
    p.add_argument('--json', action='store_true', help='print one JSON object')


def run(args) -> int:
    from .models.mixer_design import fixed_omega_pairs, optimal_width, sw_width
    # Ω/γ is the layer's size before the expansion: between 16 and 2^64 connections, as --omega itself, every
    # width below (C* = (Ω/γ)^{1/3}, m = √(Ω/(pγ))) is >= 1 and finite (1e-300 overflows, 1e300 gives m = 0)
    low, high = args.omega / 2 ** OMEGA_MAX_LOG2, args.omega / 16
    if not low <= args.gamma <= high:
        raise ValueError(f"--gamma {args.gamma:g} is out of range: accepted γ with Ω/γ in [16, 2^{OMEGA_MAX_LOG2}], "
                         f"here γ in [{low:.3g}, {high:.3g}] for --omega {args.omega}")
    if any(not 0 < p <= 1 for p in args.sw_densities):
        raise ValueError(f"--sw-densities must lie in (0, 1], got {args.sw_densities}")
    if any(not sw_width(args.omega, p, args.gamma) < 2 ** OMEGA_MAX_LOG2 for p in args.sw_densities):
        raise ValueError(f"--sw-densities {min(args.sw_densities):g} is too small: the SW-MLP width √(Ω/(pγ)) would "
                         f"exceed 2^{OMEGA_MAX_LOG2}")
    if args.channels is not None and any(not 1 <= c <= 2 ** OMEGA_MAX_LOG2 for c in args.channels):
        raise ValueError(f"--channels must be integers in [1, 2^{OMEGA_MAX_LOG2}], got {args.channels}")
    best = optimal_width(args.omega, args.gamma)
    channels = args.channels or sorted({16, 32, 48, 83, 113, 173, max(1, round(best['channels']))})
    pairs = fixed_omega_pairs(args.omega, channels, args.gamma)
    dropped = []
    if not args.channels:          # the default list keeps the C that this Ω can reach, and says which it left out
        dropped = [r['channels'] for r in pairs if not r['on_curve']]
        pairs = [r for r in pairs if r['on_curve']]
    sw = [{'density': p, 'width': sw_width(args.omega, p, args.gamma)} for p in args.sw_densities]
    if args.json:
        optimal = {k: _integral(v) for k, v in best.items()}
        print(json.dumps({'omega': args.omega, 'gamma': args.gamma, 'optimal': optimal, 'pairs': pairs,
                          'dropped_channels': dropped, 'sw_mlp': sw}))
        return 0
    print(f"Ω = {args.omega:,} connections per layer, γ = {args.gamma:g}: Ω = γ(CS² + C²S)/2 (Mixer), pγm² (SW-MLP)")
    print(f"widest Mixer: C* = S* = {best['channels']:.1f}, effective width m* = {best['width']:,.0f}")
    print(f"{'C':>6} {'S':>6} {'m = SC':>9} {'Ω of the pair':>14} {'token nnz':>10} {'channel nnz':>12}")
    for r in pairs:
        # an exact int as it is (through a float the last digits went from 2^53 on); a float (γ not an integer) rounded
        count = f"{r['omega']:>14,}" if isinstance(r['omega'], int) else f"{r['omega']:>14,.0f}"
        print(f"{r['channels']:>6} {r['tokens']:>6} {r['width']:>9,} {count}{' ' if r['on_curve'] else '!'}"
              f"{r['nonzero_token_mixing']:>10.4f} {r['nonzero_channel_mixing']:>12.4f}")
    if not all(r['on_curve'] for r in pairs):
        print("! off the fixed-Ω curve: even S = 1 spends more than 1.5 × Ω at this C (C too large for this Ω)")
    if dropped:
        print(f"left out of the default C list: {', '.join(map(str, dropped))} (this Ω cannot reach them: even S = 1 "
              "spends more than 1.5 × Ω)")
    print("SW-MLP at the same Ω: " + ', '.join(f"p = {r['density']:g} → m = {r['width']:.0f}" for r in sw))
    return 0


def _integral(value: float):
    """`value` as an int where it is one up to float rounding (C* = (2^18)^{1/3} came out 63.999999999999986),
    else unchanged (full precision: C* at Ω = 2^10 is 10.079...). The tolerance is relative, some fifty ulps
    (a cube root and a square): at 1e-9 every value above 1e9 was 'integral', m* = 6981463658331.55 at Ω = 2^64
    printed 6981463658332."""
    nearest = round(value)
    return int(nearest) if abs(value - nearest) <= 1e-14 * max(1.0, abs(value)) else value
