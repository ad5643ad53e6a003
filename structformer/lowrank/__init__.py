"""Low-rank training (seed 004): factorise any model's linear and conv layers (W = U Vᵀ), spectral
initialisation, L2 vs Frobenius decay, effective rank and spectra, and interpolation between runs.

    from structformer.lowrank import factorize
    model = factorize(model, rank=0.3, init='spectral')          # every conv but the first, or QKV + FFN

Modules: `transform` (the `factorize` model transform and its presets), `regularizers` (Frobenius
decay as tr((UᵀU)(VᵀV)) and L2 on the factors, registered loss terms), `spectra` (effective rank
‖W‖_*/‖W‖_op, singular values of every layer), `interpolate` (accuracy and loss along θ = (1-t)θ_a + tθ_b).
Submodules load on first use, so importing the package imports no torch.
"""
import importlib

_EXPORTS = {
    'factorize': 'transform', 'plan_factorization': 'transform', 'PRESETS': 'transform',
    'frobenius_decay': 'regularizers', 'factor_l2': 'regularizers', 'factor_parameter_names': 'regularizers',
    'effective_rank': 'spectra', 'layer_spectra': 'spectra', 'effective_ranks': 'spectra',
    'interpolate_parameters': 'interpolate', 'interpolation_curve': 'interpolate',
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
