"""`structformer convert`: a public checkpoint -> a weights folder of ours (model.safetensors + timm's config.json +
our state.json), written whole or not at all."""
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..cli_args import ParseKwargs
from ..errors import UsageError
from . import SOURCES

DESCRIPTION = ('Convert a checkpoint to a weights folder that eval, train --pretrained-path / --initial-checkpoint '
               "and timm's local-dir: load (docs/weights.md).")

EXAMPLES = """examples:
  structformer convert --from crate-official crate_small.pth --model crate_small_patch16_224 --output weights/crate_s
  structformer convert --from soft-official soft_tiny.pth.tar --model soft_tiny_official_224 --output weights/soft_t
  structformer convert --from timm deit_small.safetensors --model sparsifiner_deit_small_patch16_224 \\
      --output weights/sparsifiner_s      # the predictor freshly initialised: train it with --teacher
  structformer eval --checkpoint weights/crate_s --data imagefolder:/data/imagenet
  structformer train --model crate_small_patch16_224 --pretrained-path weights/crate_s --data cifar10:PATH
  python -c "import timm, structformer; timm.create_model('local-dir:weights/crate_s', pretrained=True)"

docs/weights.md lists the key maps."""


def add_arguments(parser) -> None:
    parser.add_argument('source_file', metavar='FILE', help='the checkpoint: .safetensors, or a weights-only .pth / '
                        '.pth.tar / .bin (read with weights_only=True: loading never runs code)')
    parser.add_argument('--from', dest='source', required=True, metavar='SOURCE',
                        help=f"the checkpoint's layout: {' | '.join(SOURCES)}")
    parser.add_argument('--model', required=True, help='the registered model to convert into (its architecture)')
    parser.add_argument('--model-kwargs', nargs='*', action=ParseKwargs, default=None, metavar='KEY=VALUE',
                        help='constructor arguments over what the checkpoint fixes (classes, predictor shapes), '
                             'e.g. keep_ratio=0.25 img_size=384 (the position embeddings are then resampled)')
    parser.add_argument('--output', required=True, metavar='OUT', help='a new (or empty) folder')


def _check_output(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--output {out}: exists and is not an empty folder; give a new one")
    parent = out.absolute().parent
    if parent.exists() and not os.access(parent, os.W_OK):
        raise UsageError(f"--output {out}: {parent} is not writable")


def write_weights_folder(model, name: str, kwargs: dict, out: Path, record: dict) -> Path:
    """model.safetensors, timm's config.json (`save_config_for_hf`: what `local-dir:` reads) and our state.json
    (what `eval --checkpoint` and `--initial-checkpoint` read), in a temporary sibling renamed to `out` at the end."""
    from safetensors.torch import save_file
    from timm.models._hub import save_config_for_hf

    from ..atomic import permissions_from_umask
    from ..models.factory import ModelRecipe, default_input_size
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + '.tmp-'))
    try:
        tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / 'model.safetensors'), metadata={'format': 'pt'})
        save_config_for_hf(model, str(tmp / 'config.json'), model_args=dict(kwargs))
        recipe = ModelRecipe(name, dict(kwargs), [], default_input_size(name, kwargs))
        state = {'model': name, 'model_kwargs': dict(kwargs), 'recipe': recipe.to_dict(), 'epoch': 0, 'step': 0,
                 'config': {}, 'converted_from': record}
        (tmp / 'state.json').write_text(json.dumps(state, indent=1))
        for written in tmp.iterdir():
            permissions_from_umask(written, 0o666)
        permissions_from_umask(tmp, 0o777)
        if out.exists():
            out.rmdir()                                  # empty, checked before
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def convert_checkpoint(source: str, path, name: str, model_kwargs=None, output=None):
    """Read `path` in `source`'s layout, build `name`, load the converted weights (adapted by the family filter where
    --model-kwargs asks another size, classes or channels) and write `output`. Returns (model, notes)."""
    from ..models.factory import build_model
    from ..train.initial_weights import read_weights
    from .convert import convert_state_dict, infer_model_kwargs
    from .filters import WeightsMismatch, adapt_state_dict
    if source not in SOURCES:
        raise UsageError(f"--from {source!r}: accepted {', '.join(SOURCES)}")
    if output is not None:
        _check_output(Path(output))
    state = read_weights(path, 'convert FILE')
    fixed = infer_model_kwargs(source, state)
    wanted = dict(model_kwargs or {})
    # the checkpoint's own architecture first (its classes, predictor shapes); --model-kwargs adapt it afterwards
    native, _ = build_model(name, fixed)
    converted, notes = convert_state_dict(source, state, native)
    native.load_state_dict(converted)
    kwargs = dict(fixed, **wanted)
    model, recipe = build_model(name, kwargs) if wanted else (native, None)
    if wanted:
        try:
            adapted, done = adapt_state_dict(native.state_dict(), model, where='convert --model-kwargs')
        except WeightsMismatch as e:
            raise UsageError(str(e)) from None
        model.load_state_dict(adapted, strict=False)
        notes += [f"adapted {line}" for line in done]
        kwargs = recipe.kwargs
    if output is not None:
        record = {'from': source, 'file': str(Path(path).absolute()), 'notes': notes}
        write_weights_folder(model.eval(), name, kwargs, Path(output), record)
    return model, notes


def run(args) -> int:
    _, notes = convert_checkpoint(args.source, args.source_file, args.model, args.model_kwargs, args.output)
    print(f"converted {args.source_file} ({args.source}) into {args.model}: {args.output}")
    for line in notes:
        print(f"  {line}")
    return 0
