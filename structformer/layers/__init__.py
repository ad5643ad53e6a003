from .attention import (ATTENTION_LAYERS, MSSA, LinformerAttention, NaiveSoftmaxAttention, NystromAttention,
                        PerformerAttention, SoftAttention, SoftmaxAttention, SoftPlusPlusAttention,
                        SparsifinerAttention, get_attention,
                        register_attention)
from .mlp import ISTA
from .linear import StructuredLinear
