"""Reading torch files (`torch.save`'s .pth / .pth.tar / .pt / .bin) without running code, and taking the weights
out of the checkpoints that training scripts write. The one torch-file reader of the package (docs/weights.md).

**No code runs.** `torch.load(weights_only=True)` rebuilds tensors, containers and numbers only; a file that names
any other Python global is refused, with one line naming the first global refused (torch's own message is a
paragraph that the CLI would cut mid-sentence). On top of torch's list, the plain data types that public trainers
store beside the weights are allowed (`ALLOWED_GLOBALS`), each a value with no behaviour on construction:

* `argparse.Namespace`: the parsed command line as `args`, saved by timm's `CheckpointSaver` (SOFT's and timm's
  `train.py`), DeiT's and Sparsifiner's `utils.save_model`;
* `pathlib` paths: what an argparse option of `type=Path` leaves in that Namespace, read as pure paths (a
  checkpoint written on Windows names `WindowsPath`, which cannot be made elsewhere);
* numpy scalars and dtypes: a metric or best accuracy computed with numpy (`metric`, `best_acc`), by the name
  numpy 1.x (`numpy.core.multiarray.scalar`) or numpy 2 (`numpy._core...`) wrote.

The rest of those files (optimizer and scheduler states, the AMP scaler's state, epochs, metrics) is plain data
that torch's list already covers; this was checked by writing the files with the real classes (timm's
`CheckpointSaver`, `ModelEmaV3`, `NativeScaler`, `create_scheduler_v2`: tests/test_trainer_checkpoints.py).

**Which weights.** A trainer's checkpoint holds the model's weights and often an exponential moving average of them.
`trainer_weights` takes what the source's own evaluation takes by default, says which, and takes the other kind
when asked (`convert --weights ema|model`):

| layout | keys | default | because |
|---|---|---|---|
| timm's `CheckpointSaver` (SOFT, timm `train.py`) | `state_dict`, `state_dict_ema` | EMA | SOFT's `--eval` loads `state_dict_ema` (its `--model-ema` defaults on), and its training loop scores the EMA and ranks checkpoints by that score |
| DeiT / Sparsifiner `utils.save_model` | `model`, `model_ema` | model | their `--eval` / `--finetune` load `model` (Sparsifiner's `--model_key model\\|module`) |
| CRATE `main.py` | `state_dict` | — | one kind |
| CRATE `finetune.py`, CIFAR scripts | `model` or `net` | — | one kind |
"""
import argparse
import pathlib
import pickletools
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import UsageError

__all__ = ['ALLOWED_GLOBALS', 'WEIGHT_KINDS', 'load_torch_file', 'refuse_what_is_no_torch_file',
           'trainer_weights']

WEIGHT_KINDS = ('ema', 'model')
# (key of the model's weights, key of their EMA, the kind the source evaluates by default, who writes it)
LAYOUTS = (('state_dict', 'state_dict_ema', 'ema', "timm's CheckpointSaver (SOFT, timm train.py), whose "
            "evaluation scores the EMA"),
           ('model', 'model_ema', 'model', "DeiT / Sparsifiner utils.save_model, whose --eval and --finetune load "
            "'model'"))
# where trainers keep the model's weights: timm / CRATE main.py, DeiT / Sparsifiner / CRATE finetune.py, Sparsifiner's
# --model_key 'model|module', and 'net' (the CIFAR scripts CRATE's finetune.py follows: its resume reads 'net')
_MODEL_KEYS = ('state_dict', 'model', 'module', 'net')


def _numpy_globals() -> List[Any]:
    try:
        import numpy as np
    except ImportError:
        return []
    found = [np.dtype]
    core = getattr(np, '_core', None) or getattr(np, 'core', None)
    scalar = getattr(getattr(core, 'multiarray', None), 'scalar', None)
    if scalar is not None:
        # numpy 1.x pickled a scalar as numpy.core.multiarray.scalar, numpy 2 as numpy._core...: a checkpoint
        # names the one of the numpy that wrote it, so both names are allowed, for the same function
        found.append(scalar)
        for module in ('numpy.core.multiarray', 'numpy._core.multiarray'):
            if module != scalar.__module__:
                found.append((scalar, f'{module}.scalar'))
    # the dtype classes numpy >= 1.25 pickles a dtype as (np.dtypes.Float64DType, ...)
    dtypes = getattr(np, 'dtypes', None)
    if dtypes is not None:
        found += [getattr(dtypes, name) for name in dir(dtypes) if name.endswith('DType')
                  and isinstance(getattr(dtypes, name), type)]
    return found


def _path_globals() -> List[Any]:
    """Every pathlib class a checkpoint can name, each read as its pure path: a `WindowsPath` cannot be made on
    Linux (nor a `PosixPath` on Windows), and a path in `args` is only recorded text. Under the name Python <= 3.12
    pickles them by (`pathlib.X`) and Python 3.13's (`pathlib._local.X`)."""
    pure = {'PurePath': pathlib.PurePath, 'PurePosixPath': pathlib.PurePosixPath,
            'PureWindowsPath': pathlib.PureWindowsPath, 'Path': pathlib.PurePath, 'PosixPath': pathlib.PurePosixPath,
            'WindowsPath': pathlib.PureWindowsPath}
    return [(cls, f'{module}.{name}') for name, cls in pure.items() for module in ('pathlib', 'pathlib._local')]


ALLOWED_GLOBALS = [argparse.Namespace] + _path_globals() + _numpy_globals()

# the opcodes of pickle protocols 3 to 5 (FRAME, MEMOIZE, SHORT_BINUNICODE, ...), which the weights-only unpickler
# lacks; any other unsupported operand is a damaged file, not a newer protocol
_NEWER_OPCODES = {ord(op.code) for op in pickletools.opcodes if op.proto > 2}

_GLOBAL_IN_MESSAGE = re.compile(r'GLOBAL ([\w.]+) was not an allowed global')


def _refused_globals(path: Path, error: Exception) -> List[str]:
    """The globals in `path` that the allow-list refuses (torch reads the pickle's opcodes, runs nothing)."""
    allowed = {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}" for g in ALLOWED_GLOBALS}
    try:
        named = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:                               # an old torch, or a file too damaged to list
        named = _GLOBAL_IN_MESSAGE.findall(str(error))
    return sorted({name for name in named if name not in allowed})      # get_unsafe_globals: no fixed order


def load_torch_file(path, flag: str) -> Any:
    """`torch.load(path, map_location='cpu', weights_only=True)` with `ALLOWED_GLOBALS` allowed. A file needing any
    other global, or not a torch file, is a UsageError naming `flag` and the first global refused."""
    path = Path(path)
    refuse_what_is_no_torch_file(path, flag)
    try:
        # an open file, not its name: torch.load reads a name ending in .safetensors as safetensors, whatever it is
        with torch.serialization.safe_globals(ALLOWED_GLOBALS), open(path, 'rb') as f, warnings.catch_warnings():
            # a protocol other than 2 makes torch ask the user to file an issue; a file it cannot read is named below
            warnings.filterwarnings('ignore', message='Detected pickle protocol')
            warnings.filterwarnings('ignore', message='.*looks like a TorchScript archive')     # refused below
            return torch.load(f, map_location='cpu', weights_only=True)
    except Exception as e:                          # UnpicklingError, RuntimeError (not a zip), EOFError, ...
        text = str(e)
        if 'TorchScript archive' in text:
            # torch.load refuses before torch.jit.load runs anything
            raise UsageError(f"{flag} {path}: is a TorchScript archive (torch.jit.save), a program rather than "
                             "weights, and is not loaded; save model.state_dict() where it was made and give that"
                             ) from None
        operand = re.search(r'Unsupported operand (\d+)', text)
        protocol = _pickle_protocol(path) if operand and int(operand.group(1)) in _NEWER_OPCODES else None
        if protocol is not None and protocol > 2:
            # torch's weights-only unpickler reads protocol 2's opcodes only (torch.save's default): a file saved
            # with pickle_protocol=4 or 5 is whole, but only the unrestricted unpickler, which runs code, reads it
            raise UsageError(f"{flag} {path}: saved with pickle protocol {protocol} (torch.save(..., "
                             f"pickle_protocol={protocol})), which torch's weights-only reader does not read (it reads "
                             "protocol 2, torch.save's default); re-save it with the default protocol where it was "
                             "made, or as safetensors") from None
        refused = _refused_globals(path, e) if 'Weights only load failed' in text else []
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ''
            # torch.save(model): the classes of a network (read by name only: nothing is imported to check)
            whole = any(name.startswith(('torch.nn.modules.', 'timm.', 'structformer.')) for name in refused)
            hint = ("; it is a whole pickled model (torch.save(model)): save model.state_dict() where it was made "
                    "and give that" if whole else '')
            raise UsageError(f"{flag} {path}: refused: it needs the Python global {refused[0]}{more}, which loading "
                             "would have to run; only tensors, containers, numbers and plain trainer data "
                             f"(argparse.Namespace, paths, numpy scalars) are read{hint}") from None
        # torch's weights-only message is a paragraph: its cause is the line after 'WeightsUnpickler error:'
        cause = re.search(r'WeightsUnpickler error:\s*(\S.*)', text)
        first = cause.group(1) if cause else (text.strip().splitlines()[0] if text.strip() else '')
        first = re.split(r'(?<=\.) ', first, maxsplit=1)[0]      # its first sentence (miniz adds a paragraph)
        raise UsageError(f"{flag} {path}: not a readable torch file ({type(e).__name__}: {first[:200]})") from None


def _pickle_protocol(path: Path) -> Optional[int]:
    """The pickle protocol of a torch file (the PROTO opcode's byte opening its `data.pkl`, or a legacy file's first
    pickle), or None where it cannot be told. Reads bytes only."""
    import zipfile
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                name = next((n for n in archive.namelist() if n.rsplit('/', 1)[-1] == 'data.pkl'), None)
                if name is None:
                    return None
                with archive.open(name) as f:
                    head = f.read(2)
        else:
            with open(path, 'rb') as f:
                head = f.read(2)
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    return head[1] if len(head) == 2 and head[0] == 0x80 else None


def refuse_what_is_no_torch_file(path: Path, flag: str) -> None:
    """A file whose first bytes are neither torch.save's zip archive nor a pickle (`file_kind.sniff`) is refused
    saying what it starts with: most often a web page or an error text saved under the checkpoint's name by a
    download that failed (a Drive or Hub link fetched without its confirmation step), which the unpickler would
    only call 'Unsupported operand 60'."""
    from .file_kind import TORCH, program_archive, sniff
    if sniff(path) == TORCH:
        program = program_archive(path)
        if program:
            raise UsageError(f"{flag} {path}: {program}")
        return
    try:
        with open(path, 'rb') as f:
            head = f.read(512)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot be read ({e.strerror or e})") from None
    if not head:
        raise UsageError(f"{flag} {path}: is empty (0 bytes); an interrupted download or copy?")
    if len(head) > 262 and head[257:262] == b'ustar':
        raise UsageError(f"{flag} {path}: is a tar archive, not a torch file; unpack it and give the checkpoint in it")
    if head[:2] == b'\x1f\x8b':
        raise UsageError(f"{flag} {path}: is gzip-compressed, not a torch file; decompress it first")
    text = head.decode('utf-8', errors='replace')
    printable = sum(ch.isprintable() or ch.isspace() for ch in text) >= 0.95 * len(text)
    if printable:
        first = ' '.join(text.split())[:60]
        page = '<html' in text.lower() or '<!doctype' in text.lower()
        raise UsageError(f"{flag} {path}: not a torch file: it is {'a web page' if page else 'text'} "
                         f"({first!r}...), saved in place of the checkpoint by a download that failed?")
    raise UsageError(f"{flag} {path}: not a torch file: it starts with bytes {head[:8].hex(' ')}, neither "
                     "torch.save's zip archive nor a pickle; damaged, or another format")


def _is_tensor_mapping(value) -> bool:
    return isinstance(value, dict) and bool(value) and all(torch.is_tensor(v) for v in value.values())


def trainer_weights(loaded: Any, flag: str, path, kind: Optional[str] = None) -> Tuple[Dict[str, torch.Tensor], str]:
    """The state dict in what `load_torch_file` returned, and a line saying which weights were taken (or '' for a
    bare state dict). `kind`: 'ema' or 'model' (None: the source's default, module docstring). The keys are as
    saved: the reader (`train.initial_weights.read_weights`) removes DDP's `module.` and torch.compile's
    `_orig_mod.` prefixes from every format alike, and says so."""
    if kind is not None and kind not in WEIGHT_KINDS:
        raise UsageError(f"--weights {kind!r}: accepted {', '.join(WEIGHT_KINDS)}")
    if not isinstance(loaded, dict):
        raise UsageError(f"{flag} {path}: holds no mapping of names to tensors (a {type(loaded).__name__})")
    if not loaded:
        raise UsageError(f"{flag} {path}: holds an empty mapping, no tensors")
    note = ''
    if _is_tensor_mapping(loaded):
        if kind == 'ema':
            raise UsageError(f"--weights ema: {path} is one state dict, with no EMA weights beside it")
        state = loaded
    else:
        state, note = _choose(loaded, path, kind, flag)
    if not _is_tensor_mapping(state):
        inner = [str(k) for k, v in loaded.items() if _is_tensor_mapping(v)]
        # weights under a key no trainer above uses are not guessed at (a teacher's, a discriminator's?): named
        found = f"; tensors are under {', '.join(inner[:4])}, not a key trainers keep weights under" if inner else ''
        raise UsageError(f"{flag} {path}: holds no state dict under {', '.join(_MODEL_KEYS)} or an EMA key (keys: "
                         f"{', '.join(map(str, list(loaded)[:6]))}){found}")
    return state, note


def _choose(loaded: dict, path, kind: Optional[str], flag: str = 'convert FILE') -> Tuple[Any, str]:
    """(the weights, the line saying which) of a trainer's checkpoint: `LAYOUTS` where an EMA is present, else the
    model's weights under one of `_MODEL_KEYS`. The line names how to take the other kind: convert's --weights; the
    training flags and timm's loader have no such choice, so for them it names the convert command."""
    epoch = loaded.get('epoch')
    # Sparsifiner's save_model names its best files' epoch 'best' / 'best-ema' (checkpoint-best-ema.pth: saved when
    # the EMA scored best, its 'model' still the model's weights): said, so --weights ema is seen to be the choice
    at = (f", epoch {epoch}" if isinstance(epoch, int) and not isinstance(epoch, bool) else
          f", epoch {epoch!r}" if isinstance(epoch, str) else '')
    for model_key, ema_key, default, who in LAYOUTS:
        ema = loaded.get(ema_key)
        if not _is_tensor_mapping(ema):
            continue
        model_name = next((k for k in (model_key,) + _MODEL_KEYS if _is_tensor_mapping(loaded.get(k))), None)
        model = loaded[model_name] if model_name else None
        take = kind or (default if model is not None else 'ema')
        if take == 'model' and model is None:
            raise UsageError(f"--weights model: {path} holds only EMA weights ({ema_key})")
        other = 'model' if take == 'ema' else 'ema'
        why = f"the default of {who}" if kind is None else 'as --weights asked'
        key = ema_key if take == 'ema' else model_name
        label = 'the EMA weights' if take == 'ema' else "the model's weights (not the EMA)"
        label_other = 'the EMA weights' if other == 'ema' else "the model's weights"
        switch = ('' if model is None else f"; --weights {other} takes the other" if flag == 'convert FILE' else
                  f"; to start from {label_other}, convert the file with structformer convert --weights {other}")
        return (ema if take == 'ema' else model), f"took {key}{at}: {label}, {why}{switch}"
    if kind == 'ema':
        raise UsageError(f"--weights ema: {path} holds no EMA weights (no state_dict_ema or model_ema; keys: "
                         f"{', '.join(map(str, list(loaded)[:6]))})")
    for key in _MODEL_KEYS:
        if _is_tensor_mapping(loaded.get(key)):
            return loaded[key], f"took {key}{at}" if len(loaded) > 1 else ''
    return loaded, ''
