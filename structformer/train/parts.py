"""Pieces the training loop calls at fixed points, so the loop names no family.

A `Part` may add loss terms to a step, act before an epoch (factorise the model), after an optimiser step
(update a weight average), add metrics at the end of an epoch, and keep files in each checkpoint. The engine
builds the parts a configuration asks for (`build_parts`) and calls every hook of every part in order.

    DistillationPart  Sparsifiner §4: the dense teacher starts the student, sees each batch first, gives the
                      distillation loss terms their targets, and sets the default two stages (train/distill.py)
    LowRankPart       seed 004: factorise after `factorize_at` dense epochs (truncated SVD, §4.3), Frobenius
                      decay (§3.3) as a loss term, per-layer spectra in the epoch record (Table 1)
    WeightAveragePart timm's ModelEmaV3: updated every step, evaluated every epoch, saved with the checkpoint
Precision (train/precision.py) wraps the step itself and Mixup (train/mixing.py) the batch.
"""
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch


class Part:
    """The hooks; each does nothing unless a part overrides it."""

    def phase_specs(self, trainer):
        """Default training phases (None: this part has none); the first part that gives some sets them."""
        return None

    def check_phases(self, phases) -> None:
        """Refuse, before training, phases this part cannot serve."""

    def loss_terms(self, trainer) -> Dict[str, torch.Tensor]:
        return {}

    def before_epoch(self, trainer, epoch: int) -> None:
        pass

    def before_phase(self, trainer, phase) -> None:
        """After the phase's freezing, before its epoch's first batch."""

    def before_batch(self, trainer, images: torch.Tensor) -> None:
        """Before the student's forward of `images` (the mixed batch when mixing)."""

    def loss_extras(self) -> Dict[str, object]:
        """What the phase's loss terms may read from this part (LossContext.extras)."""
        return {}

    def finish(self) -> None:
        """The run ends (normally or not): leave the model as it was."""

    def after_step(self, trainer) -> None:
        pass

    def epoch_metrics(self, trainer, epoch: int) -> Dict:
        return {}

    def checkpoint_files(self) -> Dict[str, Dict[str, torch.Tensor]]:
        """{file name: tensors} written into each checkpoint folder beside the model's weights."""
        return {}

    def restore(self, checkpoint: Path) -> None:
        pass

    def process_files(self, trainer) -> Dict[str, Dict[str, torch.Tensor]]:
        """Every process calls it before rank 0 writes a checkpoint (a collective under DDP): more files for it,
        holding what differs between the processes (rank 0's `checkpoint_files` hold the rest)."""
        return {}

    def pending_metrics(self) -> Dict:
        """Metrics this part has for the epoch under way, not yet in a record: a recovery point keeps them, so
        the epoch's record after a resume from it is the straight run's."""
        return {}

    def resume_pending(self, metrics: Dict) -> None:
        """Take back `pending_metrics` from a recovery point."""

    def model_replaced(self, trainer) -> None:
        """The trainer's model was rebuilt (factorised mid-run): drop anything tied to the old one."""

    def evaluated_modules(self) -> List[torch.nn.Module]:
        """Modules besides the model that this part evaluates and saves (the weight average): their BatchNorm
        statistics are made one across processes with the model's (--dist-bn)."""
        return []


class LowRankPart(Part):
    """Low-rank training's pieces (models/factorize.py, train/lowrank_decay.py, models/lowrank_spectra.py) as the loop sees them."""

    def __init__(self, config):
        from . import lowrank_decay        # registers the frobenius_decay / factor_l2 loss terms
        self.config, self.regularizers = config, lowrank_decay
        self.switch_metrics: Dict[str, float] = {}

    def optimizer_exemptions(self, model) -> set:
        """Factor parameters that leave the optimiser's weight decay: Frobenius decay replaces it (§3.3)."""
        if self.config.factor_decay != 'frobenius':
            return set()
        return set(self.regularizers.factor_parameter_names(model))

    def loss_terms(self, trainer) -> Dict[str, torch.Tensor]:
        if not trainer.frobenius_weight:
            return {}
        return {'frobenius_decay': trainer.frobenius_weight * self.regularizers.frobenius_decay(trainer.model)}

    def due(self, trainer, epoch: int) -> bool:
        """True before the first epoch after `factorize_at` dense epochs, unless the recipe (a resumed run's
        included) already holds the factorisation."""
        cfg = self.config
        return (bool(cfg.factorize_at) and cfg.factorize_spec() is not None and epoch == cfg.factorize_at + 1
                and not any(t['name'] == 'factorize' for t in trainer.recipe.transforms))

    def before_epoch(self, trainer, epoch: int) -> None:
        if not self.due(trainer, epoch):
            return
        from ..models.transforms import TransformContext, apply_transforms, normalize_transforms
        spec = normalize_transforms([self.config.factorize_spec()])[0]
        for param in trainer.model.parameters():        # the next phase sets requires_grad again
            param.requires_grad_(True)
        model = apply_transforms(trainer.model, [spec], TransformContext(input_size=trainer.recipe.input_size))
        trainer.recipe.transforms.append(spec)
        trainer.replace_model(model)
        after = trainer.evaluate_model(trainer.model)     # what the switch cost, before any factorised step
        self.switch_metrics = {f'factorized_val_{k}': v for k, v in after.items()}

    def pending_metrics(self) -> Dict:
        return dict(self.switch_metrics)        # the switch's cost, measured before the epoch's first step

    def resume_pending(self, metrics: Dict) -> None:
        self.switch_metrics = dict(metrics)

    def epoch_metrics(self, trainer, epoch: int) -> Dict:
        record, self.switch_metrics = dict(self.switch_metrics), {}
        if self.config.factorize_spec() or self.regularizers.factor_parameter_names(trainer.model):
            record.update(self._spectra(trainer.model))
        return record

    @staticmethod
    def _spectra(model) -> Dict:
        """Per-layer effective rank ‖W‖_*/‖W‖_op and singular values (seed 004 Table 1), dense or factorised."""
        from ..models.lowrank_spectra import effective_rank, layer_spectra
        spectra = layer_spectra(model)
        ranks = {name: effective_rank(s) for name, s in spectra.items()}
        factored = [ranks[n] for n, m in model.named_modules() if n in ranks and hasattr(m, 'factors')]
        return {'effective_rank_mean': float(np.mean(factored)) if factored else None,
                'effective_rank': ranks,
                'singular_values': {n: [float(f'{v:.5g}') for v in s.tolist()] for n, s in spectra.items()}}


class WeightAveragePart(Part):
    """--model-ema: timm's ModelEmaV3 over the trained weights (train/ema.py)."""

    def __init__(self, model, config, rank: int = 0):
        from .ema import WeightAverage
        self.average = WeightAverage(model, config.model_ema_decay, config.model_ema_warmup)
        self.config, self.rank = config, rank

    def after_step(self, trainer) -> None:
        # timm's ModelEmaV3 warms its decay up from `step` (a copy at step 1, then 1 - (1 + step)^-2/3 up to the
        # decay): an average restarted at the switch gets the steps since it, as the run's average got them from the
        # run's start; the global step would start it at the decay the run had reached
        self.average.update(trainer.model, trainer.global_step - self.restart_step(trainer))

    def restart_step(self, trainer) -> int:
        """The optimiser step the average last started at: after `factorize_at` dense epochs once the network is
        factorised (`model_replaced`), else 0. From the configuration and the recipe rather than remembered, so a run
        resumed after the switch counts from the same step (the global step of a resume on another process count
        is re-counted in whole epochs of this one, save_resume.py, as this is)."""
        cfg = self.config
        switched = bool(cfg.factorize_at) and any(t['name'] == 'factorize' for t in trainer.recipe.transforms)
        return cfg.factorize_at * trainer.steps_per_epoch if switched else 0

    def model_replaced(self, trainer) -> None:
        # another architecture (e.g. factorised): the average restarts from the new weights
        from .ema import WeightAverage
        self.average = WeightAverage(trainer.model, self.average.ema.decay, self.average.ema.use_warmup)

    def evaluated_modules(self) -> List[torch.nn.Module]:
        # the average follows each process's own BatchNorm statistics (DDP syncs buffers only into the forward)
        return [self.average.module]

    def epoch_metrics(self, trainer, epoch: int) -> Dict:
        return {f'ema_val_{k}': v for k, v in trainer.evaluate_model(self.average.module).items()}

    def checkpoint_files(self) -> Dict[str, Dict[str, torch.Tensor]]:
        from .ema import EMA_FILE
        return {EMA_FILE: self.average.state_dict()}

    def process_files(self, trainer) -> Dict[str, Dict[str, torch.Tensor]]:
        # each process's average follows its own BatchNorm statistics (evaluated_modules); --dist-bn makes them one
        # at the epoch's end, but a recovery point inside an epoch (or any checkpoint without --dist-bn) found them
        # apart, and every process resumed rank 0's: the resumed average differed from the straight run's
        if trainer.world_size == 1:
            return {}
        from .distributed import gather_tensors
        from .ema import EMA_RANKS_FILE
        every = gather_tensors(self.average.process_buffers())
        differing = {f'rank{rank}.{name}': value for rank, theirs in enumerate(every) if rank
                     for name, value in theirs.items() if not torch.equal(value, every[0][name])}
        return {EMA_RANKS_FILE: differing} if differing else {}

    def restore(self, checkpoint: Path) -> None:
        from .ema import EMA_FILE, EMA_RANKS_FILE
        path = Path(checkpoint) / EMA_FILE
        if not path.is_file():
            from .checkpoint import CheckpointError
            raise CheckpointError(f"--resume: {checkpoint} has no {EMA_FILE}: it was trained without --model-ema")
        self.average.load_state_dict(_load_part_file(path, checkpoint))
        ranks = Path(checkpoint) / EMA_RANKS_FILE
        if self.rank and ranks.is_file():           # a recovery point's other processes: each takes its own
            self.average.load_process_buffers(_load_part_file(ranks, checkpoint), self.rank)


def _load_part_file(path: Path, checkpoint) -> Dict[str, torch.Tensor]:
    """A part's safetensors file; a damaged one is one line, as a damaged model.safetensors is
    (checkpoint.load_checkpoint)."""
    from safetensors.torch import load_file

    from .checkpoint import CheckpointError, earlier_checkpoint_hint
    try:
        return load_file(str(path))
    except Exception as e:
        raise CheckpointError(f"--resume: {path} is corrupt ({type(e).__name__}: {e})"
                              f"{earlier_checkpoint_hint(Path(checkpoint))}") from None


class DistillationPart(Part):
    """--teacher: distillation from a dense teacher (Sparsifiner §4, train/distill.py)."""

    def __init__(self, trainer):
        from . import distill
        from .checkpoint import resolve_checkpoint
        cfg = trainer.config
        teacher = distill.load_teacher(cfg.teacher, trainer.info, config=cfg)
        if trainer.resume:                        # a resumed student has its own weights
            distill.check_compatible(trainer.model, teacher)
        else:                                     # a new student starts from the teacher's
            distill.init_from_teacher(trainer.model, teacher)
        if Path(cfg.teacher).exists():            # recorded as the exact checkpoint / file read (a name stays a name)
            from .initial_weights import is_run_or_checkpoint
            cfg.teacher = str(resolve_checkpoint(cfg.teacher) if is_run_or_checkpoint(cfg.teacher)
                              else Path(cfg.teacher).absolute())
        self.config, self.distill = cfg, distill
        self.distiller = distill.Distiller(trainer.model, teacher.to(trainer.device))

    def phase_specs(self, trainer):
        stage1 = self.config.predictor_epochs
        if stage1 is None:
            stage1 = self.config.default_predictor_epochs() if self.distiller.sparse_layers else 0
            # recorded: the default follows --epochs, and a resume that extends the run must keep the stage 1 it
            # trained (as it keeps the warm-up), not move the boundary behind epochs already trained in stage 2
            self.config.predictor_epochs = stage1
        return self.distill.distillation_phases(self.config.epochs, stage1)

    def check_phases(self, phases) -> None:
        for phase in phases:
            self.distiller.check_phase_terms([t for t in phase.losses if t in self.distill.DISTILL_TERMS
                                              and phase.losses[t]])

    def before_phase(self, trainer, phase) -> None:
        self.distiller.start_phase(phase)

    def before_batch(self, trainer, images: torch.Tensor) -> None:
        self.distiller.start_batch(images)

    def loss_extras(self) -> Dict[str, object]:
        return {'distiller': self.distiller}

    def finish(self) -> None:
        self.distiller.stop()


def build_parts(trainer) -> List[Part]:
    """The parts a configuration asks for, in the order their hooks run: the teacher first (it sets the
    student's starting weights, which the weight average then copies)."""
    config = trainer.config
    parts: List[Part] = []
    if config.teacher:
        parts.append(DistillationPart(trainer))
    else:
        from .distill import note_untaught_predictors
        note_untaught_predictors(trainer.model, config, trainer.is_main)
    parts.append(LowRankPart(config))           # also reports spectra of a model factorised by --transform
    if config.model_ema:
        parts.append(WeightAveragePart(trainer.model, config, trainer.rank))
    return parts
