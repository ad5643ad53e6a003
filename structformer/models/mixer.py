"""MLP-Mixer as a wide sparse MLP (Hayase & Karakida 2024): MLP-Mixer, S-Mixer, RP-Mixer and SW-MLP
built from the structured layers of `layers/linear/`.

`SparseMixer` covers four models of App. A.2 with two switches:
  mlp_ratio   γ: MLP-Mixer blocks f(X) = φ(XW₁ᵀ)W₂ᵀ (Eq. S.2, S.5–S.6); None: S-Mixer blocks f(X) = φ(XWᵀ)
              (Eq. S.3, S.7–S.8, LN and skip kept as the paper does)
  permutation 'mixer': token mixing J₁ = J_c, J₂ = J_cᵀ (Eq. S.10–S.12); 'random': fresh, frozen random
              J₁, J₂ per token-mixing layer (RP, Eq. S.13; channel mixing keeps I, I as S.12 writes it,
              `rp_channels=True` permutes it too)
The per-patch FC (Eq. S.1) maps C₀ = in_chans·P² to C; the token count S is free of the patch grid S₀
(App. A.1): the first token-mixing block maps S₀ → S and adds SkipLayer(X) = LN(W̃X) (Eq. S.14–S.15)
instead of X, used whenever S ≠ S₀ (or `skip_layer=True`, as the paper does in its S sweeps).

`SWMLP` is the static sparse-weight MLP (Eq. S.16–S.17) on the flattened token table, m = S₀·C.
"""
from functools import partial
from typing import List, Optional, Sequence, Union

import torch
from timm.layers import DropPath, PatchEmbed, to_2tuple
from timm.models import generate_default_cfgs
from torch import nn

from ..functional.tracing import checked_images
from ..layers.linear import MaskedLinear, PKLinear
from ._registry import register_model
from ..arguments import count, image_size, nonnegative_number, positive_int, positive_number, rate
from .base import CIFAR10_CFG, DIGITS_CFG, MNIST_CFG, StructuredModel, check_global_pool, create_model, model_cfg

__all__ = ['SparseMixer', 'SWMLP', 'PKMixing', 'SparseMixerBlock']

torch.fx.wrap('checked_images')                 # the input check is one node of an FX trace (functional/tracing.py)

PERMUTATIONS = ('mixer', 'random')


class PKMixing(nn.Module):
    """One mixing MLP as PK layers on the flattened table: J₂ (I⊗W₂) φ((I⊗W₁) J₁ x) (hidden given), or
    φ(J₂ (I⊗W) J₁ x) for S-Mixer (hidden None; Eq. S.3 puts φ on the single layer's output)."""

    def __init__(self, num_blocks: int, block_in: int, block_out: int, hidden: Optional[int], perm_in, perm_out,
                 seed: int, act_layer=nn.GELU, drop: float = 0., bias: bool = True):
        super().__init__()
        if hidden is None:
            self.fc1 = PKLinear(num_blocks, block_in, block_out, perm_in, perm_out, seed=seed, bias=bias)
            self.fc2 = None
        else:
            self.fc1 = PKLinear(num_blocks, block_in, hidden, perm_in, 'identity', seed=seed, bias=bias)
            self.fc2 = PKLinear(num_blocks, hidden, block_out, 'identity', perm_out, seed=seed + 2, bias=bias)
        self.act = act_layer()
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.act(self.fc1(x)))
        return x if self.fc2 is None else self.drop(self.fc2(x))


class SparseMixerBlock(nn.Module):
    """U = skip(X) + Mat∘PK-mixing(LN(X)) over tokens, Y = U + Mat∘PK-mixing(LN(U)) over channels.

    X is [B, S_in, C]; token mixing sees it flattened row-major (x = vec(Xᵀ) in the paper's notation),
    so J_c ('transpose') groups each channel's S_in tokens into one block.
    """

    def __init__(self, tokens_in: int, tokens: int, channels: int, token_hidden: Optional[int],
                 channel_hidden: Optional[int], permutation: str = 'mixer', rp_channels: bool = False,
                 skip_layer: bool = False, seed: int = 0, act_layer=nn.GELU, norm_layer=nn.LayerNorm,
                 drop: float = 0., drop_path: float = 0., bias: bool = True):
        super().__init__()
        self.tokens_in, self.tokens, self.channels = tokens_in, tokens, channels
        random = permutation == 'random'
        self.norm1 = norm_layer(channels)
        self.mlp_tokens = PKMixing(channels, tokens_in, tokens, token_hidden,
                                   'random' if random else 'transpose', 'random' if random else 'transpose',
                                   seed=seed, act_layer=act_layer, drop=drop, bias=bias)
        if skip_layer:
            # SkipLayer(X) = LN(W̃X), W̃ ∈ R^{S×S₀} (Eq. S.15), applied to every channel
            self.skip = PKLinear(channels, tokens_in, tokens, 'transpose', 'transpose', seed=seed, bias=False)
            self.skip_norm = norm_layer(channels)
        else:
            if tokens_in != tokens:
                raise ValueError(f"a Mixer block that maps {tokens_in} tokens to {tokens} needs skip_layer=True "
                                 "(Eq. S.14–S.15)")
            self.skip = self.skip_norm = None
        self.norm2 = norm_layer(channels)
        channel_perm = 'random' if random and rp_channels else 'identity'
        self.mlp_channels = PKMixing(tokens, channels, channels, channel_hidden, channel_perm, channel_perm,
                                     seed=seed + 4, act_layer=act_layer, drop=drop, bias=bias)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        mixed = self.mlp_tokens(self.norm1(x).reshape(batch, -1)).reshape(batch, self.tokens, self.channels)
        shortcut = x if self.skip is None else self.skip_norm(
            self.skip(x.reshape(batch, -1)).reshape(batch, self.tokens, self.channels))
        x = shortcut + self.drop_path(mixed)
        mixed = self.mlp_channels(self.norm2(x).reshape(batch, -1)).reshape(batch, self.tokens, self.channels)
        return x + self.drop_path(mixed)


def _hidden(ratio: Optional[float], explicit: Optional[int], width: int) -> Optional[int]:
    if explicit is not None:
        return int(explicit)
    return None if ratio is None else max(1, int(round(ratio * width)))


class _PatchTableModel(StructuredModel):
    """What Mixer and SW-MLP share: the per-patch FC stem (Eq. S.1) and the grid checks."""
    num_prefix_tokens = 0
    feature_modules = 'blocks'
    pooling = 'its head pools by the token mean (the paper\'s); no cls token, no max pooling'   # why only 'avg' / ''

    def _stem(self, img_size, patch_size, in_chans, embed_dim):
        image_size('img_size', img_size)            # 0 failed in timm's PatchEmbed as a ZeroDivisionError
        image_size('patch_size', patch_size)
        positive_int('in_chans', in_chans)
        positive_int('embed_dim', embed_dim)        # -1 failed inside the patch convolution
        # timm's PatchEmbed: a P×P stride-P conv is the per-patch FC C₀ = in_chans·P² → C
        self.stem = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim)
        self.in_chans, self.patch_tokens = in_chans, self.stem.num_patches
        self.declare_fixed_input_size(True)            # token mixing is shaped for the patch count

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None and global_pool not in ('avg', ''):
            raise ValueError(f"global_pool={global_pool!r}: {type(self).__name__}: {self.pooling}; accepted 'avg' or ''")
        super().reset_classifier(num_classes, global_pool)

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        return checked_images(x, type(self).__name__, self.in_chans, self.stem.img_size)   # an FX leaf: traceable


def _check_blocks(depth, norm_eps, num_classes, **rates) -> None:
    """The arguments every patch-table model shares, named before a layer is built: a negative depth built no
    block silently, a negative LayerNorm eps gave NaN at the first step, a rate over 1 failed in the first training
    step (timm's DropPath)."""
    positive_int('depth', depth)
    positive_number('norm_eps', norm_eps)
    count('num_classes', num_classes)
    for name, value in rates.items():
        rate(name, value)


class SparseMixer(_PatchTableModel):
    """MLP-Mixer / S-Mixer / RP-Mixer (App. A.2) as a timm classifier.

    Args:
        num_tokens: S (default: the patch count S₀); embed_dim: C; depth: L blocks.
        mlp_ratio: γ, one number or (γ_tokens, γ_channels); hidden widths γS and γC (the paper's
            convention); None or 0 builds S-Mixer blocks (0 says so through timm.create_model, which drops a
            None). token_mlp_dim / channel_mlp_dim override the hidden widths directly (timm's MlpMixer
            uses 0.5·C and 4·C).
        permutation: 'mixer' (J_c) or 'random' (RP); rp_channels: also permute channel mixing;
        perm_seed: seeds every layer's permutations (layer ℓ draws its own from it).
        skip_layer: None = only when S ≠ S₀; True = always (as in the paper's S sweeps).
        mixing_bias: biases on the mixing layers; None = none for S-Mixer blocks (Eq. S.3, S.7–S.8 have none),
            as timm's MlpMixer for MLP-Mixer blocks (its Linear layers carry them).
    """

    def __init__(self, img_size=32, patch_size=4, in_chans=3, num_classes=10, num_tokens: Optional[int] = None,
                 embed_dim=64, depth=8, mlp_ratio: Union[None, float, Sequence[float]] = None,
                 token_mlp_dim: Optional[int] = None, channel_mlp_dim: Optional[int] = None,
                 permutation: str = 'mixer', rp_channels: bool = False, perm_seed: int = 0,
                 skip_layer: Optional[bool] = None, norm_eps: float = 1e-5, drop_rate: float = 0.,
                 proj_drop_rate: float = 0., drop_path_rate: float = 0., global_pool: str = 'avg',
                 mixing_bias: Optional[bool] = None):
        super().__init__()
        if permutation not in PERMUTATIONS:
            raise ValueError(f"permutation={permutation!r}: accepted 'mixer' (J_c, the Mixer) or 'random' (RP-Mixer)")
        if rp_channels and permutation != 'random':
            raise ValueError("rp_channels=True permutes the channel mixing of an RP-Mixer: it needs "
                             f"permutation='random' (got {permutation!r})")
        if global_pool not in ('avg', ''):
            raise ValueError(f"global_pool={global_pool!r}: a Mixer: {self.pooling}; accepted 'avg' or ''")
        _check_blocks(depth, norm_eps, num_classes, drop_rate=drop_rate, proj_drop_rate=proj_drop_rate,
                      drop_path_rate=drop_path_rate)
        count('perm_seed', perm_seed)               # 2.5 was truncated to seed 2 silently
        for r in (mlp_ratio if isinstance(mlp_ratio, (tuple, list)) else (mlp_ratio,)):
            if r is not None:
                nonnegative_number('mlp_ratio', r)
        for name, value in (('token_mlp_dim', token_mlp_dim), ('channel_mlp_dim', channel_mlp_dim)):
            if value is not None:
                positive_int(name, value)
        self.num_classes, self.global_pool = num_classes, check_global_pool(global_pool)
        self._stem(img_size, patch_size, in_chans, embed_dim)
        tokens = self.patch_tokens if num_tokens is None else int(num_tokens)
        if tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens!r}")
        ratios = mlp_ratio if isinstance(mlp_ratio, (tuple, list)) else (mlp_ratio, mlp_ratio)
        ratios = tuple(None if r is not None and r == 0 else r for r in ratios)     # 0: no expansion layer
        smixer = ratios[0] is None and token_mlp_dim is None and ratios[1] is None and channel_mlp_dim is None
        self.mixing_bias = (not smixer) if mixing_bias is None else bool(mixing_bias)
        self.num_tokens, self.permutation = tokens, permutation
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        skip_first = (tokens != self.patch_tokens) if skip_layer is None else bool(skip_layer)
        norm_layer = partial(nn.LayerNorm, eps=norm_eps)
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]    # plain floats: builds on meta too
        self.blocks = nn.ModuleList([
            SparseMixerBlock(self.patch_tokens if i == 0 else tokens, tokens, embed_dim,
                             _hidden(ratios[0], token_mlp_dim, tokens), _hidden(ratios[1], channel_mlp_dim, embed_dim),
                             permutation=permutation, rp_channels=rp_channels, skip_layer=skip_first and i == 0,
                             seed=int(perm_seed) * 1000 + 10 * i, norm_layer=norm_layer, drop=proj_drop_rate,
                             drop_path=dpr[i], bias=self.mixing_bias)
            for i in range(depth)])
        self.norm = norm_layer(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        reduction = self.stem.patch_size[0]
        self.feature_info = [dict(module=f'blocks.{i}', num_chs=embed_dim, reduction=reduction) for i in range(depth)]
        self.init_weights()

    def init_weights(self) -> None:
        """Mixing weights N(0, 1/fan_in), as §4.3 assumes (W ~ N(0, 1/S), V ~ N(0, 1/C)); biases zero;
        the head zero, as timm's MlpMixer starts it."""
        for module in self.modules():
            if isinstance(module, PKLinear):
                nn.init.normal_(module.weight, std=module.block_in ** -0.5)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        x = self.stem(x)
        for block in self.blocks:
            x = self.run_block(block, x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == 'avg':
            x = x.mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = 'NCHW',
                              intermediates_only: bool = False):
        """timm's feature interface: block outputs as [B, C, H, W] on the patch grid ('NCHW', only when
        S = S₀: a table of S ≠ S₀ tokens has no grid) or [B, S, C] ('NLC')."""
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt={output_fmt!r}: accepted 'NCHW' or 'NLC'")
        if output_fmt == 'NCHW' and self.num_tokens != self.patch_tokens:
            raise ValueError(f"output_fmt='NCHW' needs num_tokens == the patch count ({self.patch_tokens}); this "
                             f"model mixes {self.num_tokens} tokens, use output_fmt='NLC'")
        x = self._check_input(x)
        x, intermediates = self.run_blocks_keeping(self.stem(x), indices, norm, stop_early)
        if output_fmt == 'NCHW':
            h, w = self.stem.grid_size
            intermediates = [y.reshape(y.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        return intermediates if intermediates_only else (self.norm(x), intermediates)


class SWMLP(_PatchTableModel):
    """Static sparse-weight MLP (App. A.2.5): per-patch FC, vectorisation (m = S₀·C), L blocks
    x ↦ x + φ((M⊙W) LN(x)) (Eq. S.16; with mlp_ratio γ: x ↦ x + φ((M₂⊙W₂) φ((M₁⊙W₁) LN(x))), Eq. S.17),
    then LN and the FC classifier (our LN before the head mirrors the Mixers' final norm).

    Args: density p ∈ (0, 1] of every mask; mlp_ratio γ (None or 0: one layer per block, Eq. S.16); mask_seed
    seeds them (layer ℓ its own); drop_path_rate:
    stochastic depth on the residual branches, growing linearly over the blocks as in timm (0, as the paper).
    """
    pooling = "its head classifies the whole flat vector (the paper's): nothing is pooled"

    def __init__(self, img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=16, depth=3,
                 density: float = 0.1, mlp_ratio: Optional[float] = None, mask_seed: int = 0, norm_eps: float = 1e-5,
                 drop_rate: float = 0., global_pool: str = 'avg', drop_path_rate: float = 0.):
        super().__init__()
        _check_blocks(depth, norm_eps, num_classes, drop_rate=drop_rate, drop_path_rate=drop_path_rate)
        count('mask_seed', mask_seed)
        if mlp_ratio is not None:
            nonnegative_number('mlp_ratio', mlp_ratio)
        if global_pool not in ('avg', ''):
            raise ValueError(f"global_pool={global_pool!r}: SW-MLP: {self.pooling}; accepted 'avg' or ''")
        self.num_classes, self.global_pool = num_classes, global_pool
        self._stem(img_size, patch_size, in_chans, embed_dim)
        self.embed_dim = embed_dim
        width = self.patch_tokens * embed_dim
        self.width = self.num_features = self.head_hidden_size = width
        # None or 0: one masked layer per block (Eq. S.16); 0 passes timm.create_model, which drops a None
        hidden = None if mlp_ratio is None or mlp_ratio == 0 else max(1, int(round(mlp_ratio * width)))
        self.blocks = nn.ModuleList([
            _SparseWeightBlock(width, hidden, density, seed=int(mask_seed) * 1000 + 10 * i, norm_eps=norm_eps,
                               drop_path=drop_path_rate * i / max(depth - 1, 1))
            for i in range(depth)])
        self.norm = nn.LayerNorm(width, eps=norm_eps)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(width, num_classes) if num_classes > 0 else nn.Identity()
        self.feature_info = [dict(module=f'blocks.{i}', num_chs=embed_dim, reduction=self.stem.patch_size[0])
                             for i in range(depth)]
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._check_input(x)
        x = self.stem(x)                       # the [B, S₀, C] table: what a hook on a block sees (feature_info's C)
        for block in self.blocks:
            x = self.run_block(block, x)
        return self.norm(x.flatten(1))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward_intermediates(self, x: torch.Tensor, indices=None, norm: bool = False, stop_early: bool = False,
                              output_fmt: str = 'NCHW', intermediates_only: bool = False):
        """Block outputs, the flat m-vector read back as the [S₀, C] table: [B, C, H, W] or [B, S₀, C]."""
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt={output_fmt!r}: accepted 'NCHW' or 'NLC'")
        x = self._check_input(x)
        x, tables = self.run_blocks_keeping(self.stem(x), indices, False, stop_early)
        if norm:                               # the final LN acts on the flat m-vector
            tables = [self.norm(t.flatten(1)).reshape(t.shape) for t in tables]
        if output_fmt == 'NCHW':
            h, w = self.stem.grid_size
            tables = [t.reshape(t.shape[0], h, w, -1).permute(0, 3, 1, 2).contiguous() for t in tables]
        return tables if intermediates_only else (self.norm(x.flatten(1)), tables)


class _SparseWeightBlock(nn.Module):
    flop_component = 'mlp'          # the whole block is one (sparse-weight) MLP: `models --flops` counts it there

    def __init__(self, width: int, hidden: Optional[int], density: float, seed: int, norm_eps: float,
                 drop_path: float = 0.):
        super().__init__()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm = nn.LayerNorm(width, eps=norm_eps)
        out = width if hidden is None else hidden
        self.fc1 = MaskedLinear(width, out, density=density, seed=seed)
        self.fc2 = None if hidden is None else MaskedLinear(hidden, width, density=density, seed=seed + 1)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: the flat m-vector [B, m] or the [B, S₀, C] table it is read from (the model passes the table, so
        that timm's hook features are [B, S₀, C] as feature_info's num_chs = C says); the output has x's shape."""
        flat = x.flatten(1)
        y = self.act(self.fc1(self.norm(flat)))
        if self.fc2 is not None:
            y = self.act(self.fc2(y))
        return x + self.drop_path(y.reshape(x.shape))


# ---- registered models ------------------------------------------------------------------------
def _cfg(**kwargs):
    # fixed_input_size, as timm's MLP-Mixer: the token-mixing width S (SW-MLP's flat width) is the number of patches
    return model_cfg(first_conv='stem.proj', fixed_input_size=True, **kwargs)


_DIGITS = dict(num_classes=10, input_size=(1, 8, 8), **DIGITS_CFG)
_MNIST = dict(num_classes=10, input_size=(1, 28, 28), **MNIST_CFG)
_CIFAR = dict(num_classes=10, input_size=(3, 32, 32), **CIFAR10_CFG)
default_cfgs = generate_default_cfgs({
    'mixer_digits.untrained': _cfg(**_DIGITS), 'rp_mixer_digits.untrained': _cfg(**_DIGITS),
    'swmlp_digits.untrained': _cfg(**_DIGITS),
    'smixer_mnist.untrained': _cfg(**_MNIST), 'rp_smixer_mnist.untrained': _cfg(**_MNIST),
    'swmlp_mnist.untrained': _cfg(**_MNIST),
    'smixer_cifar.untrained': _cfg(**_CIFAR), 'rp_smixer_cifar.untrained': _cfg(**_CIFAR),
    'mixer_cifar.untrained': _cfg(**_CIFAR), 'rp_mixer_cifar.untrained': _cfg(**_CIFAR),
    'swmlp_cifar.untrained': _cfg(**_CIFAR),
    'sparse_mixer_b16_224.untrained': _cfg(), 'rp_mixer_b16_224.untrained': _cfg(),
})


def _mixer(variant, pretrained, defaults, kwargs):
    args = dict(defaults, **kwargs)
    # S ≠ S₀ mixes a table of tokens with no patch grid, whose forward_intermediates refuses NCHW: features_only
    # hands back the tokens [B, S, C] instead (timm's getter asked for NCHW, so features_only could not run at all)
    try:
        (h, w), (ph, pw) = to_2tuple(args.get('img_size', 32)), to_2tuple(args.get('patch_size', 4))
        grid = (h // ph) * (w // pw)
    except (TypeError, ValueError, ZeroDivisionError):
        grid = None                                  # a bad size: the constructor names it
    fmt = 'NLC' if args.get('num_tokens') not in (None, grid) else 'NCHW'
    return create_model(SparseMixer, variant, pretrained, default_out_indices=3, feature_output_fmt=fmt, **args)


def _swmlp(variant, pretrained, defaults, kwargs):
    return create_model(SWMLP, variant, pretrained, default_out_indices=3, **dict(defaults, **kwargs))


_DIGITS_ARGS = dict(img_size=8, patch_size=2, in_chans=1, num_classes=10)      # S₀ = 16, C₀ = 4
_MNIST_ARGS = dict(img_size=28, patch_size=4, in_chans=1, num_classes=10)      # S₀ = 49, C₀ = 16
_CIFAR_ARGS = dict(img_size=32, patch_size=4, in_chans=3, num_classes=10)      # S₀ = 64, C₀ = 48 (App. C)
# the CIFAR variants' S = 64 is S = S₀ at 32 px: num_tokens stays unset (S₀), so a model built at another img_size
# mixes its own patches (a pinned 64 added a skip layer remapping them to 64 tokens without a grid)
# Mixer-B/16 at the paper's ImageNet setting (App. C.5): P = 16, S = S₀ = 196, C = 768, 12 blocks, γ = 4 for both
# MLPs (so the token MLP is 4·S = 784 wide, not the original Mixer-B/16's 384)
_B16_ARGS = dict(img_size=224, patch_size=16, in_chans=3, num_classes=1000, embed_dim=768, depth=12, mlp_ratio=4.0)


@register_model
def mixer_digits(pretrained: bool = False, **kwargs) -> SparseMixer:
    """MLP-Mixer on 8 px digits: S = S₀ = 16, C = 32, L = 4, γ = 2."""
    return _mixer('mixer_digits', pretrained, dict(_DIGITS_ARGS, embed_dim=32, depth=4, mlp_ratio=2.0), kwargs)


@register_model
def rp_mixer_digits(pretrained: bool = False, **kwargs) -> SparseMixer:
    """RP MLP-Mixer on 8 px digits (Eq. S.13): as mixer_digits, token mixing between random permutations."""
    return _mixer('rp_mixer_digits', pretrained,
                  dict(_DIGITS_ARGS, embed_dim=32, depth=4, mlp_ratio=2.0, permutation='random'), kwargs)


@register_model
def swmlp_digits(pretrained: bool = False, **kwargs) -> SWMLP:
    """SW-MLP on 8 px digits: m = 16·8 = 128, L = 2, p = 0.25."""
    return _swmlp('swmlp_digits', pretrained, dict(_DIGITS_ARGS, embed_dim=8, depth=2, density=0.25), kwargs)


@register_model
def smixer_mnist(pretrained: bool = False, **kwargs) -> SparseMixer:
    """S-Mixer on 28 px MNIST: S = S₀ = 49 tokens, C = 48 channels (C ≈ S, the widest at its Ω), L = 4."""
    return _mixer('smixer_mnist', pretrained, dict(_MNIST_ARGS, embed_dim=48, depth=4), kwargs)


@register_model
def rp_smixer_mnist(pretrained: bool = False, **kwargs) -> SparseMixer:
    """RP S-Mixer on 28 px MNIST, as smixer_mnist with random permutations."""
    return _mixer('rp_smixer_mnist', pretrained,
                  dict(_MNIST_ARGS, embed_dim=48, depth=4, permutation='random'), kwargs)


@register_model
def swmlp_mnist(pretrained: bool = False, **kwargs) -> SWMLP:
    """SW-MLP on 28 px MNIST: m = 49·16 = 784, L = 4, p = 0.1."""
    return _swmlp('swmlp_mnist', pretrained, dict(_MNIST_ARGS, embed_dim=16, depth=4, density=0.1), kwargs)


@register_model
def smixer_cifar(pretrained: bool = False, **kwargs) -> SparseMixer:
    """S-Mixer at the paper's CIFAR setting (App. C): patch 4, S₀ = 64, S = C = 64, 8 blocks."""
    return _mixer('smixer_cifar', pretrained, dict(_CIFAR_ARGS, embed_dim=64, depth=8), kwargs)


@register_model
def rp_smixer_cifar(pretrained: bool = False, **kwargs) -> SparseMixer:
    """RP S-Mixer at the paper's CIFAR setting."""
    return _mixer('rp_smixer_cifar', pretrained,
                  dict(_CIFAR_ARGS, embed_dim=64, depth=8, permutation='random'), kwargs)


@register_model
def mixer_cifar(pretrained: bool = False, **kwargs) -> SparseMixer:
    """MLP-Mixer at the resource-table CIFAR setting (Table S.3): S = 64, C = 48, L = 3, γ = 2."""
    return _mixer('mixer_cifar', pretrained, dict(_CIFAR_ARGS, embed_dim=48, depth=3, mlp_ratio=2.0),
                  kwargs)


@register_model
def rp_mixer_cifar(pretrained: bool = False, **kwargs) -> SparseMixer:
    """RP MLP-Mixer at the resource-table CIFAR setting (Table S.3)."""
    return _mixer('rp_mixer_cifar', pretrained, dict(_CIFAR_ARGS, embed_dim=48, depth=3,
                                                     mlp_ratio=2.0, permutation='random'), kwargs)


@register_model
def swmlp_cifar(pretrained: bool = False, **kwargs) -> SWMLP:
    """SW-MLP with the connections of the Table S.3 RP-Mixer: m = 64·48 = 3072, γ = 2, L = 3, and p matched to
    its Ω (see `structformer.models.mixer_design`): 3072² · 2 · p = Ω."""
    from ..models.mixer_design import omega, sw_density
    density = sw_density(omega(64, 48, 2.0), 64 * 48, 2.0)
    return _swmlp('swmlp_cifar', pretrained, dict(_CIFAR_ARGS, embed_dim=48, depth=3, mlp_ratio=2.0,
                                                  density=density), kwargs)


# ImageNet size. timm's own `mixer_b16_224` is the original MLP-Mixer (token MLP 384 wide, dense layers); these are
# the paper's Mixer-B/16 built from PK layers, hence `sparse_` in the first name.
@register_model
def sparse_mixer_b16_224(pretrained: bool = False, **kwargs) -> SparseMixer:
    """Mixer-B/16 as the paper trains it on ImageNet-1k (App. C.5, Table 1): S = 196, C = 768, L = 12, γ = 4."""
    return _mixer('sparse_mixer_b16_224', pretrained, dict(_B16_ARGS), kwargs)


@register_model
def rp_mixer_b16_224(pretrained: bool = False, **kwargs) -> SparseMixer:
    """RP-Mixer at the Mixer-B/16 shapes (Eq. S.13; the paper's ImageNet RP-Mixer, Fig. 6): as
    sparse_mixer_b16_224, token mixing between fresh random permutations per layer."""
    return _mixer('rp_mixer_b16_224', pretrained, dict(_B16_ARGS, permutation='random'), kwargs)
