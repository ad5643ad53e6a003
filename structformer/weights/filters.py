"""Adapting a state dict to the model it is loaded into, as timm adapts pretrained weights: one filter per family.

A filter takes (state_dict, model) and returns the state dict the model loads, as timm's `pretrained_filter_fn`
(`build_model_with_cfg` calls it inside `timm.models.load_pretrained`), and the same function serves
`structformer train --pretrained-path / --initial-checkpoint` (`adapt_state_dict`, which also returns what it did).
What adapts, with timm's own tools:

* the classifier (`pretrained_cfg['classifier']`) of another number of classes: left at the model's fresh
  initialisation;
* the first layer (`pretrained_cfg['first_conv']`) of another number of input channels: timm's `adapt_input_conv`
  (a convolution as is; CRATE's linear patch embedding on the `(p1 p2 c)` flattening is viewed as the
  convolution it is, its input LayerNorm's per-channel scale and shift averaged or repeated);
* absolute position embeddings of another grid: timm's `resample_abs_pos_embed` (ViT and CRATE: `pos_embed`;
  SOFT: each stage's `pos_embeds.i`, the cls position of stage 4 kept); timm's ViT filter for ViT models;
* Sparsifiner's connectivity basis W_down, W_up (one column per token) of another token count: freshly
  initialised at the model's count; the whole predictor, when the weights have none (a plain ViT / DeiT).

Anything else missing, unexpected or of another shape is refused by name (the first few and the count), never
dropped: `WeightsMismatch`, a ValueError.
"""
import logging
import math
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

__all__ = ['WeightsMismatch', 'adapt_state_dict', 'filter_fn_for', 'pretrained_filter_fn']

_logger = logging.getLogger(__name__)


class WeightsMismatch(ValueError):
    """The weights do not fit the model beyond what the filters adapt."""


def _is_lazy(tensor) -> bool:
    return isinstance(tensor, nn.parameter.UninitializedTensorMixin)


def _own(model: nn.Module) -> Dict[str, torch.Tensor]:
    return model.state_dict()


def _classifier(state: dict, model: nn.Module, own: dict, done: List[str]) -> None:
    names = (getattr(model, 'pretrained_cfg', None) or {}).get('classifier') or ()
    for prefix in ([names] if isinstance(names, str) else names):
        for key in (f'{prefix}.weight', f'{prefix}.bias'):
            if key in own and key in state and tuple(state[key].shape) != tuple(own[key].shape):
                done.append(f"{key} {list(state[key].shape)} -> {list(own[key].shape)}: freshly initialised "
                            "(another number of classes)")
                state[key] = own[key].clone()
            elif key in own and key not in state:            # saved with num_classes=0
                done.append(f"{key}: not in the weights, freshly initialised")
                state[key] = own[key].clone()
            elif key in state and key not in own:            # the model was built with num_classes=0
                done.append(f"{key}: dropped (the model has no classifier)")
                del state[key]


def _first_conv_key(model: nn.Module):
    first = (getattr(model, 'pretrained_cfg', None) or {}).get('first_conv')
    return f'{first}.weight' if isinstance(first, str) else None


def _input_conv(state: dict, model: nn.Module, own: dict, done: List[str]) -> None:
    """A 4-d first convolution of another input width: timm's adapt_input_conv."""
    key = _first_conv_key(model)
    if key not in state or key not in own or state[key].dim() != 4 or state[key].shape[1] == own[key].shape[1]:
        return
    from timm.models._manipulate import adapt_input_conv
    old, new = state[key].shape[1], own[key].shape[1]
    state[key] = adapt_input_conv(new, state[key].float(), base_chans=old).to(state[key].dtype)
    done.append(f"{key}: input channels {old} -> {new} (timm's adapt_input_conv)")


def _square_side(tokens: int):
    side = math.isqrt(tokens)
    return side if side * side == tokens else None


def _resample(state: dict, key: str, new_grid, prefix: int, done: List[str], interpolation: str = 'bicubic',
              antialias: bool = True) -> None:
    from timm.layers import resample_abs_pos_embed
    old_side = _square_side(state[key].shape[1] - prefix)
    if old_side is None:
        return                                              # left for the mismatch report
    state[key] = resample_abs_pos_embed(state[key], list(new_grid), [old_side, old_side], num_prefix_tokens=prefix,
                                        interpolation=interpolation, antialias=antialias)
    how = '' if interpolation == 'bicubic' else f", {interpolation}"
    done.append(f"{key}: grid {old_side}x{old_side} -> {new_grid[0]}x{new_grid[1]} (timm's resample_abs_pos_embed{how})")


def _pos_embed(state: dict, model: nn.Module, own: dict, done: List[str]) -> None:
    if 'pos_embed' in state and 'pos_embed' in own and state['pos_embed'].shape != own['pos_embed'].shape:
        prefix = getattr(model, 'num_prefix_tokens', 1)
        grid = getattr(getattr(model, 'patch_embed', None), 'grid_size', None)
        new = grid if grid is not None else (_square_side(own['pos_embed'].shape[1] - prefix),) * 2
        if new[0] is not None:
            _resample(state, 'pos_embed', tuple(new), prefix, done)


def _check(state: dict, model: nn.Module, own: dict, where: str) -> None:
    from .mismatch import describe_mismatch
    fixed = {k: v for k, v in own.items() if not _is_lazy(v)}
    lazy = {k for k, v in own.items() if _is_lazy(v)}
    mismatch = describe_mismatch(fixed, {k: v for k, v in state.items() if k not in lazy})
    if mismatch:
        name = (getattr(model, 'pretrained_cfg', None) or {}).get('architecture') or type(model).__name__
        raise WeightsMismatch(f"{where}: the weights do not fit model {name}: {mismatch}")


# ------------------------------------------------------------------ per family

def generic_filter(state: dict, model: nn.Module, done: List[str]) -> dict:
    """Classifier, 4-d first convolution, `pos_embed` (Mixers, Wide-ResNets, GPT, any timm model)."""
    own = _own(model)
    _classifier(state, model, own, done)
    _input_conv(state, model, own, done)
    _pos_embed(state, model, own, done)
    return state


def crate_filter(state: dict, model: nn.Module, done: List[str]) -> dict:
    """CRATE: the patch embedding is LN(p1·p2·c) -> Linear on patches flattened as (p1 p2 c) (Alg. 1): a
    convolution in disguise, adapted as one; then the classifier and `pos_embed`."""
    own = _own(model)
    _classifier(state, model, own, done)
    key = 'patch_embed.proj.weight'
    if key in state and key in own and state[key].shape[1] != own[key].shape[1]:
        from timm.models._manipulate import adapt_input_conv
        p1, p2 = model.patch_embed.patch_size
        new = model.patch_embed.in_chans
        old = state[key].shape[1] // (p1 * p2)
        if old * p1 * p2 == state[key].shape[1]:
            w = state[key].float().reshape(-1, p1, p2, old).permute(0, 3, 1, 2)          # [D, c, p1, p2]
            w = adapt_input_conv(new, w, base_chans=old).permute(0, 2, 3, 1).reshape(w.shape[0], -1)
            state[key] = w.to(state[key].dtype)
            for norm_key in ('patch_embed.norm_in.weight', 'patch_embed.norm_in.bias'):
                if norm_key in state:
                    v = state[norm_key].reshape(p1, p2, old)
                    # LayerNorm's affine acts per input value: averaged into one channel, or repeated for more
                    v = v.mean(-1, keepdim=True) if new == 1 else v.repeat(1, 1, math.ceil(new / old))[..., :new]
                    state[norm_key] = v.reshape(-1)
            done.append(f"{key}: input channels {old} -> {new} (timm's adapt_input_conv on the (p1 p2 c) patch "
                        "layout; patch_embed.norm_in averaged / repeated per channel)")
    _pos_embed(state, model, own, done)
    return state


def soft_filter(state: dict, model: nn.Module, done: List[str]) -> dict:
    """SOFT: the classifier, the stem's first convolution, and each stage's position embedding `pos_embeds.i`
    (stage 4's first position is its cls token's, kept), resampled bilinearly without antialiasing: the public
    code's own `F.interpolate(mode='bilinear', align_corners=False)` of its 224-px embeddings at every other size
    (position embeddings are its option; timm's bicubic default gave other values than the public model's)."""
    own = _own(model)
    _classifier(state, model, own, done)
    _input_conv(state, model, own, done)
    for i, grid in enumerate(getattr(model, 'grid_sizes', ())):
        key = f'pos_embeds.{i}'
        if key in state and key in own and state[key].shape != own[key].shape:
            _resample(state, key, grid, 1 if i == 3 else 0, done, interpolation='bilinear', antialias=False)
    return state


def vit_filter(state: dict, model: nn.Module, done: List[str]) -> dict:
    """timm VisionTransformers, Sparsifiner's included: timm's own ViT filter (other layouts, patch-embedding
    kernel, `pos_embed`), then the classifier and input channels; a connectivity basis of another token count
    is left to the model's fresh initialisation."""
    from timm.models.vision_transformer import checkpoint_filter_fn
    own = _own(model)
    before = {k: tuple(v.shape) for k, v in state.items() if k == 'pos_embed'}
    state = checkpoint_filter_fn(state, model)
    if 'pos_embed' in before and tuple(state['pos_embed'].shape) != before['pos_embed']:
        prefix = getattr(model, 'num_prefix_tokens', 1)
        old, new = (_square_side(s[1] - prefix) for s in (before['pos_embed'], state['pos_embed'].shape))
        done.append(f"pos_embed: grid {old}x{old} -> {new}x{new} (timm's resample_abs_pos_embed)")
    _classifier(state, model, own, done)
    _input_conv(state, model, own, done)
    from ..models.attention_swap import token_count
    tokens = token_count(model)
    for key in [k for k in state if k.endswith(('basis.w_down', 'basis.w_up'))]:
        if tokens is not None and state[key].shape[-1] != tokens:
            done.append(f"{key}: {state[key].shape[-1]} token columns, the model has {tokens}: freshly initialised")
            if key in own and not _is_lazy(own[key]):
                state[key] = own[key].clone()
            else:                                           # still lazy: shaped at the model's count after loading
                del state[key]
    from ..models.sparsifiner import predictor_parameter_names
    predictor = predictor_parameter_names(model)
    if predictor and not predictor & set(state):
        # a plain ViT / DeiT into a Sparsifiner (as `convert --from timm`): its predictor is new, not missing; one
        # that holds part of a predictor is left to the mismatch report
        fresh = sorted(k for k in predictor if k in own and not _is_lazy(own[k]))
        state.update({k: own[k].clone() for k in fresh})
        done.append(f"Sparsifiner's connectivity predictor freshly initialised ({len(fresh)} tensors, "
                    f"{fresh[0] if fresh else ''} ...): the weights have none (a plain ViT / DeiT); train it by "
                    "attention distillation (structformer train --teacher)")
    return state


# a key only the public code's layout has, per `structformer convert --from` source
_PUBLIC_MARKERS = {'crate-official': 'to_patch_embedding.2.weight', 'soft-official': 'patch_embed1.proj.0.weight',
                   'sparsifiner-official': 'blocks.0.attn.mask_predictor.proj_n'}


def _from_public_layout(state: dict, model: nn.Module, where: str = 'pretrained weights') -> List[str]:
    """A checkpoint of the papers' public code (CRATE, SOFT, Sparsifiner) given straight to `pretrained=True` is
    converted first, by the key maps of `structformer convert` (as timm's ViT filter converts other layouts). What
    does not fit is a `WeightsMismatch` naming `where` (the flag and file), not convert's --from."""
    for source, marker in _PUBLIC_MARKERS.items():
        if marker in state:
            from ..errors import UsageError
            from .convert import convert_state_dict
            try:
                converted, notes = convert_state_dict(source, state, model, where=where)
            except UsageError as e:
                raise WeightsMismatch(str(e)) from None
            state.clear()
            state.update(converted)
            return [f"converted from the {source} layout"] + notes + _unlike_public(source, model)
    return []


def _unlike_public(source: str, model: nn.Module) -> List[str]:
    """The public code's settings (`convert.PUBLIC_SETTINGS`: Sparsifiner's top-k coefficients, logit scale,
    |W_up| threshold) that the already built model does not have: loaded here, its weights run with the model's
    options, which `convert --from` would have set to the public code's; said, not changed."""
    from .convert import PUBLIC_SETTINGS
    from ..layers.attention.sparsifiner import SparsifinerAttention
    layer = next((m for m in model.modules() if isinstance(m, SparsifinerAttention)), None)
    if layer is None:
        return []
    differ = [f"{key}={getattr(layer, key)!r} (public {value!r})" for key, value, _ in PUBLIC_SETTINGS.get(source, ())
              if key != 'keep_ratio' and getattr(layer, key, value) != value]
    return [f"the model keeps its own {', '.join(differ)}: build it with the public values (or use structformer "
            f"convert --from {source}) for the public code's forward"] if differ else []


def filter_fn_for(model: nn.Module) -> Callable[[dict, nn.Module, List[str]], dict]:
    """The family filter of `model` (by class, so features-only and timm's own models are covered too)."""
    from timm.models.vision_transformer import VisionTransformer
    names = {cls.__name__ for cls in type(model).__mro__}
    if 'CRATE' in names:
        return crate_filter
    if 'SoftNet' in names:
        return soft_filter
    if isinstance(model, VisionTransformer):
        return vit_filter
    return generic_filter


def adapt_state_dict(state_dict: Dict[str, torch.Tensor], model: nn.Module,
                     where: str = 'pretrained weights') -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """`state_dict` adapted to `model` by its family filter, and the list of adaptations made. Raises
    `WeightsMismatch` (naming `where`) when anything else does not fit."""
    state = dict(state_dict)
    done = _from_public_layout(state, model, where)
    state = filter_fn_for(model)(state, model, done)
    _check(state, model, _own(model), where)
    return state, done


def pretrained_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """timm's `pretrained_filter_fn` for every structformer model (`models.base.create_model` passes it to
    `build_model_with_cfg`): the family filter, each adaptation logged, the rest checked."""
    state_dict = dict(state_dict)
    done: List[str] = []
    if not all(torch.is_tensor(v) for v in state_dict.values()):
        # a wrapper timm's loader does not unwrap (it takes state_dict(_ema) / model(_ema)): 'net', or the whole
        # checkpoint: our reader's choice, or its one-line refusal naming the keys
        from ..errors import UsageError
        from .torch_file import trainer_weights
        try:
            file = (getattr(model, 'pretrained_cfg', None) or {}).get('file') or ''
            state_dict, note = trainer_weights(state_dict, 'pretrained weights', file)
        except UsageError as e:
            raise WeightsMismatch(str(e)) from None
        from timm.models import clean_state_dict
        state_dict = dict(clean_state_dict(state_dict))
        done += [note] if note else []
    done += _from_public_layout(state_dict, model)
    cfg = getattr(model, 'pretrained_cfg', None)
    head = (cfg or {}).get('classifier')
    weight = state_dict.get(f'{head}.weight') if isinstance(head, str) else None
    if isinstance(cfg, dict) and weight is not None and weight.dim() == 2:
        # the config describes the weights (timm's rule): timm's loader discards a classifier whose class count
        # differs from the config's, so the count is the file's, and a head that fits the model is kept
        cfg['num_classes'] = int(weight.shape[0])
    state, adapted = adapt_state_dict(state_dict, model)
    done += adapted
    for line in done:
        _logger.info("pretrained weights adapted: %s", line)
    model.pretrained_adaptations = done                # for callers that report them
    return state
