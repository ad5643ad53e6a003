"""White-box measurements of trained models. CRATE (Yu et al., 2023, §3.1): per-layer compression R_c
(Eq. 8; `official` and `paper` estimators), per-operator deltas, sparsity, norms, curves over training,
subspace coherence (Fig. 7), token heat maps (Fig. 6) and recovery of known subspaces on synthetic data.
Sparsifiner: predicted masks and attention maps (`sparsifiner.py`). Any two models: CKA (`cka.py`).
`structformer analyze` (cli.py) runs them on checkpoints."""
import importlib

_HOMES = {'subspaces': ('coherence_summary', 'embedding_linear_map', 'map_true_bases', 'match_subspaces',
                        'principal_angles', 'random_bases', 'subspace_coherence', 'subspace_recovery'),
          'whitebox': ('ESTIMATORS', 'capture_layers', 'check_crate', 'layer_bases', 'layer_hooks', 'measure_layers',
                       'rate', 'token_heatmaps'),
          'curves': ('measure_checkpoints', 'measure_run', 'run_checkpoints')}
_WHERE = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name):
    """Imported on first use, so `structformer analyze --help` (which imports .cli) needs no torch."""
    if name in _WHERE:
        return getattr(importlib.import_module(f'{__name__}.{_WHERE[name]}'), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
