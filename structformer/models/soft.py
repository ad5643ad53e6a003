"""SOFT / SOFT++ pyramid backbones (Lu et al., "Softmax-free Linear Transformers", IJCV 2024), timm style.

Architecture (SOFT §3.4, Table 1):
* stem: three 3×3 Conv-BN-ReLU with strides 2, 1, 2 (÷4, "C33-BN-ReLU"); its two inner convs are
  dims[0] // 2 wide (the paper gives no inner width);
* stages 2–4 each start with one 3×3 Conv-BN-ReLU of stride 2 ("C31-BN-ReLU") to that stage's width.
  Table 1 prints "256-d" for the stage-3 conv while its blocks are 320-d (Tiny); we read the conv as
  producing the stage width (the only reading whose shapes fit);
* per stage, pre-LN blocks `x + attn(LN(x))`, `x + Mlp(LN(x))` (FFN ratio e = 4, GELU, DropPath),
  head dim d_h = 32, m = 49 bottleneck tokens at 224 px;
* stage 4 prepends a cls token; classification is LN → Linear on it.
* Position embeddings: the paper names none (§3.4 describes only the overlapping conv tokeniser), so
  by default there are none — the zero-padded overlapping convolutions carry position. The public
  code adds learned absolute embeddings per stage; `pos_embed=True` reproduces that option.

Landmarks: Table 1's sampling ratio sp = (8, 4, 2, 1) is the kernel = stride k of SOFT's conv sampler
(`sampling_ratio=k`, so the k×k weight exists at construction, no lazy parameters). A stage's landmark
count is m_s = ⌈H_s/k⌉·⌈W_s/k⌉ (49 for the 56², 28², 14², 7² grids at 224 px); the baselines
(`attn='linformer' | 'nystrom'`) get the same m_s, Linformer also its fixed seq_len (+1 for the cls token
in stage 4), so every Table 2 variant sees the same bottleneck size.

Known parameter/FLOP gap (measured by `structformer models --flops`, i.e. `bench.flops.model_flops`;
numbers in the README): `soft_tiny_224` has 14.53M parameters and 2.96 GMACs against the paper's
13M / 1.9G. Table 1's own Tiny configuration already has 14.35M parameters without any sampler, and
its FFNs plus per-token projections alone are 1.96 GMACs, so neither quoted number is reachable from
the table; the public code's Tiny is a different network (depths 1/2/3/2, MLP ratios 8/8/4/4). Our conv
sampler is one head_dim×head_dim k×k conv shared by the heads of a block (as the public code), not a
C×C conv over all channels, which would add 3.6M parameters.
"""
import math
from typing import Dict, List, Optional, Tuple

import torch
from timm.layers import DropPath, Mlp, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs
from torch import nn

from ..layers.attention.registry import get_attention
from ._pooling import pool_tokens
from ._registry import register_model

__all__ = ['SoftNet', 'SoftBlock']


def conv_bn_relu(in_chans: int, out_chans: int, stride: int) -> nn.Sequential:
    """3×3 Conv → BN → ReLU (padding 1, so the output side is ⌈side / stride⌉)."""
    return nn.Sequential(nn.Conv2d(in_chans, out_chans, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(out_chans), nn.ReLU(inplace=True))


def _conv_out(side: int, stride: int) -> int:
    return (side + 2 - 3) // stride + 1


class SoftBlock(nn.Module):
    """Pre-LN transformer layer (SOFT §3.4, "SOFT layer"): x + attn(LN x), then x + Mlp(LN x)."""

    def __init__(self, dim: int, num_heads: int, attn_layer, attn_kwargs: Dict, mlp_ratio: float = 4.,
                 drop: float = 0., attn_drop: float = 0., drop_path: float = 0.):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = attn_layer(dim, num_heads=num_heads, qkv_bias=True, attn_drop=attn_drop, proj_drop=drop,
                               norm_layer=nn.LayerNorm, **attn_kwargs)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=drop)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, grid_size: Tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x), grid_size=grid_size))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class SoftStage(nn.Module):
    """Downsampling (stem for stage 1, C31-BN-ReLU after) and then `depth` SoftBlocks."""

    def __init__(self, downsample: nn.Module, blocks: List[SoftBlock]):
        super().__init__()
        self.downsample = downsample
        self.blocks = nn.ModuleList(blocks)


class SoftNet(nn.Module):
    """SOFT pyramid classifier with timm's model interface.

    Args: `dims`, `num_heads`, `depths` (Table 1), `sampling_ratios` (sp, Table 1), `attn` (a name in
    the attention registry: 'soft', 'softpp', 'softmax', 'linformer', 'performer', 'nystrom', …),
    `attn_kwargs` (extra kwargs for every attention layer, e.g. sampler='avgpool'), `stem_strides`
    ((2, 1, 2) in the paper; small-image variants use (2, 1, 1)), `mlp_ratio` (e), `pos_embed`
    (learned absolute embeddings per stage; off as in the paper), `img_size` (fixes the stage grids,
    needed by Linformer's seq_len).
    """

    def __init__(self, img_size=224, in_chans=3, num_classes=1000, global_pool='token',
                 dims=(64, 128, 320, 512), num_heads=(2, 4, 10, 16), depths=(2, 2, 5, 2),
                 sampling_ratios=(8, 4, 2, 1), attn='soft', attn_kwargs: Optional[Dict] = None,
                 stem_strides=(2, 1, 2), mlp_ratio=4., pos_embed=False, drop_rate=0., attn_drop_rate=0.,
                 drop_path_rate=0., **unused):
        super().__init__()
        if unused:
            raise TypeError(f"SoftNet got unexpected keyword arguments: {sorted(unused)}")
        if not (len(dims) == len(num_heads) == len(depths) == len(sampling_ratios) == 4):
            raise ValueError("dims, num_heads, depths and sampling_ratios need one entry per stage (4)")
        if global_pool not in ('token', 'avg', ''):
            raise ValueError(f"global_pool={global_pool!r}: accepted 'token', 'avg' or ''")
        attn_layer = get_attention(attn)                 # ValueError listing the accepted names
        self.attn_name = attn if isinstance(attn, str) else attn.__name__
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = dims[-1]
        self.num_prefix_tokens = 1
        self.grad_checkpointing = False
        self.in_chans = in_chans

        side = img_size if isinstance(img_size, int) else img_size[0]
        width = img_size if isinstance(img_size, int) else img_size[1]
        grids = []
        for s in stem_strides:
            side, width = _conv_out(side, s), _conv_out(width, s)
        grids.append((side, width))
        for _ in range(3):
            side, width = _conv_out(side, 2), _conv_out(width, 2)
            grids.append((side, width))
        self.grid_sizes = grids

        stem_width = max(dims[0] // 2, 8)
        stem = nn.Sequential(conv_bn_relu(in_chans, stem_width, stem_strides[0]),
                             conv_bn_relu(stem_width, stem_width, stem_strides[1]),
                             conv_bn_relu(stem_width, dims[0], stem_strides[2]))
        total = sum(depths)                              # stochastic depth grows linearly with block index
        dpr = [drop_path_rate * j / max(total - 1, 1) for j in range(total)]
        self.stages = nn.ModuleList()
        self.pos_embeds = nn.ParameterList() if pos_embed else None
        for i, (dim, heads, depth, k, (h, w)) in enumerate(zip(dims, num_heads, depths, sampling_ratios, grids)):
            prefix = 1 if i == 3 else 0
            m = math.ceil(h / k) * math.ceil(w / k)       # 49 at 224 px for every stage
            # union of the registry's per-class kwargs; each class ignores the ones it does not use
            kwargs = dict(num_landmarks=m, sampling_ratio=k, seq_len=h * w + prefix, num_prefix_tokens=prefix,
                          grid_size=(h, w))
            kwargs.update(attn_kwargs or {})
            down = stem if i == 0 else conv_bn_relu(dims[i - 1], dim, 2)
            blocks = [SoftBlock(dim, heads, attn_layer, kwargs, mlp_ratio, drop_rate, attn_drop_rate,
                                dpr[sum(depths[:i]) + j]) for j in range(depth)]
            self.stages.append(SoftStage(down, blocks))
            if pos_embed:
                self.pos_embeds.append(nn.Parameter(torch.zeros(1, h * w + prefix, dim)))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dims[-1]))
        self.norm = nn.LayerNorm(dims[-1])
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(dims[-1], num_classes) if num_classes > 0 else nn.Identity()
        self.feature_info = [dict(num_chs=d, reduction=2 ** (sum(s > 1 for s in stem_strides) + i), module=f'stages.{i}')
                             for i, d in enumerate(dims)]
        self._init_weights()

    def _init_weights(self) -> None:
        trunc_normal_(self.cls_token, std=.02)
        if self.pos_embeds is not None:
            for p in self.pos_embeds:
                trunc_normal_(p, std=.02)
        for mod in self.modules():
            # only Linear / LayerNorm: the attention layers' own parameters (SOFT's conv sampler starts as
            # average pooling, Linformer's E/F) keep their own initialisation
            if isinstance(mod, nn.Linear):
                trunc_normal_(mod.weight, std=.02)
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)

    @torch.jit.ignore
    def no_weight_decay(self):
        names = {'cls_token'}
        if self.pos_embeds is not None:
            names |= {f'pos_embeds.{i}' for i in range(len(self.pos_embeds))}
        return names

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

    def _run_blocks(self, stage: SoftStage, x: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
        for block in stage.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = torch.utils.checkpoint.checkpoint(block, x, grid, use_reentrant=False)
            else:
                x = block(x, grid)
        return x

    def forward_intermediates(self, x: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """-> (final tokens [B, 1 + H₄W₄, C] after the LN, [stage-1…4 maps [B, C_i, H_i, W_i]])."""
        if x.ndim != 4 or x.shape[1] != self.in_chans:
            raise ValueError(f"SoftNet expects images [B, {self.in_chans}, H, W], got {list(x.shape)}")
        maps = []
        for i, stage in enumerate(self.stages):
            x = stage.downsample(x)
            b, c, h, w = x.shape
            tokens = x.flatten(2).transpose(1, 2)
            if i == 3:                                     # stage 4 carries the cls token (Table 1)
                tokens = torch.cat([self.cls_token.expand(b, -1, -1), tokens], dim=1)
            if self.pos_embeds is not None:
                tokens = tokens + self.pos_embeds[i]
            tokens = self._run_blocks(stage, tokens, (h, w))
            grid_tokens = tokens[:, 1:] if i == 3 else tokens
            x = grid_tokens.transpose(1, 2).reshape(b, c, h, w)
            maps.append(x)
        return self.norm(tokens), maps

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_intermediates(x)[0]

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(pool_tokens(x, self.global_pool, self.num_prefix_tokens))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _cfg(**kwargs):
    return {'url': '', 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': None,
            'crop_pct': 0.9, 'interpolation': 'bicubic', 'mean': (0.485, 0.456, 0.406),
            'std': (0.229, 0.224, 0.225), 'first_conv': 'stages.0.downsample.0.0', 'classifier': 'head',
            'license': 'apache-2.0', **kwargs}


_DIGITS = dict(num_classes=10, input_size=(1, 8, 8), mean=(0.,), std=(1.,), crop_pct=1.0, interpolation='nearest')
_MNIST = dict(num_classes=10, input_size=(1, 28, 28), mean=(0.,), std=(1.,), crop_pct=1.0, interpolation='nearest')

# Table 1 of SOFT
_SIZES = {
    'tiny': dict(dims=(64, 128, 320, 512), num_heads=(2, 4, 10, 16), depths=(2, 2, 5, 2)),
    'small': dict(dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24), depths=(2, 2, 5, 2)),
    'medium': dict(dims=(96, 192, 384, 768), num_heads=(3, 6, 12, 24), depths=(2, 2, 18, 2)),
    'large': dict(dims=(128, 256, 512, 1024), num_heads=(4, 8, 16, 32), depths=(2, 2, 18, 2)),
}
# Table 2 baselines on the Tiny backbone
BASELINES = ('softmax', 'linformer', 'performer', 'nystrom')
# Small-image setting: stem ÷2 (strides 2, 1, 1) so 28 px gives grids 14², 7², 4², 2²; sp (4, 3, 2, 2)
# then gives m = 16, 9, 4, 1 landmarks (the stage-4 cls token is one more landmark for SOFT).
_MNIST_ARGS = dict(img_size=28, in_chans=1, num_classes=10, stem_strides=(2, 1, 1), sampling_ratios=(4, 3, 2, 2))

# Embedded-data setting (scikit-learn digits, 8×8): no stem striding, so the stage grids are 8², 4², 2², 1²;
# sp (2, 2, 1, 1) gives m = 16, 4, 4, 1 landmarks (stage 3's 2×2 grid is its own landmark set, exact there).
# Narrow and shallow (Tiny's head width 32 and FFN ratio, depths 1/1/2/1) so it trains in seconds on a CPU.
_DIGITS_ARGS = dict(img_size=8, in_chans=1, num_classes=10, dims=(32, 64, 96, 128), num_heads=(1, 2, 3, 4),
                    depths=(1, 1, 2, 1), stem_strides=(1, 1, 1), sampling_ratios=(2, 2, 1, 1))

_MODELS: Dict[str, Dict] = {}
for _size, _args in _SIZES.items():
    _MODELS[f'soft_{_size}_224'] = dict(_args, attn='soft')
    _MODELS[f'softpp_{_size}_224'] = dict(_args, attn='softpp')
for _attn in BASELINES:
    _MODELS[f'soft_tiny_{_attn}_224'] = dict(_SIZES['tiny'], attn=_attn)
_MODELS['soft_tiny_mnist'] = dict(_SIZES['tiny'], attn='soft', **_MNIST_ARGS)
_MODELS['softpp_tiny_mnist'] = dict(_SIZES['tiny'], attn='softpp', **_MNIST_ARGS)
for _attn in BASELINES:
    _MODELS[f'soft_tiny_{_attn}_mnist'] = dict(_SIZES['tiny'], attn=_attn, **_MNIST_ARGS)
_MODELS['soft_digits'] = dict(_DIGITS_ARGS, attn='soft')
_MODELS['softpp_digits'] = dict(_DIGITS_ARGS, attn='softpp')

# test_input_size 64 px: grids 16², 8², 4², 2² and m = 4 landmarks per stage, cheap on CPU yet non-trivial
default_cfgs = generate_default_cfgs({
    f'{name}.untrained': _cfg(**_MNIST) if name.endswith('_mnist') else _cfg(**_DIGITS) if name.endswith('_digits')
    else _cfg(test_input_size=(3, 64, 64)) for name in _MODELS})


def _create(variant: str, pretrained: bool = False, **kwargs) -> SoftNet:
    if pretrained:
        raise ValueError(f"{variant}: no pretrained weights are shipped and nothing is downloaded; "
                         "pass pretrained=False or load a checkpoint with `structformer eval --checkpoint`")
    return build_model_with_cfg(SoftNet, variant, pretrained=False, **kwargs)


def _register(name: str, model_args: Dict):
    def entry(pretrained: bool = False, **kwargs) -> SoftNet:
        return _create(name, pretrained=pretrained, **dict(model_args, **kwargs))
    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = f"SOFT backbone {name} (SOFT §3.4, Table 1/2): {model_args}"
    entry.__module__ = __name__
    return register_model(entry)


for _name, _args in _MODELS.items():
    globals()[_name] = _register(_name, _args)
