"""The image size of a dataset follows the model it is for.

An image folder, shards, a Hugging Face dataset or CIFAR-10 has no size of its own that a model must
take: without `img_size` it is read at the model's input size (model_kwargs img_size, else its pretrained
config's input_size), so an 8-px `crate_digits` gets 8-px images, not 224-px ones (12,544 tokens). A given
img_size that the model cannot be built for (e.g. not a multiple of its patch) is refused in one line
naming both sizes, before anything is read.
"""
import math
from typing import Dict, Optional

from ..errors import UsageError

FOLLOWS_MODEL = ('imagefolder', 'wds', 'hfds', 'imagenet', 'cifar10')


def model_input_size(model: str, model_kwargs: Dict):
    """The model's (H, W), or None if unknown (not registered, or no pretrained config)."""
    try:
        from ..models.factory import default_input_size
        size = default_input_size(model, model_kwargs)
    except Exception:                 # an unknown model: the model build names it
        return None
    return size[1:] if size else None


def check_model_takes(model: str, model_kwargs: Dict, img_size: int, native) -> None:
    """Build `model` for `img_size` on the meta device (no memory, no init cost); a size error it raises
    becomes one line naming both sizes. Other errors are left to the real build, which names them."""
    import timm
    import torch
    kwargs = dict(model_kwargs, img_size=img_size)
    try:
        with torch.device('meta'):
            timm.create_model(model, **kwargs)
    except (ValueError, AssertionError) as e:
        if 'img_size' in str(e) or 'divisible' in str(e):
            raise UsageError(f'--data-kwargs img_size={img_size}: --model {model} (input size {native[0]}) '
                             f'cannot take {img_size}-px images: {str(e).splitlines()[0][:200]}') from None
    except Exception:
        pass


def resolve_img_size(name: str, options: Dict, model: str, model_kwargs: Dict) -> Dict:
    """{'img_size': N} to add to the dataset options (or {}), after checking a given one against the model."""
    if name not in FOLLOWS_MODEL:
        return {}
    native = model_input_size(model, model_kwargs)
    if 'img_size' in options:
        if native is not None:
            try:
                size = int(options['img_size'])
            except (TypeError, ValueError):
                return {}                 # the dataset's own option check names it
            check_model_takes(model, model_kwargs, size, native)
        return {}
    if native is None or native[0] != native[1]:
        return {}
    if name == 'cifar10' and native[0] == 32:
        return {}
    return {'img_size': int(native[0])}


def check_image_side(img_size: int, crop_pct: Optional[float] = None) -> None:
    """Refuse an image size PIL will not make: held-out images are resized to img_size / crop_pct a side (timm's
    crop_pct 0.875 when None) before their centre crop, and PIL refuses an image beyond Image.MAX_IMAGE_PIXELS
    (its decompression-bomb guard; twice it is an error). Before: img_size=30000 was PIL's DecompressionBombError
    traceback from a loader, img_size=100000 (or crop_pct=0.0001 at 8 px) a process killed for memory."""
    from PIL import Image
    limit = Image.MAX_IMAGE_PIXELS
    if limit is None:                    # a user who lifted PIL's guard takes the sizes on
        return
    pct = crop_pct or 0.875
    side = math.ceil(img_size / pct)
    if side * side > limit:
        largest = math.floor(math.isqrt(limit) * pct)
        remedy = (f"at this crop_pct img_size goes up to {largest:,}" if largest >= 8 else
                  "this crop_pct leaves no img_size >= 8 within it: raise crop_pct")
        raise UsageError(f"--data-kwargs img_size={img_size}" + (f" crop_pct={crop_pct}" if crop_pct else '')
                         + f": held-out images are resized to {side:,} px a side ({side * side:,} pixels), beyond "
                         f"PIL's limit of {limit:,} pixels (Image.MAX_IMAGE_PIXELS); {remedy}")


def check_batch_memory(flag: str, batch_size: int, in_chans: int, img_size: int) -> None:
    """Refuse a batch whose float32 images alone exceed this machine's memory: a lower bound on the step's need, so
    it refuses only what cannot run (before: the allocator's traceback, or a process killed)."""
    from ..machine import check_fits_memory
    check_fits_memory(batch_size * in_chans * img_size * img_size * 4,
                      f"{flag} {batch_size} of {in_chans}×{img_size}×{img_size} images: one float32 batch",
                      f"lower {flag} or img_size", UsageError)


class TensorResize:
    """[C, H, W] float tensor -> [C, size, size], bicubic with antialiasing (CIFAR-10 at a model's 224 px, as
    CRATE fine-tunes it), then `then` if given (a caller's transform)."""

    def __init__(self, size: int, then=None):
        self.size, self.then = size, then

    def __call__(self, x):
        import torch.nn.functional as F
        x = F.interpolate(x[None], size=(self.size, self.size), mode='bicubic', antialias=True,
                          align_corners=False)[0]
        return self.then(x) if self.then is not None else x


TEXT_FOLLOWS_MODEL = ('pysource', 'text')


def resolve_seq_len(name: str, options: Dict, model: str, model_kwargs: Dict) -> Dict:
    """{'seq_len': T} for byte-level text read for a language model, T its context (model_kwargs img_size, else its
    pretrained config's), unless options give seq_len: `--model gpt2_byte_small --data pysource` trained at the
    text's default 128 instead of the model's 256, as images follow the model's input size."""
    if name not in TEXT_FOLLOWS_MODEL or 'seq_len' in options or model is None:
        return {}
    try:
        from ..models.base import takes_token_ids
        if not takes_token_ids(model):
            return {}
    except Exception:                 # an unknown model: the model build names it
        return {}
    size = model_input_size(model, model_kwargs)         # (1, T) for a language model's (1, 1, T) config
    context = size[-1] if size else None
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        return {}
    return {'seq_len': context}
