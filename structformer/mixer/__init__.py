"""MLP-Mixer as a wide sparse MLP: design helpers (fixed-Ω widths), the effective-weight and spectrum
analysis, and CKA between models. Layers live in `structformer.layers.linear`, models in
`structformer.models.mixer`."""
from .design import (fixed_omega_pairs, omega, optimal_width, sw_density, sw_omega, sw_width, tokens_for_omega)

__all__ = ['omega', 'sw_omega', 'sw_density', 'sw_width', 'tokens_for_omega', 'fixed_omega_pairs', 'optimal_width']
