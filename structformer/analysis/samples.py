"""The images an analysis measures: a seeded subset of a dataset's validation split (`structformer analyze`, the
CRATE and Sparsifiner reproductions, CKA)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Tuple

if TYPE_CHECKING:
    import torch

# torch and the data code are imported where they are used: the analyze command imports this module to build
# its parser for `structformer --help`, which must not pay for importing torch


def load_samples(spec: str, options: Dict, data_seed: int, val_fraction: float, num_samples: int,
                 seed: int) -> Tuple[torch.Tensor, object, List[int]]:
    """B validation images (a seeded subset when the split is larger) and the dataset info."""
    import torch

    from ..data import build_datasets
    _, val, info = build_datasets(spec, seed=data_seed, val_fraction=val_fraction, **options)
    n = len(val)
    if n == 0:
        raise ValueError(f"--data {spec}: the validation split is empty")
    if n > num_samples:
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:num_samples].sort().values.tolist()
    else:
        idx = list(range(n))
    subspaces = getattr(val, 'token_subspaces', None)      # synthetic-subspaces: each token's subspace
    if subspaces is not None and getattr(info, 'extra', None) is not None:
        info.extra['val_token_subspaces'] = subspaces[idx]
    return torch.stack([val[i][0] for i in idx]), info, idx
