"""A run directory as the single source of truth, whatever interrupted the process that wrote it.

    RUN/config.yaml, RUN/metrics.jsonl, RUN/summary.json, RUN/checkpoints/epoch_NNNN/, RUN/checkpoints/latest.json

Checkpoints commit by rename (see `checkpoint.save_checkpoint`), so after a kill the folder can hold:
an `epoch_NNNN.tmp-*` folder that never committed, a committed checkpoint that `latest.json` does not
name yet, or a `metrics.jsonl` whose last line is older or newer than the newest checkpoint. On every
start (new run, `--resume`, `--overwrite`) `reconcile` brings the records back in line with the newest
committed checkpoint: stale temporaries go, `latest.json` is rewritten from the checkpoints present,
and `metrics.jsonl` keeps exactly one line per epoch up to that checkpoint (a missing line is taken
from the checkpoint's own `state.json`, which carries that epoch's metrics).
"""
import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional

from ..atomic import write_text_atomically
from .checkpoint import LATEST, mark_latest

RUN_FILES = ('config.yaml', 'metrics.jsonl', 'summary.json', 'checkpoints')


def committed_checkpoints(ckpt_dir: Path) -> List[Path]:
    """Complete checkpoint folders (weights and state present), oldest first."""
    found = []
    for path in Path(ckpt_dir).glob('epoch_[0-9][0-9][0-9][0-9]'):
        if path.is_dir() and (path / 'state.json').is_file() and (path / 'model.safetensors').is_file():
            found.append(path)
    return sorted(found, key=lambda p: int(p.name.split('_')[1]))


def remove_stale_temporaries(ckpt_dir: Path) -> List[str]:
    """Delete what an interrupted commit left behind; return the names removed."""
    removed = []
    for path in Path(ckpt_dir).glob('*.tmp-*'):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def read_metrics(path: Path) -> List[Dict]:
    """metrics.jsonl as records; a torn last line (killed mid-write) is dropped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get('epoch'), int):
            records.append(record)
    return records


def reconcile(output: Path) -> Optional[Path]:
    """Make the records of the run in `output` agree with its newest committed checkpoint, which is
    returned (None if there is none)."""
    output = Path(output)
    ckpt_dir = output / 'checkpoints'
    for aside in output.glob('.replaced-*'):           # an --overwrite that was interrupted
        if committed_checkpoints(ckpt_dir):
            discard_aside(aside)                        # ... after the new run's first checkpoint
        else:
            restore_aside(output, aside)                # ... before it: the old run comes back
    if not ckpt_dir.is_dir():
        return None
    remove_stale_temporaries(ckpt_dir)
    checkpoints = committed_checkpoints(ckpt_dir)
    if not checkpoints:
        (ckpt_dir / LATEST).unlink(missing_ok=True)
        return None
    newest = checkpoints[-1]
    mark_latest(ckpt_dir, newest)
    epoch = int(newest.name.split('_')[1])
    by_epoch: Dict[int, Dict] = {}
    for record in read_metrics(output / 'metrics.jsonl'):
        if 1 <= record['epoch'] <= epoch:
            by_epoch[record['epoch']] = record              # a repeated epoch: the later line wins
    if epoch >= 1 and epoch not in by_epoch:
        state = json.loads((newest / 'state.json').read_text())
        if state.get('metrics'):
            by_epoch[epoch] = state['metrics']
    lines = ''.join(json.dumps(by_epoch[e]) + '\n' for e in sorted(by_epoch))
    if lines or (output / 'metrics.jsonl').exists():
        write_text_atomically(output / 'metrics.jsonl', lines)
    return newest


def move_aside(output: Path) -> Optional[Path]:
    """Move an old run's records into a hidden sibling folder (for `--overwrite`), so they can be put
    back if the new run fails before its first checkpoint. Returns that folder, or None if empty."""
    output = Path(output)
    present = [name for name in RUN_FILES if (output / name).exists()]
    if not present:
        return None
    aside = output / f'.replaced-{os.getpid()}'
    aside.mkdir()
    for name in present:
        os.replace(output / name, aside / name)
    return aside


def restore_aside(output: Path, aside: Optional[Path]) -> None:
    """Undo `move_aside`: whatever the new run wrote is removed and the old records come back."""
    if aside is None:
        return
    for name in RUN_FILES:
        if (aside / name).exists():
            target = Path(output) / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            os.replace(aside / name, target)
    shutil.rmtree(aside, ignore_errors=True)


def discard_aside(aside: Optional[Path]) -> None:
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
