"""A GPT-2-style causal language model (Radford et al., 2019), the seed's LM (seed 004, §4, Table 4).

Pre-LN blocks: x + proj(causal_attention(qkv(LN(x)))), then x + fc2(GELU(fc1(LN(x)))); learned
positions; a final LayerNorm and an untied linear head over the vocabulary. The layer names are timm's
ViT names (`blocks.N.attn.qkv`, `attn.proj`, `mlp.fc1`, `mlp.fc2`), so `factorize`'s 'transformer'
preset takes QKV and both FFN matrices and leaves the attention output, as the seed does for GPT-2.

Input: token ids [B, T] (int64), T <= `img_size` (the context length: the name timm's factory and our
data facts use); output: logits [B, T, num_classes] (num_classes = vocabulary size, 256 for bytes).

Registered in timm's registry (`timm.create_model('gpt2_byte_tiny')`, `structformer train --model ...`)
as a language model: `structformer models` lists it apart from the image classifiers, whose contract
(images in, one label out) an LM does not meet: `gpt2_byte_tiny` (d 128, 4 layers, context 128, 0.88M parameters) and `gpt2_byte_small`
(d 384, 6 layers, context 256).
"""
from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from timm.layers import Mlp, trunc_normal_
from timm.models import generate_default_cfgs
from torch import nn

from ..functional.tracing import checked_token_ids
from ._registry import register_language_model
from ..arguments import nonnegative_number, positive_int, rate
from .base import TOKEN_IDS_NOTE, StructuredModel, create_model, model_cfg

__all__ = ['GPT', 'CausalSelfAttention', 'GPTBlock']

torch.fx.wrap('checked_token_ids')               # the input check is one node of an FX trace (functional/tracing.py)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask: PyTorch's SDPA (is_causal=True), or with
    `fused = False` the explicit softmax(QKᵀ/√d + causal mask)·V it computes (the reference the tests
    compare against, and the path FLOP counting takes, with the same products as the fused kernel)."""

    def __init__(self, dim: int, num_heads: int, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim={dim} must be divisible by num_heads={num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.fused = True
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop, self.proj_drop = attn_drop, nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        dropout = self.attn_drop if self.training else 0.0
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            scores = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            weights = F.dropout(scores.masked_fill(future, float('-inf')).softmax(-1), dropout)
            out = weights @ v
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, t, c)))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, drop: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, num_heads, proj_drop=drop)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(StructuredModel):
    """GPT-2-style decoder (see the module docstring). `num_classes` is the vocabulary, `img_size` the
    context length, `in_chans` must be 1 (kept for the factory's data facts)."""
    num_prefix_tokens = 0
    global_pool = ''                 # logits at every position: nothing is pooled

    def __init__(self, num_classes: int = 256, img_size: int = 128, in_chans: int = 1, embed_dim: int = 128,
                 depth: int = 4, num_heads: int = 4, mlp_ratio: float = 4.0, drop_rate: float = 0.0,
                 global_pool: str = ''):
        super().__init__()
        if global_pool != '':         # timm's save_for_hf writes the model's global_pool ('') into config.json
            raise ValueError(f"global_pool={global_pool!r}: a language model predicts at every position and pools "
                             "nothing; accepted '' (or leave it out)")
        if in_chans != 1:
            raise ValueError(f"in_chans={in_chans}: a language model takes token ids, in_chans must be 1")
        if num_classes < 1:
            raise ValueError(f"num_classes={num_classes}: the vocabulary size must be >= 1")
        positive_int('img_size', img_size)              # the context length: -1 failed inside torch.zeros
        for name, value in (('embed_dim', embed_dim), ('depth', depth), ('num_heads', num_heads)):
            positive_int(name, value)
        nonnegative_number('mlp_ratio', mlp_ratio)
        rate('drop_rate', drop_rate)
        self.num_classes = self.vocab_size = num_classes
        self.context = img_size
        self.tok_embed = nn.Embedding(num_classes, embed_dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, img_size, embed_dim))
        self.drop = nn.Dropout(drop_rate)
        self.blocks = nn.ModuleList([GPTBlock(embed_dim, num_heads, mlp_ratio, drop_rate) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.num_features = self.head_hidden_size = embed_dim
        self.head = nn.Linear(embed_dim, num_classes)
        self.no_weight_decay_names = frozenset({'pos_embed', 'tok_embed.weight'})
        self.feature_info = [dict(num_chs=embed_dim, reduction=1, module=f'blocks.{i}') for i in range(depth)]
        if not self.pos_embed.is_meta:    # on the meta device there are no values to draw (timm's clamp_: 3 ms a call)
            self._init_weights(depth)

    def _init_weights(self, depth: int) -> None:
        trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                trunc_normal_(m.weight, std=0.02)
        for block in self.blocks:                    # GPT-2: residual projections scaled by 1/sqrt(2 depth)
            trunc_normal_(block.attn.proj.weight, std=0.02 / (2 * depth) ** 0.5)
            trunc_normal_(block.mlp.fc2.weight, std=0.02 / (2 * depth) ** 0.5)

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool not in (None, ''):        # it was dropped without a word: the logits stayed per token
            raise ValueError(f"global_pool={global_pool!r}: a language model predicts at every position and pools "
                             "nothing; accepted '' (or leave it out)")
        self.num_classes = num_classes
        self.head = nn.Linear(self.head_hidden_size, num_classes) if num_classes > 0 else nn.Identity()

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = checked_token_ids(tokens, 'GPT', self.context)     # an FX leaf: the checks' `if`s stopped FX traces
        return self.drop(self.tok_embed(tokens) + self.pos_embed[:, :tokens.shape[1]])

    def forward_features(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> final hidden states [B, T, D]."""
        x = self._embed(tokens)
        for block in self.blocks:
            x = self.run_block(block, x)
        return self.norm(x)

    def forward_intermediates(self, tokens: torch.Tensor, indices: Optional[Union[int, List[int]]] = None,
                              norm: bool = False, stop_early: bool = False, output_fmt: str = 'NLC',
                              intermediates_only: bool = False):
        """timm's feature interface for a sequence model: the hidden states [B, T, D] after the blocks in
        `indices` (None: all; int n: the last n; list: those, negative from the end); `norm` applies the
        final LayerNorm to each. Only the 'NLC' layout exists (there is no grid). Returns
        (forward_features(tokens), intermediates), or only the intermediates."""
        if output_fmt != 'NLC':
            raise ValueError(f"output_fmt={output_fmt!r}: a language model's hidden states are [B, T, D]; "
                             "accepted 'NLC'")
        x, intermediates = self.run_blocks_keeping(self._embed(tokens), indices, norm, stop_early)
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates           # as forward_features (timm: normed even when stopped early)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Per-token logits [B, T, vocabulary] (pre_logits: the hidden states)."""
        return x if pre_logits else self.head(x)


def _cfg(**kwargs):
    # timm's config has no field for the input's kind: `notes` says it (`base.takes_token_ids` reads it), so that
    # generic image tooling (transforms, validate-style loops, image benchmarks) can skip these models
    return model_cfg(**dict(dict(num_classes=256, input_size=(1, 1, 128), mean=(0.,), std=(1.,), crop_pct=1.0,
                                 first_conv=None, classifier='head', notes=(TOKEN_IDS_NOTE,)), **kwargs))


default_cfgs = generate_default_cfgs({
    'gpt2_byte_tiny.untrained': _cfg(),
    'gpt2_byte_small.untrained': _cfg(input_size=(1, 1, 256)),
})


def _create(variant: str, pretrained: bool = False, **kwargs) -> GPT:
    # features_only: hidden states [B, T, D] (timm's getter asked for NCHW, which a sequence has not)
    model = create_model(GPT, variant, pretrained, feature_output_fmt='NLC', **kwargs)
    if isinstance(model, GPT):
        # timm records img_size as a spatial trait (T, T), which save_for_hf wrote into config.json's model_args
        # (img_size=[T, T]) for `local-dir:` to build from; a sequence has no grid: its context stays the int
        # model argument. The config's input size is (1, 1, context) for the context built, not the registry's
        model._traits = dict(getattr(model, '_traits', None) or {}, img_size=None)
        model.pretrained_cfg = dict(model.pretrained_cfg, input_size=(1, 1, model.context))
    return model


@register_language_model
def gpt2_byte_tiny(pretrained: bool = False, **kwargs) -> GPT:
    """d 128, 4 layers, 4 heads, context 128, byte vocabulary."""
    return _create('gpt2_byte_tiny', pretrained, **dict(dict(embed_dim=128, depth=4, num_heads=4, img_size=128),
                                                        **kwargs))


@register_language_model
def gpt2_byte_small(pretrained: bool = False, **kwargs) -> GPT:
    """d 384, 6 layers, 6 heads, context 256, byte vocabulary."""
    return _create('gpt2_byte_small', pretrained, **dict(dict(embed_dim=384, depth=6, num_heads=6, img_size=256),
                                                         **kwargs))
