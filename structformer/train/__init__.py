"""One training engine: loop, phases, checkpoints, DDP."""
from .checkpoint import CheckpointError, load_checkpoint, load_model, resolve_checkpoint, save_checkpoint
from .config import TrainConfig, load_config_file
from .engine import Trainer, TrainingDiverged, evaluate, train
from .phases import LOSS_TERMS, LossContext, Phase, register_loss_term
