"""`structformer eval`: top-1 / top-5 / loss of a checkpoint on the held-out split of its data (or --data), in the
precision the run evaluated in (its config's --amp / --amp-dtype) unless --amp / --no-amp / --amp-dtype say
otherwise, and with the run's evaluation batch size."""
import argparse
import json

from ..cli_args import ParseKwargs, positive_int
from ..errors import UsageError

DESCRIPTION = 'Evaluate a checkpoint on the held-out split of its data (or --data).'

EXAMPLES = """examples:
  structformer eval --checkpoint outputs/demo
  structformer eval --checkpoint outputs/demo/checkpoints/epoch_0010 --data digits --split train"""


def add_arguments(p) -> None:
    p.add_argument('--checkpoint', required=True, help='run directory or checkpoint directory')
    p.add_argument('--data', default=None, help="dataset spec (default: the checkpoint's)")
    p.add_argument('--data-kwargs', nargs='*', action=ParseKwargs, default=None, metavar='KEY=VALUE',
                   help="dataset options over the checkpoint's (see `structformer train --help`)")
    # timm's readers and validate.py take 'validation' (a Hugging Face / TFDS split name) for 'val': the same split
    p.add_argument('--split', choices=['val', 'validation', 'train'], default='val',
                   help='the held-out images (val, or validation as timm spells it) or the training images (train), '
                        'either read with the evaluation transform, without augmentation (as timm\'s validate.py '
                        'reads a split)')
    p.add_argument('--val-fraction', type=_fraction, default=None, metavar='F',
                   help="the held-out fraction where the data has no split of its own (an image folder of class "
                        "folders alone), as train's: default the run's (0.2 for converted weights); on the run's own "
                        "data another fraction holds out other images, some of them trained on")
    p.add_argument('-b', '--batch-size', type=positive_int('--batch-size'), default=None,
                   help="(default: the run's --eval-batch-size, else 256)")
    p.add_argument('--amp', action=argparse.BooleanOptionalAction, default=None,
                   help='evaluate under autocast (--amp) or in float32 (--no-amp); default: as the run evaluated '
                        '(its config), float32 for converted weights')
    p.add_argument('--amp-dtype', default=None, metavar='DTYPE', choices=('float16', 'bfloat16'),   # before loading
                   help="float16 or bfloat16 (default: the run's; else bfloat16 on a CPU)")
    p.add_argument('--json', action='store_true', help='print one JSON object')
    p.add_argument('--ema', action='store_true', help='score the weight average of a run trained with --model-ema')
    p.add_argument('--per-class', action='store_true',
                   help="also each class's images and top-1, by the class names the run recorded")


def _fraction(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not 0.0 < number < 1.0:
        raise argparse.ArgumentTypeError(f"--val-fraction must be a number in (0, 1), got {value!r}")
    return number


def run(args) -> int:
    if not args.json:
        return _run(args)
    import contextlib
    import sys
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):   # the data's notes (an image folder's header check) are no JSON
        return _run(args, out)


def _run(args, out=None) -> int:
    from ..train.checkpoint_paths import resolve_checkpoint
    checkpoint = resolve_checkpoint(args.checkpoint)     # a wrong path refused before torch's import (seconds)
    from ..data.spec import check_data_kwargs
    check_data_kwargs(args.data_kwargs)
    from torch.utils.data import DataLoader

    from ..data import build_datasets
    from ..train import evaluate, load_model
    split = 'val' if args.split == 'validation' else args.split     # timm's spelling of the same split
    model, state = load_model(checkpoint, ema=args.ema)
    cfg = state.get('config') or {}
    data = args.data or cfg.get('data')
    if not data:                                   # converted weights (`structformer convert`) record no data set
        raise UsageError(f"--data: {state['path']} records no data set (converted weights); pass --data")
    if not args.data:
        from ..train.data_paths import check_stored_data
        check_stored_data(data, cfg.get('data_as_given'), "the checkpoint's", '--data')
    from ..train.scoring_data import check_model_input, checkpoint_data_options, trained_input_size, unaugmented
    data_kwargs = checkpoint_data_options(state, args.data, args.data_kwargs)   # the run's on its own data only
    data_kwargs = unaugmented(data, data_kwargs)      # every split scored with the evaluation transform
    # the stratified split's refusal names --val-fraction as its remedy: eval takes it too
    val_fraction = args.val_fraction if args.val_fraction is not None else cfg.get('val_fraction', 0.2)
    train_ds, val_ds, info = build_datasets(data, seed=cfg.get('seed', 0), val_fraction=val_fraction, **data_kwargs)
    if info.num_classes != model.num_classes:
        raise ValueError(f"--data {data} has {info.num_classes} classes but the checkpoint's model predicts "
                         f"{model.num_classes}")
    from ..data.classes import class_mismatch
    data_info = state.get('data_info') or {}
    problem = class_mismatch(data_info.get('classes'), info.extra.get('classes'), data_info.get('class_descriptions'),
                             info.extra.get('class_descriptions'))
    if problem:
        order = data_info.get('class_order')
        raise UsageError(f"--data {data} does not name the classes {state['path']} was trained on: {problem}"
                         + (f" (the run's order: {order})" if order else ''))
    if args.per_class and info.name in ('pysource', 'text'):
        raise UsageError(f"--per-class: --data {data} is language modelling (its classes are bytes); leave it out")
    dataset = val_ds if split == 'val' else train_ds
    if not len(dataset):          # scoring nothing divided by zero
        raise UsageError(getattr(dataset, 'empty_because', None) or f'--split {args.split}: --data {data} holds no '
                         f'{split} images')
    from ..train.scoring_data import weights_folder_normalisation
    dataset, normalised = weights_folder_normalisation(dataset, info, model, state)   # as its config.json says
    precision, how = _precision(args, cfg, state)
    if len(dataset):           # other images (size, channels) or text: one line before the whole split is read
        from torch.utils.data import default_collate
        size = trained_input_size(state)
        check_model_input(model, default_collate([dataset[i] for i in range(min(2, len(dataset)))])[0], precision,
                          f"--data {data}: {state['path']} ({state['model']}"
                          + (f", trained on inputs {list(size)}" if size else '') + ') cannot take its batch',
                          lambda given, takes: f"score it on {takes}-channel images (data like its training data), "
                                               f"or fine-tune it on these: structformer train --model {state['model']} "
                                               f"--initial-checkpoint {args.checkpoint} --data {data} (its input layer adapts to {given} "
                                               "channels, as timm's does)")
    batch_size = args.batch_size or cfg.get('eval_batch_size') or 256
    metrics = evaluate(model, DataLoader(dataset, batch_size=batch_size), 'cpu', precision, per_class=args.per_class)
    unit = 'sequences' if 'perplexity' in metrics else 'images'     # a language model's samples are windows
    from ..export.source import weights_origin
    averaged = state.get('averaged_epochs')       # an --avg-last average: of these epochs, not epoch N's weights
    metrics.update({'model': state['model'], 'checkpoint': state['path'], 'epoch': state['epoch'],
                    **({'averaged_epochs': averaged} if averaged else {}),
                    **({'weights_origin': weights_origin(state)} if weights_origin(state) else {}),
                    'data': data, 'split': split,
                    unit: len(dataset) - metrics.get('left_out', 0), 'weights': 'ema' if args.ema else 'model',
                    'precision': precision.name,
                    'precision_from': how})
    if normalised:
        metrics.update({'mean': list(normalised[0]), 'std': list(normalised[1])})
    from ..data.pixel_stats import EVAL_GEOMETRY, eval_data_config
    if info.name in EVAL_GEOMETRY:    # the forms read at a resize and centre crop: which, as the transform used it
        geometry = eval_data_config(info.name, data_kwargs.get('crop_pct'), data_kwargs.get('interpolation'),
                                    data_kwargs.get('crop_mode'))
        metrics.update({'img_size': info.img_size, 'crop_pct': geometry['crop_pct'],
                        'interpolation': geometry['interpolation'], 'crop_mode': geometry['crop_mode']})
    if args.per_class:
        names = data_info.get('classes') or info.extra.get('classes') or [str(k) for k in range(model.num_classes)]
        images, hits = metrics.pop('per_class_images'), metrics.pop('per_class_top1_hits')
        metrics['per_class'] = [{'class': name, 'images': n, 'top1': 100.0 * h / n if n else None}
                                for name, n, h in zip(names, images, hits)]
    if args.json:
        print(json.dumps(metrics), file=out, flush=True)
        return 0
    when = (weights_origin(state)                # a weights folder's "epoch 0" is no epoch of a run
            or (f"average of epochs {averaged[0]}-{averaged[-1]}" if averaged else f"epoch {state['epoch']}"))
    print(f"{state['model']}{' (weight average)' if args.ema else ''} {when} on {data} "
          f"({split}, {metrics[unit]} {unit}"
          + (f", {metrics['left_out']} unreadable left out" if metrics.get('left_out') else '') + "): "
          f"top-1 {metrics['top1']:.2f}%  top-5 {metrics['top5']:.2f}%  loss {metrics['loss']:.4f}"
          + (f"  perplexity {metrics['perplexity']:.2f}" if 'perplexity' in metrics else '')
          + f"  [{precision.name}{' autocast' if precision.dtype is not None else ''}: {how}]")
    if args.per_class:
        width = max(len(row['class']) for row in metrics['per_class'])
        for row in metrics['per_class']:
            top1 = f"{row['top1']:6.2f}%" if row['top1'] is not None else '     -'
            print(f"  {row['class']:<{width}}  {row['images']:>6} images  top-1 {top1}")
    return 0


def _precision(args, cfg: dict, state: dict):
    """(Precision on the CPU, why): --amp / --no-amp / --amp-dtype where given, else the run's own precision (the
    checkpoint's record, else its config), else float32. A run that evaluated in float16 on CUDA is evaluated in
    float32 on a CPU without float16 arithmetic, and says so."""
    import torch

    from ..train.precision import Precision, cpu_float16_supported
    cpu = torch.device('cpu')
    if args.amp is not None or args.amp_dtype is not None:
        amp = args.amp if args.amp is not None else True
        return Precision.create(amp, args.amp_dtype, cpu), 'as asked'     # --no-amp --amp-dtype D: refused, as in train
    recorded = state.get('precision') or ('float32' if not cfg.get('amp') else cfg.get('amp_dtype')
                                          or _default_amp_dtype(cfg, state))
    if recorded == 'float32':
        return Precision(cpu), "the run's (float32)" if cfg else 'float32 (no run configuration)'
    if recorded == 'float16' and not cpu_float16_supported():
        return Precision(cpu), ("float32: the run evaluated in float16 autocast, which this CPU cannot run; "
                                "--amp-dtype bfloat16 for bfloat16")
    return Precision.create(True, recorded, cpu), f"the run's ({recorded} autocast)"


def _default_amp_dtype(cfg: dict, state: dict) -> str:
    """The autocast dtype an --amp run without --amp-dtype trained in, for checkpoints from before the precision
    record: train's default for the device the run named (float16 on CUDA as timm, bfloat16 on a CPU). A run on
    --device auto does not say which it got: refused rather than guessed."""
    import torch

    from ..train.precision import default_amp_dtype
    device = str(cfg.get('device') or 'auto')
    if device == 'auto':
        raise UsageError(f"--amp-dtype: {state.get('path', 'the checkpoint')} was trained with --amp on --device auto "
                         "and records no precision; pass --amp-dtype bfloat16 or float16 (or --no-amp)")
    return default_amp_dtype(torch.device(device.split(':')[0]))
