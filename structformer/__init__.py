"""structformer: structured deep networks (CRATE, SOFT, Sparsifiner, sparse Mixers, low-rank
training) as timm models, with one CLI and white-box measurements.

`import structformer` registers every model with timm, so `timm.create_model('crate_tiny_patch16_224')` works.
"""
from . import functional, layers, models
from .models import list_structformer_models

__version__ = '0.1.0'
