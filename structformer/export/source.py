"""What `structformer export` reads: a trained run, one of its checkpoints, or that checkpoint's files.

Only safetensors and JSON are read (`train.checkpoint.load_model`); a pickle (`torch.save`'s .pth / .pt / .bin)
is refused by its first bytes, whatever its name, because unpickling can run code.
"""
from pathlib import Path
from typing import Any, Dict, Tuple

from ..errors import UsageError

# torch.save writes a zip archive (b'PK\x03\x04'), older torch a bare pickle (protocol 2+: b'\x80')
_PICKLE_MAGIC = (b'PK\x03\x04', b'\x80')


def _looks_pickled(path: Path) -> bool:
    with open(path, 'rb') as f:
        head = f.read(4)
    return any(head.startswith(magic) for magic in _PICKLE_MAGIC)


def load_source(source) -> Tuple[Any, Dict[str, Any]]:
    """(model in eval mode on the CPU, its checkpoint's state.json) from RUN (a `structformer train` output
    folder: its latest checkpoint), a checkpoint folder, or its model.safetensors / state.json."""
    from ..train.checkpoint import load_model
    path = Path(source)
    if not path.exists():
        raise UsageError(f"SOURCE {source}: does not exist; give a run folder from `structformer train`, a "
                         "checkpoint folder or its model.safetensors")
    if path.is_file() and path.name not in ('model.safetensors', 'state.json'):
        if _looks_pickled(path):
            raise UsageError(f"SOURCE {source}: is a pickle (torch.save); export reads safetensors checkpoints "
                             "only, since unpickling can run code: give a run folder, a checkpoint folder or its "
                             "model.safetensors")
        raise UsageError(f"SOURCE {source}: is not a checkpoint file; give a run folder, a checkpoint folder or "
                         "its model.safetensors / state.json")
    model, state = load_model(path)
    return model.eval(), state
