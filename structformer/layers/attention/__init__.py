"""Attention layers with timm's `attn_layer` signature, and the name -> class registry."""
from .registry import ATTENTION_LAYERS, get_attention, register_attention
from .mssa import MSSA
