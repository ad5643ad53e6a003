"""FX tracing of our models (timm's `features_only=True, feature_cls='fx'`, its `create_feature_extractor`).

The layers whose forward FX cannot trace symbolically -- einops patterns and shape arithmetic (every attention
of the registry, CRATE's patch embedding), shape checks and feature shuffles (the structured linears), an autocast
block keyed on the input's device (ISTA) -- are registered with timm's `register_notrace_module`: timm's tracer
keeps them as leaves, which run as they are when the traced module runs (`isinstance`, so presets and subclasses
are covered). The models' own input checks are FX leaves through `functional.tracing.checked_images`. Registered
here rather than where the layers are defined: `structformer.layers` does not import timm (importing timm imports
`structformer.models`, which imports the layers).
"""
from timm.layers import register_notrace_module

from ..layers.attention.registry import ATTENTION_LAYERS
from ..layers.linear.base import StructuredLinear
from ..layers.mlp.ista import ISTA
from .crate import CratePatchEmbed
from .gpt import CausalSelfAttention

# CausalSelfAttention: its forward unpacks x.shape, which a symbolic trace cannot (the LM's fx features failed)
FX_LEAVES = (*ATTENTION_LAYERS.values(), StructuredLinear, ISTA, CratePatchEmbed, CausalSelfAttention)

for _leaf in FX_LEAVES:
    register_notrace_module(_leaf)
