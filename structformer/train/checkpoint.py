"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

Layout of one checkpoint directory:
    model.safetensors        model weights
    train_state.safetensors  optimiser tensors and the torch RNG state (absent in weights-only saves)
    ema.safetensors          the weight average (--model-ema); ema_ranks.safetensors: under DDP, the other
                             processes' BatchNorm statistics of it where they differ from rank 0's (inside an epoch)
    state.json               epoch, step, model name and kwargs, resolved config, metrics, RNG, the files
                             written beside it (`files`: a lost one is named on loading), and the
                             environment that wrote it (`records.environment`: torch, threads, CPU kind,
                             the kernel choices made: `functional.autotune`)
A run directory holds `checkpoints/epoch_NNNN/` and `checkpoints/latest.json` naming the newest (and recovery
points `recovery_EEEE_SSSSSSSS/`, train/recovery.py). The names are made and read in `checkpoint_paths` alone
(`checkpoint_name`, `parse_checkpoint_name`), which finds a checkpoint from what the user gave without torch.
Loading never executes code: safetensors and JSON only.
"""
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ..atomic import permissions_from_umask, write_text_atomically
from ..records import environment
from ..weights.mismatch import describe_mismatch  # noqa: F401  (re-exported: the engine reads it here)
from .checkpoint_paths import LATEST, CheckpointError, checkpoint_epoch, committed_checkpoints, resolve_checkpoint
from .checkpoint_paths import checkpoint_folders, checkpoint_name, parse_checkpoint_name, replaced_run  # noqa: F401

FORMAT_VERSION = 1


def crash_point(step: str) -> None:
    """Test hook: `STRUCTFORMER_TEST_KILL_AT=step` ends the process on the spot at that step, as kill -9
    would (no cleanup, no exception handlers), so tests can interrupt a commit at every step without
    relying on timing. Steps: '<checkpoint name>:weights' (weights written to the temporary folder),
    '<name>:renamed' (folder committed, latest.json not yet updated), '<name>:latest',
    'epoch <N>:metrics' (metrics line written), 'epoch <N>:step <S>' (S optimiser steps of epoch N taken).
    With `STRUCTFORMER_TEST_KILL_WITH=SIGINT` (or SIGTERM) the process sends itself that signal there instead,
    as Ctrl-C or a scheduler's stop would, so its handlers run. Unset in normal use: one dictionary lookup."""
    if os.environ.get('STRUCTFORMER_TEST_KILL_AT') == step:
        name = os.environ.get('STRUCTFORMER_TEST_KILL_WITH')
        if name:
            import signal
            os.kill(os.getpid(), getattr(signal, name))
            return
        os._exit(137)


def _flatten_optimizer(state_dict: Dict[str, Any]) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    tensors, scalars = {}, {}
    for idx, entry in state_dict['state'].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f'optim.{idx}.{key}'] = value.detach().contiguous().cpu()
            else:
                scalars[f'{idx}.{key}'] = value
    return tensors, {'param_groups': state_dict['param_groups'], 'scalars': scalars}


def _unflatten_optimizer(tensors: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> Dict[str, Any]:
    state: Dict[int, Dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith('optim.'):
            _, idx, key = name.split('.', 2)
            state.setdefault(int(idx), {})[key] = value
    for name, value in meta['scalars'].items():
        idx, key = name.split('.', 1)
        state.setdefault(int(idx), {})[key] = value
    return {'state': state, 'param_groups': meta['param_groups']}


def capture_rng() -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Every RNG the training loop draws from (python, numpy, torch CPU and, once CUDA is in use, each CUDA
    device's generator: dropout, drop path and Mixup's masks on a GPU draw from those, not from the CPU's)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    tensors = {'rng.torch': torch.get_rng_state(), 'rng.numpy': torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f'rng.cuda.{index}'] = state
    meta = {'numpy': [kind, int(pos), int(has_gauss), float(cached)],
            'python': [version, list(internal), gauss_next]}
    return tensors, meta


def restore_rng(tensors: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> None:
    """Put back what `capture_rng` saved. CUDA generators are restored where this machine has the device (a run
    checkpointed on a GPU and resumed on a CPU keeps its CPU streams; its GPU draws then cannot repeat anyway)."""
    torch.set_rng_state(tensors['rng.torch'])
    kind, pos, has_gauss, cached = meta['numpy']
    np.random.set_state((kind, tensors['rng.numpy'].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = meta['python']
    random.setstate((version, tuple(internal), gauss_next))
    cuda = sorted((int(name.rsplit('.', 1)[1]), state) for name, state in tensors.items()
                  if name.startswith('rng.cuda.'))
    if cuda and torch.cuda.is_available():
        for index, state in cuda:
            if index < torch.cuda.device_count():
                torch.cuda.set_rng_state(state, index)


def save_checkpoint(directory: Path, model: torch.nn.Module, state: Dict[str, Any],
                    optimizer: Optional[torch.optim.Optimizer] = None, with_rng: bool = True,
                    extra_files: Optional[Dict[str, Dict[str, torch.Tensor]]] = None) -> Path:
    """Write a checkpoint directory atomically: everything goes to a temporary sibling that is
    renamed into place only when complete, so an interruption never leaves a half-written one.
    `extra_files`: more safetensors files {name: tensors} in the same folder (e.g. the weight average)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=directory.name + '.tmp-'))
    try:
        permissions_from_umask(tmp, 0o777)
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(weights, str(tmp / 'model.safetensors'))
        crash_point(f'{directory.name}:weights')
        state = dict(state, format_version=FORMAT_VERSION, environment=environment(device_of(model)))
        train_tensors: Dict[str, torch.Tensor] = {}
        if optimizer is not None:
            opt_tensors, state['optimizer'] = _flatten_optimizer(optimizer.state_dict())
            train_tensors.update(opt_tensors)
        if with_rng:
            rng_tensors, state['rng'] = capture_rng()
            train_tensors.update(rng_tensors)
        if train_tensors:
            save_file(train_tensors, str(tmp / 'train_state.safetensors'))
        for name, tensors in (extra_files or {}).items():
            save_file(tensors, str(tmp / name))
        # the files it holds, so a reader tells a folder that lost one (a copy cut short, a file removed by hand)
        # from a checkpoint written without it, in one line instead of a KeyError deep in a resume
        state['files'] = sorted(p.name for p in tmp.iterdir())
        (tmp / 'state.json').write_text(json.dumps(state, indent=1, default=_json_default))
        for written in tmp.iterdir():               # safetensors writes 0600 whatever the umask
            permissions_from_umask(written, 0o666)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
        crash_point(f'{directory.name}:renamed')
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def device_of(model: torch.nn.Module) -> str:
    """The device of the model's first parameter or buffer ('cpu' for a model with neither)."""
    for tensor in (*model.parameters(), *model.buffers()):
        return str(tensor.device)
    return 'cpu'


def _json_default(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in state.json")


def mark_latest(run_checkpoints: Path, directory: Path) -> None:
    write_text_atomically(Path(run_checkpoints) / LATEST, json.dumps({'checkpoint': Path(directory).name}))
    crash_point(f'{Path(directory).name}:latest')


def _convert_command(folder: Path) -> str:
    """The `structformer convert` line that makes a checkpoint of a timm Hugging Face folder, with the architecture
    and constructor arguments its config.json records (NAME where it records none)."""
    try:
        config = json.loads((folder / 'config.json').read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    name = config.get('architecture') if isinstance(config.get('architecture'), str) else 'NAME'
    args = config.get('model_args') if isinstance(config.get('model_args'), dict) else {}
    kwargs = ' '.join(f"{key}={json.dumps(value, separators=(',', ':'))}" for key, value in args.items()
                      if isinstance(value, (int, float, list)) and not isinstance(value, bool))
    return (f"structformer convert --from timm {folder} --model {name}"
            f"{' --model-kwargs ' + kwargs if kwargs else ''} --output NEW_FOLDER")


def load_checkpoint(path, with_train_state: bool = False):
    """Return (weights, state, train_tensors) from a checkpoint, with clear errors when damaged."""
    directory = resolve_checkpoint(path)
    if not (directory / 'state.json').exists() and (directory / 'config.json').is_file():
        # complete, but another format: not 'incomplete', and what to give instead
        saved = ('model.safetensors, as `export --format hf` writes' if (directory / 'model.safetensors').exists()
                 else "pytorch_model.bin, as timm's save_for_hf writes with safe_serialization=False")
        raise CheckpointError(f"--checkpoint: {directory} is a timm Hugging Face folder (config.json + "
                              f"{saved}), not a structformer checkpoint; give "
                              f"the run it came from, or make one: {_convert_command(directory)}")
    for name in ('state.json', 'model.safetensors'):
        if not (directory / name).is_file():
            raise CheckpointError(f"--checkpoint: {directory} is incomplete: {name} is missing")
    try:
        state = json.loads((directory / 'state.json').read_text())
        weights = load_file(str(directory / 'model.safetensors'))
        train_tensors = {}
        if with_train_state and (directory / 'train_state.safetensors').exists():
            train_tensors = load_file(str(directory / 'train_state.safetensors'))
    except FileNotFoundError as e:
        raise CheckpointError(f"--checkpoint: {directory} is incomplete: {e.filename} is missing"
                              f"{earlier_checkpoint_hint(directory)}") from None
    except Exception as e:  # safetensors / json raise several types on damaged files
        raise CheckpointError(f"--checkpoint: {directory} is corrupt ({type(e).__name__}: {e})"
                              f"{earlier_checkpoint_hint(directory)}") from None
    if not isinstance(state, dict) or 'model' not in state:
        raise CheckpointError(f"--checkpoint: {directory}/state.json does not describe a model")
    missing = [name for name in state.get('files', ()) if not (directory / name).is_file()]
    if with_train_state and 'files' not in state and ('rng' in state or 'optimizer' in state):   # older checkpoints
        missing += [] if (directory / 'train_state.safetensors').is_file() else ['train_state.safetensors']
    if missing:         # written with it, gone now: not a checkpoint that never had it
        raise CheckpointError(f"--checkpoint: {directory} is incomplete: {', '.join(missing)} "
                              f"{'is' if len(missing) == 1 else 'are'} missing{earlier_checkpoint_hint(directory)}")
    state['path'] = str(directory)
    return weights, state, train_tensors


def earlier_checkpoint_hint(directory: Path) -> str:
    """For the line about a damaged checkpoint of a run: the run's newest complete epoch checkpoint before it, from
    which the run can go on in a new folder (`--resume EARLIER --output NEW`; into its own folder a resume from an
    older checkpoint is refused, as the epochs after it are another timeline), or ''."""
    if parse_checkpoint_name(Path(directory).name) is None:     # epoch_NNNN, or recovery_EEEE_SSSSSSSS in epoch E
        return ''
    epoch = checkpoint_epoch(directory)
    earlier = [p for p in committed_checkpoints(Path(directory).parent) if checkpoint_epoch(p) < epoch]
    return (f"; the checkpoint before it, {earlier[-1]}, can continue the run into a new folder "
            f"(--resume {earlier[-1]} --output NEW_FOLDER)") if earlier else ''


def load_model(path, map_location='cpu', ema: bool = False):
    """Rebuild the model a checkpoint was trained as (construction and recorded transforms, see
    `structformer.models.factory.rebuild`) and load its weights (`ema`: the weight average kept by
    --model-ema instead). Returns (model, state)."""
    from ..models.factory import ModelRecipe, rebuild
    from ..models.transforms import UnknownTransform
    weights, state, _ = load_checkpoint(path)
    if ema:
        weights = _load_average(Path(state['path']), state)
    recipe = ModelRecipe.from_state(state)
    try:
        model = rebuild(recipe)
    except UnknownTransform as e:
        raise CheckpointError(f"--checkpoint: {state['path']} cannot be rebuilt: {e}") from None
    except ValueError as e:
        raise CheckpointError(f"--checkpoint: model {recipe.name!r} cannot be rebuilt ({e})") from None
    mismatch = describe_mismatch(model.state_dict(), weights)
    if mismatch:
        raise CheckpointError(f"--checkpoint: weights do not fit model {recipe.name!r}: {mismatch}")
    model.load_state_dict(weights)
    _record_built_input_size(model, recipe.input_size)
    record_training_data(model, state.get('data_info') or {})
    return model.to(map_location).eval(), state


def _record_built_input_size(model: torch.nn.Module, input_size) -> None:
    """The (C, H, W) the model was built for into its `pretrained_cfg`: timm leaves the registry's there whatever
    in_chans= / img_size= built the model, so converted weights of another size or channel count (`structformer
    convert --model-kwargs in_chans=3`, which records no data) were exported with the registry's example input.
    A run's training data then overrides it (record_training_data)."""
    if not input_size or len(input_size) != 3 or hasattr(model, 'vocab_size'):
        return
    cfg = getattr(model, 'pretrained_cfg', None)
    if cfg is None or tuple(cfg.get('input_size') or ()) == tuple(input_size):
        return
    cfg = dict(cfg, input_size=tuple(int(v) for v in input_size))
    model.pretrained_cfg = cfg
    model.default_cfg = cfg


def _load_average(directory: Path, state: Optional[Dict[str, Any]] = None) -> Dict[str, torch.Tensor]:
    from .ema import EMA_FILE
    path = directory / EMA_FILE
    averaged = (state or {}).get('averaged_epochs')
    if not path.is_file() and averaged:      # --avg-last's folder holds the averaged model weights only
        raise CheckpointError(f"--ema: {directory} is the --avg-last average of epochs {averaged[0]}-{averaged[-1]}, "
                              "which keeps no weight average of its own; leave out --ema to score it")
    if not path.is_file():
        raise CheckpointError(f"--ema: {directory} has no weight average ({EMA_FILE}); the run was trained without "
                              "--model-ema")
    try:
        return load_file(str(path))
    except Exception as e:
        raise CheckpointError(f"--ema: {path} is corrupt ({type(e).__name__}: {e})") from None


def record_training_data(model: torch.nn.Module, data_info: Dict[str, Any]) -> None:
    """Put the input size and normalisation the model was trained with into its `pretrained_cfg` (timm's
    `resolve_data_config` reads them from there), replacing the registry's defaults: a timm model trained
    on MNIST must not be fed ImageNet statistics by timm's transforms. The class names, where the data has
    them, become timm's `label_names` (and `label_descriptions`), which `export --format hf` writes and
    timm's `local-dir:` loading reads back. Data without an image form (synthetic subspaces, text) leaves the
    config as it is."""
    from ..data.pixel_stats import eval_data_config
    data_cfg = eval_data_config(data_info.get('name', ''), data_info.get('crop_pct'), data_info.get('interpolation'),
                                data_info.get('crop_mode'))
    if data_cfg is None or not data_info.get('img_size') or not data_info.get('in_chans'):
        return
    size = data_info['img_size']
    cfg = dict(getattr(model, 'pretrained_cfg', None) or {})
    cfg.update(data_cfg, num_classes=data_info.get('num_classes', cfg.get('num_classes')),
               input_size=(data_info['in_chans'], *((size, size) if isinstance(size, int) else size)))
    classes = data_info.get('classes')
    if classes and len(classes) == cfg.get('num_classes'):     # timm's names for the classifier's outputs
        cfg['label_names'] = list(classes)
        descriptions = data_info.get('class_descriptions')
        if descriptions and len(descriptions) == len(classes):
            cfg['label_descriptions'] = dict(zip(classes, descriptions))
    else:
        cfg.pop('label_names', None)
        cfg.pop('label_descriptions', None)
    model.pretrained_cfg = cfg
    model.default_cfg = cfg                     # timm's older alias of the same dict


def optimizer_state_from(train_tensors: Dict[str, torch.Tensor], state: Dict[str, Any]) -> Dict[str, Any]:
    return _unflatten_optimizer(train_tensors, state['optimizer'])
