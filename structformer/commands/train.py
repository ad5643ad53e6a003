"""`structformer train`: its flags (timm train.py's names), and the configuration a run trains with: the defaults,
--recipe NAME, -c FILE and the flags given, or, with --resume, the saved configuration."""
import argparse
from pathlib import Path

from ..cli_args import ParseKwargs, ParsePhaseSettings, ParseTransform, StoreOnce, positive_int, rank_value
from ..errors import UsageError, one_line

DESCRIPTION = 'Train a model; writes checkpoints, metrics and its configuration.'

EXAMPLES = """examples:
  structformer train --model crate_digits --data digits --epochs 30
  structformer train --model crate_mnist --data mnist:/data/mnist --opt lion --lr 3e-4 --weight-decay 0.5
  structformer train --model vit_tiny_patch16_224 --model-kwargs img_size=8 patch_size=2 --data digits
  structformer train --model crate_synthetic --data synthetic-subspaces --data-kwargs num_classes=4 subspace_dim=3
  structformer train -c outputs/demo/config.yaml --output outputs/again      # rerun a saved configuration
  structformer train --output outputs/demo --resume                          # continue an interrupted run
  torchrun --nproc_per_node=2 -m structformer train --model crate_digits --data digits   # DDP
  structformer train --model crate_digits --data digits --amp --mixup 0.8 --cutmix 1.0 --aa rand-m9-mstd0.5-inc1 \\
      --reprob 0.25 --model-ema --grad-accum-steps 2          # timm train.py's flags (docs/training.md)
  structformer train --recipe crate_tiny_in1k --dry-run      # a paper's recipe, planned without its data

--data accepts: digits | synthetic-subspaces | mnist:PATH | cifar10:PATH | imagefolder:PATH | wds:TRAIN[,VAL]
| hfds:PATH | imagenet:PATH | pysource | text:PATH (local files only; nothing is downloaded). Every run writes config.yaml, metrics.jsonl,
summary.json and checkpoints/epoch_NNNN/ (safetensors + JSON) under --output."""


# timm train.py's flags that are not flags here, and where their setting is (the CLI names it for an unknown flag)
_FOLLOWS_DATA = 'classes and channels follow --data (or --model-kwargs num_classes=N in_chans=C)'
_FOLLOWS_MODEL = "the image size follows the model (--data-kwargs img_size=N, or --model-kwargs img_size=N)"
FLAG_HINTS = {
    '--experiment': "--output is the run folder itself (timm's --output DIR --experiment NAME is --output DIR/NAME)",
    '--data-dir': 'give the data as --data FORM:PATH (e.g. --data imagefolder:/data/imagenet; docs/data.md)',
    '--dataset': 'give the data as --data FORM:PATH (e.g. --data imagefolder:/data/imagenet, wds:..., hfds:...; '
                 'docs/data.md)',
    '--train-split': "the splits are read from the data (train/ and val/, valid/, validation/ or test/; else --val-fraction)",
    '--val-split': "the splits are read from the data (train/ and val/, valid/, validation/ or test/; else --val-fraction)",
    '--num-classes': _FOLLOWS_DATA, '--in-chans': _FOLLOWS_DATA,
    '--img-size': _FOLLOWS_MODEL, '--input-size': _FOLLOWS_MODEL,
    '-j': 'use --workers N', '-vb': 'use --eval-batch-size N', '--validation-batch-size': 'use --eval-batch-size N',
    '--checkpoint-hist': 'use --keep-last N (and --keep-best for the best val top-1)',
    '--eval-metric': 'the runs rank by val top-1 (--keep-best)',
    '--no-aug': 'use --data-kwargs augment=false',
    '--pin-mem': 'the loaders pin memory whenever training runs on CUDA',
    '--start-epoch': '--resume continues a run from its last checkpoint; --initial-checkpoint starts from weights '
                     'with a fresh optimiser and schedule',
    '--no-resume-opt': '--initial-checkpoint RUN starts from its weights with a fresh optimiser and schedule',
    '--sched-on-updates': "the schedule always steps after every optimiser step here (timm's default is once an "
                          'epoch)',
    '--torchscript': 'TorchScript is not supported (docs/export.md); --compile for torch.compile',
    '--drop-connect': 'use --drop-path',
    '--log-wandb': 'use --log-tb DIR (TensorBoard)',
    # timm's train.py hands these to the model's constructor; here --model-kwargs does, for a model that takes them
    '--bn-momentum': "a model constructor's argument (timm's train.py passes it to create_model): --model-kwargs "
                     "bn_momentum=M, for a model that takes it (--momentum is the optimiser's)",
    '--bn-eps': "a model constructor's argument (timm's train.py passes it to create_model): --model-kwargs bn_eps=E, "
                "for a model that takes it",
    '--drop-block': "a model constructor's argument (timm's train.py passes it to create_model): --model-kwargs "
                    "drop_block_rate=R, for a model that takes it",
    '--gp': "a model constructor's argument (timm's train.py passes it to create_model): --model-kwargs "
            "global_pool=NAME, for a model that takes it",
}


# what a resumed run may change: where it writes and what it keeps, never what it trains (config key -> its flag,
# spelled here so --resume's help lists exactly these without importing the config module: --help loads no torch)
_RESUME_MAY_CHANGE = {
    'output': '--output', 'eval_batch_size': '--eval-batch-size', 'keep_last': '--keep-last',
    'save_every': '--save-every', 'recovery_interval': '--recovery-interval', 'compile': '--compile',
    'compile_mode': '--compile-mode', 'tf32': '--tf32', 'num_workers': '--workers', 'device': '--device',
    'log_interval': '--log-interval', 'log_tb': '--log-tb', 'allow_world_size_change': '--allow-world-size-change',
    'keep_best': '--keep-best', 'avg_last': '--avg-last', 'amp_dtype': '--amp-dtype'}


def add_arguments(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS  # only flags given explicitly override -c / the defaults
    p.add_argument('-c', '--config', default=S, help='YAML configuration (e.g. a run\'s config.yaml); flags given override it')
    p.add_argument('--recipe', default=S, metavar='NAME', action=StoreOnce,
                   help="a paper's training setting as the starting configuration (`structformer recipes` lists "
                        "them); -c FILE and the flags given override its values")
    p.add_argument('--allow-other-model', action='store_const', const=True, default=S,
                   help="train --model with --recipe NAME although it is neither the recipe's model, one its rows "
                        "train, nor a registered shrink of it (refused otherwise)")
    p.add_argument('--dry-run', action='store_true',
                   help='print the resolved plan (model and parameters, data, batch, steps, learning rates, '
                        'augmentation, precision, EMA, stages; with --resume the checkpoint it continues from and the epoch '
                        'and batch it goes on at) and exit without training or writing anything')
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
    g.add_argument('--data', default=S, help='digits | synthetic-subspaces | mnist:PATH | cifar10:PATH | imagefolder:PATH '
                                              '| wds:TRAIN[,VAL] | hfds:PATH | imagenet:PATH | pysource | text:PATH (docs/data.md)')
    g.add_argument('--data-kwargs', nargs='*', action=ParseKwargs, default=S, metavar='KEY=VALUE',
                   help="dataset options, e.g. augment=True or num_classes=4; imagefolder/wds/hfds/cifar10: img_size=N "
                        "(default: the model's input size); imagefolder: check=header (default: open every file's "
                        "header once, cached) | decode | none, bad_images=error (an unreadable file stops the run "
                        "naming it) or bad_images=skip (left out, or replaced in training, and named in the log); "
                        "wds: train_samples=N, shuffle_buffer=N, holdout=shards|samples")
    g.add_argument('--val-fraction', type=float, default=S, help='held-out fraction where the data has no split (0.2)')
    g = p.add_argument_group('low-rank training (W = U Vᵀ, structformer.factorize)')
    g.add_argument('--rank', dest='factorize_rank', type=rank_value, default=S, metavar='R',
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
    g.add_argument('--phase-settings', nargs='+', action=ParsePhaseSettings, default=S, metavar=('PHASE', 'KEY=VALUE'),
                   help='a phase\'s own optimiser and schedule (lr, min_lr, warmup_epochs, warmup_lr, warmup_prefix, '
                        'sched, weight_decay, opt, ...): a fresh optimiser at its start, its schedule over its epochs; '
                        'repeat per phase; merged over the recipe\'s (e.g. predictor warmup_epochs=0)')
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
    g.add_argument('--opt-betas', type=float, nargs='+', default=S, metavar='BETA',
                   help="the optimiser's betas, e.g. 0.9 0.999 (default: its own)")
    g.add_argument('--opt-eps', type=float, default=S, metavar='EPS', help="the optimiser's epsilon (default: its own)")
    g.add_argument('--layer-decay', type=float, default=S, metavar='F',
                   help="layer-wise lr decay: each of the model's group_matcher groups at lr x F^(groups after it), "
                        "timm's param_groups_layer_decay (default: off)")
    g.add_argument('--sched', choices=['cosine', 'tanh', 'poly', 'step', 'multistep', 'none'], default=S,
                   help='timm scheduler after the linear warm-up: cosine (default) or tanh to --min-lr, poly to '
                        '--min-lr with power --decay-rate, step (x --decay-rate every --decay-epochs), multistep '
                        '(x --decay-rate at each --decay-milestones) or none (constant)')
    g.add_argument('--decay-epochs', type=float, default=S, metavar='N', help='step: epochs between decays (90)')
    g.add_argument('--decay-milestones', type=int, nargs='+', default=S, metavar='EPOCH',
                   help='multistep: the epochs to decay at (90 180 270)')
    g.add_argument('--decay-rate', '--dr', type=float, default=S, metavar='F',
                   help="step / multistep factor; poly's power, as timm's train.py passes it (0.1)")
    g.add_argument('--lr-cycle-limit', type=int, default=S, metavar='N',
                   help="cosine / tanh / poly restarts: N cycles, all inside --epochs (timm's train.py runs --epochs "
                        "per cycle) (1)")
    g.add_argument('--lr-cycle-mul', type=float, default=S, metavar='F', help='each cycle F x the last one (1)')
    g.add_argument('--lr-cycle-decay', type=float, default=S, metavar='F', help="each cycle's peak x F (0.5)")
    g.add_argument('--lr-k-decay', type=float, default=S, metavar='K', help="timm's k-decay of cosine / poly (1)")
    g.add_argument('--lr-noise', type=float, nargs='+', default=S, metavar='FRACTION',
                   help="timm's lr noise from (and to) these fractions of a cycle, e.g. 0.4 0.9 (off)")
    g.add_argument('--lr-noise-pct', type=float, default=S, metavar='P', help='the noise kept within P of the lr (0.67)')
    g.add_argument('--lr-noise-std', type=float, default=S, metavar='S', help="the noise's std (1)")
    g.add_argument('--cooldown-epochs', type=int, default=S, metavar='N',
                   help='the last N of --epochs at --min-lr (timm adds them after --epochs; here --epochs counts '
                        'them) (0)')
    g.add_argument('--warmup-epochs', type=float, default=S, help='linear warm-up length in epochs (2, or a tenth of --epochs if less)')
    g.add_argument('--warmup-lr', type=float, default=S, help='(1e-6, or lr if lower)')
    g.add_argument('--warmup-prefix', action=argparse.BooleanOptionalAction, default=S,
                   help="the schedule starts after the warm-up instead of under it (timm's --warmup-prefix)")
    g.add_argument('--min-lr', type=float, default=S, help='(1e-6, or lr if lower)')
    g.add_argument('--smoothing', dest='label_smoothing', type=float, default=S,
                   help='label smoothing (0.1; 0 for a language model: text data or a model that takes token ids)')
    g.add_argument('--bce-loss', action=argparse.BooleanOptionalAction, default=S,
                   help="timm's BinaryCrossEntropy instead of cross-entropy (Mixup / CutMix targets included)")
    g.add_argument('--bce-target-thresh', type=float, default=S, metavar='T',
                   help='with --bce-loss: binarise soft targets at T (default: keep them soft)')
    g.add_argument('--clip-grad', type=float, default=S,
                   help='clip the gradients at this threshold (the global norm unless --clip-mode says otherwise)')
    g.add_argument('--clip-mode', default=S, metavar='MODE',
                   help="what --clip-grad bounds, timm's modes: norm (the global gradient norm, default), value (each "
                        "element) or agc (adaptive: each unit's gradient norm at most clip-grad x its weight norm; "
                        "the head is not clipped)")
    g.add_argument('--seed', type=int, default=S, help='one seed for data split, init, order and augmentation (0)')
    g.add_argument('--limit-train-batches', type=int, default=S, help='at most this many batches per epoch (0 = all)')
    g.add_argument('--workers', dest='num_workers', type=int, default=S, help='data loader workers (0)')
    g.add_argument('--compile', '--torchcompile', dest='compile', nargs='?', const='inductor', default=S,
                   metavar='BACKEND',
                   help='torch.compile the model for training and evaluation (alone: inductor); default eager')
    g.add_argument('--compile-mode', '--torchcompile-mode', dest='compile_mode', default=S, metavar='MODE',
                   help="with --compile: inductor's mode (default, reduce-overhead: CUDA graphs, max-autotune, "
                        "max-autotune-no-cudagraphs)")
    g = p.add_argument_group("precision, device and throughput (timm train.py's flags)")
    g.add_argument('--amp', action=argparse.BooleanOptionalAction, default=S,
                   help='mixed precision: autocast, float32 master weights (a gradient scaler for float16)')
    g.add_argument('--amp-dtype', default=S, metavar='DTYPE',
                   help='float16 or bfloat16 (default: float16 on CUDA as timm, bfloat16 on a CPU)')
    g.add_argument('--device', default=S, help='auto (default: CUDA if present), cpu, cuda or cuda:N')
    g.add_argument('--tf32', action=argparse.BooleanOptionalAction, default=S,
                   help="on CUDA: TF32 matmuls and convolutions and cudnn.benchmark, as timm's train.py sets them "
                        "(default off: float32 products in float32)")
    g.add_argument('--channels-last', action=argparse.BooleanOptionalAction, default=S,
                   help='channels-last memory format for the model and its image inputs (not for token ids)')
    g.add_argument('--grad-checkpointing', action=argparse.BooleanOptionalAction, default=S,
                   help="activation checkpointing in the model's blocks (its set_grad_checkpointing): less memory, "
                        "one more forward per block")
    g.add_argument('--sync-bn', action=argparse.BooleanOptionalAction, default=S,
                   help='BatchNorm statistics synchronised across processes every step (SyncBatchNorm; CUDA, '
                        'several processes)')
    g.add_argument('--grad-accum-steps', type=int, default=S, metavar='N',
                   help='accumulate gradients over N batches per optimiser step (1)')
    g.add_argument('--lr-base', type=float, default=S, metavar='LR',
                   help='scale this lr to the effective batch (timm: lr = lr_base * batch / lr_base_size); '
                        "instead of --lr (--lr given over a recipe's or config file's --lr-base replaces it)")
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
    g.add_argument('--train-interpolation', default=S, metavar='NAME',
                   help="resampling of the random-resized crop and the --aa policy: random (bilinear or bicubic per "
                        "image, timm's train.py), bilinear (default), bicubic (DeiT), nearest, lanczos, box, hamming")
    g.add_argument('--aug-repeats', type=int, default=S, metavar='N',
                   help='repeated augmentation (DeiT): every image N times an epoch, 0 = off')
    g.add_argument('--mixup', type=float, default=S, metavar='ALPHA', help='Mixup alpha (0 = off)')
    g.add_argument('--cutmix', type=float, default=S, metavar='ALPHA', help='CutMix alpha (0 = off)')
    g.add_argument('--cutmix-minmax', type=float, nargs=2, default=S, metavar=('MIN', 'MAX'),
                   help='CutMix box ratio range (overrides --cutmix alpha)')
    g.add_argument('--mixup-prob', type=float, default=S, help='probability of mixing a batch (1.0)')
    g.add_argument('--mixup-switch-prob', type=float, default=S, help='probability of CutMix instead of Mixup when both are on (0.5)')
    g.add_argument('--mixup-mode', default=S, help='batch (default), pair or elem')
    g.add_argument('--mixup-off-epoch', type=int, default=S, metavar='E', help='mix the first E epochs only, as timm does (0 = every epoch)')
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
    g.add_argument('--recovery-interval', type=int, default=S, metavar='N',
                   help="timm's flag: a recovery checkpoint every N optimiser steps inside an epoch, only the newest "
                        'kept; --resume continues a crashed epoch from it, as an uninterrupted run would (0 = none)')
    g.add_argument('--keep-best', action=argparse.BooleanOptionalAction, default=S,
                   help='also keep the checkpoint of the best val top-1, whatever --keep-last says')
    g.add_argument('--avg-last', type=int, default=S, metavar='N',
                   help="at the end, average the weights of the last N epochs (timm's avg_checkpoints) into "
                        "checkpoints/average_last_N, evaluated and recorded in summary.json (needs --keep-last >= N)")
    g.add_argument('--resume', nargs='?', const=True, default=None, metavar='CHECKPOINT',
                   help='continue the run in --output (or from CHECKPOINT) with its saved configuration; '
                        f"--epochs may extend it, {', '.join(_RESUME_MAY_CHANGE.values())} may change, any other "
                        'flag that differs from the saved value is refused')
    g.add_argument('--stop-after', type=positive_int('--stop-after'), default=None, metavar='N', help='stop after N epochs of this invocation (resume later)')
    g.add_argument('--overwrite', action='store_true', help='replace an existing run in --output')
    g.add_argument('--no-progress', action='store_true', help='no progress bar')


_NOT_CONFIG = ('command', 'config', 'resume', 'stop_after', 'overwrite', 'no_progress', 'func', 'dry_run')


def _flag(key: str) -> str:
    from ..train.config import flag_name
    return flag_name(key) or key


def _resume_config(args, given: dict, from_file: dict, config_path) -> dict:
    """The saved configuration of the run to resume. --epochs may extend it (never below the epochs
    already trained), where and how it runs (_RESUME_MAY_CHANGE) may change; any other
    value given by flag or -c that differs from the saved one is refused by name, since the checkpoint was
    trained with the saved one."""
    from ..train import TrainConfig
    from ..train.checkpoint import load_checkpoint
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
    if saved_config.get('amp') and not saved_config.get('amp_dtype') and state.get('precision') in ('float16',
                                                                                                    'bfloat16'):
        # --amp alone means the device's default dtype: keep the one the run trained in (its checkpoint's record),
        # not the default of the device it resumes on (a CPU bfloat16 run on CUDA would turn float16)
        values['amp_dtype'] = state['precision']
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
            if (value != saved_config.get('epochs') and saved_config.get('warmup_epochs') is None
                    and saved_config.get('sched') != 'none'):
                # keep the warm-up the run was trained with: the default is fitted to the epoch count
                values['warmup_epochs'] = TrainConfig.from_dict(saved_config).resolved_warmup_epochs()
            values['epochs'] = value
            continue
        saved = saved_config.get(key)
        if key == 'teacher' and value and saved and _same_checkpoint(value, saved):
            continue                                   # the run directory given again: the recorded checkpoint
        if key == 'data' and isinstance(value, str) and _moved_data(value, saved, values):
            continue
        if (key in ('initial_checkpoint', 'pretrained_path') and value and saved
                and Path(value).absolute() == Path(saved).absolute()):
            continue                                   # recorded absolute (train/build.py): the same path given again
        if value != saved and not (key == 'warmup_epochs' and value == values.get(key)):
            raise UsageError(f"{flag} cannot change on --resume (saved {saved!r}, given {value!r}); "
                             "start a new run with --output")
    return values


def _moved_data(given: str, saved, values: dict) -> bool:
    """--data on --resume: the saved data named again (relative paths compared as absolute), or the same kind of
    data where the saved path no longer exists (the data moved: `values` takes the new place)."""
    from ..train.data_paths import absolute_data, data_path
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
    from ..train.checkpoint import resolve_checkpoint
    try:
        return resolve_checkpoint(given).resolve() == Path(saved).resolve()
    except (FileNotFoundError, ValueError):
        return False


def _peak_lr(from_recipe: dict, from_file: dict, given: dict) -> dict:
    """--lr and --lr-base set one thing, the peak lr, and --lr-base wins whenever it is set; so the layer of highest
    priority that sets either decides: `--recipe R --lr 0.01` (R scaling an lr_base) trains at 0.01, as timm's
    train.py uses --lr when given, instead of R's lr_base silently. Both as flags is refused."""
    if 'lr' in given and given.get('lr_base') is not None:
        raise UsageError(f"--lr {given['lr']:g} and --lr-base {given['lr_base']:g}: both set the peak lr (--lr-base "
                         "scales it to the effective batch); give one")
    for layer in (given, from_file, from_recipe):
        if layer.get('lr_base') is not None:
            return {}
        if 'lr' in layer:
            return {'lr_base': None}
    return {}


def _refuse_idle_flags(config, given: dict) -> None:
    """A flag given with a value of its own that acts on nothing in this run (config_checks.idle_settings: e.g.
    --lr-base-size without --lr-base, --model-ema-decay without --model-ema): one line instead of a run that
    trains otherwise than the command line reads. A setting from a recipe or -c file is left alone (a run's
    config.yaml holds every key)."""
    from ..train.config import TrainConfig
    from ..train.config_checks import idle_settings
    from ..train.config_file import config_defaults
    defaults = config_defaults(TrainConfig)
    for key, why in idle_settings(config).items():
        if key in given and given[key] != defaults.get(key):
            value = given[key]
            shown = '' if value is True else ' ' + (' '.join(map(str, value)) if isinstance(value, list) else str(value))
            raise UsageError(f"{_flag(key)}{shown} does nothing in this run: {why}; leave it out")


def _named_source(message: str, given: dict, from_file: dict, config_path, from_recipe: dict, recipe) -> str:
    """A range error names the value's flag; where that value was not given but came from -c FILE or --recipe NAME
    (e.g. `--recipe R --epochs 1` under R's 5-epoch warm-up), the line says so, and that the flag changes it."""
    from ..train.config import flag_name
    named = message.split(' ', 1)[0].split('=', 1)[0]
    key = next((k for k in {**from_recipe, **from_file} if flag_name(k) == named), None)
    if key is None or key in given:
        return message
    source = f"-c/--config {config_path}'s" if key in from_file else f"--recipe {recipe}'s"
    return f"{message} ({named.split('/')[-1]} {from_file.get(key, from_recipe.get(key))} is {source} value: " \
           f"give {named.split('/')[-1]} to change it)"


def train_config(args):
    """TrainConfig from (in increasing priority) the defaults, --recipe NAME, -c FILE and the flags given
    explicitly; with --resume, the saved configuration (see `_resume_config`)."""
    from ..train import TrainConfig, load_config_file
    given = {k: v for k, v in vars(args).items() if k not in _NOT_CONFIG}
    config_path = getattr(args, 'config', None)
    # timm's keys (its flags' dest names) that are not ours say where their setting is, as the flags do
    timm_hints = {flag[2:].replace('-', '_'): hint for flag, hint in FLAG_HINTS.items() if flag.startswith('--')}
    from_file = load_config_file(config_path, hints=timm_hints) if config_path else {}
    from_recipe: dict = {}
    if args.resume:
        values = _resume_config(args, given, from_file, config_path)
    else:
        if 'recipe' in given:                      # the recipe's values sit under -c FILE and the flags
            from ..train.recipes import load_recipe
            from_recipe, _ = load_recipe(given['recipe'])
        values = {**from_recipe, **from_file, **given}
        if 'phase_settings' in given:              # per phase, over the recipe's and the file's settings
            lower = {**from_recipe.get('phase_settings', {}), **from_file.get('phase_settings', {})}
            values['phase_settings'] = {name: {**lower.get(name, {}), **given['phase_settings'].get(name, {})}
                                        for name in {**lower, **given['phase_settings']}}
        if 'data' in given:                        # a data_as_given from -c FILE recorded the file's data
            values['data_as_given'] = None
        values.update(_peak_lr(from_recipe, from_file, given))
    config = TrainConfig.from_dict(values, source='-c/--config ' + config_path if config_path else 'configuration')
    if not args.resume:
        try:
            config.validate()                      # a value out of range is named as such first
        except UsageError as e:
            raise UsageError(_named_source(str(e), given, from_file, config_path, from_recipe,
                                           given.get('recipe'))) from None
        _refuse_idle_flags(config, given)
    if 'recipe' in given:                          # another family's model with a recipe: refused by name
        from ..train.recipes import check_recipe_model
        check_recipe_model(config)
    return config


def run(args) -> int:
    if args.dry_run:                               # the plan only: nothing trained, nothing written
        from ..train.plan import dry_run
        print(dry_run(train_config(args), resume=args.resume))
        return 0
    config = train_config(args)                    # refused here, before the engine's imports (torch, timm)
    from ..models.factory import check_registered
    check_registered(config.model)                 # before the engine and the data, and before --overwrite moves a run
    from ..train import Trainer
    trainer = Trainer(config, resume=args.resume, stop_after=args.stop_after, overwrite=args.overwrite,
                      progress=not args.no_progress)
    result = trainer.fit()
    if trainer.is_main:
        print(f"\nrun:        {result.output}\ncheckpoint: {result.last_checkpoint}\n"
              f"metrics:    {result.output / 'metrics.jsonl'}\nconfig:     {result.output / 'config.yaml'}")
    return 0


