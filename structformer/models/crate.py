"""CRATE: white-box transformers via sparse rate reduction (Yu et al., 2023), timm style.

Layer ℓ (Eq. 18, Alg. 2): Z^{ℓ+½} = Z^ℓ + MSSA(LN(Z^ℓ)), Z^{ℓ+1} = ISTA(LN(Z^{ℓ+½})), no residual
around ISTA. Model (Alg. 1): patch embedding LN → Linear → LN, cls token, learned positions,
head LN → Linear.

White-box hooks: Z^{ℓ+½} is the input of `blocks[ℓ].norm2`; Z^{ℓ+1} is the output of
`blocks[ℓ].mlp`; U_k of layer ℓ is `blocks[ℓ].attn.subspace_bases()`.
"""
from functools import partial
from typing import Optional

import torch
from einops import rearrange
from timm.layers import to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs
from torch import nn

from ..layers.attention.mssa import MSSA
from ..layers.mlp.ista import ISTA
from ._pooling import pool_tokens
from ._registry import register_model

__all__ = ['CRATE', 'CrateBlock']


class CratePatchEmbed(nn.Module):
    """Rearrange → LN(patch_dim) → Linear(patch_dim, dim) → LN(dim) (Alg. 1)."""

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=384):
        super().__init__()
        self.img_size = to_2tuple(img_size)
        self.patch_size = to_2tuple(patch_size)
        h, w = self.img_size
        ph, pw = self.patch_size
        if h % ph or w % pw:
            raise ValueError(f"img_size={self.img_size} must be divisible by patch_size={self.patch_size}")
        self.in_chans = in_chans
        self.grid_size = (h // ph, w // pw)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        patch_dim = in_chans * ph * pw
        self.norm_in = nn.LayerNorm(patch_dim)
        self.proj = nn.Linear(patch_dim, embed_dim)
        self.norm_out = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != self.in_chans or tuple(x.shape[2:]) != self.img_size:
            raise ValueError(
                f"CRATE expects images of shape [B, {self.in_chans}, {self.img_size[0]}, {self.img_size[1]}] "
                f"(in_chans={self.in_chans}, img_size={self.img_size}), got {list(x.shape)}; "
                "build the model with matching img_size= / in_chans=")
        x = rearrange(x, 'b c (h p1) (w p2) -> b (h w) (p1 p2 c)', p1=self.patch_size[0], p2=self.patch_size[1])
        return self.norm_out(self.proj(self.norm_in(x)))


class CrateBlock(nn.Module):
    """One CRATE layer (Eq. 18): compression by MSSA with a residual, then ISTA without one."""

    def __init__(self, dim, num_heads, dim_head, *, drop=0., attn_drop=0., eta=0.1, lambd=0.1,
                 tied_output=False, sparse_step='ista', eps=1.0, fused_ista=True):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MSSA(dim, num_heads=num_heads, attn_head_dim=dim_head, attn_drop=attn_drop,
                         proj_drop=drop, tied_output=tied_output, eps=eps)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = ISTA(dim, eta=eta, lambd=lambd, step=sparse_step, eps=eps, fused=fused_ista, drop=drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return self.mlp(self.norm2(x))


class CRATE(nn.Module):
    """CRATE image classifier with timm's model interface.

    Args (paper names where they exist): `embed_dim` (d), `depth` (L), `num_heads` (K),
    `dim_head` (p), `eta` (η, ISTA step), `lambd` (λ, sparsity), `tied_output` (Eq. 11–12 MSSA
    instead of Eq. 115), `sparse_step` ('ista' = Eq. 17, 'mm' = Eq. 92), `eps` (ε of Eq. 12 / 92),
    `global_pool` ('token' = cls as in the paper, or 'avg').
    """

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool='token',
                 embed_dim=384, depth=12, num_heads=6, dim_head=64, drop_rate=0., pos_drop_rate=0.,
                 attn_drop_rate=0., eta=0.1, lambd=0.1, tied_output=False, sparse_step='ista',
                 eps=1.0, fused_ista=True, **unused):
        super().__init__()
        if unused:
            raise TypeError(f"CRATE got unexpected keyword arguments: {sorted(unused)}")
        if global_pool not in ('token', 'avg', ''):
            raise ValueError(f"global_pool={global_pool!r}: accepted 'token', 'avg' or ''")
        for name, value in (('embed_dim', embed_dim), ('depth', depth), ('num_heads', num_heads),
                            ('dim_head', dim_head), ('in_chans', in_chans)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.grad_checkpointing = False

        self.patch_embed = CratePatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.blocks = nn.ModuleList([
            CrateBlock(embed_dim, num_heads, dim_head, drop=drop_rate, attn_drop=attn_drop_rate, eta=eta,
                       lambd=lambd, tied_output=tied_output, sparse_step=sparse_step, eps=eps,
                       fused_ista=fused_ista)
            for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)            # the head's LN (Alg. 1: LN → Linear)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    @torch.jit.ignore
    def no_weight_decay(self):
        return {'pos_embed', 'cls_token'}

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable=True):
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None):
        self.num_classes = num_classes
        if global_pool is not None:
            if global_pool not in ('token', 'avg', ''):
                raise ValueError(f"global_pool={global_pool!r}: accepted 'token', 'avg' or ''")
            self.global_pool = global_pool
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.pos_drop(x)
        for block in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.norm(pool_tokens(x, self.global_pool, self.num_prefix_tokens))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _cfg(**kwargs):
    return {'url': '', 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': None,
            'crop_pct': 0.9, 'interpolation': 'bicubic', 'mean': (0.485, 0.456, 0.406),
            'std': (0.229, 0.224, 0.225), 'first_conv': 'patch_embed.proj', 'classifier': 'head',
            'license': 'apache-2.0', **kwargs}


_SMALL_IMAGE = dict(mean=(0.,), std=(1.,), crop_pct=1.0, interpolation='nearest')

default_cfgs = generate_default_cfgs({
    # test_input_size: the size timm-style contract tests build these at, to stay cheap on CPU
    'crate_tiny_patch16_224.untrained': _cfg(test_input_size=(3, 32, 32)),
    'crate_small_patch16_224.untrained': _cfg(test_input_size=(3, 32, 32)),
    'crate_base_patch16_224.untrained': _cfg(test_input_size=(3, 32, 32)),
    'crate_large_patch16_224.untrained': _cfg(test_input_size=(3, 32, 32)),
    'crate_digits.untrained': _cfg(num_classes=10, input_size=(1, 8, 8), **_SMALL_IMAGE),
    'crate_mnist.untrained': _cfg(num_classes=10, input_size=(1, 28, 28), **_SMALL_IMAGE),
    'crate_cifar.untrained': _cfg(num_classes=10, input_size=(3, 32, 32), crop_pct=1.0),
    'crate_synthetic.untrained': _cfg(num_classes=4, input_size=(1, 16, 16), **_SMALL_IMAGE),
})


def _create_crate(variant: str, pretrained: bool = False, **kwargs) -> CRATE:
    if pretrained:
        raise ValueError(f"{variant}: no pretrained weights are shipped and nothing is downloaded; "
                         "pass pretrained=False or load a checkpoint with `structformer eval --checkpoint`")
    return build_model_with_cfg(CRATE, variant, pretrained=False, **kwargs)


def _register(name, **model_args):
    """Define and register `name(pretrained=False, **kwargs)` with the given defaults."""
    def entry(pretrained: bool = False, **kwargs) -> CRATE:
        return _create_crate(name, pretrained=pretrained, **dict(model_args, **kwargs))
    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = f"CRATE {name}: {model_args}"
    entry.__module__ = __name__
    return register_model(entry)


# Table 1 of the paper (224 px, patch 16)
crate_tiny_patch16_224 = _register('crate_tiny_patch16_224', embed_dim=384, depth=12, num_heads=6, dim_head=64)
crate_small_patch16_224 = _register('crate_small_patch16_224', embed_dim=576, depth=12, num_heads=12, dim_head=48)
crate_base_patch16_224 = _register('crate_base_patch16_224', embed_dim=768, depth=12, num_heads=12, dim_head=64)
crate_large_patch16_224 = _register('crate_large_patch16_224', embed_dim=1024, depth=24, num_heads=16, dim_head=64)
# small-image variants for the embedded data (sized to train on 2 CPU cores in minutes)
crate_digits = _register('crate_digits', img_size=8, patch_size=2, in_chans=1, num_classes=10,
                         embed_dim=64, depth=4, num_heads=4, dim_head=16)
crate_mnist = _register('crate_mnist', img_size=28, patch_size=4, in_chans=1, num_classes=10,
                        embed_dim=96, depth=6, num_heads=6, dim_head=16)
crate_cifar = _register('crate_cifar', img_size=32, patch_size=4, in_chans=3, num_classes=10,
                        embed_dim=192, depth=6, num_heads=6, dim_head=32)
crate_synthetic = _register('crate_synthetic', img_size=16, patch_size=4, in_chans=1, num_classes=4,
                            embed_dim=16, depth=4, num_heads=4, dim_head=4)
