"""`structformer export SOURCE --format onnx|torch-export|hf --output OUT`: a trained model in a form other tools run.

    onnx          one .onnx file (free batch dimension; a language model's tokens up to its context), checked
                  against eager torch with ONNX Runtime
    torch-export  one .pt2 file (`torch.export.save`, free batch dimension), checked against eager torch
    hf            a folder in timm's Hugging Face layout (config.json, model.safetensors, README.md model card)

SOURCE is a run folder from `structformer train` (its latest checkpoint), a checkpoint folder or its
model.safetensors (`source.load_source`: safetensors and JSON only). The output is written to a temporary
sibling and renamed into place once complete and checked, so an error or an interruption leaves nothing at OUT.
TorchScript is not offered: our layers use Python control flow and custom autograd that `torch.jit.script`
does not compile (docs/export.md).
"""
import os
import shutil
from pathlib import Path
from typing import Dict

from ..errors import UsageError

__all__ = ['FORMATS', 'export', 'check_output']

FORMATS = ('onnx', 'torch-export', 'hf')
SUFFIX = {'onnx': '.onnx', 'torch-export': '.pt2', 'hf': ''}
# float32 outputs of depth-12 models agree with eager torch to ~1e-6 relative; an export past this is wrong
MAX_RELATIVE_ERROR = 1e-4


# what `--format hf` writes (hf.save_hf_folder: timm's save_for_hf and the model card): the only files of a folder
# that --overwrite replaces whole
HF_FILES = frozenset({'README.md', 'config.json', 'model.safetensors'})


def check_output(output, fmt: str, overwrite: bool, source=None) -> Path:
    """OUT before any work: not there (or --overwrite), its folder writable; a file format's OUT not a folder.
    --overwrite replaces an earlier export, nothing else: not a folder holding other files (`--output . --overwrite`
    would have emptied the current folder), not a file without the format's suffix (a checkpoint's weights), not
    SOURCE or a folder holding it, not the current folder."""
    from ..records import check_writable
    if not str(output).strip():
        raise UsageError("--output '': empty; give a new file (onnx, torch-export) or folder (hf)")
    out = Path(output)
    target = out.absolute().resolve()
    if source is not None and Path(source).exists() and Path(source).resolve().is_relative_to(target):
        raise UsageError(f"--output {output}: exists, and is SOURCE {source} or holds it, which the export would "
                         "replace; give a new path")
    if Path.cwd().resolve().is_relative_to(target):
        raise UsageError(f"--output {output}: is the current folder or holds it; give a new folder")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise UsageError(f"--output {output}: exists; give a new path or pass --overwrite")
        if fmt != 'hf' and out.is_dir():
            raise UsageError(f"--output {output}: is a folder; --format {fmt} writes one file")
        if fmt == 'hf' and not out.is_dir():
            raise UsageError(f"--output {output}: is a file; --format hf writes a folder")
        if fmt != 'hf' and out.suffix != SUFFIX[fmt]:       # e.g. a checkpoint's model.safetensors
            raise UsageError(f"--output {output}: --overwrite replaces an earlier {SUFFIX[fmt]} export only, and "
                             f"this file is not one; give a new path")
        others = sorted(p.name for p in out.iterdir() if p.name not in HF_FILES) if fmt == 'hf' else []
        if others:
            shown = ', '.join(others[:3]) + (f' and {len(others) - 3} more' if len(others) > 3 else '')
            raise UsageError(f"--output {output}: holds files an export does not write ({shown}); --overwrite "
                             "replaces an earlier --format hf folder only: give a new folder")
    elif fmt != 'hf' and out.suffix != SUFFIX[fmt]:
        # what --overwrite will know as an earlier export (above) is a file with the format's suffix: one named
        # otherwise could be written once and never replaced
        raise UsageError(f"--output {output}: --format {fmt} writes a {SUFFIX[fmt]} file; give a path ending in "
                         f"{SUFFIX[fmt]}")
    data = out.absolute().parent / f'{out.name}.data'
    if fmt == 'onnx' and not overwrite and (data.exists() or data.is_symlink()):
        # the name of an ONNX file's external weights: the commit writes it, or removes a replaced export's
        raise UsageError(f"--output {output}: {data.name} exists beside it (the name of an ONNX file's external "
                         "weights); give a new path or pass --overwrite")
    check_writable(out.absolute().parent, '--output', shown=output)
    return out


def _commit(tmp: Path, out: Path, fmt: str) -> None:
    """Move the finished temporary output over `out` (a folder replaced whole, a file by one rename). A folder is
    moved aside first (`OUT.old-PID-...`): if this process dies in between, the next run puts it back
    (`atomic.prepare_output`). ONNX: the temporary folder holds OUT's name and, for weights past protobuf's limit,
    OUT.data beside it (the name the graph refers to): that first, OUT last."""
    from ..atomic import temporary_sibling
    if fmt == 'onnx':
        data = out.absolute().parent / f'{out.name}.data'
        written = sorted(tmp.iterdir(), key=lambda p: p.name == out.name)
        for path in written:
            os.replace(path, out.absolute().parent / path.name)
        if data.name not in {p.name for p in written} and data.is_file():
            data.unlink()                    # the weights of the export this one replaced (--overwrite)
        tmp.rmdir()
        return
    if out.is_dir() and not out.is_symlink():
        old = temporary_sibling(out, directory=True, kind='old')
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def export(source, fmt: str, output, overwrite: bool = False, batch_size: int = 2, ema: bool = False) -> Dict:
    """Export SOURCE as `fmt` to `output` (`ema`: its --model-ema weight average); returns what was written and
    checked (for the CLI's report)."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: accepted {', '.join(FORMATS)}")
    out = check_output(output, fmt, overwrite, source)
    from .source import check_source
    check_source(source)                                     # before onnx's imports (seconds)
    if fmt == 'onnx':
        from .graphs import require_onnx
        require_onnx(runtime=True)                           # before loading anything
    from ..atomic import permissions_from_umask, prepare_output, temporary_sibling
    from .source import load_source
    model, state = load_source(source, ema=ema)
    made = [folder for folder in out.absolute().parents if not folder.exists()]     # removed again on failure
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    report = {'source': state['path'], 'model': state['model'], 'format': fmt, 'output': str(out.absolute()),
              'epoch': state.get('epoch'), 'notes': prepare_output(out, '--output') + state.get('notes', [])}
    # ONNX in a folder: a graph with external weights refers to its data file by name, which must be OUT's
    tmp = temporary_sibling(out, directory=fmt in ('hf', 'onnx'), suffix=SUFFIX[fmt] if fmt != 'onnx' else '')
    try:
        report.update(_write(model, state, fmt, tmp / out.name if fmt == 'onnx' else tmp, batch_size))
        for path in [tmp, *tmp.rglob('*')] if tmp.is_dir() else [tmp]:
            permissions_from_umask(path, 0o777 if path.is_dir() else 0o666)
        _commit(tmp, out, fmt)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        for folder in made:                                  # innermost first; only if still empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return report


def _write(model, state, fmt: str, tmp: Path, batch_size: int) -> Dict:
    import torch

    from .graphs import example_input, onnx_error, program_error, to_onnx, to_program
    example = example_input(model, max(batch_size, 2))
    checks = [example_input(model, 1, seed=1), example_input(model, 3, seed=2)]     # other batch sizes than traced
    if not example.is_floating_point() and example.shape[1] > 2:                     # token ids: a shorter sequence too
        checks[1] = checks[1][:, :example.shape[1] // 2 + 1]
    if fmt == 'hf':
        from .hf import save_hf_folder
        save_hf_folder(model, state, tmp)
        return {'files': sorted(p.name for p in tmp.iterdir())}
    with torch.no_grad():
        if fmt == 'onnx':
            to_onnx(model, example, tmp)
            error = onnx_error(tmp, model, checks)
        else:
            program = to_program(model, example)
            torch.export.save(program, str(tmp))
            error = program_error(torch.export.load(str(tmp)), model, checks)
    if not error <= MAX_RELATIVE_ERROR:
        raise RuntimeError(f"the exported {fmt} graph of {state['model']} is {error:.2e} away from eager torch "
                           f"(relative, bound {MAX_RELATIVE_ERROR:g}): an export bug; nothing was written")
    return {'batch_sizes_checked': [int(x.shape[0]) for x in checks], 'max_relative_error': error}
