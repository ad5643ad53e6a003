"""Swap the attention of a built ViT for any registered attention, keeping its weights.

`swap_attention(model, 'linformer', num_landmarks=49)` replaces every timm `Attention` (and every
structformer attention with the same projections) by the registered class, moving the q/k/v and output
projections, the q/k norms and the scale norm across as the same modules: the dense weights are kept
exactly and only the new layer's own parameters (Sparsifiner's predictor, Linformer's E and F) are fresh.
This is how `sparsify` converts a ViT (Sparsifiner §4: the backbone is the pretrained dense model) and how
the Linformer comparison of Sparsifiner Table 4 gets the same backbone. Registered as the model transform
'swap_attention', so runs reload.
"""
from typing import Optional, Tuple

import torch
from timm.layers import Attention as TimmAttention
from torch import nn

from ..layers.attention.registry import ATTENTION_LAYERS, accepted_options, check_options, get_attention
from ..layers.attention.linformer import SequenceProjection
from ..layers.attention.softmax import AttentionBase
from .transforms import TransformContext, register_transform

__all__ = ['swap_attention', 'token_count', 'check_attention_fits', 'check_patch_dropout', 'cls_row_options',
           'shape_sequence_projections', 'SHARED_PARTS']

SHARED_PARTS = ('qkv', 'q_norm', 'k_norm', 'norm', 'proj')     # moved across unchanged


def token_count(model: nn.Module) -> Optional[int]:
    """Tokens per image of a ViT with a fixed input size (patches + prefix tokens), or None when the size
    is dynamic (layers with per-token parameters are then shaped at the first forward)."""
    embed = getattr(model, 'patch_embed', None)
    patches = getattr(embed, 'num_patches', None)
    # timm keeps the flag on the model (PatchEmbed only relaxes its size check)
    if patches is None or getattr(model, 'dynamic_img_size', False) or getattr(embed, 'dynamic_img_size', False):
        return None
    return patches + getattr(model, 'num_prefix_tokens', 0)


def token_layout(model: nn.Module) -> Optional[Tuple[int, Tuple[int, int]]]:
    """(prefix tokens, (H, W) patch grid) of a ViT with a fixed input size, or None where either is not known."""
    grid = getattr(getattr(model, 'patch_embed', None), 'grid_size', None)
    if token_count(model) is None or grid is None:
        return None
    return getattr(model, 'num_prefix_tokens', 0), (int(grid[0]), int(grid[1]))


def check_attention_fits(model: nn.Module) -> nn.Module:
    """Refuse, when the model is built, attention options its fixed token count makes impossible (Nyström's or
    Linformer's num_landmarks above N, SOFT's above the grid): each structformer attention's `check_num_tokens`.
    Before, `vit_digits` (17 tokens) built with attn_layer='nystrom' (49 landmarks) and every forward failed.
    A model with a dynamic input size (no fixed N) is checked by its forwards instead."""
    vit = model if hasattr(model, 'patch_embed') else getattr(model, 'model', model)
    num_tokens = token_count(vit)
    misfit = attention_misfit(model, num_tokens, token_layout(vit)) if num_tokens is not None else None
    if misfit:
        raise ValueError(f"{misfit[0]} in a model of {num_tokens} tokens: {misfit[1]}")
    return model


def shape_sequence_projections(model: nn.Module) -> nn.Module:
    """Shape Linformer's E, F (a `LinformerAttention` built without seq_len, e.g. timm's `attn_layer`) for the
    model's fixed token count now, so that parameter counts, `load_state_dict` and an optimiser see them before any
    forward (they stayed lazy until the first one). Drawn in forward order without advancing the global RNG, as
    `materialize_lazy`'s dry forward drew them: the same seed gives the same initial weights as before. A model with a
    dynamic input size (no fixed N) keeps them lazy, shaped at its first forward."""
    vit = model if hasattr(model, 'patch_embed') else getattr(model, 'model', model)
    num_tokens = token_count(vit)
    lazy = [m for m in model.modules() if isinstance(m, SequenceProjection) and m.has_uninitialized_params()]
    if num_tokens is None or not lazy:
        return model
    device = vit.patch_embed.proj.weight.device
    gpus = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == 'cuda' else []
    with torch.random.fork_rng(devices=gpus):
        for projection in lazy:
            projection.materialize(num_tokens, device=device)
    return model


def attention_misfit(model: nn.Module, num_tokens: int, layout=None):
    """(layer named with its type, why) for the first attention of `model` that cannot take `num_tokens` tokens
    (its `check_num_tokens`), or would misread their `layout` (prefix tokens, (H, W) patch grid) where the model
    knows it (SOFT's `check_token_layout`), or None when every one can."""
    for name, module in model.named_modules():
        if isinstance(module, AttentionBase):
            try:
                module.check_num_tokens(num_tokens)
                if layout is not None and hasattr(module, 'check_token_layout') \
                        and layout[0] + layout[1][0] * layout[1][1] == num_tokens:
                    module.check_token_layout(*layout)
            except ValueError as e:
                return f"{name} ({type(module).__name__})", str(e)
    return None


def _patch_drop_prob(model: nn.Module) -> float:
    return float(getattr(getattr(model, 'patch_drop', None), 'prob', 0.0) or 0.0)


def _refuse_patch_dropout(prob: float, layer: str) -> None:
    raise ValueError(f"{layer} has parameters per token position (built for the model's fixed token count), but the "
                     f"model drops patches in training (patch_drop_rate={prob}), so its first training step would "
                     "fail on the token count; build the model with patch_drop_rate=0")


def check_patch_dropout(model: nn.Module) -> nn.Module:
    """Refuse timm's patch dropout (`patch_drop_rate`, training drops a random share of the patch tokens) in a model
    whose attention has per-token parameters (a `seq_len` option: Linformer's E, F; Sparsifiner's W_down, W_up):
    before, the first training forward failed on the token count, in a message that did not name the cause."""
    prob = _patch_drop_prob(model)
    if prob:
        for module in model.modules():
            if type(module) in ATTENTION_LAYERS.values() and 'seq_len' in accepted_options(type(module)):
                _refuse_patch_dropout(prob, type(module).__name__)
    return model


def cls_row_options(has_class_token: bool, options: dict, where: str) -> dict:
    """`dense_cls_row` (Sparsifiner) for a ViT with or without a class token: the public code keeps the cls query
    dense (the default), but without a class token (timm's `class_token=False`) row 0 is a patch, and a dense row
    there attended to every key for nothing (and was left out of the attention-distillation loss): off by default
    there, and asking for it is refused by name."""
    if has_class_token:
        return options
    if options.get('dense_cls_row'):
        raise ValueError(f"{where}: dense_cls_row=True, but the model has no class token (class_token=False): its "
                         "first token is a patch; leave dense_cls_row out or pass False")
    return dict(options, dense_cls_row=False)


def _swappable(module: nn.Module) -> bool:
    if isinstance(module, TimmAttention):
        return True
    # a structformer attention with separate q, k, v (not a shared-QK one such as SOFT's)
    return type(module) is not AttentionBase and isinstance(module, AttentionBase) and not module.shared_qk


def _check_same_projection(attn: str, new: nn.Module, child: nn.Module) -> None:
    """The moved q/k/v projection must fit the new layer: shared-QK attentions (SOFT's Q = K, CRATE's
    Q = K = V) have fewer rows than timm's [3·inner, dim] and would fail at the first forward."""
    want = _shape(getattr(new, 'qkv', None))
    have = _shape(child.qkv)
    if want is None or want != have:
        shape = 'no qkv projection' if want is None else f"a {want} qkv projection"
        raise ValueError(f"swap_attention: attn={attn!r} has {shape}, so it cannot take the "
                         f"{have} q/k/v weights of this model's attention (it shares Q and "
                         f"K); build the model with attn_layer={attn!r} instead of converting it")


def _shape(linear: Optional[nn.Module]) -> Optional[list]:
    """[out, in] of a linear layer, dense or structured: after `factorize` the q/k/v projection is a
    FactorizedLinear, which has no `.weight` (reading it failed with AttributeError) and moves across all the same."""
    if linear is None or not hasattr(linear, 'out_features'):
        return None
    return [linear.out_features, linear.in_features]


def swap_attention(model: nn.Module, attn: str, **options) -> nn.Module:
    """Replace every attention of `model` by the registered attention `attn` built with `options`
    (plus `seq_len` when the layer takes one and the model's token count is fixed); see the module
    docstring. Returns the model (changed in place)."""
    cls = get_attention(attn)
    check_options(cls, options)
    seq_len = token_count(model)
    if 'dense_cls_row' in accepted_options(cls):
        options = cls_row_options(getattr(model, 'has_class_token', True), options, 'swap_attention')
    if 'seq_len' in accepted_options(cls) and _patch_drop_prob(model):
        _refuse_patch_dropout(_patch_drop_prob(model), f"swap_attention: attn={attn!r}")
    if 'seq_len' in accepted_options(cls) and 'seq_len' not in options:
        options = dict(options, seq_len=seq_len)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _swappable(child) or isinstance(child, cls):
                continue
            if abs(getattr(child, 'scale', child.head_dim ** -0.5) - child.head_dim ** -0.5) > 1e-12:
                raise ValueError(f"swap_attention: {name} uses a non-standard attention scale {child.scale}")
            weight = next(child.qkv.parameters())             # dense or factorised (`_shape`)
            new = cls(child.qkv.in_features, child.num_heads, attn_drop=child.attn_drop.p,
                      proj_drop=child.proj_drop.p, attn_head_dim=child.head_dim, device=weight.device,
                      dtype=weight.dtype, **options)
            _check_same_projection(attn, new, child)
            if seq_len is not None:
                new.check_num_tokens(seq_len)         # before any layer is replaced: the model stays as it was
            for part in SHARED_PARTS:
                setattr(new, part, getattr(child, part))
            new.train(child.training)             # a fresh module is in training mode; keep the model's mode
            setattr(parent, name, new)
            replaced += 1
    if not replaced:
        # a second call (or sparsify on a Sparsifiner model) finds only layers of the class asked for: say so,
        # rather than that the model has no attention (as it said before)
        already = sum(isinstance(m, cls) for m in model.modules())
        if already:
            raise ValueError(f"swap_attention: every attention of {type(model).__name__} is already {cls.__name__} "
                             f"({already} layer(s)); it converts timm Attention, once (to change the new layers' "
                             "options, convert the dense model again)")
        raise ValueError(f"swap_attention: {type(model).__name__} has no timm Attention module to replace "
                         "(it converts timm VisionTransformer-style models)")
    return model


@register_transform('swap_attention')
def swap_attention_transform(model: nn.Module, context: TransformContext, attn: str = 'softmax',
                             **options) -> nn.Module:
    """Model transform: `swap_attention(model, attn, **options)` (recorded in checkpoints)."""
    return swap_attention(model, attn, **options)
