"""The rows a comparison can hold, the sets, and the parameter matching that makes the rows comparable.

A row (`Entry`) names a registered model per data kind (the embedded digits, 8 px, or MNIST, 28 px), the keyword
arguments that make it that model (`kind_kwargs`: an MLP-Mixer is a SparseMixer with γ = 2; RP-Mixer permutes at
random), the shape the matched sets give it (`shape_kwargs`, e.g. SOFT's depths) and how its width grows (`knob`).
Matching (`match_rows`) picks, for every row with a knob, the width whose parameter count is nearest the set's
budget, and refuses a row that cannot come within ±15 % (`TOLERANCE`). A masked layer counts the weights its mask
keeps (`models.inventory.effective_parameter_count`). Rows without a knob follow another row's width: the attention
swaps and Sparsifiner are the matched ViT with its attention replaced (within ±15 % too: only Linformer's E, F and
Sparsifiner's predictor are added), and the low-rank rows are the matched ViT or WRN factorised, so they have fewer
parameters on purpose and say so (`role`). `--no-match` keeps the registry's sizes.

Every set holds the dense baselines: timm's ViT (softmax), the ViT with Linformer, Performer and Nyström attention
at the Sparsifiner budget (k = m = B = ⌈0.25·n⌉ keys, Sparsifiner Table 4's equal-budget rule), an MLP-Mixer and a
Wide-ResNet. Standard library only: the command's parser imports this module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..errors import UsageError

TOLERANCE = 0.15                 # matched rows: parameters within ±15 % of the budget
KEEP = 0.25                      # Sparsifiner's keep ratio, and the equal budget of the Linformer / Nyström rows
DATA_KINDS = ('digits', 'mnist')
# tokens of the registry ViTs (patches + cls): 8 px at patch 2, 28 px at patch 4
TOKENS = {'digits': (8 // 2) ** 2 + 1, 'mnist': (28 // 4) ** 2 + 1}


def key_budget(kind: str) -> int:
    """B = ⌈keep · n⌉ keys per query: Sparsifiner's budget, Linformer's k and Nyström's landmarks."""
    return math.ceil(KEEP * TOKENS[kind] - 1e-9)


@dataclass(frozen=True)
class Entry:
    key: str
    label: str
    family: str
    models: Dict[str, str]                                  # data kind -> registered model
    kind_kwargs: Dict[str, Dict] = field(default_factory=dict)    # always applied
    shape_kwargs: Dict[str, Dict] = field(default_factory=dict)   # applied when matching
    knob: Optional[str] = None                              # how the width grows (KNOBS)
    follows: Optional[str] = None                           # the row whose (matched) width it takes
    transforms: Tuple[Tuple[str, Tuple[Tuple[str, object], ...]], ...] = ()   # (name, ((key, value), ...))
    seeded: Tuple[str, ...] = ()                            # model kwargs that take the cell's seed
    rank: Optional[float] = None                            # factorised at this rank (low-rank training)
    pretrained: bool = False                                # dense first, factorised at the switch
    teacher: bool = False                                   # distilled from the `depends` row's cell
    depends: Optional[str] = None                           # the row whose cell of the same seed it needs
    baseline: bool = False                                  # a dense baseline


def _swap(attn: str, **options) -> Tuple:
    return (('swap_attention', tuple(sorted(dict(attn=attn, **options).items()))),)


_VIT = {'digits': 'vit_digits', 'mnist': 'vit_mnist'}
# the registry's heads (the knobs keep them); SOFT on MNIST takes the digits model's depths and heads: SOFT-Tiny's
# (2, 2, 5, 2) blocks would leave a few channels per head at these budgets
_VIT_SHAPE = {'digits': {'num_heads': 4}, 'mnist': {'num_heads': 3}}
_CRATE_SHAPE = {'digits': {'num_heads': 4}, 'mnist': {'num_heads': 6}}
_SOFT_SHAPE = {'digits': {'num_heads': (1, 2, 3, 4)}, 'mnist': {'depths': (1, 1, 2, 1), 'num_heads': (1, 2, 3, 4)}}
_MIXER = {'digits': 'mixer_digits', 'mnist': 'smixer_mnist'}
_WRN = {'digits': 'wrn_10_2_digits', 'mnist': 'wrn_16_2_mnist'}
B = 'budget'                     # a transform value filled with key_budget(kind)

ENTRIES: Tuple[Entry, ...] = (
    Entry('vit', 'ViT (timm, softmax)', 'ViT', _VIT, shape_kwargs=_VIT_SHAPE, knob='vit', baseline=True),
    Entry('crate', 'CRATE', 'CRATE', {'digits': 'crate_digits', 'mnist': 'crate_mnist'}, shape_kwargs=_CRATE_SHAPE,
          knob='crate'),
    Entry('soft', 'SOFT', 'SOFT', {'digits': 'soft_digits', 'mnist': 'soft_tiny_mnist'},
          shape_kwargs=_SOFT_SHAPE, knob='soft'),
    Entry('softpp', 'SOFT++', 'SOFT', {'digits': 'softpp_digits', 'mnist': 'softpp_tiny_mnist'},
          shape_kwargs=_SOFT_SHAPE, knob='soft'),
    Entry('vit_linformer', 'ViT + Linformer (k = B)', 'ViT', _VIT, follows='vit',
          transforms=_swap('linformer', num_landmarks=B), baseline=True),
    Entry('vit_performer', 'ViT + Performer', 'ViT', _VIT, follows='vit', transforms=_swap('performer'),
          baseline=True),
    Entry('vit_nystrom', 'ViT + Nyström (m = B)', 'ViT', _VIT, follows='vit',
          transforms=_swap('nystrom', num_landmarks=B), baseline=True),
    Entry('sparsifiner', f'Sparsifiner keep {KEEP:g} (distilled from the ViT)', 'Sparsifiner',
          {'digits': 'sparsifiner_digits', 'mnist': 'sparsifiner_mnist'},
          kind_kwargs={k: {'keep_ratio': KEEP} for k in DATA_KINDS}, follows='vit', teacher=True, depends='vit'),
    Entry('mixer', 'MLP-Mixer', 'Mixer', _MIXER, kind_kwargs={'mnist': {'mlp_ratio': 2.0}}, knob='mixer',
          baseline=True),
    Entry('rp_mixer', 'RP-Mixer', 'Mixer', {'digits': 'rp_mixer_digits', 'mnist': 'smixer_mnist'},
          kind_kwargs={'mnist': {'mlp_ratio': 2.0, 'permutation': 'random'}}, knob='mixer', seeded=('perm_seed',)),
    Entry('smixer', 'S-Mixer', 'Mixer', _MIXER, kind_kwargs={'digits': {'mlp_ratio': 0}}, knob='mixer'),
    Entry('swmlp', 'SW-MLP', 'Mixer', {'digits': 'swmlp_digits', 'mnist': 'swmlp_mnist'}, knob='swmlp',
          seeded=('mask_seed',)),
    Entry('vit_lowrank_0.25', 'ViT factorised, rank 0.25', 'low-rank', _VIT, follows='vit', rank=0.25),
    Entry('vit_lowrank_0.5', 'ViT factorised, rank 0.5', 'low-rank', _VIT, follows='vit', rank=0.5),
    Entry('vit_lowrank_0.25_pretrained', 'ViT dense, then factorised, rank 0.25', 'low-rank', _VIT, follows='vit',
          rank=0.25, pretrained=True, depends='vit'),
    Entry('vit_lowrank_0.5_pretrained', 'ViT dense, then factorised, rank 0.5', 'low-rank', _VIT, follows='vit',
          rank=0.5, pretrained=True, depends='vit'),
    Entry('wrn', 'Wide-ResNet', 'WRN', _WRN, knob='wrn', baseline=True),
    Entry('wrn_lowrank_0.25', 'Wide-ResNet factorised, rank 0.25', 'low-rank', _WRN, follows='wrn', rank=0.25),
)
BY_KEY = {e.key: e for e in ENTRIES}

# the shared recipe of each set (TrainConfig values); --recipe, -c and the training flags override them
_COMMON = dict(opt='adamw', weight_decay=0.05, sched='cosine', label_smoothing=0.1, val_fraction=0.2, keep_last=1)
SETS: Dict[str, Dict] = {
    'quick': dict(data='digits', seeds=1, budget=80_000, entries=[e.key for e in ENTRIES],
                  recipe=dict(_COMMON, epochs=8, batch_size=64, lr=2e-3),
                  about='every family on the embedded digits, one seed: a few minutes'),
    'mnist': dict(data=None, seeds=3, budget=170_000, entries=[e.key for e in ENTRIES],
                  recipe=dict(_COMMON, epochs=15, batch_size=128, lr=2e-3),
                  about='real MNIST at 28 px (8,000 train / 2,000 held out of a 10,000-image IDX pair), three seeds'),
    'in1k': dict(data='imagefolder:IMAGENET', seeds=1, budget=None, entries=None, recipe=None,
                 about="the paper-scale recipes' models at their own recipes, one torchrun job per cell (dry run)"),
}


def data_kind(spec: str) -> str:
    """'digits' or 'mnist' for a --data spec the catalogue's models are sized for; anything else refused."""
    form = str(spec).partition(':')[0].strip().lower()
    if form in DATA_KINDS and (form == 'digits' or ':' in str(spec)):
        return form
    raise UsageError(f"--data {spec}: compare's models are sized for digits or mnist:PATH (a folder of MNIST IDX "
                     "files); accepted digits | mnist:PATH (--set in1k: imagefolder:PATH)")


def resolve_keys(set_name: Optional[str], models: Optional[List[str]]) -> List[str]:
    """The rows of a grid, in the set's order: `--models` (a subset of the set when one is named), with the rows
    they depend on added (Sparsifiner's teacher, the dense start of a pre-trained low-rank row)."""
    if set_name is not None and set_name not in SETS:
        raise UsageError(f"--set {set_name!r} is not a set: accepted {', '.join(SETS)}")
    pool = list(SETS[set_name]['entries']) if set_name else [e.key for e in ENTRIES]
    if not models:
        return pool
    for key in models:
        if key not in pool:
            where = f"in --set {set_name}" if set_name else 'a compare model'
            raise UsageError(f"--models {key!r} is not {where}: accepted {', '.join(pool)}")
    wanted = set(models)
    for key in models:
        if BY_KEY[key].depends:
            wanted.add(BY_KEY[key].depends)
        if BY_KEY[key].follows:          # a follower takes the matched width of the row it follows
            wanted.add(BY_KEY[key].follows)
    return [k for k in pool if k in wanted]


# ---- knobs: each returns the candidate shapes, smallest first (parameter counts grow along the list) -----------
def _vit_candidates(model: str, shape: Dict) -> List[Dict]:
    heads = shape['num_heads']
    return [{'embed_dim': heads * 2 * j} for j in range(1, 129)]


def _crate_candidates(model: str, shape: Dict) -> List[Dict]:
    heads = shape['num_heads']
    return [{'embed_dim': heads * p, 'dim_head': p} for p in range(1, 129)]


def _soft_candidates(model: str, shape: Dict) -> List[Dict]:
    return [{'dims': tuple(h * w for h in shape['num_heads'])} for w in range(1, 129)]


def _mixer_candidates(model: str, shape: Dict) -> List[Dict]:
    return [{'embed_dim': c} for c in range(4, 1025, 4)]


def _swmlp_candidates(model: str, shape: Dict) -> List[Dict]:
    return [{'embed_dim': c} for c in range(1, 257)]


def _wrn_candidates(model: str, shape: Dict) -> List[Dict]:
    # widen_factor is an integer, so the depth (6n + 4) is the finer step; sorted by count in `_match`
    return [{'depth': d, 'widen_factor': k} for d in (10, 16, 22, 28) for k in range(1, 9)]


KNOBS = {'vit': _vit_candidates, 'crate': _crate_candidates, 'soft': _soft_candidates, 'mixer': _mixer_candidates,
         'swmlp': _swmlp_candidates, 'wrn': _wrn_candidates}
UNSORTED_KNOBS = ('wrn',)


@dataclass
class Row:
    """One model of a grid: the entry, its registered model and constructor arguments (without the seeded ones),
    its transforms, and how its size was chosen (`role`)."""
    entry: Entry
    model: str
    model_kwargs: Dict
    transforms: List[Dict]
    role: str                     # 'matched' | 'registry size' | 'width of <row>' | 'factorised <row>'
    budget: Optional[int] = None

    @property
    def key(self) -> str:
        return self.entry.key

    def kwargs_for(self, seed: int) -> Dict:
        return dict(self.model_kwargs, **{name: seed for name in self.entry.seeded})


_COUNTS: Dict[str, int] = {}


def _count(model: str, kwargs: Dict, transforms: List[Dict] = ()) -> int:
    """Effective parameters of `model` built with `kwargs` (then `transforms`) on the meta device (no memory, no
    init); remembered for the process, since a build on the meta device always gives the same count."""
    key = repr((model, sorted(kwargs.items()), list(transforms)))
    if key not in _COUNTS:
        import torch

        from ..models.factory import build_model
        from ..models.inventory import effective_parameter_count
        with torch.device('meta'):
            built, _ = build_model(model, kwargs, None, list(transforms))
        _COUNTS[key] = effective_parameter_count(built)
    return _COUNTS[key]


def _match(entry: Entry, kind: str, budget: int) -> Tuple[Dict, int]:
    """The candidate shape of `entry` whose parameter count is nearest `budget` (bisection on the growing list)."""
    model = entry.models[kind]
    base = dict(entry.kind_kwargs.get(kind, {}), **entry.shape_kwargs.get(kind, {}))
    candidates = [dict(base, **c) for c in KNOBS[entry.knob](model, entry.shape_kwargs.get(kind, {}))]
    if entry.knob in UNSORTED_KNOBS:
        counted = sorted(((_count(model, c), i) for i, c in enumerate(candidates)))
        best = min(counted, key=lambda ci: abs(ci[0] - budget))
        return candidates[best[1]], best[0]
    cache = {}

    def count(i):
        if i not in cache:
            cache[i] = _count(model, candidates[i])
        return cache[i]

    lo, hi = 0, len(candidates) - 1
    while lo < hi:                       # the first candidate at or above the budget
        mid = (lo + hi) // 2
        if count(mid) >= budget:
            hi = mid
        else:
            lo = mid + 1
    near = [i for i in (lo - 1, lo) if 0 <= i < len(candidates)]
    best = min(near, key=lambda i: abs(count(i) - budget))
    return candidates[best], count(best)


def _transforms(entry: Entry, kind: str) -> List[Dict]:
    out = []
    for name, items in entry.transforms:
        kwargs = {k: (key_budget(kind) if v == B else v) for k, v in items}
        out.append({'name': name, 'kwargs': kwargs})
    return out


def within(count: int, budget: int) -> bool:
    return abs(count / budget - 1) <= TOLERANCE + 1e-12


def match_rows(keys: List[str], kind: str, budget: Optional[int], match: bool = True) -> List[Row]:
    """The rows of `keys` for data `kind`: matched to `budget` (knob rows by search, followers at the width of the
    row they follow), or at the registry's sizes (`match=False`). A knob row that cannot come within ±15 % of the
    budget is refused by name, and so is a row at its width that its own attention weights take beyond it."""
    shapes: Dict[str, Dict] = {}
    rows = []
    for key in keys:
        entry = BY_KEY[key]
        model = entry.models[kind]
        kind_kwargs = dict(entry.kind_kwargs.get(kind, {}))
        if not match:
            shape, role = kind_kwargs, 'registry size'
        elif entry.knob:
            shape, count = _match(entry, kind, budget)
            if not within(count, budget):
                raise UsageError(f"--budget {budget}: {entry.label} comes no nearer than {count:,} parameters "
                                 f"({count / budget - 1:+.0%}; matched rows must be within ±{TOLERANCE:.0%}); "
                                 "choose another --budget, leave the row out of --models, or pass --no-match")
            role = 'matched'
        else:
            followed = shapes[entry.follows]
            shape = dict({k: v for k, v in followed.items() if k not in BY_KEY[entry.follows].kind_kwargs.get(kind, {})},
                         **kind_kwargs)
            role = f"factorised {entry.follows}" if entry.rank else f"width of {entry.follows}"
            if not entry.rank:          # its own attention's weights added (Linformer's E, F; Sparsifiner's predictor)
                count = _count(model, shape, _transforms(entry, kind))
                if not within(count, budget):
                    raise UsageError(f"--budget {budget}: {entry.label} at the width of "
                                     f"{BY_KEY[entry.follows].label} has {count:,} parameters ({count / budget - 1:+.0%}"
                                     f"; rows at a matched row's width must be within ±{TOLERANCE:.0%} too); choose "
                                     "another --budget, leave the row out of --models, or pass --no-match")
        shapes[key] = shape
        rows.append(Row(entry, model, dict(shape), _transforms(entry, kind), role, budget if match else None))
    return rows
