"""Importing this registers every structformer model with timm."""
from ._registry import list_structformer_models, register_model
from .crate import CRATE, CrateBlock
from . import soft
