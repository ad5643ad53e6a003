"""Recovery points: a checkpoint every `--recovery-interval` optimiser steps inside an epoch (timm's flag), so a
crash in a multi-hour ImageNet epoch loses minutes, not the epoch.

A recovery point is a full checkpoint (weights, optimiser, RNG, the parts' files) in
`RUN/checkpoints/recovery_EEEE_SSSSSSSS/` (epoch E under way, global step S), plus where the epoch stood: the
batches it had taken and its running sums for the epoch record. It commits by rename like an epoch checkpoint,
then the older recovery points are removed, so there is one (two for the moment between). Once epoch E's own
checkpoint commits, its recovery points go; `reconcile` removes any that an epoch checkpoint has overtaken.

`--resume` takes the newest of the two kinds. From a recovery point the epoch goes on after its first k batches:
the training order and every sample's augmentation depend on (seed, epoch, position) alone, the RNGs that
dropout, drop path and Mixup draw from are restored, and a shard stream's workers replay their shuffle
buffers (data/shards.py), so the weights equal an uninterrupted run's, bit for bit, for folders, Hugging Face
data sets and shards alike (tested).
"""
import shutil
from pathlib import Path
from typing import Dict, List, Optional

from .checkpoint import checkpoint_epoch, checkpoint_folders, checkpoint_name, committed_checkpoints


def recovery_name(epoch: int, global_step: int) -> str:
    return checkpoint_name(epoch, global_step)


def recovery_points(ckpt_dir: Path) -> List[Path]:
    """Committed recovery points (weights and state present), oldest first; a folder named otherwise (a copy, a
    temporary) is none (checkpoint.parse_checkpoint_name)."""
    return [p for p in checkpoint_folders(ckpt_dir, recovery=True)
            if (p / 'state.json').is_file() and (p / 'model.safetensors').is_file()]


def epoch_of(point: Path) -> int:
    """The epoch under way at a recovery point."""
    return checkpoint_epoch(point)


def newer_than(ckpt_dir: Path, completed_epochs: int) -> Optional[Path]:
    """The newest recovery point inside an epoch after `completed_epochs`, or None."""
    points = [p for p in recovery_points(ckpt_dir) if epoch_of(p) > completed_epochs]
    return points[-1] if points else None


def resume_source(resume, ckpt_dir: Path):
    """What `--resume` continues: alone, the run's latest checkpoint or a recovery point inside the epoch after it;
    `--resume PATH`, that checkpoint (`Trainer` and `train --dry-run --resume` both ask here)."""
    if resume not in (True, 'latest', ''):
        return resume
    done = committed_checkpoints(ckpt_dir)
    return newer_than(ckpt_dir, checkpoint_epoch(done[-1]) if done else -1) or ckpt_dir


def resume_plan(resume, output, epochs: int) -> str:
    """The line of `train --dry-run --resume`: the checkpoint the run would continue from and where training goes
    on (the epoch, and the batch inside it from a recovery point), in the words the resumed run prints. Reads
    only."""
    from ..errors import UsageError, one_line
    from .checkpoint import load_checkpoint
    try:
        _, state, _ = load_checkpoint(resume_source(resume, Path(output) / 'checkpoints'))
    except (FileNotFoundError, ValueError) as e:       # CheckpointError is a ValueError
        raise UsageError(f"--resume: {one_line(e).split('--checkpoint: ', 1)[-1]}") from None
    source, step, within = state['path'], state.get('global_step'), state.get('recovery')
    at_step = f" (optimiser step {step})" if step is not None else ''
    if within:
        batches = within.get('batches_per_epoch')
        return (f"resume        from {source}: a recovery point inside epoch {within['epoch']} of {epochs}, after "
                f"{within['batches']}" + (f" of its {batches}" if batches else '') + f" batches{at_step}; training "
                f"goes on at epoch {within['epoch']}, batch {within['batches'] + 1}")
    done = int(state.get('epoch', 0))
    if done >= epochs:
        return (f"resume        from {source}: epoch {done} of {epochs}{at_step}, the last; nothing is left to "
                f"train (--epochs N above {done} extends the run)")
    return f"resume        from {source}: epoch {done} of {epochs}{at_step}; training goes on at epoch {done + 1}"


def prune(ckpt_dir: Path, keep: Optional[Path] = None, completed_epochs: int = -1) -> None:
    """Remove every recovery point but `keep`, and those of epochs up to `completed_epochs` (overtaken)."""
    for point in recovery_points(ckpt_dir):
        if point != keep or epoch_of(point) <= completed_epochs:
            shutil.rmtree(point, ignore_errors=True)


def progress_state(batches: int, totals: Dict[str, float], seen: int, seen_targets: int, correct: int,
                   elapsed: float) -> Dict:
    """Where an epoch stands, for its record after a resume (the sums of the batches already taken)."""
    return {'batches': batches, 'totals': dict(totals), 'seen': seen, 'seen_targets': seen_targets,
            'correct': correct, 'elapsed': elapsed}
