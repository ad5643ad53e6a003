"""Widths at a fixed number of connections Ω per layer (Mixer paper §4.2, Eq. 13–15).

    Mixer / S-Mixer:  Ω = γ (C·S² + C²·S) / 2   (token mixing has C·S² non-zeros, channel mixing S·C²,
                                                  averaged over the two, times the expansion γ)
    SW-MLP:           Ω = p·γ·m²                (a width-m layer with a density-p mask)

The effective width of a Mixer is m = S·C, with non-zero fractions 1/C (token) and 1/S (channel); at fixed
Ω it is largest at C* = S* = (Ω/γ)^{1/3}, where m* = (Ω/γ)^{2/3}. Pure Python: no torch needed.
"""
import math
from typing import Dict, Iterable, List


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def omega(tokens: float, channels: float, gamma: float = 1.0) -> float:
    """Ω of a Mixer layer pair with S tokens, C channels and expansion γ (Eq. 14). Integer S, C and γ give the
    exact integer (CS(S + C) is even; floats lost the last digits from about 2^53 on, and --omega goes to 2^64)."""
    S, C, g = _positive('tokens', tokens), _positive('channels', channels), _positive('gamma', gamma)
    if all(isinstance(v, int) for v in (tokens, channels)) and g.is_integer():
        return int(g) * (channels * tokens * (tokens + channels) // 2)
    return g * (C * S * S + C * C * S) / 2


def sw_omega(width: float, density: float, gamma: float = 1.0) -> float:
    """Ω = pγm² of an SW-MLP layer (Eq. 13)."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return density * _positive('gamma', gamma) * _positive('width', width) ** 2


def sw_density(omega_: float, width: float, gamma: float = 1.0) -> float:
    """The SW-MLP density p that gives a width-m layer Ω connections: p = Ω / (γm²), at most 1."""
    p = _positive('omega', omega_) / (_positive('gamma', gamma) * _positive('width', width) ** 2)
    if p > 1:
        raise ValueError(f"width {width} is too narrow for Ω={omega_:g} at γ={gamma}: even a dense layer has only "
                         f"{gamma * width * width:g} connections")
    return p


def sw_width(omega_: float, density: float, gamma: float = 1.0) -> float:
    """The SW-MLP width at Ω and density p: m = √(Ω / (pγ)) (the paper's m = 540 … 1619 at Ω = 2¹⁸)."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return math.sqrt(_positive('omega', omega_) / (density * _positive('gamma', gamma)))


def tokens_for_omega(omega_: float, channels: float, gamma: float = 1.0) -> float:
    """S solving γ(CS² + C²S)/2 = Ω for given C (the positive root; round it for a model)."""
    O, C, g = _positive('omega', omega_), _positive('channels', channels), _positive('gamma', gamma)
    return (-C + math.sqrt(C * C + 8 * O / (g * C))) / 2


def optimal_width(omega_: float, gamma: float = 1.0) -> Dict[str, float]:
    """C* = S* = (Ω/γ)^{1/3} and m* = (Ω/γ)^{2/3}, the widest Mixer at Ω (§4.2)."""
    side = (_positive('omega', omega_) / _positive('gamma', gamma)) ** (1 / 3)
    return {'channels': side, 'tokens': side, 'width': side * side}


OFF_CURVE = 1.5         # a pair spending more than this × Ω is off the fixed-Ω curve (C too large for Ω)


def fixed_omega_pairs(omega_: float, channels: Iterable[int], gamma: float = 1.0) -> List[Dict[str, float]]:
    """One row per C: the integer S nearest the fixed-Ω curve, the effective width m = SC, the Ω that
    pair really has, and the non-zero fractions of token and channel mixing (1/C, 1/S). `on_curve` is
    False where even S = 1 spends more than 1.5 × Ω (C too large for this Ω): that pair is not on the curve."""
    rows = []
    for C in channels:
        if isinstance(C, bool) or not isinstance(C, int) or C < 1:
            raise ValueError(f"channels must be positive integers, got {C!r}")
        S = max(1, int(round(tokens_for_omega(omega_, C, gamma))))
        pair_omega = omega(S, C, gamma)
        rows.append({'channels': C, 'tokens': S, 'width': S * C, 'omega': pair_omega,
                     'nonzero_token_mixing': 1 / C, 'nonzero_channel_mixing': 1 / S,
                     'on_curve': pair_omega <= OFF_CURVE * omega_})
    return rows
