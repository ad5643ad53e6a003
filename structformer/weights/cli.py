"""`structformer convert`: a public checkpoint -> a weights folder of ours (model.safetensors + timm's config.json +
our state.json), written whole or not at all."""
from pathlib import Path

from ..cli_args import ParseKwargs
from ..errors import UsageError
from . import SOURCES

DESCRIPTION = ('Convert a checkpoint to a weights folder that eval, train --pretrained-path / --initial-checkpoint '
               "and timm's local-dir: load (docs/weights.md).")

EXAMPLES = """examples:
  structformer convert --from crate-official crate_small.pth --model crate_small_patch16_224 --output weights/crate_s
  structformer convert --from soft-official soft_tiny.pth.tar --model soft_tiny_official_224 --output weights/soft_t
  structformer convert --from soft-official checkpoint-299.pth.tar --model soft_tiny_official_224 --weights model \\
      --output weights/soft_t_model       # a training checkpoint: the non-EMA weights (default: what SOFT scores, EMA)
  structformer convert --from sparsifiner-official checkpoint-49.pth --model sparsifiner_deit_small_patch16_224 \\
      --output weights/spf_s              # the public code's top-8 coefficients, heads^-1/2 scale, |W_up| > 2e-2
  structformer convert --from timm deit_small.safetensors --model sparsifiner_deit_small_patch16_224 \\
      --output weights/sparsifiner_s      # the predictor freshly initialised: train it with --teacher
  structformer eval --checkpoint weights/crate_s --data imagefolder:/data/imagenet
  structformer train --model crate_small_patch16_224 --pretrained-path weights/crate_s --data cifar10:PATH
  python -c "import timm, structformer; timm.create_model('local-dir:weights/crate_s', pretrained=True)"

convert prints every setting it chose and why, and which weights of a training checkpoint it took.
docs/weights.md lists the key maps and the layouts of training checkpoints."""


def add_arguments(parser) -> None:
    parser.add_argument('source_file', metavar='FILE', help='the checkpoint: .safetensors, or a .pth / .pth.tar / .bin '
                        "as torch.save wrote it, a trainer's checkpoint included (read with weights_only=True and an "
                        'allow-list of plain data such as argparse.Namespace: loading never runs code)')
    parser.add_argument('--from', dest='source', required=True, metavar='SOURCE',
                        help=f"the checkpoint's layout: {' | '.join(SOURCES)}")
    parser.add_argument('--model', required=True, help='the registered model to convert into (its architecture)')
    parser.add_argument('--model-kwargs', nargs='*', action=ParseKwargs, default=None, metavar='KEY=VALUE',
                        help='constructor arguments over what the checkpoint fixes (classes, predictor shapes), '
                             'e.g. keep_ratio=0.25 img_size=384 (the position embeddings are then resampled)')
    parser.add_argument('--output', required=True, metavar='OUT', help='a new (or empty) folder')
    parser.add_argument('--weights', choices=('ema', 'model'), default=None,
                        help="of a trainer's checkpoint holding both: the EMA weights or the model's (default: what "
                             "the source's own evaluation takes: EMA for timm's CheckpointSaver files (SOFT), the "
                             "model for DeiT / Sparsifiner save_model files, and for a structformer run, whose "
                             "--model-ema average --weights ema takes); which was taken is printed")


def _check_output(out: Path) -> None:
    from ..records import check_writable
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--output {out}: exists and is not an empty folder; give a new one")
    try:
        check_writable(out, '--output')
    except ValueError as e:
        raise UsageError(str(e)) from None


# what the family filters adapt (a fresh classifier, resampled position embeddings, folded input channels), in the
# order a checkpoint's own architecture is more likely to differ from the model's default in them (last: in_chans)
_ADAPTED = ('num_classes', 'img_size', 'in_chans')


def _own_candidates(wanted: dict):
    """Readings of --model-kwargs as the checkpoint's own architecture, most first: all of them; all but what the
    filters adapt (num_classes, img_size); all but in_chans too."""
    seen = []
    for adapted in ((), _ADAPTED[:2], _ADAPTED):
        own = {key: value for key, value in wanted.items() if key not in adapted}
        if own not in seen:
            seen.append(own)
            yield own


def _other_channel_counts(name: str) -> list:
    """Without --model-kwargs, the readings tried when the checkpoint does not fit the registered model: the
    other of 1 and 3 input channels. timm's train.py, validate.py and inference.py build in_chans=3 unless told, so
    a 1-channel model of ours (crate_digits, *_mnist) trained there holds 3-channel weights (and an RGB model given
    --in-chans 1, 1-channel ones), which the default build refuses as another size."""
    import timm
    try:
        size = timm.get_pretrained_cfg(name).input_size
    except Exception:                  # not registered: the build names it
        return []
    return [{'in_chans': c} for c in (3, 1) if size and c != size[0]]


def convert_checkpoint(source: str, path, name: str, model_kwargs=None, output=None, weights=None):
    """Read `path` in `source`'s layout, build `name`, load the converted weights (adapted by the family filter where
    --model-kwargs asks another size, classes or channels) and write `output`. `weights`: 'ema' or 'model' of a
    trainer's checkpoint (None: what its source evaluates). Returns (model, notes): the settings chosen and why,
    which weights were taken, what was converted or adapted."""
    from ..models.factory import build_model
    from ..train.initial_weights import read_weights
    from .convert import convert_state_dict, settings
    from .filters import WeightsMismatch, adapt_state_dict
    if source not in SOURCES:
        raise UsageError(f"--from {source!r}: accepted {', '.join(SOURCES)}")
    if output is not None:
        _check_output(Path(output))
    taken: list = []
    state = read_weights(path, 'convert FILE', kind=weights, notes=taken)
    wanted = dict(model_kwargs or {})
    chosen = settings(source, state)
    # KEY=None on a setting the conversion fixes (coef_topk=None: not the public top 8) asks for the model's own
    # default: the key is left out, as timm.create_model would drop the None (build_model refuses a None elsewhere)
    default = {key for key, value in wanted.items() if value is None and any(key == k for k, _, _ in chosen)}
    wanted = {key: value for key, value in wanted.items() if key not in default}
    fixed = {key: value for key, value, _ in chosen if key not in default}
    notes = [f"{key}={value!r}: {why}" if key not in wanted and key not in default else
             f"{key}: the model's default, as --model-kwargs {key}=None asked (the conversion's choice: {value!r}, "
             f"{why})" if key in default else
             f"{key}={wanted[key]!r}: as --model-kwargs asked (the conversion's choice: {value!r}, {why})"
             for key, value, why in chosen] + taken
    # the checkpoint's own architecture first (its classes, predictor shapes); --model-kwargs adapt it afterwards
    native, _ = build_model(name, fixed)
    try:
        converted, converted_notes = convert_state_dict(source, state, native, shapes_must_fit=True)
    except UsageError as first:
        # a checkpoint trained with another architecture than the model's default (timm's --in-chans 1, a depth):
        # --model-kwargs then say what it is, and may also say what to adapt it to (num_classes, img_size): the
        # first of these readings whose model the weights fit is taken, the rest adapted as timm's loader would
        candidates = _own_candidates(wanted) if wanted else _other_channel_counts(name)
        if not candidates:
            raise
        for own in candidates:
            try:
                native, _ = build_model(name, dict(fixed, **own))
            except ValueError as e:
                if own == wanted:
                    # the model asked for cannot be built at all (a typo, eps without the tied MSSA, ...): that is
                    # the error, not the default-sized model's mismatch with the checkpoint
                    message = str(e)
                    raise UsageError(message if message.startswith('--model-kwargs') else
                                     f"--model-kwargs: {message}") from None
                continue
            try:
                converted, converted_notes = convert_state_dict(source, state, native, shapes_must_fit=True)
                break
            except ValueError:               # UsageError: the weights do not fit this reading
                continue
        else:
            raise first from None
        fixed = dict(fixed, **own)
        asked = 'as --model-kwargs asked, ' if wanted else ''
        notes = [f"{key}={value!r}: {asked}the checkpoint's own (its weights fit the model built with them"
                 + ('' if wanted else "; timm's train.py builds 3-channel models unless --in-chans") + ')'
                 for key, value in own.items()] + [n for n in notes if n.split('=')[0] not in own]
        wanted = {key: value for key, value in wanted.items() if key not in own}
    native.load_state_dict(converted)
    notes += converted_notes
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
        from .folder import save_weights_folder
        took = [line for line in taken if line.startswith('took ')]      # not the prefixes removed
        record = {'from': source, 'file': str(Path(path).absolute()), 'weights': took[0] if took else None,
                  'notes': notes}
        save_weights_folder(model.eval(), output, kwargs, name, record=record, flag='--output')
    return model, notes


def run(args) -> int:
    _, notes = convert_checkpoint(args.source, args.source_file, args.model, args.model_kwargs, args.output,
                                  args.weights)
    print(f"converted {args.source_file} ({args.source}) into {args.model}: {args.output}")
    for line in notes:
        print(f"  {line}")
    return 0
