"""`structformer convert --from SOURCE FILE --model NAME --output OUT`: checkpoints of the papers' public code (and
timm's ViT / DeiT weights) into our models, written as a folder that `eval --checkpoint`, `train --pretrained-path`,
`--initial-checkpoint` and `timm.create_model('local-dir:OUT', pretrained=True)` load (docs/weights.md).

Each source is a table of key rules (regex -> our key, and how the tensor changes), written from the public code's
module structure (Ma-Lab-Berkeley/CRATE `model/crate.py`, fudan-zvg/SOFT `models/softmax_free_*.py`,
lim142857/Sparsifiner `src/models/sparsifiner.py`); no code of theirs is imported. A key no rule takes, or one of
ours no key fills, is named (the first few and the count) and refused; the only exception is said in the report:
Sparsifiner's predictor when a timm ViT / DeiT (`--from timm`) has none (freshly initialised). A Sparsifiner
checkpoint whose predictor lacks a weight is refused by name, and so is a `--from sparsifiner-official` file
with no predictor at all (a plain DeiT: `--from timm`).

`settings(source, state)` lists the constructor arguments a conversion fixes, each with its reason: those the
checkpoint's shapes fix (classes, the predictor's n_down and channels) and, for the public Sparsifiner, the three
choices of its code that are options of ours (`PUBLIC_SETTINGS`), so the converted model keeps the keys the public
code keeps.
"""
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import UsageError
from . import SOURCES

__all__ = ['SOURCES', 'PUBLIC_SETTINGS', 'convert_state_dict', 'infer_model_kwargs', 'settings']

Tensor = torch.Tensor
Rule = Tuple[str, str, Optional[Callable[[Tensor], Tensor]]]


def _names(keys, show: int = 3) -> str:
    keys = sorted(keys)
    return ', '.join(keys[:show]) + (f', ... ({len(keys)} in all)' if len(keys) > show else f' ({len(keys)})')


# ------------------------------------------------------------------ CRATE (Ma-Lab-Berkeley/CRATE, model/crate.py)
# to_patch_embedding = Sequential(Rearrange('b c (h p1) (w p2) -> b (h w) (p1 p2 c)'), LayerNorm, Linear, LayerNorm):
# our CratePatchEmbed flattens patches in the same (p1 p2 c) order, so its Linear takes the weight as is.
# transformer.layers.i = [PreNorm(Attention: qkv (no bias), to_out.0), PreNorm(FeedForward: weight = D)];
# mlp_head = Sequential(LayerNorm, Linear).
CRATE_RULES: List[Rule] = [
    (r'to_patch_embedding\.1\.(weight|bias)', r'patch_embed.norm_in.\1', None),
    (r'to_patch_embedding\.2\.(weight|bias)', r'patch_embed.proj.\1', None),
    (r'to_patch_embedding\.3\.(weight|bias)', r'patch_embed.norm_out.\1', None),
    (r'pos_embedding', r'pos_embed', None),
    (r'cls_token', r'cls_token', None),
    (r'transformer\.layers\.(\d+)\.0\.norm\.(weight|bias)', r'blocks.\1.norm1.\2', None),
    (r'transformer\.layers\.(\d+)\.0\.fn\.qkv\.weight', r'blocks.\1.attn.qkv.weight', None),
    (r'transformer\.layers\.(\d+)\.0\.fn\.to_out\.0\.(weight|bias)', r'blocks.\1.attn.proj.\2', None),
    (r'transformer\.layers\.(\d+)\.1\.norm\.(weight|bias)', r'blocks.\1.norm2.\2', None),
    # FeedForward: x + η(x W − x Wᵀ W) − ηλ, i.e. Eq. 17 with D = W (F.linear's row convention): our ISTA's weight
    (r'transformer\.layers\.(\d+)\.1\.fn\.weight', r'blocks.\1.mlp.weight', None),
    (r'mlp_head\.0\.(weight|bias)', r'norm.\1', None),
    (r'mlp_head\.1\.(weight|bias)', r'head.\1', None),
]

# ------------------------------------------------------------------ SOFT (fudan-zvg/SOFT, models/softmax_free_*.py)
_BN = r'(weight|bias|running_mean|running_var|num_batches_tracked)'
_STEM = {'0': '0.0', '1': '0.1', '3': '1.0', '4': '1.1', '6': '2.0', '7': '2.1'}   # Conv, BN, ReLU ×3 -> 3 × (Conv, BN)
SOFT_RULES: List[Rule] = [
    (r'patch_embed1\.proj\.([013467])\.' + _BN, lambda m: f'stages.0.downsample.{_STEM[m[1]]}.{m[2]}', None),
    (r'patch_embed([234])\.proj\.([01])\.' + _BN, lambda m: f'stages.{int(m[1]) - 1}.downsample.{m[2]}.{m[3]}', None),
    (r'pos_embed([1-4])', lambda m: f'pos_embeds.{int(m[1]) - 1}', None),
    (r'cls_token', r'cls_token', None),
    # stages 1-3: SoftmaxFreeTransformerBlock.att = post-LN layer (mha, norm1, ff1, ff2, norm2)
    (r'block([123])\.(\d+)\.att\.mha\.ff\.(weight|bias)', lambda m: f'stages.{int(m[1]) - 1}.blocks.{m[2]}.attn.proj.{m[3]}', None),
    # the landmark conv: nn.Conv2d [C_out, C_in, k, k] -> ours channels-last [C_out, k, k, C_in] (ConvLandmarkSampler)
    (r'block([123])\.(\d+)\.att\.mha\.attn\.Qlandmark_op\.weight', lambda m: f'stages.{int(m[1]) - 1}.blocks.{m[2]}.attn.conv.weight',
     lambda w: w.permute(0, 2, 3, 1).contiguous()),
    (r'block([123])\.(\d+)\.att\.mha\.attn\.Qnorm_act\.0\.(weight|bias)',
     lambda m: f'stages.{int(m[1]) - 1}.blocks.{m[2]}.attn.landmark_norm.0.{m[3]}', None),
    (r'block([123])\.(\d+)\.att\.mha\.attn\.conv\.weight', lambda m: f'stages.{int(m[1]) - 1}.blocks.{m[2]}.attn.value_conv.weight', None),
    (r'block([123])\.(\d+)\.att\.(norm[12])\.(weight|bias)', lambda m: f'stages.{int(m[1]) - 1}.blocks.{m[2]}.{m[3]}.{m[4]}', None),
    (r'block([123])\.(\d+)\.att\.ff([12])\.(weight|bias)', lambda m: f'stages.{int(m[1]) - 1}.blocks.{m[2]}.mlp.fc{m[3]}.{m[4]}', None),
    # stage 4: a PVT-style Block (q, kv, proj; sr_ratio 1), timm's names otherwise
    (r'block4\.(\d+)\.attn\.proj\.(weight|bias)', r'stages.3.blocks.\1.attn.proj.\2', None),
    (r'block4\.(\d+)\.(norm[12])\.(weight|bias)', r'stages.3.blocks.\1.\2.\3', None),
    (r'block4\.(\d+)\.mlp\.(fc[12])\.(weight|bias)', r'stages.3.blocks.\1.mlp.\2.\3', None),
    (r'norm\.(weight|bias)', r'norm.\1', None),
    (r'head\.(weight|bias)', r'head.\1', None),
]


def _soft_joined(state: Dict[str, Tensor], done: Dict[str, Tensor], used: set) -> None:
    """Our fused qkv: SOFT's [W_q; W_v] (its keys are its queries), stage 4's [q; k; v] from q and kv = [k; v]."""
    for key in list(state):
        m = re.fullmatch(r'block([123])\.(\d+)\.att\.mha\.W_q\.(weight|bias)', key)
        if m:
            v_key = key.replace('.W_q.', '.W_v.')
            if v_key in state:
                done[f'stages.{int(m[1]) - 1}.blocks.{m[2]}.attn.qkv.{m[3]}'] = torch.cat([state[key], state[v_key]])
                used |= {key, v_key}
        m = re.fullmatch(r'block4\.(\d+)\.attn\.q\.(weight|bias)', key)
        if m:
            kv_key = key.replace('.q.', '.kv.')
            if kv_key in state:
                done[f'stages.3.blocks.{m[1]}.attn.qkv.{m[2]}'] = torch.cat([state[key], state[kv_key]])
                used |= {key, kv_key}


# ------------------------------------------------------------------ Sparsifiner (lim142857/Sparsifiner)
# DeiT's timm names for everything but the MaskPredictor: proj_c_q / proj_c_k Linear(head_dim, reduced_c) (with
# bias, as ours by default: predictor_bias), proj_n and proj_back_n [N, n_down] (used as k @ proj_n and proj_back_nᵀ):
# ours [n_down, N].
_T = lambda w: w.t().contiguous()                 # noqa: E731
SPARSIFINER_RULES: List[Rule] = [
    (r'blocks\.(\d+)\.attn\.mask_predictor\.proj_c_q\.weight', r'blocks.\1.attn.predictor_q.weight', None),
    (r'blocks\.(\d+)\.attn\.mask_predictor\.proj_c_k\.weight', r'blocks.\1.attn.predictor_k.weight', None),
    (r'blocks\.(\d+)\.attn\.mask_predictor\.proj_c_([qk])\.bias', r'blocks.\1.attn.predictor_\2.bias', None),
    (r'blocks\.(\d+)\.attn\.mask_predictor\.proj_n', r'blocks.\1.attn.basis.w_down', _T),
    (r'blocks\.(\d+)\.attn\.mask_predictor\.proj_back_n', r'blocks.\1.attn.basis.w_up', _T),
    (r'(.*)', r'\1', None),                       # the ViT: timm's own names
]


# the public code's choices that are options of ours: its src/models/sparsifiner.py (MaskPredictor) and the config
# its README trains with (experiments-results-analysis/experiments/sparsifiner_default_config.yaml)
PUBLIC_SETTINGS = {'sparsifiner-official': (
    ('coef_topk', 8, "the public config keeps each row's top 8 coefficients (BASIS_COEF.USE_TOPK, TOPK 8) instead of "
                     "Eq. 2's threshold tau"),
    ('predictor_scale', 'heads', "the public MaskPredictor scales its logits by num_heads^-1/2 "
                                 "(qk_scale or num_heads ** -0.5), not 1/sqrt(d)"),
    ('up_threshold', 0.02, "the public config's BASIS_THRESHOLD 2e-2 on |W_up| (ours 1e-2)"),
    ('keep_ratio', 0.25, "the public config's ATTN_KEEP_RATE 0.25 (the checkpoint does not record it)"),
)}


def _public_predictor_name(key: str) -> str:
    """Our predictor key -> the public checkpoint's (SPARSIFINER_RULES backwards), for messages."""
    for ours, theirs in (('predictor_q.', 'mask_predictor.proj_c_q.'), ('predictor_k.', 'mask_predictor.proj_c_k.')):
        if ours in key:
            return key.replace(ours, theirs)
    return key.replace('basis.w_down', 'mask_predictor.proj_n').replace('basis.w_up', 'mask_predictor.proj_back_n')


def _apply_rules(state: Dict[str, Tensor], rules: List[Rule], done: Dict[str, Tensor], used: set,
                 origins: Optional[Dict[str, str]] = None) -> None:
    for key, value in state.items():
        if key in used:
            continue
        for pattern, target, change in rules:
            m = re.fullmatch(pattern, key)
            if m:
                name = target(m) if callable(target) else m.expand(target)
                done[name] = change(value) if change else value
                used.add(key)
                if origins is not None:
                    origins[name] = key
                break


def convert_state_dict(source: str, state: Dict[str, Tensor], model: torch.nn.Module,
                       shapes_must_fit: bool = False,
                       where: Optional[str] = None) -> Tuple[Dict[str, Tensor], List[str]]:
    """`state` in `source`'s layout -> our keys for `model`, and the notes of what was not a plain copy. Unknown keys
    and keys of ours left unfilled are a UsageError naming them, after `where` (default: convert's `--from SOURCE`;
    the training flags and timm's loader, which find the layout by its keys, name their own flag or file).
    `shapes_must_fit` (convert, which builds the checkpoint's own architecture; timm's loader adapts shapes
    afterwards instead): a tensor of another shape than the model's is refused first, naming the first one in the
    model's order and both shapes."""
    # only convert has --from and --model; elsewhere the layout was recognised from the keys and the model built
    head = where or f"--from {source}"
    model_ask = f"is {'--model' if where is None else 'the model'} the checkpoint's architecture"
    ask = f"{model_ask} and --from its layout?" if where is None else f"{model_ask}?"
    arch = (getattr(model, 'pretrained_cfg', None) or {}).get('architecture') or type(model).__name__
    if source not in SOURCES:
        raise UsageError(f"--from {source!r}: accepted {', '.join(SOURCES)}")
    if source == 'sparsifiner-official' and not any('.mask_predictor.' in k for k in state):
        raise UsageError("--from sparsifiner-official: the checkpoint has no Sparsifiner predictor (no "
                         "blocks.N.attn.mask_predictor.* weights): a plain ViT / DeiT; convert it with --from timm, "
                         "which initialises the predictor afresh and says so")
    done: Dict[str, Tensor] = {}
    used: set = set()
    notes: List[str] = []
    if source == 'soft-official':
        _soft_joined(state, done, used)
    rules = {'crate-official': CRATE_RULES, 'soft-official': SOFT_RULES, 'sparsifiner-official': SPARSIFINER_RULES,
             'timm': [(r'(.*)', r'\1', None)]}[source]
    origins: Dict[str, str] = {}
    _apply_rules(state, rules, done, used, origins)
    unknown = set(state) - used
    ours = model.state_dict()
    if source == 'soft-official':          # BatchNorm counters exist in ours only when tracked
        unknown -= {k for k in unknown if k.endswith('num_batches_tracked')}
    unexpected = set(done) - set(ours)
    # the right layout and architecture (every key has a rule and a place): a size first, if any; otherwise the keys
    # (`--from timm` maps every key, so another architecture shows as keys without a place, not as a size)
    if shapes_must_fit and not unknown and not unexpected:
        _first_shape_mismatch(done, ours, origins, source, model)
    if unknown or unexpected:
        what = [f"{len(unknown)} unknown ({_names(unknown)})"] if unknown else []
        what += [f"{len(unexpected)} without a place in {type(model).__name__} ({_names(unexpected)})"] if unexpected else []
        fit = "this converter and --model" if where is None else f"model {arch} (read in the {source} layout)"
        raise UsageError(f"{head}: the checkpoint does not fit {fit}: {'; '.join(what)}; {ask}")
    missing = set(ours) - set(done)
    from ..models.sparsifiner import predictor_parameter_names
    predictor = predictor_parameter_names(model)
    if missing & predictor and (source != 'timm' or predictor - missing):
        # a checkpoint with a predictor must hold all of it: a missing tensor is not made up at random
        lacking = missing & predictor
        public = f" (the public code's {_public_predictor_name(min(lacking))})" if source == 'sparsifiner-official' else ''
        shown = ', '.join(sorted(lacking)[:3]) + (', ...' if len(lacking) > 3 else '')
        raise UsageError(f"{head}: the checkpoint's Sparsifiner predictor is incomplete, {len(lacking)} "
                         f"weight(s) missing: {shown}{public}; refused rather than filled at random")
    fresh = missing & (predictor | {k for k in ours if k.endswith('num_batches_tracked')})
    if missing - fresh:
        whose = 'the model' if where is None else f"model {arch}"
        read = '' if where is None else f" (read in the {source} layout)"
        raise UsageError(f"{head}: {len(missing - fresh)} weights of {whose} are not in the checkpoint "
                         f"({_names(missing - fresh)}){read}; {model_ask}?")
    predictors = {k for k in fresh if not k.endswith('num_batches_tracked')}
    if predictors:
        notes.append(f"Sparsifiner's connectivity predictor freshly initialised ({_names(predictors)}): the source has "
                     "none; train it by attention distillation (structformer train --teacher)")
    for key in fresh:
        done[key] = ours[key].clone()
    return done, notes


def settings(source: str, state: Dict[str, Tensor]) -> List[Tuple[str, object, str]]:
    """(constructor argument, value, why) of what a conversion from `source` fixes: the classes (from the
    classifier), for the public Sparsifiner the predictor's shapes (n_down, predictor_dim) and `PUBLIC_SETTINGS`."""
    chosen: List[Tuple[str, object, str]] = []
    head = {'crate-official': 'mlp_head.1.weight'}.get(source, 'head.weight')
    if head in state:
        chosen.append(('num_classes', int(state[head].shape[0]),
                       f"the checkpoint's classifier {head} is {list(state[head].shape)}"))
    elif state and head.rsplit('.', 1)[0] + '.bias' not in state:
        # a backbone saved with num_classes=0 (timm's reset_classifier(0), features): converted as it is;
        # --model-kwargs num_classes=N then adds a fresh classifier, as timm's loader does
        chosen.append(('num_classes', 0, f"the checkpoint has no classifier ({head}): saved with num_classes=0; "
                                         "--model-kwargs num_classes=N adds a freshly initialised one"))
    if source == 'sparsifiner-official':
        down = next((k for k in state if k.endswith('mask_predictor.proj_n')), None)
        q = next((k for k in state if k.endswith('mask_predictor.proj_c_q.weight')), None)
        if down is not None:
            chosen.append(('n_down', int(state[down].shape[1]), f"the checkpoint's {down} is {list(state[down].shape)}"))
        if q is not None:
            chosen.append(('predictor_dim', int(state[q].shape[0]), f"the checkpoint's {q} is {list(state[q].shape)}"))
    chosen += list(PUBLIC_SETTINGS.get(source, ()))
    return chosen


def _first_shape_mismatch(done: Dict[str, Tensor], ours: Dict[str, Tensor], origins: Dict[str, str], source: str,
                          model: torch.nn.Module) -> None:
    """One line naming the first tensor (in the model's order) whose shape differs from the model's: a checkpoint of
    the right family and another size (DeiT-T into DeiT-S, CRATE-S into CRATE-T)."""
    wrong = [k for k in ours if k in done and tuple(done[k].shape) != tuple(ours[k].shape)]
    if not wrong:
        return
    key = wrong[0]
    name = (getattr(model, 'pretrained_cfg', None) or {}).get('architecture') or type(model).__name__
    theirs = f"{key} (the checkpoint's {origins[key]})" if origins.get(key, key) != key else key
    more = f" (and {len(wrong) - 1} more of another shape)" if len(wrong) > 1 else ''
    raise UsageError(f"--from {source}: the checkpoint does not fit --model {name}: {theirs} is "
                     f"{list(done[key].shape)} in the checkpoint and {list(ours[key].shape)} in the model{more}; "
                     "is --model the checkpoint's size?")


def infer_model_kwargs(source: str, state: Dict[str, Tensor]) -> Dict[str, object]:
    """The constructor arguments of `settings` as a dict."""
    return {key: value for key, value, _ in settings(source, state)}

