"""`--initial-checkpoint` / `--pretrained-path`: start a new run from trained weights (fine-tuning), with a fresh
optimiser and schedule.

Accepted: a structformer run or checkpoint folder, a folder in timm's local-dir layout (`structformer convert`,
`export --format hf`: config.json + model.safetensors), a `.safetensors` file, or a weights-only `.pth` / `.pt` / `.bin`
(read by `structformer.weights.torch_file`: `torch.load(weights_only=True)` with an allow-list of plain data, so
loading never runs code; a trainer's checkpoint gives its model or EMA weights, as its own evaluation takes them).
The weights are adapted to the model as timm adapts pretrained weights: a classifier of another size is left at its fresh initialisation, the first layer's
input channels are folded or repeated (`timm.models._manipulate.adapt_input_conv`), an absolute position
embedding of another grid is resampled (`timm.layers.resample_abs_pos_embed`): the family filters of
`structformer.weights.filters`, which timm's `pretrained=True` uses too. Every adaptation is reported;
any other key that is missing, unexpected or of another shape is refused by name, never silently dropped.
"""
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..errors import UsageError

FLAG = '--initial-checkpoint'


def read_weights(path, flag: str = FLAG, kind: Optional[str] = None,
                 notes: Optional[List[str]] = None) -> Dict[str, torch.Tensor]:
    """The tensors of a run / checkpoint folder, a safetensors file or a weights-only torch file (a trainer's
    checkpoint: its model or EMA weights, `kind` 'model' / 'ema' or the source's default; which were taken is
    appended to `notes`). A temporary of an interrupted writer is refused, never read as weights."""
    from ..atomic import describe_temporary
    from .checkpoint import CheckpointError, load_checkpoint
    given, path = path, Path(path)
    if not path.exists():
        from .checkpoint_paths import timm_name_hint
        raise UsageError(f"{flag} {path}: does not exist{timm_name_hint(given)}")
    unfinished = describe_temporary(path)
    if unfinished:
        raise UsageError(f"{flag} {path}: {unfinished}")
    if path.is_dir() and not (path / 'state.json').exists():
        # timm's local-dir / push_to_hf_hub layout: config.json + model.safetensors, or pytorch_model.bin where it
        # was saved with safe_serialization=False (timm's loader takes either, safetensors first)
        path = next((path / name for name in ('model.safetensors', 'pytorch_model.bin') if (path / name).is_file()),
                    path)
        if path.is_dir() and not (path / 'checkpoints').is_dir():
            _refuse_folder_of_files(path, flag)
    if path.is_dir() or (path.name in ('model.safetensors', 'state.json') and (path.parent / 'state.json').exists()):
        from .checkpoint import _load_average
        try:
            weights, state, _ = load_checkpoint(path)
        except CheckpointError as e:
            raise UsageError(f"{flag} {path}: {str(e).split('--checkpoint: ', 1)[-1]}") from None
        if kind == 'ema':                               # a structformer run trained with --model-ema
            try:
                weights = _load_average(Path(state['path']), state)
            except CheckpointError as e:
                raise UsageError(f"--weights ema: {str(e).split('--ema: ', 1)[-1]}") from None
        if kind == 'ema' and notes is not None:
            notes.append(f"took {Path(state['path']).name}'s weight average (--model-ema), as --weights asked")
        return weights
    kind_of_file = file_format(path)
    if kind == 'ema' and kind_of_file == 'safetensors':          # by content: a safetensors file named .pth too
        raise UsageError(f"--weights ema: {path} holds one set of weights (safetensors); EMA weights are "
                         "chosen in a trainer's torch checkpoint or a structformer run trained with --model-ema")
    if kind_of_file == 'empty':
        raise UsageError(f"{flag} {path}: is empty (0 bytes); an interrupted download or copy?")
    if kind_of_file == 'safetensors':
        from safetensors.torch import load_file
        try:
            weights = load_file(str(path))
        except Exception as e:                      # safetensors raises several types on damaged files
            raise UsageError(f"{flag} {path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
        if not weights:                             # else: 'N weights of the model are not in the checkpoint'
            raise UsageError(f"{flag} {path}: holds no tensors (an empty safetensors file)")
        return clean_prefixes(weights, notes)
    if kind_of_file == 'torch':                     # .pth / .pth.tar (timm's train.py) / .pt / .bin, whatever its name
        from ..weights.torch_file import load_torch_file, trainer_weights
        weights, note = trainer_weights(load_torch_file(path, flag), flag, path, kind)
        if note and notes is not None:
            notes.append(note)
        return clean_prefixes(weights, notes)
    raise UsageError(f"{flag} {path}: accepted a run or checkpoint folder, .safetensors, or a weights-only "
                     ".pth / .pt / .bin / .pth.tar")


# .t7: what CRATE's finetune.py (and the CIFAR scripts it follows) names its torch.save checkpoint
_TORCH_SUFFIXES = ('.pth', '.pt', '.bin', '.tar', '.t7')


def _refuse_folder_of_files(folder: Path, flag: str) -> None:
    """A folder of weights files that is neither ours nor timm's local-dir layout (timm train.py's output folder, a
    download folder): refused naming the weights files in it, best and last first, as the file to give. A folder of
    ours (a run's checkpoints/ with latest.json and epoch_* folders, a moved-aside run) or one without weights files
    is left to the checkpoint reader and its messages."""
    ours = ('latest.json', 'train_state.safetensors', 'ema.safetensors')     # a run's checkpoints/, a checkpoint
    if any((folder / name).exists() for name in ours) or any(
            p.is_dir() and p.name.startswith(('epoch_', '.replaced-')) for p in folder.iterdir()):
        return
    files = sorted((p for p in folder.iterdir() if p.is_file() and (p.suffix in _TORCH_SUFFIXES + ('.safetensors',)
                                                                     or p.name.endswith('.pth.tar'))),
                   key=lambda p: (0 if p.name.startswith(('model_best', 'checkpoint-best')) else
                                  1 if p.name.startswith('last') else 2, p.name))
    names = ', '.join(p.name for p in files[:4]) + (f" ({len(files)} in all)" if len(files) > 4 else '')
    if not files:
        return
    raise UsageError(f"{flag} {folder}: a folder that is not a structformer run or checkpoint, nor a convert / timm "
                     f"local-dir folder (config.json + model.safetensors); give one of its files: {names}")


def file_format(path: Path) -> str:
    """'safetensors', 'torch', 'empty' or '' (neither) for a weights file, by its first bytes where they are
    recognisable (`structformer.weights.file_kind.sniff`, the sniffer export shares), so a file saved under the other
    format's name (a safetensors file called `.pth`) is read as what it is. Otherwise the suffix decides (a damaged
    file then gets its format's own error)."""
    from ..weights.file_kind import sniff
    found = sniff(path)
    if found:
        return found
    if path.suffix == '.safetensors':
        return 'safetensors'
    return 'torch' if path.suffix in _TORCH_SUFFIXES else ''


def clean_prefixes(weights: Dict[str, torch.Tensor], notes: Optional[List[str]] = None) -> Dict[str, torch.Tensor]:
    """The keys without the wrappers' prefixes, as timm's `clean_state_dict` removes them: DDP's `module.` and
    torch.compile's `_orig_mod.` (a compiled model's `state_dict()`), in either order. What was removed, from how
    many keys, is appended to `notes`."""
    from timm.models import clean_state_dict
    cleaned = clean_state_dict(weights)
    if notes is not None and len(cleaned) == len(weights):
        removed: Dict[str, int] = {}
        for key, clean in zip(weights, cleaned):        # clean_state_dict keeps the order
            if key != clean:
                prefix = key[:len(key) - len(clean)]
                removed[prefix] = removed.get(prefix, 0) + 1
        notes += [f"removed the prefix {prefix!r} from {count} keys (DataParallel / DDP / torch.compile wrappers, "
                  "as timm's clean_state_dict)" for prefix, count in removed.items()]
    return cleaned


def adapt_weights(model: torch.nn.Module, weights: Dict[str, torch.Tensor], flag: str = FLAG, path='') -> List[str]:
    """Adapt `weights` in place to `model` with the family's filter (`structformer.weights.filters`, the one timm's
    `pretrained=True` uses); returns what was done. Anything else that does not fit is a UsageError naming `flag`."""
    from ..weights.filters import WeightsMismatch, adapt_state_dict
    try:
        adapted, done = adapt_state_dict(weights, model, where=f"{flag} {path}".strip())
    except WeightsMismatch as e:
        raise UsageError(str(e).replace('model ', '--model ', 1)) from None
    weights.clear()
    weights.update(adapted)
    return done


def load_initial_weights(model: torch.nn.Module, path, flag: str = FLAG, notes: Optional[List[str]] = None) -> List[str]:
    """Load `path` into `model` as --initial-checkpoint / --pretrained-path do; returns the adaptations made (and
    appends to `notes` which weights of a trainer's checkpoint were taken)."""
    weights = read_weights(path, flag, notes=notes)
    done = adapt_weights(model, weights, flag, path)
    model.load_state_dict(weights, strict=False)      # complete but for a lazy basis left to its own shape
    return done


def load_timm_pretrained(model: torch.nn.Module, name: str, flag: str = '--pretrained'):
    """timm's pretrained weights for `name` (what its pretrained config points at) into the built `model`, through
    timm's `load_pretrained` and the family filter. Returns (where they came from, the adaptations made)."""
    import timm
    from timm.models import load_pretrained
    from timm.models._builder import _resolve_pretrained_source

    from ..weights.filters import WeightsMismatch, adapt_state_dict
    cfg = timm.get_pretrained_cfg(name)
    load_from, location = _resolve_pretrained_source(cfg.to_dict()) if cfg else ('', '')
    if not load_from:
        raise UsageError(f"{flag}: timm has no pretrained weights for --model {name} (structformer ships none); "
                         "give --pretrained-path FILE (e.g. `structformer convert` output)")
    own = getattr(model, 'pretrained_cfg', None) or {}
    done: List[str] = []

    def filter_fn(state, target):
        adapted, lines = adapt_state_dict(state, target, where=f"{flag} ({load_from} {location})")
        done.extend(lines)
        return adapted
    try:
        load_pretrained(model, pretrained_cfg=dict(cfg.to_dict(), classifier=own.get('classifier', cfg.classifier),
                                                   first_conv=own.get('first_conv', cfg.first_conv)),
                        num_classes=cfg.num_classes, in_chans=(cfg.input_size or (3,))[0], filter_fn=filter_fn,
                        strict=False)
    except WeightsMismatch as e:
        raise UsageError(str(e)) from None
    except Exception as e:                          # offline: huggingface_hub / urllib raise many types
        raise UsageError(f"{flag}: timm's weights for --model {name} ({load_from} {location}) could not be read "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); offline, give "
                         "--pretrained-path FILE") from None
    return f"{flag} ({load_from} {location})", done


# the dense model a registered Sparsifiner student was converted from (Sparsifiner §4 distils DeiT into it)
DENSE_COUNTERPARTS = {'sparsifiner_deit_tiny_patch16_224': 'deit_tiny_patch16_224',
                      'sparsifiner_deit_small_patch16_224': 'deit_small_patch16_224',
                      'sparsifiner_digits': 'vit_digits', 'sparsifiner_mnist': 'vit_mnist'}


def is_run_or_checkpoint(path) -> bool:
    """A structformer run or checkpoint folder (state.json, or a run's checkpoints/), as --teacher RUN_DIR means."""
    path = Path(path)
    if path.is_file() and path.name in ('model.safetensors', 'state.json'):
        path = path.parent
    return path.is_dir() and ((path / 'state.json').is_file() or (path / 'checkpoints').is_dir())


def build_teacher(spec: str, config, data_info) -> torch.nn.Module:
    """--teacher as a weights file or folder (the student's dense counterpart, or the architecture a local-dir
    folder's config.json names) or a registered model name (with --teacher-pretrained: timm's weights), built for
    the run's data. A teacher's classifier must already fit the data: it is never re-initialised."""
    import json

    import timm

    from ..models.factory import build_model
    kwargs, taken = {}, []
    if Path(spec).exists():
        folder_cfg = Path(spec) / 'config.json'
        if folder_cfg.is_file():
            recorded = json.loads(folder_cfg.read_text())
            name, kwargs = recorded.get('architecture'), dict(recorded.get('model_args') or {})
        else:
            sparsified = any((t.get('name') if isinstance(t, dict) else t) == 'sparsify' for t in config.transforms or ())
            name = DENSE_COUNTERPARTS.get(config.model, config.model if sparsified else None)
            kwargs = dict(config.model_kwargs or {}) if name == config.model else {}
        if not name:
            raise UsageError(f"--teacher {spec}: a weights file needs the student's dense counterpart, and --model "
                             f"{config.model} has none known ({', '.join(sorted(DENSE_COUNTERPARTS))} do); give the "
                             "teacher's run directory or a registered model name with --teacher-pretrained")
        # a recorded None was dropped by timm when that run was built (build_model now refuses one): drop it too
        teacher, _ = build_model(name, {k: v for k, v in kwargs.items()
                                        if k not in ('num_classes', 'in_chans') and v is not None}, data_info)
        done = load_initial_weights(teacher, spec, '--teacher', taken)
    elif timm.is_model(spec):
        if not config.teacher_pretrained:
            raise UsageError(f"--teacher {spec}: an untrained teacher teaches nothing; add --teacher-pretrained "
                             "(timm's weights) or give a run directory or weights file")
        teacher, _ = build_model(spec, {}, data_info)
        _, done = load_timm_pretrained(teacher, spec, '--teacher-pretrained')
    else:
        from .checkpoint_paths import timm_name_hint
        raise UsageError(f"--teacher {spec}: does not exist, and is not a registered model name (expected a run "
                         "directory, a weights file or folder, or a model name with --teacher-pretrained)"
                         + timm_name_hint(spec))
    wrong = [line for line in done if 'number of classes' in line or 'classifier' in line]
    if wrong:
        raise UsageError(f"--teacher {spec}: its classifier does not fit the data ({wrong[0]}); a teacher must be "
                         "trained for the same classes")
    if done or taken:
        print(f"--teacher {spec}: weights loaded" + ''.join(f"\n  {line}" for line in taken)
              + ''.join(f"\n  adapted {line}" for line in done), flush=True)
    for param in teacher.parameters():
        param.requires_grad_(False)
    return teacher.eval()
