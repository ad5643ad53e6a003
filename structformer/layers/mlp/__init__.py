from .ista import ISTA
