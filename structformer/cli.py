"""`structformer train | eval | analyze | bench | reproduce | design | models` — one command line for the library."""
import argparse
import ast
import importlib
import json
import sys
from pathlib import Path
from typing import List, Optional

from .errors import UsageError, expected_failure, one_line

# Nothing heavy at module level: `structformer --help` must answer without importing torch or timm.

TRAIN_EXAMPLES = """examples:
  structformer train --model crate_digits --data digits --epochs 30
  structformer train --model crate_mnist --data mnist:/data/mnist --opt lion --lr 3e-4 --weight-decay 0.5
  structformer train --model vit_tiny_patch16_224 --model-kwargs img_size=8 patch_size=2 --data digits
  structformer train --model crate_synthetic --data synthetic-subspaces --data-kwargs num_classes=4 subspace_dim=3
  structformer train -c outputs/demo/config.yaml --output outputs/again      # rerun a saved configuration
  structformer train --output outputs/demo --resume                          # continue an interrupted run
  torchrun --nproc_per_node=2 -m structformer train --model crate_digits --data digits   # DDP
  structformer train --model crate_digits --data digits --amp --mixup 0.8 --cutmix 1.0 --aa rand-m9-mstd0.5-inc1 \
      --reprob 0.25 --model-ema --grad-accum-steps 2          # timm train.py's flags (docs/training.md)
  structformer train --recipe crate_tiny_in1k --dry-run      # a paper's recipe, planned without its data

--data accepts: digits | synthetic-subspaces | mnist:PATH | imagefolder:PATH | cifar10:PATH | wds:TRAIN[,VAL]
| hfds:PATH (local files only; nothing is downloaded). Every run writes config.yaml, metrics.jsonl,
summary.json and checkpoints/epoch_NNNN/ (safetensors + JSON) under --output."""

EVAL_EXAMPLES = """examples:
  structformer eval --checkpoint outputs/demo
  structformer eval --checkpoint outputs/demo/checkpoints/epoch_0010 --data digits --split train"""

MODELS_EXAMPLES = """examples:
  structformer models                 # every structformer model with its parameter count
  structformer models --filter crate  # only names containing 'crate'
  structformer models --json
  structformer models --filter soft_tiny --flops   # + multiply-adds per image, by component"""

RECIPES_EXAMPLES = """examples:
  structformer recipes
  structformer train --recipe crate_base_in1k --data imagefolder:/data/imagenet --dry-run
  torchrun --nproc_per_node 8 -m structformer train --recipe crate_base_in1k --data imagefolder:/data/imagenet"""

BENCH_EXAMPLES = """examples:
  structformer bench models                      # CRATE-T vs ViT-T, train/infer img/s and peak memory
  structformer bench models --batch-size 16 --img-size 224 --steps 5
  structformer bench attention --threads 1 --output outputs/bench/attention.json   # SOFT Fig. 1b sweep"""


REPRODUCE_EXAMPLES = """examples:
  structformer reproduce soft --data /data/mnist --epochs 1 --limit-train-batches 40
  structformer reproduce soft --attn softmax soft softpp --epochs 3 --output outputs/reproduce_soft"""

DATA_EXAMPLES = """examples:
  structformer data shard /data/imagenet /data/imagenet-wds --shard-size 1000
  structformer train --model crate_base --data wds:/data/imagenet-wds          # the folder's _info.json names the splits"""

# `structformer bench TARGET` and `structformer reproduce PAPER`: one row per target, naming a module that
# defines add_arguments(parser), run(args) -> int and, optionally, EXAMPLES. The modules must not import
# torch at module level (`structformer --help` builds every parser).
BENCH_TARGETS = {
    'models': ('structformer.bench.models', 'CRATE-T vs ViT-T training / inference speed'),
    'attention': ('structformer.bench.attention', 'attention time / memory / FLOPs vs token count (SOFT Fig. 1b)'),
    'lowrank': ('structformer.bench.lowrank', 'dense vs factorised (W = UVᵀ) layer and ViT-S block stack step time / memory'),
    'mlp': ('structformer.bench.mlp', 'structured linear layers at equal width; Mixer Table S.3 (RP-Mixer vs SW-MLP)'),
    'sparse-attention': ('structformer.bench.sparse_attention', 'Sparsifiner MHSA paths vs dense SDPA: time and FLOPs vs n, keep'),
    'data': ('structformer.bench.data', 'loader images/s (decode + train transform): our folder and shards vs timm, '
             'against what a training step needs'),
    'gpu': ('structformer.bench.gpu', 'one GPU in one command: 224-px training img/s, SOFT and Sparsifiner vs SDPA, compiled'),
}
REPRODUCE_TARGETS = {
    'soft': ('structformer.reproduce.soft', 'SOFT Table 2 analogue: the Tiny backbone with each attention on MNIST'),
    'lowrank': ('structformer.reproduce.lowrank', 'low-rank training: inits, Frobenius decay vs L2, pre-training, '
                'interpolation (WRN on MNIST, GPT on the standard library)'),
    'mixer': ('structformer.reproduce.mixer', 'Mixer as a wide sparse MLP: fixed-Ω width, depth and init spectra on MNIST'),
    'crate': ('structformer.reproduce.crate', 'CRATE Fig. 3–5: R_c and sparsity per layer over training, depth 12 on MNIST'),
    'sparsifiner': ('structformer.reproduce.sparsifiner', 'Sparsifiner Tables 1 and 4: keep ratio vs accuracy and MHSA '
                    'FLOPs, against Linformer at equal budget, distilled from a dense ViT on MNIST'),
}


def parse_value(text: str):
    """A Python literal where the text is one (3, 0.1, True, None, [1, 2], {'a': 1}), else the string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


class ParseKwargs(argparse.Action):
    """KEY=VALUE ... into a dict, values as Python literals (timm's convention), with a one-line
    error naming the flag for an item without '='."""

    def __call__(self, parser, namespace, values, option_string=None):
        out = dict(getattr(namespace, self.dest, None) or {})
        for item in values:
            key, sep, value = item.partition('=')
            if not sep or not key.isidentifier():
                parser.error(f"{option_string} {item!r}: expected KEY=VALUE with KEY a Python name "
                             "(e.g. depth=6 or attn_kwargs=\"{'num_landmarks': 4}\")")
            out[key] = parse_value(value)
        setattr(namespace, self.dest, out)


class ParseTransform(argparse.Action):
    """`--transform NAME KEY=VALUE ...`, repeatable, into [{'name': NAME, 'kwargs': {...}}, ...] in order."""

    def __call__(self, parser, namespace, values, option_string=None):
        name, items = values[0], values[1:]
        if not name.isidentifier():
            parser.error(f"{option_string} {name!r}: expected a transform name, then KEY=VALUE arguments")
        kwargs = {}
        for item in items:
            key, sep, value = item.partition('=')
            if not sep or not key.isidentifier():
                parser.error(f"{option_string} {name} {item!r}: expected KEY=VALUE")
            kwargs[key] = parse_value(value)
        transforms = list(getattr(namespace, self.dest, None) or [])
        transforms.append({'name': name, 'kwargs': kwargs})
        setattr(namespace, self.dest, transforms)


def _rank_value(text: str):
    """argparse type for --rank: an integer count, or a fraction (validated with the configuration)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--rank must be an integer >= 1 or a fraction in (0, 1], got {text!r}")


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS  # only flags given explicitly override -c / the defaults
    p.add_argument('-c', '--config', default=S, help='YAML configuration (e.g. a run\'s config.yaml); flags given override it')
    p.add_argument('--recipe', default=S, metavar='NAME',
                   help="a paper's training setting as the starting configuration (`structformer recipes` lists "
                        "them); -c FILE and the flags given override its values")
    p.add_argument('--dry-run', action='store_true',
                   help='print the resolved plan (model and parameters, data, batch, steps, learning rates, '
                        'augmentation, precision, EMA, stages) and exit without training or writing anything')
    p.add_argument('--dataset-size', type=int, default=S, metavar='N',
                   help="training images (sequences) of --data, for a dry run that does not read the data "
                        "(recipes state their data's)")
    g = p.add_argument_group('model and data')
    g.add_argument('--model', default=S, help='registered timm or structformer model (default crate_digits)')
    g.add_argument('--model-kwargs', nargs='*', action=ParseKwargs, default=S, metavar='KEY=VALUE',
                   help='extra model constructor arguments, e.g. eta=0.1 lambd=0.1 sparse_step=mm')
    g.add_argument('--initial-checkpoint', default=S, metavar='RUN|FILE',
                   help='fine-tune from these weights (run or checkpoint folder, .safetensors, weights-only .pth); '
                        'the classifier, input channels and position embedding adapt to the model, as timm does; '
                        'a fresh optimiser and schedule')
    g.add_argument('--pretrained', action='store_const', const=True, default=S,
                   help="start from timm's pretrained weights for --model (its pretrained config; structformer ships "
                        "none, and offline nothing downloads: use --pretrained-path); adapted as --initial-checkpoint")
    g.add_argument('--pretrained-path', default=S, metavar='FILE',
                   help='start from this weights file (.safetensors, weights-only .pth / .bin, or a folder written by '
                        '`structformer convert`); adapted as --initial-checkpoint')
    g.add_argument('--transform', dest='transforms', nargs='+', action=ParseTransform, default=S,
                   metavar=('NAME', 'KEY=VALUE'),
                   help='a registered model transform applied after construction, with its arguments; '
                        'repeat for several (applied in order, recorded in every checkpoint)')
    g.add_argument('--data', default=S, help='digits | synthetic-subspaces | mnist:PATH | imagefolder:PATH | cifar10:PATH '
                                              '| wds:TRAIN[,VAL] | hfds:PATH (docs/data.md)')
    g.add_argument('--data-kwargs', nargs='*', action=ParseKwargs, default=S, metavar='KEY=VALUE',
                   help="dataset options, e.g. augment=True or num_classes=4; imagefolder/wds/hfds/cifar10: img_size=N "
                        "(default: the model's input size); imagefolder: check=header (default: open every file's "
                        "header once, cached) | decode | none, bad_images=error (an unreadable file stops the run "
                        "naming it) or bad_images=skip (left out, or replaced in training, and named in the log); "
                        "wds: train_samples=N, shuffle_buffer=N, holdout=shards|samples")
    g.add_argument('--val-fraction', type=float, default=S, help='held-out fraction where the data has no split (0.2)')
    g = p.add_argument_group('low-rank training (W = U Vᵀ, structformer.factorize)')
    g.add_argument('--rank', dest='factorize_rank', type=_rank_value, default=S, metavar='R',
                   help='factorise linear / conv layers at this rank: an integer, or a fraction in (0, 1] of min(m, n)')
    g.add_argument('--factorize-at', type=int, default=S, metavar='K',
                   help='train dense for K epochs, then factorise by truncated SVD and continue (0 = from the start)')
    g.add_argument('--init', dest='factorize_init', default=S, metavar='INIT',
                   help='factor initialisation: spectral (default), spectral_ones or he')
    g.add_argument('--factorize-include', nargs='+', default=S, metavar='PATTERN',
                   help='layers to factorise: a preset (vision, transformer, all) or module-name patterns; default: '
                        'every conv but the first, or QKV and both FFN matrices for a transformer')
    g.add_argument('--factorize-lr-scale', type=float, default=S, metavar='S',
                   help='multiply the lr by S while the network is factorised: the whole run from the start, or from '
                        'the switch with --factorize-at (seed 004 App. A.2: 0.5 for transformers; default 1)')
    g.add_argument('--factor-decay', default=S, metavar='KIND',
                   help="regulariser of the factors: l2 (the optimiser's weight decay, default) or frobenius "
                        "(weight_decay/2 * ||U Vᵀ||²_F, factors taken out of the weight decay)")
    g = p.add_argument_group('distillation from a dense teacher (Sparsifiner §4)')
    g.add_argument('--teacher', default=S, metavar='RUN_DIR|FILE|NAME',
                   help='the dense model the student was converted from: a finished run, a weights file or folder '
                        '(the dense counterpart of --model, e.g. deit_small_patch16_224 for sparsifiner_deit_small_'
                        'patch16_224, or `structformer convert` output), or a registered model name with '
                        '--teacher-pretrained; the student starts from its weights and trains in two stages: the '
                        'attention predictors alone on attention distillation, then everything on CE + token and '
                        'logit distillation')
    g.add_argument('--teacher-pretrained', action='store_const', const=True, default=S,
                   help="--teacher NAME with timm's pretrained weights (downloads where timm has them)")
    g.add_argument('--predictor-epochs', type=int, default=S, metavar='K',
                   help='epochs of stage 1 (default about 1/9 of --epochs, the paper\'s 5 of 45; 0 = none)')
    g = p.add_argument_group('optimisation (timm optimisers and schedulers)')
    g.add_argument('--epochs', type=int, default=S, help='total epochs (30)')
    g.add_argument('-b', '--batch-size', type=int, default=S, help='per-process batch size (64)')
    g.add_argument('--eval-batch-size', type=int, default=S, help='(256)')
    g.add_argument('--opt', default=S, help='any timm optimiser: adamw (default), lion, sgd, ...')
    g.add_argument('--lr', type=float, default=S, help='peak learning rate (1e-3)')
    g.add_argument('--weight-decay', type=float, default=S, help='(0.05)')
    g.add_argument('--decay-everything', action=argparse.BooleanOptionalAction, default=S,
                   help='decay every parameter, norms, biases and cls/pos embeddings included, as the official '
                        'CRATE recipe does (default: timm\'s exemptions)')
    g.add_argument('--momentum', type=float, default=S, help='for sgd (0.9)')
    g.add_argument('--sched', choices=['cosine', 'none'], default=S, help='cosine with linear warm-up (default) or constant')
    g.add_argument('--warmup-epochs', type=float, default=S, help='linear warm-up length in epochs (2)')
    g.add_argument('--warmup-lr', type=float, default=S, help='(1e-6, or lr if lower)')
    g.add_argument('--min-lr', type=float, default=S, help='(1e-6, or lr if lower)')
    g.add_argument('--smoothing', dest='label_smoothing', type=float, default=S, help='label smoothing (0.1)')
    g.add_argument('--clip-grad', type=float, default=S, help='clip the gradient norm to this value')
    g.add_argument('--seed', type=int, default=S, help='one seed for data split, init, order and augmentation (0)')
    g.add_argument('--limit-train-batches', type=int, default=S, help='at most this many batches per epoch (0 = all)')
    g.add_argument('--workers', dest='num_workers', type=int, default=S, help='data loader workers (0)')
    g.add_argument('--compile', nargs='?', const='inductor', default=S, metavar='BACKEND',
                   help='torch.compile the model for training and evaluation (alone: inductor); default eager')
    g = p.add_argument_group("precision, device and throughput (timm train.py's flags)")
    g.add_argument('--amp', action=argparse.BooleanOptionalAction, default=S,
                   help='mixed precision: autocast, float32 master weights (a gradient scaler for float16)')
    g.add_argument('--amp-dtype', default=S, metavar='DTYPE',
                   help='float16 or bfloat16 (default: float16 on CUDA as timm, bfloat16 on a CPU)')
    g.add_argument('--device', default=S, help='auto (default: CUDA if present), cpu, cuda or cuda:N')
    g.add_argument('--channels-last', action=argparse.BooleanOptionalAction, default=S,
                   help='channels-last memory format for the model and its inputs')
    g.add_argument('--grad-accum-steps', type=int, default=S, metavar='N',
                   help='accumulate gradients over N batches per optimiser step (1)')
    g.add_argument('--lr-base', type=float, default=S, metavar='LR',
                   help='scale this lr to the effective batch (timm: lr = lr_base * batch / lr_base_size); '
                        'replaces --lr')
    g.add_argument('--lr-base-size', type=int, default=S, metavar='N', help='batch size of --lr-base (256)')
    g.add_argument('--lr-base-scale', default=S, metavar='RULE', help="linear or sqrt (default: sqrt for ada*/lamb)")
    g.add_argument('--log-interval', type=int, default=S, metavar='N',
                   help='a log line every N optimiser steps: loss, lr, img/s (50; 0 = epoch lines only)')
    g.add_argument('--log-tb', default=S, metavar='DIR', help='also write TensorBoard scalars to DIR (needs tensorboard)')
    g.add_argument('--dist-bn', default=S, metavar='MODE',
                   help="BatchNorm statistics across processes after each epoch: reduce (average, default), broadcast "
                        "(rank 0's) or '' (each its own)")
    g.add_argument('--allow-world-size-change', action=argparse.BooleanOptionalAction, default=S,
                   help='let --resume continue on another number of processes (the schedule is recomputed)')
    g = p.add_argument_group("augmentation and regularisation (timm's transforms, Mixup / CutMix, EMA)")
    g.add_argument('--aa', default=S, metavar='POLICY',
                   help="RandAugment / AutoAugment / AugMix policy, timm's strings: rand-m9-mstd0.5-inc1, "
                        "original, v0, augmix-m5-w4-d2")
    g.add_argument('--reprob', type=float, default=S, help='random erasing probability (0)')
    g.add_argument('--remode', default=S, help="random erasing fill: pixel (default), rand or const")
    g.add_argument('--recount', type=int, default=S, help='random erasing count (1)')
    g.add_argument('--color-jitter', type=float, default=S, metavar='S',
                   help='colour jitter strength (default: none; timm applies it only without --aa)')
    g.add_argument('--scale', type=float, nargs=2, default=S, metavar=('MIN', 'MAX'),
                   help='random-resized-crop area range (0.08 1.0)')
    g.add_argument('--ratio', type=float, nargs=2, default=S, metavar=('MIN', 'MAX'),
                   help='random-resized-crop aspect range (0.75 1.333)')
    g.add_argument('--hflip', type=float, default=S, help='horizontal flip probability (0.5 where the data flips)')
    g.add_argument('--aug-repeats', type=int, default=S, metavar='N',
                   help='repeated augmentation (DeiT): every image N times an epoch, 0 = off')
    g.add_argument('--mixup', type=float, default=S, metavar='ALPHA', help='Mixup alpha (0 = off)')
    g.add_argument('--cutmix', type=float, default=S, metavar='ALPHA', help='CutMix alpha (0 = off)')
    g.add_argument('--cutmix-minmax', type=float, nargs=2, default=S, metavar=('MIN', 'MAX'),
                   help='CutMix box ratio range (overrides --cutmix alpha)')
    g.add_argument('--mixup-prob', type=float, default=S, help='probability of mixing a batch (1.0)')
    g.add_argument('--mixup-switch-prob', type=float, default=S, help='probability of CutMix instead of Mixup when both are on (0.5)')
    g.add_argument('--mixup-mode', default=S, help='batch (default), pair or elem')
    g.add_argument('--mixup-off-epoch', type=int, default=S, metavar='E', help='stop mixing after epoch E (0 = never)')
    g.add_argument('--drop', type=float, default=S, help="dropout rate passed to the model as drop_rate")
    g.add_argument('--drop-path', type=float, default=S, help='stochastic depth rate passed to the model as drop_path_rate')
    g.add_argument('--model-ema', action=argparse.BooleanOptionalAction, default=S,
                   help='keep an exponential moving average of the weights, evaluated and saved beside them')
    g.add_argument('--model-ema-decay', type=float, default=S, help='(0.9998)')
    g.add_argument('--model-ema-warmup', action=argparse.BooleanOptionalAction, default=S,
                   help="timm ModelEmaV3's decay warm-up")
    g = p.add_argument_group('outputs')
    g.add_argument('--output', default=S, help='run directory (default outputs/<model>_<data>)')
    g.add_argument('--keep-last', type=int, default=S, help='checkpoints kept besides epoch 0 (2)')
    g.add_argument('--save-every', type=int, default=S, help='also keep every N-th epoch (0 = none)')
    g.add_argument('--resume', nargs='?', const=True, default=None, metavar='CHECKPOINT',
                   help='continue the run in --output (or from CHECKPOINT) with its saved configuration; '
                        '--epochs may extend it, --output, --eval-batch-size, --keep-last, --save-every and '
                        '--compile may change, any other flag that differs from the saved value is refused')
    g.add_argument('--stop-after', type=_positive_int('--stop-after'), default=None, metavar='N', help='stop after N epochs of this invocation (resume later)')
    g.add_argument('--overwrite', action='store_true', help='replace an existing run in --output')
    g.add_argument('--no-progress', action='store_true', help='no progress bar')


_NOT_CONFIG = ('command', 'config', 'resume', 'stop_after', 'overwrite', 'no_progress', 'func', 'dry_run')
# what a resumed run may change: where it writes and what it keeps, never what it trains
_RESUME_MAY_CHANGE = ('output', 'eval_batch_size', 'keep_last', 'save_every', 'compile', 'num_workers', 'device',
                      'log_interval', 'log_tb', 'allow_world_size_change')


def _flag(key: str) -> str:
    from .train.config import flag_name
    return flag_name(key) or key


def _resume_config(args, given: dict, from_file: dict, config_path) -> dict:
    """The saved configuration of the run to resume. --epochs may extend it (never below the epochs
    already trained), where and how it runs (_RESUME_MAY_CHANGE) may change; any other
    value given by flag or -c that differs from the saved one is refused by name, since the checkpoint was
    trained with the saved one."""
    from .train import TrainConfig
    from .train.checkpoint import load_checkpoint
    source = args.resume if isinstance(args.resume, str) else (given.get('output') or from_file.get('output'))
    if source is None:
        raise UsageError("--resume needs --output RUN_DIR (or --resume CHECKPOINT)")
    try:
        _, state, _ = load_checkpoint(source)
    except (FileNotFoundError, ValueError) as e:       # CheckpointError is a ValueError
        message = one_line(e)
        raise UsageError(f"--resume: {message.split('--checkpoint: ', 1)[-1]}") from None
    saved_config = dict(state['config'])
    values = dict(saved_config)                        # a resumed run keeps its configuration
    done = int(state.get('epoch', 0))
    requested = {**{k: (v, f"-c/--config {config_path} key {k!r}") for k, v in from_file.items()},
                 **{k: (v, _flag(k)) for k, v in given.items()}}
    for key, (value, flag) in requested.items():
        if key in _RESUME_MAY_CHANGE:
            values[key] = value
            continue
        if key == 'epochs':
            if value < done:
                raise UsageError(f"{flag} {value}: this run has already trained {done} epochs; --resume can "
                                 f"extend it (--epochs >= {done}), not shorten it")
            if value != saved_config.get('epochs') and saved_config.get('warmup_epochs') is None:
                # keep the warm-up the run was trained with: the default is fitted to the epoch count
                values['warmup_epochs'] = TrainConfig.from_dict(saved_config).resolved_warmup_epochs()
            values['epochs'] = value
            continue
        saved = saved_config.get(key)
        if key == 'teacher' and value and saved and _same_checkpoint(value, saved):
            continue                                   # the run directory given again: the recorded checkpoint
        if key == 'data' and isinstance(value, str) and _moved_data(value, saved, values):
            continue
        if value != saved and not (key == 'warmup_epochs' and value == values.get(key)):
            raise UsageError(f"{flag} cannot change on --resume (saved {saved!r}, given {value!r}); "
                             "start a new run with --output")
    return values


def _moved_data(given: str, saved, values: dict) -> bool:
    """--data on --resume: the saved data named again (relative paths compared as absolute), or the same kind of
    data where the saved path no longer exists (the data moved: `values` takes the new place)."""
    from .train.data_paths import absolute_data, data_path
    spec, as_given = absolute_data(given)
    if spec == saved or given == saved:
        return True
    old_path = data_path(saved) if isinstance(saved, str) else None
    same_kind = spec.partition(':')[0].strip().lower() == str(saved).partition(':')[0].strip().lower()
    if old_path is None or Path(old_path).exists() or not same_kind:
        return False
    values['data'], values['data_as_given'] = spec, as_given
    return True


def _same_checkpoint(given: str, saved: str) -> bool:
    from .train.checkpoint import resolve_checkpoint
    try:
        return resolve_checkpoint(given).resolve() == Path(saved).resolve()
    except (FileNotFoundError, ValueError):
        return False


def _train_config(args):
    """TrainConfig from (in increasing priority) the defaults, --recipe NAME, -c FILE and the flags given
    explicitly; with --resume, the saved configuration (see `_resume_config`)."""
    from .train import TrainConfig, load_config_file
    given = {k: v for k, v in vars(args).items() if k not in _NOT_CONFIG}
    config_path = getattr(args, 'config', None)
    from_file = load_config_file(config_path) if config_path else {}
    if args.resume:
        values = _resume_config(args, given, from_file, config_path)
    else:
        from_recipe = {}
        if 'recipe' in given:                      # the recipe's values sit under -c FILE and the flags
            from .train.recipes import load_recipe
            from_recipe, _ = load_recipe(given['recipe'])
        values = {**from_recipe, **from_file, **given}
        if 'data' in given:                        # a data_as_given from -c FILE recorded the file's data
            values['data_as_given'] = None
    return TrainConfig.from_dict(values, source='-c/--config ' + config_path if config_path else 'configuration')


def cmd_train(args) -> int:
    if args.dry_run:                               # the plan only: nothing trained, nothing written
        from .train.recipes import dry_run
        print(dry_run(_train_config(args)))
        return 0
    from .train import Trainer
    config = _train_config(args)
    trainer = Trainer(config, resume=args.resume, stop_after=args.stop_after, overwrite=args.overwrite,
                      progress=not args.no_progress)
    result = trainer.fit()
    if trainer.is_main:
        print(f"\nrun:        {result.output}\ncheckpoint: {result.last_checkpoint}\n"
              f"metrics:    {result.output / 'metrics.jsonl'}\nconfig:     {result.output / 'config.yaml'}")
    return 0


def cmd_eval(args) -> int:
    from torch.utils.data import DataLoader

    from .data import build_datasets
    from .train import evaluate, load_model
    model, state = load_model(args.checkpoint, ema=args.ema)
    cfg = state.get('config') or {}
    data = args.data or cfg.get('data')
    if not data:                                   # converted weights (`structformer convert`) record no data set
        raise UsageError(f"--data: {state['path']} records no data set (converted weights); pass --data")
    if not args.data:
        from .train.data_paths import check_stored_data
        check_stored_data(data, cfg.get('data_as_given'), "the checkpoint's", '--data')
    data_kwargs = dict(cfg.get('data_kwargs', {}), **(args.data_kwargs or {}))
    train_ds, val_ds, info = build_datasets(data, seed=cfg.get('seed', 0), val_fraction=cfg.get('val_fraction', 0.2),
                                            **data_kwargs)
    if info.num_classes != model.num_classes:
        raise ValueError(f"--data {data} has {info.num_classes} classes but the checkpoint's model predicts "
                         f"{model.num_classes}")
    dataset = val_ds if args.split == 'val' else train_ds
    metrics = evaluate(model, DataLoader(dataset, batch_size=args.batch_size), 'cpu')
    unit = 'sequences' if 'perplexity' in metrics else 'images'     # a language model's samples are windows
    metrics.update({'checkpoint': state['path'], 'epoch': state['epoch'], 'data': data, 'split': args.split,
                    unit: len(dataset), 'weights': 'ema' if args.ema else 'model'})
    if args.json:
        print(json.dumps(metrics))
    else:
        print(f"{state['model']}{' (weight average)' if args.ema else ''} epoch {state['epoch']} on {data} ({args.split}, {len(dataset)} {unit}): "
              f"top-1 {metrics['top1']:.2f}%  top-5 {metrics['top5']:.2f}%  loss {metrics['loss']:.4f}"
              + (f"  perplexity {metrics['perplexity']:.2f}" if 'perplexity' in metrics else ''))
    return 0


def _positive_int(flag: str):
    """argparse type: an int >= 1, else a one-line error naming the flag and the accepted range."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer >= 1, got {value!r}")
        return number
    return parse


def human_count(n: int) -> str:
    """A parameter count people can read: 812, 4.1K, 3.60M, 1.20G."""
    n = int(n)
    if abs(n) < 1000:
        return str(n)
    for scale, unit, digits in ((1e9, 'G', 2), (1e6, 'M', 2), (1e3, 'K', 1)):
        if round(abs(n) / scale, digits) >= 1:        # 999,999 is 1.00M, not 1000.0K
            return f"{n / scale:.{digits}f}{unit}"
    return str(n)


def cmd_models(args) -> int:
    from .models import list_structformer_language_models, list_structformer_models
    from .models.inventory import model_inventory
    language = set(list_structformer_language_models())
    names = [n for n in list_structformer_models() + sorted(language) if args.filter in n]
    rows = model_inventory(names)
    for row in rows:
        row['task'] = 'language model' if row['name'] in language else 'image classification'
    if args.flops:
        from .bench.flops import COMPONENTS, model_flops
        for row in rows:
            row.update(model_flops(row['name'], img_size=args.img_size))    # params of the model at that size
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    width = max(len(r['name']) for r in rows) if rows else 10
    header = f"{'model':<{width}}  {'params':>12}  input"
    if args.flops:
        columns = COMPONENTS + ('other',)
        col = max(9, *(len(c) for c in columns))            # whole component names: no truncated headers
        parts = ''.join(f"  {c:>{col}}" for c in columns)
        header = f"{'model':<{width}}  {'params':>12}  {'input':>10}  {'GMACs':>7}{parts}"
    print(header)
    for r in rows:
        # a language model reads token ids [B, T]: its "input" is the context length
        size = f"T={r['input_size'][-1]}" if r['task'] == 'language model' else 'x'.join(map(str, r['input_size']))
        if args.flops:
            parts = ''.join(f"  {r['breakdown_macs'][c] / 1e9:>{col}.3f}" for c in columns)
            print(f"{r['name']:<{width}}  {human_count(r['params']):>12}  {size:>10}  {r['macs'] / 1e9:>7.3f}{parts}")
        else:
            print(f"{r['name']:<{width}}  {human_count(r['params']):>12}  {size}")
    if args.flops:
        print("GMACs: multiply-adds of one image's forward (a language model: one sequence of T tokens; "
              "FlopCounterMode, matmul/conv only; papers quote these as FLOPs), split by component")
    return 0


def cmd_recipes(args) -> int:
    from .train.recipes import recipe_rows
    rows = recipe_rows()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    def short(text: str, width: int) -> str:
        return text if len(text) <= width else text[:width - 1] + '…'
    table = [{'name': r['name'], 'paper': r['paper'].split(' (')[0], 'model': r['model'],
              'reported': short(r['reported'], 48), 'source': short(r['source'], 60)} for r in rows]
    columns = ('name', 'paper', 'model', 'reported')
    widths = {c: max(len(c), *(len(t[c]) for t in table)) for c in columns}
    print('  '.join(f"{c:<{widths[c]}}" for c in columns) + '  source')
    for t in table:
        print('  '.join(f"{t[c]:<{widths[c]}}" for c in columns) + f"  {t['source']}")
    print(f"\n{len(rows)} recipes; `structformer train --recipe NAME --data ... --dry-run` prints a recipe's plan "
          "(docs/recipes.md)")
    return 0


def _target_module(table: dict, target: str):
    return importlib.import_module(table[target][0])


def cmd_bench(args) -> int:
    from .bench.load import start_watch, summary_line
    module = _target_module(BENCH_TARGETS, args.target)
    watch = start_watch(getattr(args, 'threads', 0) or None)     # every benchmark says whether others were busy
    status = module.run(args)
    print(summary_line(watch.record()))
    return status


def cmd_data(args) -> int:
    """`structformer data shard IMAGEFOLDER OUT`: webdataset shards of an image folder (data/wds.py)."""
    from .data.wds import shard_patterns, write_shards
    info = write_shards(args.imagefolder, args.out, args.shard_size, seed=args.seed, check=args.check)
    for split in info['splits'].values():
        print(f"{split['name']}: {split['num_samples']} samples in {len(split['filenames'])} shard(s)")
    print(f"wrote {args.out} ({len(info['classes'])} classes); train with --data {shard_patterns(args.out, info)}")
    return 0


def cmd_reproduce(args) -> int:
    return _target_module(REPRODUCE_TARGETS, args.target).run(args)


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog='structformer', formatter_class=fmt,
        description='Structured deep networks (CRATE, SOFT, ...) as timm models: train, evaluate, analyse, benchmark.',
        epilog='run `structformer COMMAND --help` for the options and examples of each command')
    from . import __version__
    parser.add_argument('--version', action='version', version=f'structformer {__version__}')
    sub = parser.add_subparsers(dest='command', metavar='COMMAND')
    sub.required = True

    p = sub.add_parser('train', help='train any registered model on a dataset', formatter_class=fmt,
                       epilog=TRAIN_EXAMPLES, description='Train a model; writes checkpoints, metrics and its configuration.')
    _add_train_arguments(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser('eval', help='top-1 / top-5 / loss of a checkpoint', formatter_class=fmt, epilog=EVAL_EXAMPLES,
                       description='Evaluate a checkpoint on the held-out split of its data (or --data).')
    p.add_argument('--checkpoint', required=True, help='run directory or checkpoint directory')
    p.add_argument('--data', default=None, help="dataset spec (default: the checkpoint's)")
    p.add_argument('--data-kwargs', nargs='*', action=ParseKwargs, default=None, metavar='KEY=VALUE',
                   help="dataset options over the checkpoint's (see `structformer train --help`)")
    p.add_argument('--split', choices=['val', 'train'], default='val')
    p.add_argument('-b', '--batch-size', type=_positive_int('--batch-size'), default=256)
    p.add_argument('--json', action='store_true', help='print one JSON object')
    p.add_argument('--ema', action='store_true', help='score the weight average of a run trained with --model-ema')
    p.set_defaults(func=cmd_eval)

    from .analysis.cli import ANALYZE_EXAMPLES, add_analyze_arguments, run_analyze
    p = sub.add_parser('analyze', help='white-box analysis of a CRATE checkpoint', formatter_class=fmt,
                       epilog=ANALYZE_EXAMPLES,
                       description='Per-layer coding rates, sparsity, subspace coherence and token maps (CRATE §3.1).')
    add_analyze_arguments(p)
    p.set_defaults(func=run_analyze)

    p = sub.add_parser('bench', help='speed / memory benchmarks (ratios measured in one run)', formatter_class=fmt,
                       epilog=BENCH_EXAMPLES, description='Benchmarks print measured ratios; they are not tests.')
    bench_sub = p.add_subparsers(dest='target', metavar='TARGET')
    bench_sub.required = True
    for target, (module, help_text) in BENCH_TARGETS.items():
        module = importlib.import_module(module)
        module.add_arguments(bench_sub.add_parser(target, help=help_text, formatter_class=fmt,
                                                  epilog=getattr(module, 'EXAMPLES', None)))
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser('reproduce', help="small-scale reproductions of the papers' tables", formatter_class=fmt,
                       epilog=REPRODUCE_EXAMPLES, description='Train the paper\'s comparison at a scale this machine runs.')
    reproduce_sub = p.add_subparsers(dest='target', metavar='PAPER')
    reproduce_sub.required = True
    for target, (module, help_text) in REPRODUCE_TARGETS.items():
        module = importlib.import_module(module)
        module.add_arguments(reproduce_sub.add_parser(target, help=help_text, formatter_class=fmt,
                                                      epilog=getattr(module, 'EXAMPLES', REPRODUCE_EXAMPLES)))
    p.set_defaults(func=cmd_reproduce)

    p = sub.add_parser('data', help='dataset tools: webdataset shards from an image folder', formatter_class=fmt,
                       epilog=DATA_EXAMPLES)
    data_sub = p.add_subparsers(dest='action', metavar='ACTION')
    data_sub.required = True
    s = data_sub.add_parser('shard', help='write an ImageFolder as webdataset tar shards (KEY.jpg + KEY.cls, _info.json)',
                            formatter_class=fmt, epilog=DATA_EXAMPLES)
    s.add_argument('imagefolder', metavar='IMAGEFOLDER', help='class sub-folders; train/ and val/ (or test/) become two splits')
    s.add_argument('out', metavar='OUT', help='a new (or empty) folder; written all at once, nothing on failure')
    s.add_argument('--shard-size', type=_positive_int('--shard-size'), default=1000, help='samples per shard (1000)')
    s.add_argument('--seed', type=int, default=0, help='seed of the order the training samples are written in')
    s.add_argument('--check', choices=['header', 'decode', 'none'], default='header',
                   help='up-front check of the images (header: open each file without decoding)')
    p.set_defaults(func=cmd_data)

    from . import design_cli as mixer_design
    p = sub.add_parser('design', help='Mixer widths at a fixed number of connections Ω (Mixer paper §4.2)',
                       formatter_class=fmt, epilog=mixer_design.EXAMPLES,
                       description='(S, C) pairs on a fixed-Ω curve, C* = S*, effective widths, SW-MLP widths.')
    mixer_design.add_arguments(p)
    p.set_defaults(func=mixer_design.run)

    p = sub.add_parser('models', help='list registered models with parameter counts', formatter_class=fmt,
                       epilog=MODELS_EXAMPLES)
    p.add_argument('--filter', default='', help='substring of the name')
    p.add_argument('--json', action='store_true')
    p.add_argument('--flops', action='store_true',
                   help='also count forward multiply-adds of one image, split by component (builds each model)')
    p.add_argument('--img-size', type=_positive_int('--img-size'), default=None,
                   help='input side for --flops (default: the model\'s own)')
    p.set_defaults(func=cmd_models)

    from .weights import cli as convert_cli
    p = sub.add_parser('convert', help="the papers' public checkpoints (and timm's DeiT) into our models",
                       formatter_class=fmt, epilog=convert_cli.EXAMPLES,
                       description='Convert a checkpoint to a weights folder that eval, train --pretrained-path / '
                                   "--initial-checkpoint and timm's local-dir: load (docs/weights.md).")
    convert_cli.add_arguments(p)
    p.set_defaults(func=convert_cli.run)

    from .export import cli as export_cli
    p = sub.add_parser('export', help='a trained model as ONNX, a torch.export program or a timm Hugging Face folder',
                       formatter_class=fmt, epilog=export_cli.EXAMPLES,
                       description='Export a run or checkpoint: onnx and torch-export are checked against eager torch '
                                   'before they are kept (docs/export.md).')
    export_cli.add_arguments(p)
    p.set_defaults(func=export_cli.run)

    p = sub.add_parser('recipes', help="the papers' training settings, for `structformer train --recipe NAME`",
                       formatter_class=fmt, epilog=RECIPES_EXAMPLES)
    p.add_argument('--json', action='store_true', help='one JSON list: name, paper, source, model, data, reported')
    p.set_defaults(func=cmd_recipes)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command. Expected failures -- bad input (UsageError and the project's other validation
    errors), unusable checkpoints, user paths that are missing, not folders or not writable -- end as one
    line, `structformer CMD: error: ...`, and exit status 2, as argparse's own errors do. Anything else is
    a bug and keeps its traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command + (f" {args.target}" if getattr(args, 'target', None) else '')
    try:
        return args.func(args)
    except KeyboardInterrupt as e:              # Ctrl-C, or SIGTERM during training (exit status 143)
        print(f"structformer {command}: interrupted; checkpoints already written are intact", file=sys.stderr)
        return getattr(e, 'exit_status', 130)
    except Exception as e:
        engine = sys.modules.get('structformer.train.engine')        # only a loaded engine can diverge
        if engine is not None and isinstance(e, engine.TrainingDiverged):
            print(f"structformer {command}: stopped: {e}", file=sys.stderr)
            return 1
        if not expected_failure(e):
            raise
        print(f"structformer {command}: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
