from .attention import ATTENTION_LAYERS, MSSA, get_attention, register_attention
from .mlp import ISTA
