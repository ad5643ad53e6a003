"""Weights in: timm's pretrained loading for structformer models (per-family filters) and converters from the
public code's checkpoints (`structformer convert`). docs/weights.md."""
from .filters import WeightsMismatch, adapt_state_dict, filter_fn_for, pretrained_filter_fn

__all__ = ['WeightsMismatch', 'adapt_state_dict', 'filter_fn_for', 'pretrained_filter_fn']
