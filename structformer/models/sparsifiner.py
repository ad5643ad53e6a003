"""Sparsifiner models: any timm VisionTransformer with its attention replaced by `SparsifinerAttention`.

`sparsify(model, keep_ratio=...)` converts a built ViT in place and keeps every weight (qkv, norms, proj
are the same modules); it is also the registered model transform 'sparsify', so a run that used it
(`structformer train --transform sparsify keep_ratio=0.25`) reloads. The registered names build timm's
`VisionTransformer` with the Sparsifiner layer from the start: `sparsifiner_deit_{tiny,small}_patch16_224`
(DeiT-T/S shapes, the paper's backbones) and `sparsifiner_digits`, `sparsifiner_mnist` for the
embedded data; `vit_digits`, `vit_mnist` are their dense counterparts (same weights but the predictors),
the teachers of the two-stage distillation (`structformer train --teacher`, structformer.train.distill).
"""
import copy

import torch
from timm.models import generate_default_cfgs
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..layers.attention.registry import with_defaults
from ..layers.attention.sparsifiner import SparsifinerAttention
from ._registry import register_model
from ..arguments import check_conventional_kwargs
from .attention_swap import (attention_misfit, check_attention_fits, check_patch_dropout, cls_row_options,
                             shape_sequence_projections, swap_attention, token_count)
from .base import DIGITS_CFG, MNIST_CFG, create_model, model_cfg
from .transforms import TransformContext, register_transform

__all__ = ['sparsify', 'SparsifinerAttention', 'SparsifinerViT', 'ContractViT', 'predictor_parameter_names']


def predictor_parameter_names(model: nn.Module) -> set:
    """Names of the connectivity predictors' parameters (W_down, W_up, the optional q/k reductions).
    The mask they produce is detached from the attention path (Eq. 3–4), so the task loss gives them no
    gradient: they learn only from the attention-distillation loss (Eq. 10)."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, SparsifinerAttention):
            for part in ('basis', 'predictor_q', 'predictor_k'):
                sub = getattr(module, part)
                if sub is not None:
                    names |= {f"{prefix}.{part}.{n}" if prefix else f"{part}.{n}" for n, _ in sub.named_parameters()}
    return names


def sparsify(model: nn.Module, keep_ratio: float = 0.25, **options) -> nn.Module:
    """Replace every timm `Attention` in `model` by a `SparsifinerAttention` with the same projections
    (the modules themselves move across, so the dense weights are kept exactly) and a fresh
    connectivity predictor (`swap_attention`). `options` are SparsifinerAttention's (n_down, tau,
    up_threshold, predictor_dim, dense_cls_row, connectivity, block_size, impl, up_basis, stage1,
    predictor_bias, basis_init, coef_topk, predictor_scale). At keep_ratio=1 every key
    is kept and the model computes what it computed before. A ViT without a class token (timm's
    `class_token=False`) gets `dense_cls_row=False` by default: its first token is a patch (`cls_row_options`)."""
    try:
        return swap_attention(model, 'sparsifiner', keep_ratio=keep_ratio, **options)
    except ValueError as e:
        raise ValueError(str(e).replace('swap_attention:', 'sparsify:')) from None


@register_transform('sparsify')
def sparsify_transform(model: nn.Module, context: TransformContext, keep_ratio: float = 0.25, **options) -> nn.Module:
    """Model transform: `sparsify(model, keep_ratio, **options)` (recorded in checkpoints)."""
    return sparsify(model, keep_ratio=keep_ratio, **options)


class ContractViT(VisionTransformer):
    """timm's VisionTransformer with the structformer contract where timm's differs: `no_weight_decay` names
    only parameters that exist, a bad `output_fmt` is a ValueError, and an `attn_layer` whose options do not fit
    the token count is refused when built (`check_attention_fits`), not by every forward, and a Linformer
    `attn_layer` built without seq_len gets its E, F shaped for the token count now (`shape_sequence_projections`)."""

    def __init__(self, *args, **kwargs):
        # timm's own checks come late or not at all (patch_size=0: a ZeroDivisionError in PatchEmbed; depth=-1:
        # "number of steps must be non-negative"; drop_path_rate=1.5: the first training step's DropPath)
        check_conventional_kwargs(kwargs)
        super().__init__(*args, **kwargs)
        check_attention_fits(self)
        check_patch_dropout(self)         # per-token E, F (and Sparsifiner's W_down, W_up) cannot take dropped patches
        shape_sequence_projections(self)

    def set_input_size(self, img_size=None, patch_size=None) -> None:
        """timm's change of resolution, refused, changing nothing, where the new token count does not fit an
        attention layer (Linformer's E, F shaped for N; landmarks above the new N): the next forward failed."""
        probe = copy.deepcopy(self.patch_embed)
        probe.set_input_size(img_size=img_size, patch_size=patch_size)
        tokens = probe.num_patches + self.num_prefix_tokens
        misfit = attention_misfit(self, tokens)
        if misfit:
            raise ValueError(f"set_input_size(img_size={img_size}, patch_size={patch_size}) gives {tokens} "
                             f"tokens, which {misfit[0]} cannot take: {misfit[1]}")
        super().set_input_size(img_size=img_size, patch_size=patch_size)

    def no_weight_decay(self):
        names = {n for n, _ in self.named_parameters()}
        return {k for k in super().no_weight_decay() if k in names}

    def forward_intermediates(self, x, *args, output_fmt: str = 'NCHW', **kwargs):
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt={output_fmt!r}: accepted 'NCHW' or 'NLC'")
        return super().forward_intermediates(x, *args, output_fmt=output_fmt, **kwargs)


class SparsifinerViT(ContractViT):
    """A ContractViT whose attention layers are `SparsifinerAttention`, their predictors shaped at construction
    (`materialize_predictors`), so inside any of timm's feature wrappers too: shaped after `create_model` returned,
    they stayed lazy in the 'hook' and 'fx' extractors (neither holds the ViT as `.model`), out of
    `parameters()` until a first forward that warned. Patch dropout is refused here too (`check_patch_dropout`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_patch_dropout(self)
        materialize_predictors(self)

    def set_input_size(self, img_size=None, patch_size=None) -> None:
        """timm's change of resolution (position embeddings resampled), refused, changing nothing, where it would
        change the token count the predictors' W_down, W_up are shaped for (one column per token): the next
        forward failed with "built for seq_len=17 tokens, got n=65". Build the model at the new size and load
        the weights with pretrained=True instead (the filter keeps all but W_down, W_up, which start fresh)."""
        probe = copy.deepcopy(self.patch_embed)
        probe.set_input_size(img_size=img_size, patch_size=patch_size)
        tokens = probe.num_patches + self.num_prefix_tokens
        shaped = {m.basis.seq_len for m in self.modules() if isinstance(m, SparsifinerAttention)} - {None}
        if shaped and shaped != {tokens}:
            raise ValueError(f"set_input_size: the Sparsifiner predictors are shaped for {sorted(shaped)[0]} tokens "
                             f"and img_size={img_size}, patch_size={patch_size} gives {tokens}; build the model with "
                             "that img_size and load these weights with pretrained=True (W_down, W_up start fresh)")
        super().set_input_size(img_size=img_size, patch_size=patch_size)


def _cfg(**kwargs):
    # timm's ViT refuses another size (strict_img_size), as timm's DeiT configs say
    return model_cfg(first_conv='patch_embed.proj', fixed_input_size=True, **kwargs)


# the public code's evaluation (src/datasets.py build_transform, DeiT's): Resize(256 / 224 · size) bicubic, CenterCrop
_PUBLIC_EVAL = dict(crop_pct=224 / 256, interpolation='bicubic')
default_cfgs = generate_default_cfgs({
    'sparsifiner_deit_tiny_patch16_224.untrained': _cfg(**_PUBLIC_EVAL),
    'sparsifiner_deit_small_patch16_224.untrained': _cfg(**_PUBLIC_EVAL),
    'sparsifiner_digits.untrained': _cfg(num_classes=10, input_size=(1, 8, 8), **DIGITS_CFG),
    'sparsifiner_mnist.untrained': _cfg(num_classes=10, input_size=(1, 28, 28), **MNIST_CFG),
    'vit_digits.untrained': _cfg(num_classes=10, input_size=(1, 8, 8), **DIGITS_CFG),
    'vit_mnist.untrained': _cfg(num_classes=10, input_size=(1, 28, 28), **MNIST_CFG),
})

_LAYER_OPTIONS = ('keep_ratio', 'keys_per_query', 'n_down', 'tau', 'up_threshold', 'predictor_dim', 'dense_cls_row',
                  'connectivity', 'block_size', 'impl', 'up_basis', 'stage1', 'predictor_bias', 'basis_init',
                  'coef_topk', 'predictor_scale')


_DIGITS = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4)
_MNIST = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=96, depth=6, num_heads=3)


def _create(variant: str, pretrained: bool, defaults: dict, kwargs: dict) -> SparsifinerViT:
    args = dict(defaults, **kwargs)
    layer = cls_row_options(bool(args.get('class_token', True)),
                            {k: args.pop(k) for k in _LAYER_OPTIONS if k in args}, variant)
    args['attn_layer'] = with_defaults(SparsifinerAttention, **layer)    # timm's Block does not pass n
    return create_model(SparsifinerViT, variant, pretrained, default_out_indices=3, **args)


def materialize_predictors(model: nn.Module) -> nn.Module:
    """Shape every predictor's W_down, W_up for the model's token count now (patches + prefix tokens at
    its img_size), so that `model.parameters()` is complete before an optimiser is built. With
    `dynamic_img_size=True` the count is unknown and they stay lazy (shaped at the first forward)."""
    vit = model if hasattr(model, 'patch_embed') else getattr(model, 'model', model)   # features_only: timm's wrapper
    num_tokens = token_count(vit)
    if num_tokens is not None:
        device = vit.patch_embed.proj.weight.device
        # drawn without advancing the global RNG, as `materialize_lazy`'s dry forward drew them before:
        # the same seed gives the same initial weights and the same run as in runs recorded earlier
        with torch.random.fork_rng(devices=[]):
            for module in model.modules():
                if isinstance(module, SparsifinerAttention):
                    module.basis.materialize(num_tokens, device=device)
    return model


@register_model
def sparsifiner_deit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> SparsifinerViT:
    """DeiT-T (d = 192, 12 blocks, 3 heads) with Sparsifiner attention, keep 0.25, n_down 32."""
    return _create('sparsifiner_deit_tiny_patch16_224', pretrained,
                   dict(patch_size=16, embed_dim=192, depth=12, num_heads=3), kwargs)


@register_model
def sparsifiner_deit_small_patch16_224(pretrained: bool = False, **kwargs) -> SparsifinerViT:
    """DeiT-S (d = 384, 12 blocks, 6 heads), the paper's main backbone, with Sparsifiner attention."""
    return _create('sparsifiner_deit_small_patch16_224', pretrained,
                   dict(patch_size=16, embed_dim=384, depth=12, num_heads=6), kwargs)


@register_model
def sparsifiner_digits(pretrained: bool = False, **kwargs) -> SparsifinerViT:
    """8 px digits, patch 2 (16 + 1 tokens), d = 64, 4 blocks, 4 heads; n_down 8, keep 0.25 (B = 5)."""
    return _create('sparsifiner_digits', pretrained,
                   dict(_DIGITS, n_down=8), kwargs)


@register_model
def sparsifiner_mnist(pretrained: bool = False, **kwargs) -> SparsifinerViT:
    """28 px MNIST, patch 4 (49 + 1 tokens), d = 96, 6 blocks, 3 heads; n_down 16, keep 0.25 (B = 13)."""
    return _create('sparsifiner_mnist', pretrained,
                   dict(_MNIST, n_down=16), kwargs)


@register_model
def vit_digits(pretrained: bool = False, **kwargs) -> ContractViT:
    """The dense ViT `sparsifiner_digits` is converted from (its distillation teacher): same shapes, timm attention."""
    return create_model(ContractViT, 'vit_digits', pretrained, default_out_indices=3, **dict(_DIGITS, **kwargs))


@register_model
def vit_mnist(pretrained: bool = False, **kwargs) -> ContractViT:
    """The dense ViT `sparsifiner_mnist` is converted from (its distillation teacher): same shapes, timm attention."""
    return create_model(ContractViT, 'vit_mnist', pretrained, default_out_indices=3, **dict(_MNIST, **kwargs))
