"""The data a trained model is scored on, and the one forward that checks the model can take it.

`structformer eval` and `analyze` score a checkpoint on its run's own data or on `--data` given. The run's data
options (`data_kwargs`) belong to its own data: an image folder's `check=` or `bad_images=` is not an option of
shards or of digits, so on other data only the options given now apply (`checkpoint_data_options`). An image
folder, shards, a Hugging Face dataset or CIFAR-10 has no size of its own (data/sizing.py): on those the images
are read at the size the model was trained on, as training read them, not at the form's 224 px default.

`check_model_input` runs one forward of a small batch before the real work (the trainer's pre-flight, eval's),
so a model built for other images (size, channels) or for other data (images into a language model) is refused
in one line naming both, whichever library's check caught it: torch's convolutions raise RuntimeError, timm's
patch embedding an AssertionError (`_assert`) or a ValueError from unpacking the shape, our models a ValueError.
"""
import contextlib
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..errors import UsageError
from .precision import Precision, low_precision_failure

# what a model raises on an input it was not built for (see the module docstring)
_SHAPE_ERRORS = (RuntimeError, NotImplementedError, ValueError, AssertionError)


def trained_input_size(state: Dict[str, Any]) -> Optional[Tuple[int, int, int]]:
    """(C, H, W) the checkpoint's model was built for: its recipe's input size, else its data's; None if unknown."""
    size = (state.get('recipe') or {}).get('input_size')
    if size and len(size) == 3:
        return tuple(int(v) for v in size)
    info = state.get('data_info') or {}
    if info.get('in_chans') and isinstance(info.get('img_size'), int):
        return int(info['in_chans']), info['img_size'], info['img_size']
    return None


def checkpoint_data_options(state: Dict[str, Any], data: Optional[str], given: Optional[Dict] = None) -> Dict:
    """The dataset options to score `state`'s model on `data` (None: the run's own): the run's options on its own
    data, only `given` on other data; and on a form whose size follows the model, img_size = the size the model
    was trained on unless given."""
    from ..data.sizing import FOLLOWS_MODEL
    from ..data.spec import parse_data_spec
    from .data_paths import absolute_data
    config = state.get('config') or {}
    own = data is None or data == config.get('data') or absolute_data(data)[0] == config.get('data')
    options = dict(config.get('data_kwargs') or {}) if own else {}
    options.update(given or {})
    try:
        name, _ = parse_data_spec(data or config.get('data') or '')
    except ValueError:               # the dataset builder names a bad spec
        return options
    size = trained_input_size(state)
    if name in FOLLOWS_MODEL and 'img_size' not in options and size is not None and size[1] == size[2]:
        options['img_size'] = size[1]
    options.update({k: v for k, v in _weights_folder_geometry(state, name).items() if k not in options})
    return options


# the data forms with an `augment` option (data/*.py OPTIONS); the others have no augmentation to turn off
AUGMENTING_FORMS = frozenset({'digits', 'mnist', 'cifar10', 'imagefolder', 'wds', 'hfds', 'imagenet'})


def unaugmented(data: str, options: Dict) -> Dict:
    """`options` with the training augmentation off where `data`'s form has one: a split that is scored (eval's
    --split train) is read as timm's validate.py reads any split, with the evaluation transform. The train split of
    an image folder, shards, MNIST or CIFAR-10 is augmented by default (random crops and flips), and digits' with the
    run's augment=true, so it was scored on random images, another number at each call."""
    from ..data.spec import parse_data_spec
    try:
        name, _ = parse_data_spec(data)
    except ValueError:               # the dataset builder names a bad spec
        return options
    return dict(options, augment=False) if name in AUGMENTING_FORMS else options


def _weights_folder_geometry(state: Dict[str, Any], name: str) -> Dict[str, Any]:
    """crop_pct / interpolation of a weights folder's model (`structformer convert`, `save_weights_folder`: no run,
    so no data options of its own), read from its registered pretrained_cfg: the held-out images as the public code
    evaluates them (CRATE's Resize 256 / CenterCrop 224 bilinear, SOFT's crop 0.9 bicubic), not the image forms'
    generic 0.875 bilinear, which scored a converted SOFT checkpoint at another geometry than the one its config.json
    states. Only for the forms that take these options (image folders, shards, HF datasets, ImageNet)."""
    from ..data.imagefolder import CROP_MODES, EVAL_INTERPOLATIONS
    from ..data.pixel_stats import EVAL_GEOMETRY
    if not state.get('weights_folder') or name not in EVAL_GEOMETRY:
        return {}
    try:
        import timm
        cfg = timm.get_pretrained_cfg(state.get('model') or '')
    except Exception:                 # not registered: the model build names it
        return {}
    crop, interpolation = getattr(cfg, 'crop_pct', None), getattr(cfg, 'interpolation', None)
    out = {}
    if isinstance(crop, (int, float)) and 0 < crop <= 1:
        out['crop_pct'] = float(crop)
    if interpolation in EVAL_INTERPOLATIONS:
        out['interpolation'] = interpolation
    if getattr(cfg, 'crop_mode', None) in CROP_MODES:
        out['crop_mode'] = cfg.crop_mode
    return out


def model_in_chans(model: torch.nn.Module) -> Optional[int]:
    """The input channels `model` takes: the first `in_chans` of the model or a submodule (timm's models, CRATE's
    patch embedding), else the first Conv2d's in_channels; None where neither is found."""
    for module in model.modules():
        value = getattr(module, 'in_chans', None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return next((m.in_channels for m in model.modules() if isinstance(m, torch.nn.Conv2d)), None)


def check_model_input(model: torch.nn.Module, batch: torch.Tensor, precision: Optional[Precision],
                      refusal: str, channel_remedy: Optional[Callable[[int, int], str]] = None) -> torch.Tensor:
    """Logits of one forward of `batch` in eval mode, without gradients and with torch's RNG restored afterwards
    (the caller's run is unchanged). A failure that is the input's shape becomes one UsageError line,
    '`refusal` (shape [...]): <the model's own first line>'; where the images' channels are not the model's
    in_chans, '`refusal` (shape [...]): its images have C channels, the model takes M (in_chans=M); <channel_remedy(C, M)>' (the
    model's own line was torch's conv message, or advice to rebuild a trained model); one that is autocast's low
    precision, its own line."""
    was_training = model.training
    model.eval()
    device = batch.device
    gpus = [torch.cuda.current_device() if device.index is None else device.index] if device.type == 'cuda' else []
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=gpus), \
                (precision.autocast() if precision is not None else contextlib.nullcontext()):
            return model(batch)
    except UsageError:
        raise
    except _SHAPE_ERRORS as e:
        low = low_precision_failure(e, precision)
        if low is not None:
            raise low from None
        takes = model_in_chans(model) if batch.dim() == 4 and batch.is_floating_point() else None
        if takes is not None and takes != batch.shape[1]:
            given = int(batch.shape[1])
            raise UsageError(f"{refusal} (shape {list(batch.shape)}): its images have {given} channels, the model "
                             f"takes {takes} (in_chans="
                             f"{takes})" + (f"; {channel_remedy(given, takes)}" if channel_remedy else '')) from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"{refusal} (shape {list(batch.shape)}): {first}") from None
    finally:
        model.train(was_training)


class _Renormalised(torch.utils.data.Dataset):
    """`dataset`'s (image, label) pairs with each image channel mapped x -> x * scale + shift."""

    def __init__(self, dataset, scale: torch.Tensor, shift: torch.Tensor):
        self.dataset, self.scale, self.shift = dataset, scale, shift

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        image, label = self.dataset[index]
        return image * self.scale + self.shift, label


def weights_folder_normalisation(dataset, info, model: torch.nn.Module, state: Dict[str, Any]):
    """(dataset, (mean, std) or None): a weights folder's images normalised with the mean / std of its model's
    `pretrained_cfg` (its config.json: what timm's `local-dir:` loading and validate.py use) where the data form
    normalises with ImageNet's. A digits / MNIST / CIFAR model trained by timm's train.py on an image folder
    saw its registry statistics; scored with ImageNet's it got another number than timm's validate.py gave
    (41.7 % vs 16.7 % top-1 on the same 12 images). The data is already normalised as (p - m_d) / s_d, so
    (p - m) / s = x * s_d / s + (m_d - m) / s: exact up to rounding, whatever the transform before it."""
    from ..data.pixel_stats import EVAL_GEOMETRY
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    if not state.get('weights_folder') or info.name not in EVAL_GEOMETRY:
        return dataset, None
    stats = [tuple(float(v) for v in values or ()) for values in
             (cfg.get('mean'), cfg.get('std'), info.extra.get('mean'), info.extra.get('std'))]
    if any(len(values) != info.in_chans for values in stats) or any(v <= 0 for v in stats[1] + stats[3]):
        return dataset, None
    mean, std, data_mean, data_std = (torch.tensor(values).view(-1, 1, 1) for values in stats)
    if torch.allclose(mean, data_mean) and torch.allclose(std, data_std):
        return dataset, None
    return _Renormalised(dataset, data_std / std, (data_mean - mean) / std), (stats[0], stats[1])
