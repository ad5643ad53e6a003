"""One training engine: loop, phases, checkpoints, DDP.

The names below load on first use (PEP 562), not with the package: `structformer train` checks its flags and
its config file through `structformer.train.config`, which needs neither torch nor timm, so a bad argument is
refused in a fraction of a second instead of after the engine's imports (about 7 s on a 2-core Zen 1).
"""
from ..lazy_names import lazy_exports

_EXPORTS = {'CheckpointError': 'checkpoint', 'load_checkpoint': 'checkpoint', 'load_model': 'checkpoint',
            'resolve_checkpoint': 'checkpoint', 'save_checkpoint': 'checkpoint',
            'TrainConfig': 'config', 'load_config_file': 'config',
            'Trainer': 'engine', 'TrainingDiverged': 'engine', 'evaluate': 'engine', 'train': 'engine',
            'LOSS_TERMS': 'phases', 'LossContext': 'phases', 'Phase': 'phases', 'register_loss_term': 'phases'}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
