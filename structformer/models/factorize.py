"""`factorize`: replace a model's linear / conv layers by low-rank factorisations (seed 004, §3.1).

A registered model transform (`structformer.models.transforms`), so a run that used it records it and
rebuilds it on `--resume`, `eval` and `analyze`:

    model = factorize(model, rank=0.3, init='spectral')                      # the paper's preset
    structformer train ... --transform factorize rank=0.3 init=spectral_ones
    structformer train ... --factorize-at 5 --rank 0.3 --init spectral       # pre-train, then factorise

Which layers (`include`, fnmatch patterns over module names, or a preset name):
  'vision'       every nn.Conv2d except the model's first convolution (the stem, of whatever class), as the paper
                 does for WRN / ResNet-50;
  'transformer'  the Q, K, V projections and both FFN matrices, not the attention output, as the paper does for
                 GPT-2 (SPEC §5): the q/k/v projection fused (`*qkv`: timm's ViT, our GPT, CRATE) or apart
                 (`*attn.q_proj` / `k_proj` / `v_proj`: timm's EVA; `*attn.q` / `k` / `v` / `kv`: CaiT, MViTv2,
                 PVTv2, Twins), and the FFN's (`*mlp.fc1`, `*mlp.fc2`; a SwiGLU's first matrix is the two halves
                 `*mlp.fc1_g`, `*mlp.fc1_x`: EVA-02, timm's ViTs built with mlp_layer=SwiGLU);
  'all'          every nn.Linear and nn.Conv2d;
  None           'vision' when the model has more than one conv, else 'transformer'.
`exclude` patterns then remove layers. Every pattern must match at least one layer, so a typo fails.

A layer whose rank r does not save parameters (r ≥ mn/(m+n)) is skipped and named in the report
(`skip_no_saving=False` factorises it anyway: at full rank that reproduces the model exactly, which is
what the tests use). Everything is checked before any module is replaced: a bad argument changes nothing.
"""
import fnmatch
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Union

from torch import nn

from ..layers.linear.factorized import (FACTORIZED_TYPES, INITS, FactorizedConv2d, FactorizedLinear,
                                        resolve_rank, saves_parameters)
from ..models.transforms import TransformContext, register_transform

__all__ = ['factorize', 'plan_factorization', 'PRESETS', 'LayerPlan', 'eligible_layers']

# every spelling of a transformer's Q, K, V projections and FFN matrices in timm and here: a model whose names the
# preset missed trained with those layers dense (timm's EVA-02: its separate q/k/v and SwiGLU halves, a third of the
# preset's layers, were left out, and the run looked factorised)
TRANSFORMER_LAYERS = ['*qkv', '*attn.q_proj', '*attn.k_proj', '*attn.v_proj', '*attn.q', '*attn.k', '*attn.v',
                      '*attn.kv', '*mlp.fc1', '*mlp.fc1_g', '*mlp.fc1_x', '*mlp.fc2']
PRESETS = {
    'transformer': TRANSFORMER_LAYERS,
    'lm': TRANSFORMER_LAYERS,
    # 'vision' and 'all' are rules over layer types, not name patterns (see _preset_names)
    'vision': None,
    'all': None,
}


@dataclass
class LayerPlan:
    name: str
    kind: str               # 'linear' | 'conv'
    out_features: int       # m
    in_features: int        # n (c_in·h·w for a conv)
    rank: int
    action: str             # 'factorize' | 'skip'
    reason: str = ''

    @property
    def dense_params(self) -> int:
        return self.out_features * self.in_features

    @property
    def factor_params(self) -> int:
        return self.rank * (self.out_features + self.in_features)


def _conv_factorizable(module: nn.Conv2d) -> bool:
    return not _conv_refusal(module)


def _conv_refusal(module: nn.Conv2d) -> str:
    """'' for a conv FactorizedConv2d can replace, else why not (it needs groups=1 and numeric zero padding)."""
    if module.groups != 1:
        return f'grouped (groups={module.groups})'
    if module.padding_mode != 'zeros':
        return f'padding_mode={module.padding_mode!r}'
    if isinstance(module.padding, str):
        return f'padding={module.padding!r}'
    return ''


def eligible_layers(model: nn.Module) -> Dict[str, nn.Module]:
    """Every nn.Linear and plain nn.Conv2d by name, in module order. Linears inside
    nn.MultiheadAttention are left out (it reads `out_proj.weight` directly); conv subclasses with their
    own padding rules (timm's Conv2dSame) too."""
    out, inside_mha = {}, set()
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            inside_mha.update(f'{name}.{child}' if name else child for child, _ in module.named_modules() if child)
        if name in inside_mha:
            continue
        if isinstance(module, nn.Linear) or type(module) is nn.Conv2d:
            out[name] = module
    return out


def _shape(module: nn.Module):
    if isinstance(module, nn.Linear):
        return 'linear', module.out_features, module.in_features
    return 'conv', module.out_channels, module.weight[0].numel()


def _preset_names(preset: str, layers: Dict[str, nn.Module], stem: Optional[str] = None) -> List[str]:
    convs = [n for n, m in layers.items() if isinstance(m, nn.Conv2d)]
    if preset == 'vision':
        # the model's first convolution, whatever its class: a stem that is not eligible itself (timm's Conv2dSame in
        # the tf_* models) took the first eligible conv with it (tf_efficientnetv2_b0: blocks.0.0.conv went dense)
        return [n for n in convs if n != stem] if stem is not None else convs[1:]
    if preset == 'all':
        return list(layers)
    return [n for n in layers if any(fnmatch.fnmatchcase(n, p) for p in PRESETS[preset])]


def _already_factorized(already: Dict[str, nn.Module], patterns: Sequence[str] = ('*',)) -> str:
    """'' or the sentence naming the layers an earlier `factorize` replaced that `patterns` match: a second call
    finds no nn.Linear / nn.Conv2d there, and without it the error read as if the model had no such layer."""
    hit = [n for n in already if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not hit:
        return ''
    return (f"the model is already factorised there ({len(hit)} layer(s): {', '.join(hit[:4])}"
            f"{', ...' if len(hit) > 4 else ''}); factorize replaces a dense nn.Linear / nn.Conv2d once")


def _select(layers: Dict[str, nn.Module], include, exclude,
            already: Optional[Dict[str, nn.Module]] = None, stem: Optional[str] = None) -> List[str]:
    """The names of `layers` (dense, still eligible) chosen by `include` / `exclude`. `already`: the layers an
    earlier `factorize` replaced; the default preset counts their convs too (a factorised WRN is still a
    vision model), and an include that matches only them is refused by saying so."""
    already = already or {}
    if include is None:
        convs = [n for n, m in {**layers, **already}.items() if isinstance(m, (nn.Conv2d, FactorizedConv2d))]
        include = 'vision' if len(convs) > 1 else 'transformer'
    if isinstance(include, str) and include in PRESETS:
        chosen = _preset_names(include, layers, stem)
        if not chosen and _already_factorized(already):
            raise ValueError(f"include={include!r}: {_already_factorized(already)}, and no layer the preset "
                             "takes is still dense")
        if not chosen:
            raise ValueError(f"include={include!r}: the preset matches no layer of this model; give patterns "
                             f"over its layer names, e.g. {', '.join(list(layers)[:4]) or '(no linear or conv layers)'}")
    else:
        patterns = [include] if isinstance(include, str) else list(include)
        if not patterns or not all(isinstance(p, str) for p in patterns):
            raise ValueError(f"include={include!r}: expected a preset ({', '.join(PRESETS)}) or a list of "
                             "fnmatch patterns over module names")
        for p in patterns:
            if not any(fnmatch.fnmatchcase(n, p) for n in layers) and _already_factorized(already, [p]):
                raise ValueError(f"include pattern {p!r}: {_already_factorized(already, [p])}")
            if not any(fnmatch.fnmatchcase(n, p) for n in layers):
                raise ValueError(f"include pattern {p!r} matches no nn.Linear or nn.Conv2d of the model; "
                                 f"presets: {', '.join(PRESETS)}; layer names look like "
                                 f"{', '.join(list(layers)[:4]) or '(none: the model has no such layers)'}")
        chosen = [n for n in layers if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    excludes = [exclude] if isinstance(exclude, str) else list(exclude or ())
    for p in excludes:
        if not isinstance(p, str) or not any(fnmatch.fnmatchcase(n, p) for n in chosen):
            raise ValueError(f"exclude pattern {p!r} matches none of the included layers "
                             f"({', '.join(chosen[:4])}{', ...' if len(chosen) > 4 else ''})")
    return [n for n in chosen if not any(fnmatch.fnmatchcase(n, p) for p in excludes)]


def plan_factorization(model: nn.Module, rank: Union[int, float], include=None, exclude=None,
                       skip_no_saving: bool = True) -> List[LayerPlan]:
    """What `factorize` would do, layer by layer, without changing anything (raises on bad input)."""
    if not isinstance(skip_no_saving, bool):        # `--transform factorize skip_no_saving=false` arrives as a
        raise ValueError(f"skip_no_saving={skip_no_saving!r}: accepted True or False")   # string, and was truthy
    for arg, value in (('include', include), ('exclude', exclude)):
        if not (value is None or isinstance(value, str)
                or (isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value))):
            raise ValueError(f"{arg}={value!r}: accepted a preset name or fnmatch pattern, or a list of patterns")
    if isinstance(rank, bool) or not isinstance(rank, (int, float)) or not rank > 0:
        raise ValueError(f"rank={rank!r} is out of range: accepted an integer >= 1 or a fraction in (0, 1]")
    if isinstance(rank, float) and not rank <= 1:
        raise ValueError(f"rank={rank!r} is out of range: a float is a fraction of min(m, n) in (0, 1]; "
                         "give an integer for a count")
    layers = eligible_layers(model)
    plans = []
    stem = next((n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, FactorizedConv2d))), None)
    for name in _select(layers, include, exclude, factorized_layers(model), stem):
        module = layers[name]
        kind, m, n = _shape(module)
        r = resolve_rank(rank, m, n, name=f'rank (layer {name}, {m}x{n})')
        plan = LayerPlan(name, kind, m, n, r, 'factorize')
        if kind == 'conv' and not _conv_factorizable(module):
            plan.action, plan.reason = 'skip', f'not factorisable: {_conv_refusal(module)}'
        elif skip_no_saving and not saves_parameters(r, m, n):
            plan.action, plan.reason = 'skip', f'no saving: r={r} >= mn/(m+n)={m * n / (m + n):.1f}'
        plans.append(plan)
    return plans


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition('.')
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _summary(plans: Sequence[LayerPlan], rank, init: str) -> str:
    done = [p for p in plans if p.action == 'factorize']
    skipped = [p for p in plans if p.action == 'skip']
    before = sum(p.dense_params for p in done)
    after = sum(p.factor_params for p in done)
    text = (f"factorize: {len(done)} layer(s) at rank {rank} ({init}), their weights {before:,} -> {after:,} "
            f"parameters")
    if skipped:
        names = ', '.join(f"{p.name} ({p.reason})" for p in skipped[:6])
        more = f" and {len(skipped) - 6} more" if len(skipped) > 6 else ''
        text += f"; skipped {len(skipped)}: {names}{more}"
    return text


def check_factorization(model: nn.Module, rank: Union[int, float] = 0.3, init: str = 'spectral',
                        include=None, exclude=None, skip_no_saving: bool = True) -> List[LayerPlan]:
    """The plan of `factorize` with these arguments, or the ValueError it would raise, without changing
    the model: the trainer calls it before a run that factorises after pre-training starts, so a rank
    that saves nothing is refused before the dense epochs rather than after them."""
    if init not in INITS:
        raise ValueError(f"init={init!r} is not a factor initialisation: accepted {', '.join(INITS)}")
    plans = plan_factorization(model, rank, include, exclude, skip_no_saving)
    if plans and all(p.reason.startswith('not factorisable') for p in plans):
        # no rank and no skip_no_saving helps here: name the layers and what they lack
        named = ', '.join(f"{p.name} ({p.reason.split(': ', 1)[1]})" for p in plans[:4])
        raise ValueError(f"none of the {len(plans)} chosen layer(s) can be factorised: {named}"
                         f"{', ...' if len(plans) > 4 else ''}; a factorised conv needs groups=1 and numeric zero "
                         "padding: choose other layers (include / exclude)")
    if not any(p.action == 'factorize' for p in plans):
        raise ValueError(f"rank={rank}: none of the {len(plans)} chosen layer(s) would save parameters "
                         f"(r >= mn/(m+n) everywhere); lower the rank, or factorise anyway with "
                         f"skip_no_saving=False (command line: --transform factorize rank={rank} "
                         f"skip_no_saving=False)")
    return plans


def factorize(model: nn.Module, rank: Union[int, float] = 0.3, init: str = 'spectral',
              include: Optional[Union[str, Sequence[str]]] = None, exclude: Optional[Sequence[str]] = None,
              skip_no_saving: bool = True, verbose: bool = True) -> nn.Module:
    """Replace the chosen nn.Linear / nn.Conv2d layers of `model` (in place; returned) by
    FactorizedLinear / FactorizedConv2d of rank `rank` (int, or fraction of min(m, n)) initialised by
    `init`: 'spectral' (truncated SVD of the current weight, Eq. 3), 'spectral_ones' (its singular
    vectors, Σ = I) or 'he'. The plan is stored as `model.lowrank_plan` (a list of dicts) and, with
    `verbose`, summarised on stderr. Raises ValueError, changing nothing, on bad arguments or when no
    chosen layer would save parameters."""
    plans = check_factorization(model, rank, init, include, exclude, skip_no_saving)
    layers = eligible_layers(model)
    for plan in plans:
        if plan.action != 'factorize':
            continue
        module = layers[plan.name]
        new = (FactorizedLinear.from_linear(module, plan.rank, init) if plan.kind == 'linear'
               else FactorizedConv2d.from_conv(module, plan.rank, init))
        new.train(module.training)
        _set_module(model, plan.name, new)
    model.lowrank_plan = [asdict(p) for p in plans]
    if verbose:
        print(_summary(plans, rank, init), file=sys.stderr)
    return model


@register_transform('factorize')
def factorize_transform(model: nn.Module, context: TransformContext, rank: Union[int, float] = 0.3,
                        init: str = 'spectral', include=None, exclude=None, skip_no_saving: bool = True) -> nn.Module:
    """`factorize` as a recorded model transform (see the module docstring)."""
    return factorize(model, rank=rank, init=init, include=include, exclude=exclude, skip_no_saving=skip_no_saving)


def factorized_layers(model: nn.Module) -> Dict[str, nn.Module]:
    """The FactorizedLinear / FactorizedConv2d modules of `model` by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, FACTORIZED_TYPES)}
