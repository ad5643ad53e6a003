"""Importing this registers every structformer model with timm; `factory` is the one way to build one."""
from ..requirements import warn_if_too_old
from ._registry import list_structformer_language_models, list_structformer_models, register_model
from .crate import CRATE, CrateBlock
from . import attention_swap, mixer, soft, soft_variants, sparsifiner, token_pruning
from .soft import SoftNet
from . import gpt, wide_resnet
from .factory import ModelRecipe, build_model, rebuild
from .transforms import TRANSFORMS, register_transform
from . import factorize as _factorize  # noqa: F401,E402  (registers the 'factorize' transform)
from . import _fx  # noqa: F401,E402  (our layers as leaves of timm's FX tracing)

warn_if_too_old()             # torch / timm older than the floors says so once (an install with --no-deps)
