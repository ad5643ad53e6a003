"""White-box analysis of CRATE (Yu et al., 2023, §3.1): per-layer compression R_c (Eq. 8), coding rate
R (Eq. 7), sparsity, subspace coherence (Fig. 7), token heat maps (Fig. 6) and recovery of known
subspaces on synthetic data. `structformer analyze` (cli.py) runs it all on checkpoints."""
from .subspaces import (coherence_summary, embedding_linear_map, map_true_bases, match_subspaces,
                        principal_angles, random_bases, subspace_coherence, subspace_recovery)
from .whitebox import capture_layers, check_crate, layer_bases, layer_hooks, measure_layers, token_heatmaps

__all__ = ['measure_layers', 'capture_layers', 'layer_hooks', 'layer_bases', 'check_crate', 'token_heatmaps',
           'subspace_coherence', 'coherence_summary', 'principal_angles', 'embedding_linear_map',
           'map_true_bases', 'match_subspaces', 'random_bases', 'subspace_recovery']
