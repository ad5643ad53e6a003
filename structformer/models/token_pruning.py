"""EViT token pruning (Liang et al., "Not All Patches are What You Need", ICLR 2022) as a model transform,
to combine with Sparsifiner attention as in Sparsifiner's comparison with token pruning (§4, Table 1).

`prune_tokens(model, keep_rate=0.7, layers=(3, 6, 9), fuse=True)` rewrites a timm VisionTransformer-style
model (blocks are timm `Block`s with timm `Attention` or `SparsifinerAttention`) in place. In each chosen
block, after the attention, the cls token's attention row a = mean over heads of softmax(q_cls Kᵀ · scale)
(EViT Eq. 1) ranks the N patch tokens; the ⌈keep_rate · N⌉ most attended are kept, the rest are fused into
one token Σ a_i x_i / Σ a_i over the dropped i (fuse=False: dropped), and the block's MLP runs on the
reduced set. Prefix tokens (cls, registers) are always kept; a fused token of an earlier layer is a patch
token like the others (it may be kept, or fused again), as in EViT. Where we depart from EViT's code: the
fused token is the *normalised* weighted mean (the code sums a_i x_i, so its size follows the dropped
attention mass); kept tokens stay in their original order (the code orders them by attention; attention
and MLP are permutation-equivariant, so only ties and Sparsifiner's 'block' tiles see a difference); a is
taken before attention dropout; a SparsifinerAttention must keep its cls row dense (dense_cls_row=True) so
that a is the full row; keep_rate is fixed from the first step (EViT's published run shrinks it from 1 by a cosine
over epochs 10–110 of 300, `adjust_keep_rate`; Sparsifiner's public code, which fine-tunes, has no schedule).

Sub-modules and state_dict keys are unchanged (the blocks from the first chosen one on become
`TokenPruningBlock`s holding the same children). keep_rate=1 computes what the model computed before.

Token bookkeeping, per forward, in `model.token_pruning` (a `TokenPruningState`):
  `positions`  [B, n_final] long: the original index (prefix tokens included) of each token leaving the
               last block, -1 for a fused token, so a token-distillation loss can gather the teacher's
               tokens at `positions.clamp(min=0)` where `positions >= 0`;
  `sources`    [B, n_final, n] or None (nothing dropped): row i = the convex weights of the original tokens
               token i stands for. Blocks pass theirs to a SparsifinerAttention (`token_sources=`), which
               takes its W_down, W_up columns from it (a fused token: the same mix of its tokens' columns).
`tokens_per_block(model)` gives the token counts without a forward (for MHSA FLOPs).

`forward_intermediates` (timm's feature interface): in 'NLC' every block's tokens come back as they are; in the
default 'NCHW' only those of blocks before the first that drops tokens, and asking for a later one is a ValueError
naming it (timm's reshape to the H×W grid does not check the count: 8 kept + 1 fused tokens of width 192 on a 4×4
grid came back as a [B, 108, 4, 4] map). timm's `prune_intermediate_layers` keeps the bookkeeping's depth
with the blocks it keeps.
"""
import functools
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from timm.layers import Attention as TimmAttention
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import Block
from torch import nn

from ..functional.sparsifiner import budget
from ..layers.attention.sparsifiner import SparsifinerAttention
from .attention_swap import attention_misfit, token_count
from .transforms import TransformContext, register_transform

__all__ = ['prune_tokens', 'TokenPruningBlock', 'TokenPruningState', 'prune_by_cls_attention', 'tokens_per_block']


class TokenPruningState:
    """What each block's tokens are, per block index, for the last forward (see the module docstring).
    Entries are keyed by the index of the block they enter, so recomputing one block (gradient
    checkpointing) reads the same entry it read in the forward."""

    def __init__(self, depth: int):
        self.depth = depth
        self.entering: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}

    @property
    def positions(self) -> Optional[torch.Tensor]:
        return self.entering.get(self.depth, (None, None))[0]

    @property
    def sources(self) -> Optional[torch.Tensor]:
        return self.entering.get(self.depth, (None, None))[1]

    def pruned_positions(self, block: Optional[int] = None) -> Optional[torch.Tensor]:
        """`positions` of the tokens entering block `block` (None: leaving the last block) where an earlier block
        dropped or fused tokens, else None. Whether tokens were pruned is not their count: with a fused token the
        count can stay the same (4 patches at keep 0.7: 3 kept + 1 fused; 196 at keep 0.99: 195 + 1)."""
        positions, sources = self.entering.get(self.depth if block is None else block, (None, None))
        return None if sources is None else positions


def prune_by_cls_attention(x: torch.Tensor, cls_attn: torch.Tensor, keep_rate: float, num_prefix: int,
                           fuse: bool = True) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One EViT step on x [B, n, C] with the cls attention row `cls_attn` [B, n] (over all n tokens).
    Returns (new x, kept [B, k] indices into x's patch tokens in ascending order, fusion weights [B, n_patch]:
    a_i / Σ a_j over the dropped tokens, zero at kept ones). Nothing is dropped when k = n_patch."""
    patches, scores = x[:, num_prefix:], cls_attn[:, num_prefix:]
    n, k = patches.shape[1], budget(patches.shape[1], keep_rate)
    kept = scores.topk(k, dim=-1).indices.sort(dim=-1).values
    dropped = torch.ones_like(scores, dtype=torch.bool).scatter(-1, kept, False)
    weights = scores * dropped
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
    if k == n:
        return x, kept, weights
    parts = [x[:, :num_prefix], patches.gather(1, kept.unsqueeze(-1).expand(-1, -1, x.shape[-1]))]
    if fuse:
        parts.append(torch.einsum('bn,bnc->bc', weights, patches).unsqueeze(1))
    return torch.cat(parts, dim=1), kept, weights


def _check_attention(attn: nn.Module, where: str) -> None:
    if not isinstance(attn, (TimmAttention, SparsifinerAttention)):
        raise ValueError(f"prune_tokens: {where}.attn is {type(attn).__name__}; a pruning block needs timm "
                         "Attention or SparsifinerAttention (for the cls attention row)")
    if isinstance(attn, SparsifinerAttention) and not attn.dense_cls_row:
        raise ValueError(f"prune_tokens: {where}.attn has dense_cls_row=False; EViT needs the cls token's full "
                         "attention row (dense_cls_row=True)")


class TokenPruningBlock(nn.Module):
    """A timm `Block` (same children) that follows the token bookkeeping and, when `keep_rate` is set,
    prunes after its attention (module docstring). `index`: the block's position in `model.blocks`."""

    def __init__(self, block: Block, state: TokenPruningState, index: int, keep_rate: Optional[float],
                 num_prefix: int, fuse: bool, starts: bool):
        super().__init__()
        for name, child in block.named_children():
            self.add_module(name, child)
        self.state, self.index, self.keep_rate = state, index, keep_rate
        self.num_prefix, self.fuse, self.starts = num_prefix, fuse, starts

    def _attend(self, x: torch.Tensor, sources: Optional[torch.Tensor], want_cls_row: bool):
        kwargs = {'token_sources': sources} if sources is not None and getattr(self.attn, 'takes_token_sources', False) else {}
        if not want_cls_row:
            return self.attn(x, **kwargs), None
        _check_attention(self.attn, f"blocks[{self.index}]")
        seen = {}
        hooks = [getattr(self.attn, f'{part}_norm').register_forward_hook(
            lambda module, args, out, part=part: seen.setdefault(part, out)) for part in 'qk']
        try:
            out = self.attn(x, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        q, k = seen['q'], seen['k']
        scale = getattr(self.attn, 'scale', q.shape[-1] ** -0.5)
        cls_attn = torch.softmax((q[..., :1, :] @ k.transpose(-2, -1)) * scale, dim=-1).mean(1)[:, 0]
        return out, cls_attn

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False) -> torch.Tensor:
        if attn_mask is not None or is_causal:
            raise ValueError("prune_tokens: attention masks are not supported in a token-pruning model")
        if self.starts:
            positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
            entry = (positions, None)
        else:
            entry = self.state.entering[self.index]
        positions, sources = entry
        prune = self.keep_rate is not None and budget(x.shape[1] - self.num_prefix, self.keep_rate) < x.shape[1] - self.num_prefix
        out, cls_attn = self._attend(self.norm1(x), sources, prune)
        x = x + self.drop_path1(self.ls1(out))
        if prune:
            x, kept, weights = prune_by_cls_attention(x, cls_attn, self.keep_rate, self.num_prefix, self.fuse)
            entry = self._follow(positions, sources, kept, weights.detach(), x.shape[1])
        self.state.entering[self.index + 1] = entry
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))

    def _follow(self, positions, sources, kept, weights, num_tokens):
        """The bookkeeping entry of the pruned sequence (module docstring)."""
        p = self.num_prefix
        if sources is None:                                  # identity so far
            sources = torch.eye(positions.shape[1], dtype=weights.dtype, device=weights.device).expand(
                positions.shape[0], -1, -1)
        pos = [positions[:, :p], positions[:, p:].gather(1, kept)]
        src = [sources[:, :p], sources[:, p:].gather(1, kept.unsqueeze(-1).expand(-1, -1, sources.shape[-1]))]
        if num_tokens > p + kept.shape[1]:                   # a fused token
            pos.append(torch.full_like(positions[:, :1], -1))
            src.append(torch.einsum('bn,bnm->bm', weights.to(sources.dtype), sources[:, p:]).unsqueeze(1))
        return torch.cat(pos, dim=1), torch.cat(src, dim=1)

    def extra_repr(self) -> str:
        return f"index={self.index}, keep_rate={self.keep_rate}, fuse={self.fuse}"


def _check_args(keep_rate, layers, fuse, depth: int) -> Tuple[float, List[int]]:
    if not isinstance(fuse, bool):
        raise ValueError(f"prune_tokens: fuse must be True or False, got {fuse!r}")
    if isinstance(keep_rate, bool) or not isinstance(keep_rate, (int, float)) or not 0 < keep_rate <= 1:
        raise ValueError(f"prune_tokens: keep_rate must be in (0, 1], got {keep_rate!r}")
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < depth for i in layers):
        raise ValueError(f"prune_tokens: layers must be block indices in [0, {depth - 1}] (the model has {depth} "
                         f"blocks), got {layers!r}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"prune_tokens: layers has repeated indices: {layers!r}")
    return float(keep_rate), sorted(layers)


def _tokens_after(num_tokens: int, keep_rate: float, num_prefix: int, fuse: bool) -> int:
    """Tokens (prefix included) leaving a pruning block that `num_tokens` enter: the prefix, the kept patches and,
    with `fuse` and something pruned, the fused token."""
    patches = num_tokens - num_prefix
    kept = budget(patches, keep_rate)
    return num_prefix + kept + (1 if fuse and kept < patches else 0)


def _check_pruned_counts(blocks: nn.Sequential, num_tokens: Optional[int], keep_rate: float, layers: List[int],
                         num_prefix: int, fuse: bool) -> None:
    """Refuse, before the model changes, an attention after a pruning block that cannot take the fewer tokens it
    would get (Linformer's E, F built for the full seq_len; Nyström landmarks above the count): before, the first
    forward failed inside the layer. Skipped where the model's token count is dynamic."""
    if num_tokens is None:
        return
    n = num_tokens
    for i, block in enumerate(blocks):
        if n != num_tokens:
            misfit = attention_misfit(block, n)
            if misfit:
                layer, why = misfit
                raise ValueError(f"prune_tokens: blocks[{i}].{layer} gets {n} tokens after pruning at blocks "
                                 f"{[j for j in layers if j < i]} (of {num_tokens}): {why}; prune only after its "
                                 "last such block, or use an attention that takes any token count")
        if i in layers:
            n = _tokens_after(n, keep_rate, num_prefix, fuse)


def prune_tokens(model: nn.Module, keep_rate: float = 0.7, layers: Sequence[int] = (3, 6, 9),
                 fuse: bool = True) -> nn.Module:
    """EViT pruning at the blocks `layers` (indices into model.blocks) with `keep_rate` of the patch tokens
    kept there and the rest fused (`fuse`) or dropped; see the module docstring. Changes the model in place
    and returns it; layers=() leaves it untouched."""
    blocks = getattr(model, 'blocks', None)
    if not isinstance(blocks, nn.Sequential):
        raise ValueError(f"prune_tokens: {type(model).__name__} has no `blocks` sequence (a timm VisionTransformer-style model)")
    keep_rate, layers = _check_args(keep_rate, layers, fuse, len(blocks))
    if isinstance(getattr(model, 'token_pruning', None), TokenPruningState):
        raise ValueError("prune_tokens: the model is already token-pruned")
    if not layers:
        return model
    num_prefix = getattr(model, 'num_prefix_tokens', 0)
    if getattr(model, 'cls_token', None) is None or num_prefix < 1:
        raise ValueError("prune_tokens: EViT ranks tokens by the cls token's attention; the model has no cls token")
    for i in range(layers[0], len(blocks)):
        if type(blocks[i]) is not Block:
            raise ValueError(f"prune_tokens: blocks[{i}] is {type(blocks[i]).__name__}; accepted: timm Block")
    for i in layers:
        _check_attention(blocks[i].attn, f"blocks[{i}]")
    _check_pruned_counts(blocks, token_count(model), keep_rate, layers, num_prefix, fuse)
    state = TokenPruningState(len(blocks))
    for i in range(layers[0], len(blocks)):
        blocks[i] = TokenPruningBlock(blocks[i], state, i, keep_rate if i in layers else None, num_prefix,
                                      fuse, starts=i == layers[0])
    model.token_pruning = state
    if hasattr(type(model), 'forward_intermediates'):
        # an attribute of this model, not of its class (timm's or ours, shared with unpruned models); a partial
        # of a module-level function, so that deepcopy (EMA) and pickle carry it, bound to the copy
        model.forward_intermediates = functools.partial(_grid_checked_intermediates, model)
    if hasattr(type(model), 'prune_intermediate_layers'):
        model.prune_intermediate_layers = functools.partial(_depth_following_prune, model)
    return model


def _depth_following_prune(model: nn.Module, *args, **kwargs):
    """The model class's `prune_intermediate_layers` (timm's: `blocks` cut after the last index taken, as timm's
    'getter' feature wrapper does), with the bookkeeping's depth following the cut: `positions` / `sources` read the
    entry of the old last block, which the shorter model no longer writes (a stale one from an earlier forward)."""
    taken = type(model).prune_intermediate_layers(model, *args, **kwargs)
    model.token_pruning.depth = len(model.blocks)
    model.token_pruning.entering.clear()             # entries of blocks that are gone would read as current
    return taken


def _grid_checked_intermediates(model: nn.Module, x: torch.Tensor, indices=None, *args, output_fmt: str = 'NCHW',
                                **kwargs):
    """The model class's `forward_intermediates`, refusing 'NCHW' for the output of a block whose tokens no longer
    fill the patch grid (module docstring), before anything runs."""
    if output_fmt == 'NCHW' and hasattr(getattr(model, 'patch_embed', None), 'dynamic_feat_size'):
        h, w = model.patch_embed.dynamic_feat_size(tuple(x.shape[-2:]))
        counts = tokens_per_block(model, h * w + model.num_prefix_tokens)
        take, _ = feature_take_indices(len(model.blocks), indices)
        pruned = [i for i in take if counts[i + 1] != counts[0]]
        if pruned:
            raise ValueError(f"forward_intermediates: output_fmt='NCHW' needs the {h}x{w} patch grid, but after "
                             f"token pruning block(s) {pruned} leave {[counts[i + 1] for i in pruned]} tokens "
                             f"(prefix included), not {counts[0]}; ask for output_fmt='NLC', or for blocks before the "
                             "first pruning one")
    return type(model).forward_intermediates(model, x, indices, *args, output_fmt=output_fmt, **kwargs)


@register_transform('prune_tokens')
def prune_tokens_transform(model: nn.Module, context: TransformContext, keep_rate: float = 0.7,
                           layers: Sequence[int] = (3, 6, 9), fuse: bool = True) -> nn.Module:
    """Model transform: `prune_tokens(model, keep_rate, layers, fuse)` (recorded in checkpoints)."""
    return prune_tokens(model, keep_rate=keep_rate, layers=layers, fuse=fuse)


def tokens_per_block(model: nn.Module, num_tokens: Optional[int] = None) -> List[int]:
    """Token counts, prefix tokens included: entry i enters block i (its attention runs on it), entry i + 1
    leaves it (its MLP runs on it); depth + 1 entries. `num_tokens`: the count entering block 0 (default:
    the model's fixed patches + prefix tokens). A model without pruning gives the same count throughout."""
    blocks = model.blocks
    if num_tokens is None:
        num_tokens = token_count(model)
        if num_tokens is None:
            raise ValueError("tokens_per_block: the model's token count is dynamic; pass num_tokens=")
    counts = [num_tokens]
    for block in blocks:
        n = counts[-1]
        if isinstance(block, TokenPruningBlock) and block.keep_rate is not None:
            n = _tokens_after(n, block.keep_rate, block.num_prefix, block.fuse)
        counts.append(n)
    return counts

