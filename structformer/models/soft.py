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

The registered sizes and settings (Table 1, the public code's, the baselines, small images): soft_variants.py.

Landmarks: Table 1's sampling ratio sp = (8, 4, 2, 1) is the kernel = stride k of SOFT's conv sampler
(`sampling_ratio=k`, so the k×k weight exists at construction, no lazy parameters). A stage's landmark
count is m_s = ⌈H_s/k⌉·⌈W_s/k⌉ (49 for the 56², 28², 14², 7² grids at 224 px); the baselines
(`attn='linformer' | 'nystrom'`) get the same m_s, Linformer also its fixed seq_len (+1 for the cls token
in stage 4), so every Table 2 variant sees the same bottleneck size.

Known parameter/FLOP gap (`structformer models --flops`; numbers in docs/soft.md): `soft_tiny_224` has
more parameters and multiply-adds than the paper's 13M / 1.9G, and so does Table 1's own Tiny
configuration without any sampler (its FFNs plus per-token projections alone exceed 1.9 GMACs), so
neither quoted number is reachable from the table; the public code's Tiny is a different network
(depths 1/2/3/2, MLP ratio 4 everywhere: its `mlp_ratios=[8, 8, 4, 4]` never reaches the SOFT
blocks), built by `soft_tiny_official_224` (`official=True`, docs/soft.md lists every difference). Our conv
sampler is one head_dim×head_dim k×k conv shared by the heads of a block (as the public code), not a
C×C conv over all channels, which would add 3.6M parameters.
"""
import math
from functools import partial
from typing import Dict, List, Optional, Tuple, Union

import torch
from timm.layers import DropPath, Mlp, trunc_normal_
from timm.models._features import feature_take_indices   # timm's own index rule for forward_intermediates
from torch import nn

from ..functional.tracing import checked_images
from ..layers.attention.registry import accepted_options, check_options, get_attention, select_options
from ..layers.attention.softmax import AttentionBase
from ..arguments import count, image_size, positive_int, positive_ints, positive_number, rate
from .base import StructuredModel, check_global_pool

__all__ = ['SoftNet', 'SoftBlock']

torch.fx.wrap('checked_images')                 # the input check is one node of an FX trace (functional/tracing.py)


def conv_bn_relu(in_chans: int, out_chans: int, stride: int, bias: bool = False) -> nn.Sequential:
    """3×3 Conv → BN → ReLU (padding 1, so the output side is ⌈side / stride⌉). `bias`: the public code's
    conv bias before BN (redundant with BN's shift, but parameters all the same)."""
    return nn.Sequential(nn.Conv2d(in_chans, out_chans, 3, stride, 1, bias=bias),
                         nn.BatchNorm2d(out_chans), nn.ReLU(inplace=True))


def _per_stage(name: str, value, types) -> tuple:
    """One value per stage (4) from a scalar or a 4-sequence."""
    if isinstance(value, types):
        return (value,) * 4
    value = tuple(value)
    if len(value) != 4:
        raise ValueError(f"{name} takes one value or one per stage (4), got {value!r}")
    return value


def _conv_out(side: int, stride: int) -> int:
    return (side + 2 - 3) // stride + 1


MLP_ACTS = {'gelu': nn.GELU, 'gelu_tanh': partial(nn.GELU, approximate='tanh')}


class SoftBlock(nn.Module):
    """Pre-LN transformer layer (SOFT §3.4, "SOFT layer"): x + attn(LN x), then x + Mlp(LN x).
    `post_norm=True`: the public code's post-LN layer, x = LN(x + attn(x)), then x = LN(x + Mlp(x)).
    `mlp_act`: 'gelu' or 'gelu_tanh' (the public code's SOFT blocks use the tanh approximation).
    `branch_dropout=True`: the block's stochastic-depth rate drops *entries* of each residual branch
    (`nn.Dropout(p=drop_path)`, the public code's SOFT blocks) instead of whole samples' branches (DropPath)."""

    def __init__(self, dim: int, num_heads: int, attn_layer, attn_kwargs: Dict, mlp_ratio: float = 4.,
                 drop: float = 0., attn_drop: float = 0., drop_path: float = 0., post_norm: bool = False,
                 mlp_act: str = 'gelu', norm_eps: float = 1e-5, branch_dropout: bool = False):
        super().__init__()
        self.post_norm = post_norm
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = attn_layer(dim, num_heads=num_heads, qkv_bias=True, attn_drop=attn_drop, proj_drop=drop,
                               norm_layer=nn.LayerNorm, **attn_kwargs)
        drop_branch = nn.Dropout if branch_dropout else DropPath
        self.drop_path1 = drop_branch(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=MLP_ACTS[mlp_act], drop=drop)
        self.drop_path2 = drop_branch(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, grid_size: Tuple[int, int]) -> torch.Tensor:
        if self.post_norm:
            x = self.norm1(x + self.drop_path1(self.attn(x, grid_size=grid_size)))
            return self.norm2(x + self.drop_path2(self.mlp(x)))
        x = x + self.drop_path1(self.attn(self.norm1(x), grid_size=grid_size))
        return x + self.drop_path2(self.mlp(self.norm2(x)))


class SoftStage(nn.Module):
    """Downsampling (stem for stage 1, C31-BN-ReLU after) and then `depth` SoftBlocks."""

    def __init__(self, downsample: nn.Module, blocks: List[SoftBlock]):
        super().__init__()
        self.downsample = downsample
        self.blocks = nn.ModuleList(blocks)


class SoftNet(StructuredModel):
    """SOFT pyramid classifier with timm's model interface.

    Args: `dims`, `num_heads`, `depths` (Table 1), `sampling_ratios` (sp, Table 1), `attn` (a name in
    the attention registry: 'soft', 'softpp', 'softmax', 'linformer', 'performer', 'nystrom', …),
    `attn_kwargs` (extra kwargs for every attention layer, e.g. sampler='avgpool'; a key the chosen attention
    does not take is a TypeError naming it), `stem_strides`
    ((2, 1, 2) in the paper; small-image variants use (2, 1, 1)), `mlp_ratio` (e), `pos_embed`
    (learned absolute embeddings per stage; off as in the paper), `img_size` (fixes the stage grids,
    needed by Linformer's seq_len).

    Public-code options (github.com/fudan-zvg/SOFT; table in docs/soft.md), each its own argument so
    each can be ablated; None follows `official`: `pos_embed`, `post_norm` (bool or one per stage;
    official: post-LN in the SOFT stages 1–3, pre-LN in the softmax stage 4), `last_stage_attn`
    (official: 'softmax'), `conv_bias` (conv biases before BN), `mlp_act` ('gelu' | 'gelu_tanh', or one
    per stage; official: tanh GELU in the SOFT stages), `value_conv` (per-stage kernel of the V
    depthwise conv, official 9/5/3/3, for attentions that take it), `branch_dropout` (bool or one per stage;
    official: (True, True, True, False): the SOFT stages apply their drop-path rate as element-wise
    `nn.Dropout` on the residual branches, `SoftBlock`). `official=True` also passes
    `official=True` to every attention that accepts it (landmark LayerNorm + GELU, the public inverse
    rule and backward, kaiming sampler init); `attn_kwargs` overrides any of those.
    """
    feature_modules = 'stages'

    def __init__(self, img_size=224, in_chans=3, num_classes=1000, global_pool='token',
                 dims=(64, 128, 320, 512), num_heads=(2, 4, 10, 16), depths=(2, 2, 5, 2),
                 sampling_ratios=(8, 4, 2, 1), attn='soft', attn_kwargs: Optional[Dict] = None,
                 stem_strides=(2, 1, 2), mlp_ratio=4., pos_embed: Optional[bool] = None, drop_rate=0.,
                 attn_drop_rate=0., drop_path_rate=0., official: bool = False,
                 post_norm: Optional[Union[bool, Tuple[bool, ...]]] = None, last_stage_attn: Optional[str] = None,
                 conv_bias: Optional[bool] = None, mlp_act: Optional[Union[str, Tuple[str, ...]]] = None,
                 value_conv: Optional[Union[int, Tuple[int, ...]]] = None,
                 branch_dropout: Optional[Union[bool, Tuple[bool, ...]]] = None):
        super().__init__()
        # each before a layer is built: a 0 or a missing entry failed as a ZeroDivisionError or IndexError in the
        # grid arithmetic, a negative width inside a convolution, a negative depth built an empty stage silently
        dims, num_heads = positive_ints('dims', dims, 4), positive_ints('num_heads', num_heads, 4)
        depths = positive_ints('depths', depths, 4, least=0)
        sampling_ratios = positive_ints('sampling_ratios', sampling_ratios, 4)
        stem_strides = positive_ints('stem_strides', stem_strides, 3)
        image_size('img_size', img_size)
        positive_int('in_chans', in_chans)
        count('num_classes', num_classes)
        positive_number('mlp_ratio', mlp_ratio)
        for name, value in (('drop_rate', drop_rate), ('attn_drop_rate', attn_drop_rate),
                            ('drop_path_rate', drop_path_rate)):
            rate(name, value)
        pos_embed = official if pos_embed is None else pos_embed
        post_norm = _per_stage('post_norm', ((True, True, True, False) if official else False)
                               if post_norm is None else post_norm, (bool,))
        branch_dropout = _per_stage('branch_dropout', ((True, True, True, False) if official else False)
                                    if branch_dropout is None else branch_dropout, (bool,))
        last_stage_attn = last_stage_attn or ('softmax' if official else None)
        conv_bias = official if conv_bias is None else conv_bias
        mlp_act = _per_stage('mlp_act', (('gelu_tanh',) * 3 + ('gelu',) if official else 'gelu')
                             if mlp_act is None else mlp_act, (str,))
        if any(a not in MLP_ACTS for a in mlp_act):
            raise ValueError(f"mlp_act must be one of {sorted(MLP_ACTS)} (or one per stage), got {mlp_act!r}")
        value_conv = _per_stage('value_conv', ((9, 5, 3, 3) if official else None)
                                if value_conv is None else value_conv, (int, type(None)))
        attn_layer = get_attention(attn)                 # ValueError listing the accepted names
        check_options(attn_layer, attn_kwargs or {})     # TypeError naming a typo (it would be silently dropped)
        user = attn_kwargs or {}
        if 'num_landmarks' in user and 'sampling_ratio' in accepted_options(attn_layer) and \
                user.get('sampler', 'conv') != 'random':
            # each stage passes SOFT its sampling ratio k, which decides m over num_landmarks: it was silently unused
            raise ValueError(f"attn_kwargs num_landmarks={attn_kwargs['num_landmarks']}: the {attn_layer.__name__} "
                             "stages take their landmarks from sampling_ratios (m = ⌈H/k⌉·⌈W/k⌉ per stage); "
                             "pass "
                             "sampling_ratios=(k1, k2, k3, k4) instead (num_landmarks applies to sampler='random')")
        stage_layers = [attn_layer] * 3 + [get_attention(last_stage_attn) if last_stage_attn else attn_layer]
        self.attn_name = attn if isinstance(attn, str) else attn.__name__
        self.num_classes = num_classes
        self.global_pool = check_global_pool(global_pool)
        self.num_features = self.head_hidden_size = self.embed_dim = dims[-1]
        self.num_prefix_tokens = 1
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
        self.img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        # another image size changes the stage grids: position embeddings and attentions shaped for a token count
        # (Linformer's E, F) then no longer fit, and the input check names img_size instead of a shape mismatch
        fixed_size = bool(pos_embed)

        stem_width = max(dims[0] // 2, 8)
        stem = nn.Sequential(conv_bn_relu(in_chans, stem_width, stem_strides[0], conv_bias),
                             conv_bn_relu(stem_width, stem_width, stem_strides[1], conv_bias),
                             conv_bn_relu(stem_width, dims[0], stem_strides[2], conv_bias))
        total = sum(depths)                              # stochastic depth grows linearly with block index
        dpr = [drop_path_rate * j / max(total - 1, 1) for j in range(total)]
        self.stages = nn.ModuleList()
        self.pos_embeds = nn.ParameterList() if pos_embed else None
        for i, (dim, heads, depth, k, (h, w)) in enumerate(zip(dims, num_heads, depths, sampling_ratios, grids)):
            prefix = 1 if i == 3 else 0
            m = math.ceil(h / k) * math.ceil(w / k)       # 49 at 224 px for every stage
            # what the stage fixes, for any attention: each class takes only the options it accepts
            facts = dict(num_landmarks=m, sampling_ratio=k, seq_len=h * w + prefix, num_prefix_tokens=prefix,
                         grid_size=(h, w))
            if official:
                facts['official'] = True
            if value_conv[i] is not None:
                facts['value_conv'] = value_conv[i]
            layer = stage_layers[i]
            kwargs = select_options(layer, facts)
            fixed_size = fixed_size or 'seq_len' in kwargs
            if layer is attn_layer:                      # the user's options belong to `attn`
                kwargs.update(attn_kwargs or {})
            down = stem if i == 0 else conv_bn_relu(dims[i - 1], dim, 2, conv_bias)
            blocks = [SoftBlock(dim, heads, layer, kwargs, mlp_ratio, drop_rate, attn_drop_rate,
                                dpr[sum(depths[:i]) + j], post_norm[i], mlp_act[i],
                                # the public code's stage 4 and final norm: LayerNorm(eps=1e-6), as timm's PVT blocks
                                norm_eps=1e-6 if official and i == 3 else 1e-5,
                                branch_dropout=branch_dropout[i]) for j in range(depth)]
            for block in blocks:                         # an option the stage's N cannot take: refused here, by name
                if isinstance(block.attn, AttentionBase):
                    try:
                        block.attn.check_num_tokens(h * w + prefix)
                    except ValueError as e:
                        raise ValueError(f"stage {i} ({h}×{w} grid + {prefix} prefix token(s)), "
                                         f"{type(block.attn).__name__}: {e}") from None
            self.stages.append(SoftStage(down, blocks))
            if pos_embed:
                self.pos_embeds.append(nn.Parameter(torch.zeros(1, h * w + prefix, dim)))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dims[-1]))
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6 if official else 1e-5)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(dims[-1], num_classes) if num_classes > 0 else nn.Identity()
        self.no_weight_decay_names = frozenset({'cls_token'} | {f'pos_embeds.{i}' for i in range(4) if pos_embed})
        self.fixed_size = fixed_size
        self.declare_fixed_input_size(fixed_size)
        # `module`: a module that runs (timm's hook extractor hooks it; 'stages.i' is never called: hooks got nothing)
        self.feature_info = [dict(num_chs=d, reduction=2 ** (sum(s > 1 for s in stem_strides) + i),
                                  module=f'stages.{i}.blocks.{len(stage.blocks) - 1}' if len(stage.blocks) else
                                  f'stages.{i}.downsample') for i, (d, stage) in enumerate(zip(dims, self.stages))]
        self._init_weights()

    def _init_weights(self) -> None:
        if self.cls_token.is_meta:    # built on the meta device: no values to draw (timm's clamp_ there: 3 ms a call)
            return
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

    def _run_stage(self, i: int, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stage i on a [B, C, H, W] map: downsample, tokens (+ cls in stage 4, + positions), blocks.
        Returns (the stage's grid tokens as a map [B, C_i, H_i, W_i], all its tokens [B, N_i, C_i])."""
        stage = self.stages[i]
        x = stage.downsample(x)
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)
        prefix = 1 if i == 3 else 0                        # stage 4 carries the cls token (Table 1)
        if prefix:
            tokens = torch.cat([self.cls_token.expand(b, -1, -1), tokens], dim=1)
        if self.pos_embeds is not None:
            tokens = tokens + self.pos_embeds[i]
        for block in stage.blocks:
            tokens = self.run_block(block, tokens, (h, w))
        return tokens[:, prefix:].transpose(1, 2).reshape(b, c, h, w), tokens

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        return checked_images(x, 'SoftNet', self.in_chans, self.img_size if self.fixed_size else None)  # an FX leaf

    def forward_intermediates(self, x: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = 'NCHW',
                              intermediates_only: bool = False):
        """timm's feature interface (as its hierarchical models): the outputs of the stages in `indices`
        (None: all four; int n: the last n; list: those, negative from the end) as maps [B, C_i, H_i, W_i]
        ('NCHW') or tokens [B, H_i·W_i, C_i] ('NLC'); stage 4's cls token is left out. `norm` applies the
        final LayerNorm to stage 4's output, the only one of its width. Returns (forward_features(x),
        intermediates), or only the intermediates."""
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt={output_fmt!r}: accepted 'NCHW' or 'NLC'")
        x = self._check_input(x)
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        last = len(self.stages) - 1
        intermediates, tokens = [], None
        for i in range(max_index + 1 if stop_early else len(self.stages)):
            x, tokens = self._run_stage(i, x)
            if i in take_indices:
                if norm and i == last:
                    b, c, h, w = x.shape
                    # only stage 4 carries the cls token; a pruned model's last stage has none
                    x_out = self.norm(tokens)[:, tokens.shape[1] - h * w:].transpose(1, 2).reshape(b, c, h, w)
                else:
                    x_out = x
                intermediates.append(x_out.flatten(2).transpose(1, 2) if output_fmt == 'NLC' else x_out)
        if intermediates_only:
            return intermediates
        return (self.norm(tokens) if len(self.stages) == 4 and i == last else tokens), intermediates

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Final tokens [B, 1 + H₄W₄, C₄] after the LayerNorm."""
        x = self._check_input(x)
        for i in range(len(self.stages)):
            x, tokens = self._run_stage(i, x)
        return self.norm(tokens)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.pool(x))
        return x if pre_logits else self.head(x)
