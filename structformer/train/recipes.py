"""Training recipes: every training setting the five papers report, as `TrainConfig` values.

A recipe is `structformer/recipes/<name>.yaml` (package data): TrainConfig keys, exactly the field names
(checked by `config.check_values`, which refuses unknown keys and wrong types), plus one reserved key
`about:`, removed before loading, that says where the values come from:

    about:
      paper:    the paper (seed number)
      source:   section / table / appendix, or the public-code file where the paper is silent
      reported: the paper's number for this setting ("ImageNet-1k top-1 70.8% (Table 1)")
      data:     what --data should point at ("ImageNet-1k train/val as an ImageFolder")
      devices:  the paper's accelerators and global batch, where known
      notes:    where the recipe departs from the paper, and the values the paper does not give
      world_size: the process count the recipe's batch_size x grad_accum_steps is sized for: at that count
                  the effective batch is the paper's (optional, default 1)
      classes:  classes of the intended data (optional): the dry run builds the model with them when it
                does not read the data
      covers:   the table / figure cells the recipe trains ("Table 1: CRATE-T, ImageNet-1k"); `structformer
                recipes` shows it
      sweep:    the rows of those tables the recipe reaches by flags (optional): the axis, each row's flags and
                its reported number, or "not in the seed" where the seed gives none
      models:   other registered models the sweep's rows train (optional): --model accepts them with this recipe

`data:` in a recipe is a placeholder (`imagefolder:IMAGENET`) that `--data` overrides; every recipe sets
`dataset_size` (train images of the intended data) so `--dry-run` can count steps without the data.
`structformer train --recipe NAME` puts the recipe under `-c FILE` and the flags given (priority: defaults <
recipe < -c < flags) and records `recipe: NAME` in the run's config.yaml.

`dry_run(config)` is `structformer train --dry-run`: the resolved plan (model and parameter count, built on
the meta device; data; batch, accumulation, processes; steps; learning rates at the end of warm-up, half-way
and the end, from the same timm scheduler call as the engine; augmentation, precision, EMA, checkpoints,
teacher and stages, factorisation), printed without training or writing anything.

`check_recipe_model(config)`: --recipe with a model that is not the recipe's, one its rows train (about.models)
or a registered shrink of its family (a model of the same family registered for small data, `*_digits`,
`*_mnist`, `*_synthetic`, or the family's tiny member) is refused unless --allow-other-model is given; the plan
never prints the recipe's reported number for another model.
"""
import difflib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from ..errors import UsageError
from .config import TrainConfig, check_values

RECIPE_DIR = Path(__file__).resolve().parent.parent / 'recipes'
ABOUT_REQUIRED = ('paper', 'source', 'reported', 'data', 'devices', 'notes', 'covers')
ABOUT_OPTIONAL = ('world_size', 'classes', 'sweep', 'models')


def list_recipes() -> List[str]:
    """Names of the shipped recipes, sorted."""
    return sorted(p.stem for p in RECIPE_DIR.glob('*.yaml'))


def _unknown(name: str) -> UsageError:
    names = list_recipes()
    close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ''
    return UsageError(f"--recipe {name!r} is not a recipe: {hint}`structformer recipes` lists the {len(names)} recipes")


def load_recipe(name: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(values, about) of recipe `name`: the TrainConfig values, checked by key and type, and the `about`
    block. An unknown name is a UsageError naming --recipe, the closest names and `structformer recipes`."""
    if not isinstance(name, str) or not name or '/' in name or '\\' in name or name.startswith('.'):
        raise _unknown(name)
    path = RECIPE_DIR / f'{name}.yaml'
    if not path.is_file():
        raise _unknown(name)
    where = f"--recipe {name} ({path})"
    try:
        values = yaml.safe_load(path.read_text(encoding='utf-8'))
    except yaml.YAMLError as e:
        raise UsageError(f"{where}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise UsageError(f"{where}: expected a mapping of key: value")
    about = values.pop('about', None)
    if not isinstance(about, dict):
        raise UsageError(f"{where}: no `about:` block (paper, source, reported, data, devices, notes)")
    missing = [k for k in ABOUT_REQUIRED if k not in about]
    unknown = sorted(set(about) - set(ABOUT_REQUIRED) - set(ABOUT_OPTIONAL))
    if missing or unknown:
        raise UsageError(f"{where}: `about:` " + (f"lacks {', '.join(missing)}" if missing else '')
                         + ('; ' if missing and unknown else '') + (f"has unknown {', '.join(unknown)}" if unknown else ''))
    values = check_values(values, where)
    if values.get('dataset_size') is None:
        raise UsageError(f"{where}: sets no dataset_size (a dry run counts steps from it)")
    return values, dict(about)


def recipe_rows() -> List[Dict[str, Any]]:
    """One row per recipe for `structformer recipes`: name, paper, source, model, data, reported."""
    rows = []
    for name in list_recipes():
        values, about = load_recipe(name)
        rows.append({'name': name, 'paper': about['paper'], 'source': about['source'], 'covers': about['covers'],
                     'model': values.get('model', TrainConfig.model), 'data': values.get('data', TrainConfig.data),
                     'reported': about['reported'], 'sweep': about.get('sweep'),
                     'models': list(about.get('models', []))})
    return rows


# ------------------------------------------------------------------------------------ the recipe's model
# the registering module of a model is its family; timm's ViT modules and our small ViTs are one family
_FAMILY_ALIASES = {'deit': 'vit', 'vision_transformer': 'vit'}
_VIT_SHRINKS = ('vit_digits', 'vit_mnist')
# a family's small members registered for a smoke run, besides its *_digits / *_mnist / *_synthetic models
_TINY_MEMBERS = {'gpt': ('gpt2_byte_tiny',), 'resnet': ('resnet18',), 'wide_resnet': ('wrn_16_4',)}
_SMALL_DATA_SUFFIXES = ('_digits', '_mnist', '_synthetic')


def model_family(name: str) -> Optional[str]:
    """The family of a registered model: the module that registers it ('crate', 'soft', 'vit', 'mixer',
    'resnet', ...); None for a name timm does not know."""
    import timm
    from timm.models._registry import _model_to_module

    import structformer.models  # noqa: F401  (registers our models)
    if name in _VIT_SHRINKS:
        return 'vit'
    if not timm.is_model(name):
        return None
    module = _model_to_module.get(name)
    return _FAMILY_ALIASES.get(module, module)


def is_registered_shrink(model: str, of: str) -> bool:
    """`model` is a small member of `of`'s family, registered for small data: a smoke run of the recipe."""
    family = model_family(of)
    if family is None or model_family(model) != family:
        return False
    return model.endswith(_SMALL_DATA_SUFFIXES) or model in _TINY_MEMBERS.get(family, ())


def recipe_model_relation(config: TrainConfig, recipe_values: Dict[str, Any], about: Dict[str, Any]) -> str:
    """'recipe' (the recipe's model and model_kwargs), 'kwargs' (its model, other kwargs), 'row' (a model its
    rows train), 'shrink', 'other'."""
    model = recipe_values.get('model', TrainConfig.model)
    if config.model == model:
        return 'recipe' if config.model_kwargs == recipe_values.get('model_kwargs', {}) else 'kwargs'
    if config.model in about.get('models', []):
        return 'row'
    return 'shrink' if is_registered_shrink(config.model, model) else 'other'


def check_recipe_model(config: TrainConfig) -> None:
    """Refuse --recipe NAME with another family's model (or another size of the family that is not its
    registered shrink) unless --allow-other-model: the recipe's values and reported number belong to its model."""
    if not config.recipe or config.allow_other_model:
        return
    values, about = load_recipe(config.recipe)
    if recipe_model_relation(config, values, about) != 'other':
        return
    model = values.get('model', TrainConfig.model)
    rows = f", one its rows train ({', '.join(about['models'])})" if about.get('models') else ''
    raise UsageError(f"--model {config.model} with --recipe {config.recipe}: the recipe trains {model}{rows}; "
                     f"--model {config.model} is {_family_words(config.model)}, not the recipe's model or a "
                     f"registered shrink of it (e.g. {_a_shrink(model)}); pass --allow-other-model to train it "
                     "with this recipe's settings anyway (its reported number is then not this model's)")


def _family_words(name: str) -> str:
    family = model_family(name)
    return f"of the {family} family" if family else 'not a registered model'


def _a_shrink(model: str) -> str:
    import timm
    family = model_family(model)
    small = [n for n in timm.list_models() + list(_VIT_SHRINKS)
             if model_family(n) == family and is_registered_shrink(n, model)] if family else []
    return ', '.join(sorted(small)[:3]) or f"{model} with smaller --model-kwargs"
