"""A weights folder: what `structformer convert` writes, and what a model built in Python is saved as
(`save_weights_folder`), so that every reader of the package takes it:

    model.safetensors   the weights
    config.json         timm's `save_config_for_hf` (architecture, model_args, pretrained_cfg):
                        timm.create_model('local-dir:FOLDER', pretrained=True)
    state.json          our checkpoint state (model, kwargs, the recipe): `structformer export FOLDER`,
                        `eval --checkpoint FOLDER`, `train --pretrained-path / --initial-checkpoint FOLDER`

Written in a temporary sibling renamed into place when complete (`structformer.atomic`), so OUT is absent or whole.
"""
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from ..errors import UsageError

__all__ = ['save_weights_folder']


def save_weights_folder(model: torch.nn.Module, folder, model_kwargs: Optional[Dict[str, Any]] = None,
                        name: Optional[str] = None, transforms: Sequence = (), recipe=None,
                        record: Optional[Dict] = None, flag: str = 'folder') -> Path:
    """Save `model` as a weights folder at `folder` (new, or an empty folder). `name` (default: the model's
    `pretrained_cfg['architecture']`) and `model_kwargs` must be what the model was built with
    (`timm.create_model(name, **model_kwargs)`), and `transforms` the model transforms applied after it; or give
    the `recipe` that `structformer.models.factory.build_model` returned. Readers rebuild the network from these:
    checked here by rebuilding it, and refused with the first weights that do not fit. `record`: kept in
    state.json as `converted_from`. Returns the folder's absolute path."""
    from safetensors.torch import save_file
    from timm.models._hub import save_config_for_hf

    from ..atomic import permissions_from_umask, prepare_output, temporary_sibling
    from ..models.factory import ModelRecipe, default_input_size, rebuild
    from ..models.transforms import normalize_transforms
    from .mismatch import describe_mismatch
    if recipe is not None:
        name, model_kwargs, transforms = recipe.name, recipe.kwargs, recipe.transforms
    name = name or (getattr(model, 'pretrained_cfg', None) or {}).get('architecture')
    if not name:
        raise UsageError(f"{flag}: the model has no pretrained_cfg['architecture']; pass name= (the registered "
                         "name it was built with)")
    kwargs = dict(model_kwargs or {})
    out = Path(folder).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{flag} {folder}: exists and is not an empty folder; give a new one")
    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
    recipe = ModelRecipe(name, kwargs, normalize_transforms(list(transforms)), default_input_size(name, kwargs))
    mismatch = describe_mismatch(rebuild(recipe).state_dict(), tensors)
    if mismatch:
        raise UsageError(f"{flag} {folder}: the weights do not fit {name} built with {kwargs or 'no kwargs'}"
                         f"{' and its transforms' if transforms else ''} ({mismatch}); pass the model_kwargs it was "
                         "built with")
    made = [parent for parent in out.parents if not parent.exists()]      # removed again on failure
    out.parent.mkdir(parents=True, exist_ok=True)
    for line in prepare_output(out, flag):            # what an interrupted earlier writer left beside it
        print(f"note: {line}")
    tmp = temporary_sibling(out, directory=True)
    try:
        save_file(tensors, str(tmp / 'model.safetensors'), metadata={'format': 'pt'})
        save_config_for_hf(model, str(tmp / 'config.json'), model_args=dict(kwargs))
        # 'weights_folder': not a training checkpoint (epoch 0 is no epoch of a run): export says where it came from
        state = {'model': name, 'model_kwargs': kwargs, 'recipe': recipe.to_dict(), 'epoch': 0, 'step': 0,
                 'config': {}, 'weights_folder': True}
        if record is not None:
            state['converted_from'] = record
        (tmp / 'state.json').write_text(json.dumps(state, indent=1))
        for written in tmp.iterdir():
            permissions_from_umask(written, 0o666)
        permissions_from_umask(tmp, 0o777)
        if out.exists():
            out.rmdir()                                  # empty, checked before
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in made:                              # innermost first; only if still empty
            try:
                parent.rmdir()
            except OSError:
                break
        raise
    return out
