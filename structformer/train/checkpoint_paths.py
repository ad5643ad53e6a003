"""Where a checkpoint is, from what the user gave (`resolve_checkpoint`), and the names of a run's checkpoint
folders (`checkpoint_name`, `parse_checkpoint_name`): paths, names and JSON only, no torch, so a command refuses a
wrong --checkpoint before it imports torch (seconds). `train.checkpoint` re-exports every name here."""
import json
import re
import sys
from pathlib import Path
from typing import List, Optional, Tuple

LATEST = 'latest.json'


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or not a structformer checkpoint."""


# the folder names of a run's checkpoints: epoch_NNNN (after epoch N; 0 is the initial weights) and
# recovery_EEEE_SSSSSSSS (inside epoch E at global step S); at least 4 / 8 digits, more where the number needs them
_CHECKPOINT_NAME = re.compile(r'epoch_(?P<epoch>\d{4,})|recovery_(?P<recovery_epoch>\d{4,})_(?P<step>\d{8,})')
# timm train.py's CheckpointSaver: checkpoint-N.pth.tar, last.pth.tar, model_best.pth.tar (pickled whole state)
_TIMM_SAVER_NAME = re.compile(r'checkpoint-\d+\.pth\.tar|last\.pth\.tar|model_best\.pth\.tar')


def checkpoint_name(epoch: int, global_step: Optional[int] = None) -> str:
    """The folder name of epoch `epoch`'s checkpoint, or of a recovery point inside it at `global_step`."""
    return f'epoch_{epoch:04d}' if global_step is None else f'recovery_{epoch:04d}_{global_step:08d}'


def parse_checkpoint_name(name: str) -> Optional[Tuple[int, Optional[int]]]:
    """(epoch, global step or None) of a name `checkpoint_name` writes; None for any other name (a copy such as
    epoch_0003.bak or recovery_0002_00000010 (2), a temporary, timm's checkpoint-N.pth.tar / last.pth.tar /
    model_best.pth.tar), which is not this run's checkpoint."""
    match = _CHECKPOINT_NAME.fullmatch(name)
    if match is None:
        return None
    epoch, step = ((int(match['epoch']), None) if match['epoch'] is not None
                   else (int(match['recovery_epoch']), int(match['step'])))
    return (epoch, step) if checkpoint_name(epoch, step) == name else None      # one name per checkpoint


def checkpoint_folders(ckpt_dir: Path, recovery: bool = False) -> List[Path]:
    """The folders in `ckpt_dir` named as epoch checkpoints (or recovery points), complete or not, oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    named = {p: parse_checkpoint_name(p.name) for p in ckpt_dir.iterdir() if p.is_dir()}
    kept = [p for p, key in named.items() if key is not None and (key[1] is not None) == recovery]
    return sorted(kept, key=lambda p: (named[p][0], named[p][1] or 0))


def timm_name_hint(given) -> str:
    """For a path that does not exist: where it is timm's model-name form of a folder, `local-dir:FOLDER` (what
    `timm.create_model` takes, and the pages show beside these flags), the folder to give instead; else ''."""
    text = str(given)
    if not text.startswith('local-dir:') or Path(text).exists():
        return ''
    rest = text[len('local-dir:'):]
    there = (' (a folder)' if Path(rest).is_dir() else ' (a file)' if Path(rest).is_file() else '') if rest else ''
    return (f"; local-dir: is timm's model-name prefix (timm.create_model('local-dir:FOLDER')); here give the path "
            f"itself: {rest}{there}")


def resolve_checkpoint(path) -> Path:
    """Accept a checkpoint directory, its model.safetensors, a run directory or its checkpoints/ folder."""
    from ..atomic import describe_temporary
    given, path = path, Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--checkpoint: {path} does not exist{timm_name_hint(given)}")
    unfinished = describe_temporary(path) or (describe_temporary(path.parent) if path.is_file() else '')
    if unfinished:                                      # an interrupted writer's temporary is never an output
        raise CheckpointError(f"--checkpoint: {path} {unfinished}")
    if path.is_file():
        if _TIMM_SAVER_NAME.fullmatch(path.name):
            raise CheckpointError(f"--checkpoint: {path} is a timm train.py checkpoint (its CheckpointSaver's "
                                  "checkpoint-N / last / model_best .pth.tar), not a structformer run: its weights can "
                                  "start a run (train --initial-checkpoint FILE), but it cannot resume or be scored "
                                  "as one; `structformer convert FILE --from timm --model NAME --output FOLDER` makes "
                                  "a weights folder of it that eval and export take")
        if path.name not in ('model.safetensors', 'state.json'):
            from ..weights.file_kind import torch_archive
            torch_file, program = torch_archive(path)
            if program:
                raise CheckpointError(f"--checkpoint: {path} {program}")
            if torch_file:
                raise CheckpointError(f"--checkpoint: {path} is a torch.save file, not a structformer checkpoint: "
                                      f"convert it into a weights folder first (structformer convert {path} --from "
                                      "LAYOUT --model NAME --output DIR) and give that folder, or start a run from "
                                      "it with train --initial-checkpoint")
            raise CheckpointError(f"--checkpoint: {path} is a file but not a checkpoint's model.safetensors or "
                                  "state.json; give a run directory, a checkpoint folder or its model.safetensors")
        path = path.parent
    replaced = replaced_run(path.parent if path.name == 'checkpoints' else path)
    if replaced is not None:
        print(f"note: {path} holds an --overwrite that stopped before its first epoch; reading the run it "
              f"replaced, which the next `train --output` into this folder puts back", file=sys.stderr)
        path = replaced
    for candidate in (path, path / 'checkpoints'):
        if (candidate / 'model.safetensors').exists() or (candidate / 'state.json').exists() or (
                (candidate / 'config.json').is_file() and (candidate / 'pytorch_model.bin').is_file()):
            return candidate            # a timm Hub folder (pytorch_model.bin: saved unsafe) is named by the reader
        committed = committed_checkpoints(candidate)
        latest = candidate / LATEST
        if latest.exists():
            try:
                name = json.loads(latest.read_text())['checkpoint']
                if not isinstance(name, str) or (candidate / name) not in committed:
                    raise ValueError(f"it names {name!r}, which is not a complete checkpoint here")
                return candidate / name
            except (ValueError, KeyError, TypeError, OSError) as e:
                if not committed:
                    raise CheckpointError(f"--checkpoint: {latest} is corrupt ({e}) and {candidate} holds no "
                                          "complete checkpoint") from None
                print(f"note: {latest} is unreadable ({type(e).__name__}: {e}); using the newest complete "
                      f"checkpoint, {committed[-1].name}", file=sys.stderr)
                return committed[-1]
        if committed:                                   # killed before latest.json was first written
            return committed[-1]
    raise CheckpointError(f"--checkpoint: {path} is not a structformer checkpoint or run directory "
                          "(expected model.safetensors + state.json, or checkpoints/latest.json)")


def committed_checkpoints(ckpt_dir: Path):
    """Complete checkpoint folders (weights and state present) in `ckpt_dir`, oldest first."""
    return [p for p in checkpoint_folders(ckpt_dir) if (p / 'state.json').is_file()
            and (p / 'model.safetensors').is_file()]


def checkpoint_epoch(checkpoint: Path) -> int:
    """N of a checkpoint folder epoch_NNNN (and E of a recovery point recovery_EEEE_SSSSSSSS)."""
    parsed = parse_checkpoint_name(Path(checkpoint).name)
    if parsed is None:
        raise ValueError(f"{checkpoint}: not a checkpoint folder name (epoch_NNNN or recovery_EEEE_SSSSSSSS)")
    return parsed[0]


def replaced_run(run: Path) -> Optional[Path]:
    """The records an `--overwrite` of `run` moved aside (RUN/.replaced-PID) while the new run has not yet
    committed a trained epoch, else None. That old run is still the folder's run: the next start puts it back
    (`run_dir.reconcile`), so readers (eval, analyze, --resume) read it rather than the new run's init."""
    run = Path(run)
    asides = [a for a in sorted(run.glob('.replaced-*')) if committed_checkpoints(a / 'checkpoints')]
    if not asides or any(checkpoint_epoch(p) >= 1 for p in committed_checkpoints(run / 'checkpoints')):
        return None
    return asides[-1]
