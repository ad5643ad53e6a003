"""CRATE: white-box transformers via sparse rate reduction (Yu et al., 2023), timm style.

Layer ℓ (Eq. 18, Alg. 2): Z^{ℓ+½} = Z^ℓ + MSSA(LN(Z^ℓ)), Z^{ℓ+1} = ISTA(LN(Z^{ℓ+½})), no residual
around ISTA. Model (Alg. 1): patch embedding LN → Linear → LN, cls token, learned positions,
head LN → Linear.

White-box hooks: Z^{ℓ+½} is the input of `blocks[ℓ].norm2`; Z^{ℓ+1} is the output of
`blocks[ℓ].mlp`; U_k of layer ℓ is `blocks[ℓ].attn.subspace_bases()`.
"""
from typing import List, Optional, Union

import torch
from einops import rearrange
from timm.layers import DropPath
from timm.models import generate_default_cfgs
from torch import nn

from ..layers.attention.mssa import MSSA
from ..functional.tracing import checked_images
from ..layers.linear.tuned import TunedLinear
from ..layers.mlp.ista import ISTA
from ._registry import register_model
from ..arguments import count, image_size, positive_int, rate
from .base import (CIFAR10_CFG, DIGITS_CFG, MNIST_CFG, SMALL_IMAGE_CFG, StructuredModel, check_global_pool, create_model,
                   model_cfg)

__all__ = ['CRATE', 'CrateBlock']

torch.fx.wrap('checked_images')                 # the input check is one node of an FX trace (functional/tracing.py)


class CratePatchEmbed(nn.Module):
    """Rearrange → LN(patch_dim) → Linear(patch_dim, dim) → LN(dim) (Alg. 1)."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=384):
        super().__init__()
        self.img_size = image_size('img_size', img_size)
        self.patch_size = image_size('patch_size', patch_size)     # 0 failed as "integer modulo by zero" below
        h, w = self.img_size
        ph, pw = self.patch_size
        if h % ph or w % pw:
            raise ValueError(f"img_size={self.img_size} must be divisible by patch_size={self.patch_size}")
        self.in_chans = in_chans
        self.grid_size = (h // ph, w // pw)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        patch_dim = in_chans * ph * pw
        self.norm_in = nn.LayerNorm(patch_dim)
        self.proj = TunedLinear(patch_dim, embed_dim)          # nn.Linear on this machine's fastest GEMM
        self.norm_out = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checked_images(x, 'CRATE', self.in_chans, self.img_size)     # an FX leaf: traceable
        x = rearrange(x, 'b c (h p1) (w p2) -> b (h w) (p1 p2 c)', p1=self.patch_size[0], p2=self.patch_size[1])
        return self.norm_out(self.proj(self.norm_in(x)))


class CrateBlock(nn.Module):
    """One CRATE layer (Eq. 18): compression by MSSA with a residual, then ISTA without one.

    `drop` is the dropout after MSSA's output projection and `attn_drop` the one on its attention weights (the
    official code's single `dropout` is both);
    `ista_drop` drops ISTA's output, which the official code does not (default 0); `drop_path` is stochastic
    depth on the one residual branch, MSSA's (not in the paper or its code; default 0)."""

    def __init__(self, dim, num_heads, dim_head, *, drop=0., attn_drop=0., ista_drop=0., eta=0.1, lambd=0.1,
                 tied_output=False, sparse_step='ista', eps=1.0, fused_ista=True, ssa_impl='auto', drop_path=0.):
        super().__init__()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm1 = nn.LayerNorm(dim)
        # Alg. 3 (and the public code): one head as wide as the model is the output itself, no `to_out`
        self.attn = MSSA(dim, num_heads=num_heads, attn_head_dim=dim_head, attn_drop=attn_drop,
                         proj_drop=drop, tied_output=tied_output, eps=eps, ssa_impl=ssa_impl,
                         project_out=not (num_heads == 1 and dim_head == dim))
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = ISTA(dim, eta=eta, lambd=lambd, step=sparse_step, eps=eps, fused=fused_ista, drop=ista_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return self.mlp(self.norm2(x))


class CRATE(StructuredModel):
    """CRATE image classifier with timm's model interface.

    Args (paper names where they exist): `embed_dim` (d), `depth` (L), `num_heads` (K),
    `dim_head` (p), `eta` (η, ISTA step), `lambd` (λ, sparsity), `tied_output` (Eq. 11–12 MSSA
    instead of Eq. 115), `sparse_step` ('ista' = Eq. 17, 'mm' = Eq. 92), `eps` (ε of Eq. 12 / 92),
    `global_pool` ('token' = cls as in the paper; 'avg' / 'max' / 'avgmax' over the patch tokens,
    cls left out; 'avg_all' = mean over all tokens, cls included, as the official code's 'mean'), `drop_rate` (after MSSA's projection), `ista_drop_rate` (after ISTA; 0 as in the
    official code), `drop_path_rate` (stochastic depth on MSSA's residual, growing linearly over the blocks as
    in timm; 0, as the paper), `ssa_impl` (how MSSA runs before a backward: see `MSSA`; the same function either way).
    """
    no_weight_decay_names = frozenset({'pos_embed', 'cls_token'})

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool='token',
                 embed_dim=384, depth=12, num_heads=6, dim_head=64, drop_rate=0., pos_drop_rate=0.,
                 attn_drop_rate=0., ista_drop_rate=0., eta=0.1, lambd=0.1, tied_output=False, sparse_step='ista',
                 eps=1.0, fused_ista=True, ssa_impl='auto', drop_path_rate=0.):
        super().__init__()
        for name, value in (('drop_rate', drop_rate), ('pos_drop_rate', pos_drop_rate),
                            ('attn_drop_rate', attn_drop_rate), ('ista_drop_rate', ista_drop_rate),
                            ('drop_path_rate', drop_path_rate)):
            rate(name, value)           # a rate over 1 failed in the first training step, inside torch's dropout
        # options that only one variant reads: a value the model would never use is a mistake, not a no-op
        if eps != 1.0 and not tied_output and sparse_step != 'mm':
            raise ValueError(f"eps={eps!r} is the ε of the tied MSSA (Eq. 12) and of the mm step (Eq. 92); this model "
                             "has neither: pass tied_output=True or sparse_step='mm', or leave eps out")
        if eta != 0.1 and sparse_step == 'mm':
            raise ValueError(f"eta={eta!r} is the ISTA step size (Eq. 17); sparse_step='mm' (Eq. 92) has none: "
                             "leave eta out or use sparse_step='ista'")
        for name, value in (('embed_dim', embed_dim), ('depth', depth), ('num_heads', num_heads),
                            ('dim_head', dim_head), ('in_chans', in_chans)):
            positive_int(name, value)
        count('num_classes', num_classes)
        self.num_classes = num_classes
        self.global_pool = check_global_pool(global_pool)
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1

        self.patch_embed = CratePatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.declare_fixed_input_size(True)            # the position embedding fixes the token grid
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.blocks = nn.ModuleList([
            CrateBlock(embed_dim, num_heads, dim_head, drop=drop_rate, attn_drop=attn_drop_rate,
                       ista_drop=ista_drop_rate, eta=eta, lambd=lambd, tied_output=tied_output,
                       sparse_step=sparse_step, eps=eps, fused_ista=fused_ista, ssa_impl=ssa_impl,
                       drop_path=drop_path_rate * i / max(depth - 1, 1))
            for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)            # the head's LN (Alg. 1: LN → Linear)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        reduction = self.patch_embed.patch_size[0]
        self.feature_info = [dict(module=f'blocks.{i}', num_chs=embed_dim, reduction=reduction) for i in range(depth)]

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._embed(x)
        for block in self.blocks:
            x = self.run_block(block, x)
        return x

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              return_prefix_tokens: bool = False, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = 'NCHW', intermediates_only: bool = False):
        """timm's feature interface (as `VisionTransformer.forward_intermediates`): the outputs Z^{ℓ+1}
        of the blocks in `indices` (None: all; int n: the last n; list: those, negative from the end),
        patch tokens as [B, C, H, W] ('NCHW') or [B, N, C] ('NLC'), the cls token split off (returned
        beside them with `return_prefix_tokens`). `norm` applies the head's LayerNorm to each.
        Returns (forward_features(x), intermediates), or only the intermediates."""
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt={output_fmt!r}: accepted 'NCHW' or 'NLC'")
        batch = x.shape[0]
        x, intermediates = self.run_blocks_keeping(self._embed(x), indices, norm, stop_early)
        prefix = [y[:, :self.num_prefix_tokens] for y in intermediates]
        intermediates = [y[:, self.num_prefix_tokens:] for y in intermediates]
        if output_fmt == 'NCHW':
            h, w = self.patch_embed.grid_size
            intermediates = [y.reshape(batch, h, w, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if return_prefix_tokens:
            intermediates = list(zip(intermediates, prefix))
        return intermediates if intermediates_only else (x, intermediates)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.norm(self.pool(x))
        return x if pre_logits else self.head(x)


def _cfg(**kwargs):
    # fixed_input_size: the position embedding is made for one grid (forward refuses another size), so timm's
    # scripts build the model at a requested --img-size, or refuse it, instead of resizing images it then refuses
    return model_cfg(first_conv='patch_embed.proj', fixed_input_size=True, **kwargs)


# the public code's ImageNet evaluation (main.py): Resize(256) → CenterCrop(224), torchvision's bilinear default
_OFFICIAL_EVAL = dict(crop_pct=224 / 256, interpolation='bilinear')
default_cfgs = generate_default_cfgs({
    'crate_tiny_patch16_224.untrained': _cfg(**_OFFICIAL_EVAL),
    'crate_small_patch16_224.untrained': _cfg(**_OFFICIAL_EVAL),
    'crate_base_patch16_224.untrained': _cfg(**_OFFICIAL_EVAL),
    'crate_large_patch16_224.untrained': _cfg(**_OFFICIAL_EVAL),
    'crate_digits.untrained': _cfg(num_classes=10, input_size=(1, 8, 8), **DIGITS_CFG),
    'crate_mnist.untrained': _cfg(num_classes=10, input_size=(1, 28, 28), **MNIST_CFG),
    'crate_cifar.untrained': _cfg(num_classes=10, input_size=(3, 32, 32), **CIFAR10_CFG),
    'crate_synthetic.untrained': _cfg(num_classes=4, input_size=(1, 16, 16), **SMALL_IMAGE_CFG),
})


def _create_crate(variant: str, pretrained: bool = False, **kwargs) -> CRATE:
    return create_model(CRATE, variant, pretrained, default_out_indices=3, **kwargs)


# Table 1 of the paper (224 px, patch 16)
@register_model
def crate_tiny_patch16_224(pretrained: bool = False, **kwargs) -> CRATE:
    """CRATE-T (Table 1): d=384, L=12, K=6, p=64."""
    args = dict(embed_dim=384, depth=12, num_heads=6, dim_head=64)
    return _create_crate('crate_tiny_patch16_224', pretrained, **dict(args, **kwargs))


@register_model
def crate_small_patch16_224(pretrained: bool = False, **kwargs) -> CRATE:
    """CRATE-S (Table 1): d=576, L=12, K=12, p=48."""
    args = dict(embed_dim=576, depth=12, num_heads=12, dim_head=48)
    return _create_crate('crate_small_patch16_224', pretrained, **dict(args, **kwargs))


@register_model
def crate_base_patch16_224(pretrained: bool = False, **kwargs) -> CRATE:
    """CRATE-B (Table 1): d=768, L=12, K=12, p=64."""
    args = dict(embed_dim=768, depth=12, num_heads=12, dim_head=64)
    return _create_crate('crate_base_patch16_224', pretrained, **dict(args, **kwargs))


@register_model
def crate_large_patch16_224(pretrained: bool = False, **kwargs) -> CRATE:
    """CRATE-L (Table 1): d=1024, L=24, K=16, p=64."""
    args = dict(embed_dim=1024, depth=24, num_heads=16, dim_head=64)
    return _create_crate('crate_large_patch16_224', pretrained, **dict(args, **kwargs))


# small-image variants for the embedded data (sized to train on 2 CPU cores in minutes)
@register_model
def crate_digits(pretrained: bool = False, **kwargs) -> CRATE:
    """8 px digits, patch 2 (16 tokens), d=64, L=4, K=4, p=16."""
    args = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=64, depth=4, num_heads=4, dim_head=16)
    return _create_crate('crate_digits', pretrained, **dict(args, **kwargs))


@register_model
def crate_mnist(pretrained: bool = False, **kwargs) -> CRATE:
    """28 px MNIST, patch 4 (49 tokens), d=96, L=6, K=6, p=16."""
    args = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=96, depth=6, num_heads=6,
                dim_head=16)
    return _create_crate('crate_mnist', pretrained, **dict(args, **kwargs))


@register_model
def crate_cifar(pretrained: bool = False, **kwargs) -> CRATE:
    """32 px CIFAR-10, patch 4 (64 tokens), d=192, L=6, K=6, p=32."""
    args = dict(img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=192, depth=6, num_heads=6,
                dim_head=32)
    return _create_crate('crate_cifar', pretrained, **dict(args, **kwargs))


@register_model
def crate_synthetic(pretrained: bool = False, **kwargs) -> CRATE:
    """16 px synthetic subspaces, patch 4 = token dim 16, d=16, L=4, K=4, p=4."""
    args = dict(img_size=16, patch_size=4, in_chans=1, num_classes=4, embed_dim=16, depth=4, num_heads=4, dim_head=4)
    return _create_crate('crate_synthetic', pretrained, **dict(args, **kwargs))
