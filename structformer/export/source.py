"""What `structformer export` reads: a trained run, one of its checkpoints, or that checkpoint's files.

Only safetensors and JSON are read (`train.checkpoint.load_model`); a pickle (`torch.save`'s .pth / .pt / .bin)
is refused by its first bytes, whatever its name, because unpickling can run code. The state returned carries
`notes`: which epoch was taken, and whether the run is still training (its latest committed checkpoint then).
"""
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..errors import UsageError


def weights_origin(state: Dict[str, Any]) -> Optional[str]:
    """Where a weights folder's weights came from (`structformer convert`: the file's name and layout, and which
    weights of a trainer's checkpoint; `save_weights_folder`: a model built in Python), or None for a training
    checkpoint. The file's name only: a model card is published, a local path is not."""
    record = state.get('converted_from')
    if isinstance(record, dict):
        taken = f", {record['weights']}" if record.get('weights') else ''
        return (f"converted by `structformer convert` from {Path(str(record.get('file', '?'))).name} "
                f"({record.get('from', '?')} layout{taken})")
    if state.get('weights_folder'):
        return 'saved from Python by structformer.weights.save_weights_folder (not a structformer train run)'
    return None


def _epoch_notes(source, state: Dict[str, Any]) -> List[str]:
    """Which epoch of which run the checkpoint is, and whether that run is training now; for a weights folder,
    where its weights came from (its 'epoch 0' is no epoch of a run)."""
    from ..train.run_dir import training_now
    checkpoint = Path(state['path'])
    origin = weights_origin(state)
    if origin:
        return [f"took {checkpoint.name}: weights {origin}"]
    epoch = state.get('epoch')
    total = (state.get('config') or {}).get('epochs')
    of = f" of {total}" if isinstance(total, int) and total else ''
    if checkpoint.parent.name != 'checkpoints':
        return [f"took {checkpoint.name} (epoch {epoch}{of})"] if epoch is not None else []
    run = checkpoint.parent.parent
    if training_now(run):
        return [f"SOURCE {source}: the run is still training (a train process holds {run}/.lock): took its latest "
                f"committed checkpoint, {checkpoint.name} (epoch {epoch}{of}); export again when it has finished "
                "for the final weights"]
    finished = (run / 'summary.json').is_file()
    return [f"took {checkpoint.name} (epoch {epoch}{of}" + ('' if finished or not of else
                                                           ', the run stopped before its last epoch') + ')']


def check_source(source) -> Path:
    """SOURCE's path, refused in one line (UsageError) where it is missing, an unfinished writer's temporary, or a
    file that is no checkpoint (a pickle is never opened): paths and file headers only, no torch."""
    from ..atomic import describe_temporary
    path = Path(source)
    if not path.exists():
        from ..train.checkpoint_paths import timm_name_hint
        raise UsageError(f"SOURCE {source}: does not exist; give a run folder from `structformer train`, a "
                         f"checkpoint folder or its model.safetensors{timm_name_hint(source)}")
    for part in (path, path.parent):
        unfinished = describe_temporary(part)
        if unfinished:
            raise UsageError(f"SOURCE {source}: {unfinished}")
    if path.is_file() and path.name not in ('model.safetensors', 'state.json'):
        from ..weights.file_kind import torch_archive
        torch_file, program = torch_archive(path)
        if program:
            raise UsageError(f"SOURCE {source}: {program}")
        if torch_file:
            raise UsageError(f"SOURCE {source}: is a pickle (torch.save); export reads safetensors checkpoints "
                             "only, since unpickling can run code: give a run folder, a checkpoint folder or its "
                             "model.safetensors, or make a weights folder of it first, read without running code "
                             "(structformer convert FILE --from timm, or the public code's layout, --model NAME "
                             "--output DIR) and export that folder")
        raise UsageError(f"SOURCE {source}: is not a checkpoint file; give a run folder, a checkpoint folder or "
                         "its model.safetensors / state.json")
    return path


def load_source(source, ema: bool = False) -> Tuple[Any, Dict[str, Any]]:
    """(model in eval mode on the CPU, its checkpoint's state.json with `notes`) from RUN (a `structformer train`
    output folder: its latest checkpoint), a checkpoint folder, or its model.safetensors / state.json; `ema`: the
    weight average the run kept with --model-ema instead of its weights."""
    path = check_source(source)
    from ..train.checkpoint import CheckpointError, load_model     # torch: after the checks that need none
    try:
        model, state = load_model(path, ema=ema)
    except (CheckpointError, FileNotFoundError) as e:
        # the loader's messages name eval's --checkpoint; export has SOURCE
        message = str(e)
        for flag in ('--checkpoint: ', '--checkpoint '):
            message = message.replace(flag, '', 1) if message.startswith(flag) else message
        raise UsageError(f"SOURCE {source}: {message}") from None
    average = ['the weight average (--model-ema), not the weights'] if ema else []
    state['notes'] = _epoch_notes(source, state) + average
    return model.eval(), state
