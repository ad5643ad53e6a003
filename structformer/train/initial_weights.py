"""`--initial-checkpoint`: start a new run from trained weights (fine-tuning), with a fresh optimiser and schedule.

Accepted: a structformer run or checkpoint folder, a `.safetensors` file, or a weights-only `.pth` / `.pt` / `.bin`
(read with `torch.load(weights_only=True)`: loading never runs code). The weights are adapted to the model as timm
adapts pretrained weights: a classifier of another size is left at its fresh initialisation, the first layer's
input channels are folded or repeated (`timm.models._manipulate.adapt_input_conv`), an absolute position
embedding of another grid is resampled (`timm.layers.resample_abs_pos_embed`). Every adaptation is reported;
any other key that is missing, unexpected or of another shape is refused by name, never silently dropped.
"""
import math
from pathlib import Path
from typing import Dict, List

import torch

from ..errors import UsageError

FLAG = '--initial-checkpoint'


def read_weights(path) -> Dict[str, torch.Tensor]:
    """The tensors of a run / checkpoint folder, a safetensors file or a weights-only torch file."""
    from .checkpoint import CheckpointError, load_checkpoint
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{FLAG} {path}: does not exist")
    if path.is_dir() or path.name in ('model.safetensors', 'state.json'):
        try:
            weights, _, _ = load_checkpoint(path)
        except CheckpointError as e:
            raise UsageError(f"{FLAG} {path}: {str(e).split('--checkpoint: ', 1)[-1]}") from None
        return weights
    if path.suffix == '.safetensors':
        from safetensors.torch import load_file
        try:
            return load_file(str(path))
        except Exception as e:                      # safetensors raises several types on damaged files
            raise UsageError(f"{FLAG} {path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if path.suffix in ('.pth', '.pt', '.bin'):
        try:
            loaded = torch.load(str(path), map_location='cpu', weights_only=True)
        except Exception as e:                      # a pickle with code in it, or a damaged file
            raise UsageError(f"{FLAG} {path}: not a weights-only torch file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
        for key in ('state_dict', 'model', 'state_dict_ema'):       # common wrappers of training scripts
            if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
                loaded = loaded[key]
                break
        if not isinstance(loaded, dict) or not all(torch.is_tensor(v) for v in loaded.values()):
            raise UsageError(f"{FLAG} {path}: holds no mapping of names to tensors")
        return {k[len('module.'):] if k.startswith('module.') else k: v for k, v in loaded.items()}
    raise UsageError(f"{FLAG} {path}: accepted a run or checkpoint folder, .safetensors, or a weights-only "
                     ".pth / .pt / .bin")


def adapt_weights(model: torch.nn.Module, weights: Dict[str, torch.Tensor]) -> List[str]:
    """Adapt `weights` in place to `model` (classifier, input channels, position embedding); returns what was done."""
    own = model.state_dict()
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    done = []
    classifiers = cfg.get('classifier') or ()
    for prefix in ([classifiers] if isinstance(classifiers, str) else classifiers):
        for key in (f'{prefix}.weight', f'{prefix}.bias'):
            if key in weights and key in own and weights[key].shape != own[key].shape:
                done.append(f"{key} {list(weights[key].shape)} -> {list(own[key].shape)}: freshly initialised "
                            "(another number of classes)")
                del weights[key]
    first = cfg.get('first_conv')
    key = f'{first}.weight' if isinstance(first, str) else None
    if key in weights and key in own and weights[key].dim() == 4 and weights[key].shape[1] != own[key].shape[1]:
        from timm.models._manipulate import adapt_input_conv
        old = weights[key].shape[1]
        weights[key] = adapt_input_conv(own[key].shape[1], weights[key].float(), base_chans=old).to(weights[key].dtype)
        done.append(f"{key}: input channels {old} -> {own[key].shape[1]} (timm's adapt_input_conv)")
    if 'pos_embed' in weights and 'pos_embed' in own and weights['pos_embed'].shape != own['pos_embed'].shape:
        from timm.layers import resample_abs_pos_embed
        prefix = getattr(model, 'num_prefix_tokens', 1)
        old_tokens, new_tokens = weights['pos_embed'].shape[1] - prefix, own['pos_embed'].shape[1] - prefix
        old_side, new_side = math.isqrt(old_tokens), math.isqrt(new_tokens)
        if old_side ** 2 == old_tokens and new_side ** 2 == new_tokens:
            weights['pos_embed'] = resample_abs_pos_embed(weights['pos_embed'], [new_side, new_side],
                                                          [old_side, old_side], num_prefix_tokens=prefix)
            done.append(f"pos_embed: grid {old_side}x{old_side} -> {new_side}x{new_side} (timm's resample_abs_pos_embed)")
    return done


def load_initial_weights(model: torch.nn.Module, path) -> List[str]:
    """Load `path` into `model` as --initial-checkpoint does; returns the adaptations made."""
    from .checkpoint import describe_mismatch
    weights = read_weights(path)
    done = adapt_weights(model, weights)
    own = model.state_dict()
    dropped = {k for k in own if k not in weights and any(k in line.split(' ')[0] for line in done)}
    mismatch = describe_mismatch({k: v for k, v in own.items() if k not in dropped}, weights)
    if mismatch:
        raise UsageError(f"{FLAG} {path}: the weights do not fit --model {getattr(model, 'default_cfg', {}).get('architecture', type(model).__name__)}: {mismatch}")
    model.load_state_dict(weights, strict=False)
    return done
