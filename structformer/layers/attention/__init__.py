"""Attention layers with timm's `attn_layer` signature, and the name -> class registry."""
from .registry import (ATTENTION_LAYERS, accepted_options, check_options, get_attention, register_attention,
                       select_options)
from .mssa import MSSA
from .softmax import NaiveSoftmaxAttention, SoftmaxAttention
from .soft import SoftAttention, SoftPlusPlusAttention
from .linformer import LinformerAttention
from .performer import PerformerAttention
from .nystrom import NystromAttention
from .sparsifiner import SparsifinerAttention
