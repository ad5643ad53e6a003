"""What an analysis reads: the data a checkpoint is measured on (`recorded_data`), a seeded subset of its
validation split (`load_samples`), and the second checkpoint of a comparison (`second_checkpoint`); used by
`structformer analyze` (CRATE, Sparsifiner, CKA, interpolation) and the CRATE reproduction; `load_named` loads one
beside --checkpoint, its errors naming the flag that gave it; `check_takes_images` refuses data a model cannot take."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

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


def recorded_data(state: Dict, data: Optional[str], checkpoint) -> Tuple[str, Dict, int, float]:
    """The data a checkpoint is measured on, as (spec, options, seed, val_fraction): --data when given, else the
    run's own (refused by name if it has moved); the run's data options only on the run's own data, images at the
    size the model was trained on; the run's seed and held-out fraction, so the held-out split is the one
    training used."""
    config = state.get('config') or {}
    spec = data or config.get('data')
    if not spec:
        raise ValueError(f"--data: checkpoint {checkpoint} records no training data; pass --data SPEC")
    if not data:
        from ..train.data_paths import check_stored_data
        check_stored_data(spec, config.get('data_as_given'), "the checkpoint's", '--data')
    from ..train.scoring_data import checkpoint_data_options
    options = checkpoint_data_options(state, data)     # the run's options on its own data; the model's image size
    return spec, options, int(config.get('seed', 0)), float(config.get('val_fraction', 0.2))


def second_checkpoint(flag: str, value: str):
    """The checkpoint a comparison reads beside --checkpoint (--cka, --interpolate), its errors naming `flag`."""
    from ..train.checkpoint import resolve_checkpoint
    try:
        return resolve_checkpoint(value)
    except (FileNotFoundError, ValueError) as e:          # CheckpointError is a ValueError
        raise ValueError(f"{flag} {value}: {str(e).split('--checkpoint: ', 1)[-1]}") from None


def load_named(flag: str, path, ema: bool = False):
    """`load_model(path, ema=ema)` for the checkpoint `flag` names (--cka, --interpolate, --compare): the loader's
    errors say '--checkpoint: ...', which blamed the flag whose checkpoint was fine."""
    from ..train.checkpoint import load_model
    try:
        return load_model(path, ema=ema)
    except (FileNotFoundError, ValueError) as e:          # CheckpointError is a ValueError
        text = str(e)
        if not text.startswith('--checkpoint'):
            raise
        raise type(e)(flag + text[len('--checkpoint'):]) from None


def check_takes_images(spec: str, images, path, model, state: Dict, flag: str = '') -> None:
    """Data a checkpoint's model cannot take (another channel count or image size): one line naming --data and the
    checkpoint (with the flag that named it, beside --checkpoint), not a traceback from inside timm's patch
    embedding. Tried on the first two of `images`."""
    from ..train.scoring_data import check_model_input
    named = f"{flag} {path}" if flag else str(path)
    check_model_input(model, images[:2], None, f"--data {spec}: {named} ({state.get('model')}) cannot take its images")
