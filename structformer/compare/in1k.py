"""`structformer compare --set in1k`: the papers' ImageNet-1k rows, each at its own shipped recipe, as cluster jobs.

Every cell is one `torchrun` job of `structformer train --recipe NAME` at the process count the recipe is sized
for (its `about: world_size`), into `OUTPUT/cells/<row>/seed_<s>`, with Sparsifiner's `--teacher` the DeiT-S cell
of the same seed (so that cell runs first). `--dry-run` prints the commands in order and each cell's GPU-hours,
estimated from the forward FLOPs of one image (FlopCounterMode, of the model the recipe trains: its transforms and
its factorisation applied, the dense model before a pre-trained low-rank row's switch) × 3 (forward and backward) ×
the images the recipe trains on (plus a teacher forward where it distils, plus an evaluation of 50,000 images per
epoch), divided by an
assumed sustained rate per GPU (`--gpu-tflops`, 30 by default: an assumption, not a measurement; a DeiT-S trained for
300 epochs in a day on 8 GPUs sustains about 15 TFLOP/s each by this count, an A100's bfloat16 peak is 312; pass
the rate your cluster measures).
This machine has no GPU and no ImageNet: the set is planned here, not run.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import UsageError

# (row, recipe, the row whose cell of the same seed it needs as --teacher)
ROWS = (
    ('deit_tiny', 'deit_tiny_in1k', None),
    ('deit_small', 'deit_small_in1k', None),
    ('crate_tiny', 'crate_tiny_in1k', None),
    ('crate_small', 'crate_small_in1k', None),
    ('crate_base', 'crate_base_in1k', None),
    ('soft_tiny', 'soft_tiny_in1k', None),
    ('softpp_tiny', 'softpp_tiny_in1k', None),
    ('soft_small', 'soft_small_in1k', None),
    ('soft_tiny_softmax', 'soft_tiny_softmax_in1k', None),
    ('soft_tiny_linformer', 'soft_tiny_linformer_in1k', None),
    ('soft_tiny_performer', 'soft_tiny_performer_in1k', None),
    ('soft_tiny_nystrom', 'soft_tiny_nystrom_in1k', None),
    ('sparsifiner_deit_small', 'sparsifiner_deit_small_in1k', 'deit_small'),
    ('mixer_b16', 'mixer_b16_in1k', None),
    ('mixer_b_w', 'mixer_b_w_in1k', None),
    ('resnet50', 'resnet50_in1k', None),
    ('resnet50_lowrank', 'resnet50_lowrank_in1k', None),
    ('resnet50_lowrank_pretrain', 'resnet50_lowrank_pretrain_in1k', None),
)
BY_KEY = {r[0]: r for r in ROWS}
VAL_IMAGES = 50_000
IMAGENET_FORMS = ('imagefolder', 'imagenet', 'wds', 'hfds')      # --data forms that hold ImageNet-1k
DEFAULT_TFLOPS = 30.0


def resolve_keys(models: Optional[List[str]]) -> List[str]:
    if not models:
        return [r[0] for r in ROWS]
    for key in models:
        if key not in BY_KEY:
            raise UsageError(f"--models {key!r} is not in --set in1k: accepted {', '.join(BY_KEY)}")
    wanted = set(models) | {BY_KEY[k][2] for k in models if BY_KEY[k][2]}
    return [r[0] for r in ROWS if r[0] in wanted]


def forward_flops(model_name: str, model_kwargs: Dict, img_size: int, transforms=()) -> int:
    """FLOPs of one 224-px image's forward (the recipe's size where it sets one) of the model as the recipe trains
    it (`build_model` with its transforms: a factorised ResNet-50 runs its two thin convolutions, not the dense
    one), counted on the meta device where the model allows it, else on a CPU build."""
    import torch

    from ..bench.flops import forward_flops as count
    from ..models.factory import build_model
    kwargs = dict(model_kwargs, num_classes=1000)
    for device in ('meta', 'cpu'):
        try:
            with torch.device(device):
                model, _ = build_model(model_name, kwargs, None, list(transforms))
                sample = torch.randn(1, 3, img_size, img_size)
            return int(count(model, sample)[0])
        except (NotImplementedError, RuntimeError):
            if device == 'cpu':
                raise
    raise AssertionError('unreachable')


def _trained_models(values: Dict):
    """[(transforms, epochs)] of a recipe: the model it trains and for how many epochs; a pre-trained low-rank
    recipe trains the dense model up to its switch (`factorize_at`), then the factorised one."""
    from ..train.config import TrainConfig
    config = TrainConfig.from_dict(values)
    transforms = list(config.transforms)
    spec = config.factorize_spec()
    if spec is None:
        return [(transforms, config.epochs)]
    switch = config.factorize_at or 0
    return [(transforms, switch), (transforms + [spec], config.epochs - switch)][0 if switch else 1:]


def plan(keys: List[str], seeds: List[int], data: str, output: Path, gpu_tflops: float) -> List[Dict]:
    """One entry per cell: its command and its estimated GPU-hours."""
    from ..train.recipes import load_recipe
    flops_cache: Dict[str, int] = {}
    cells = []
    for seed in seeds:
        for key in keys:
            _, recipe, teacher = BY_KEY[key]
            values, about = load_recipe(recipe)
            processes = int(about.get('world_size', 1))
            folder = output / 'cells' / key / f'seed_{seed}'
            # quoted: a path with a space or a shell character is copied into a shell as one argument
            command = (f"torchrun --nproc_per_node {processes} -m structformer train --recipe {recipe} "
                       f"--data {shlex.quote(data)} --seed {seed} --output {shlex.quote(str(folder))}")
            if teacher:
                command += f" --teacher {shlex.quote(str(output / 'cells' / teacher / f'seed_{seed}'))}"
            img_size = int((values.get('data_kwargs') or {}).get('img_size', 224))
            if key not in flops_cache:
                flops_cache[key] = [(forward_flops(values['model'], values.get('model_kwargs') or {}, img_size,
                                                   transforms), phase_epochs)
                                    for transforms, phase_epochs in _trained_models(values)]
            per_image = flops_cache[key][-1][0]             # the model it ends as (and is evaluated as)
            epochs, images = int(values['epochs']), int(values['dataset_size'])
            train = sum(3 * flops * images * phase_epochs for flops, phase_epochs in flops_cache[key])
            if teacher:                       # the dense teacher's forward of every training image
                teacher_values, _ = load_recipe(BY_KEY[teacher][1])
                train += forward_flops(teacher_values['model'], teacher_values.get('model_kwargs') or {},
                                       img_size) * images * epochs
            total = train + sum(flops * VAL_IMAGES * phase_epochs for flops, phase_epochs in flops_cache[key])
            cells.append({'row': key, 'recipe': recipe, 'seed': seed, 'processes': processes, 'epochs': epochs,
                          'gflops_per_image': per_image / 1e9, 'gpu_hours': total / (gpu_tflops * 1e12) / 3600,
                          'command': command, 'devices': about.get('devices'), 'reported': about.get('reported')})
    return cells


def run(args) -> int:
    """--set in1k: the plan (dry run only)."""
    for flag, value in (('--recipe', args.recipe), ('-c', args.config), ('--budget', args.budget),
                        ('--measure-only', args.measure_only)):
        if value:
            raise UsageError(f"{flag} with --set in1k: every in1k row trains at its own paper recipe; leave {flag} out")
    # what the plan neither trains, times nor publishes here (it was taken and ignored)
    for flag, value in (('--publish', args.publish), ('--no-match', args.no_match), ('--skip-speed', args.skip_speed),
                        ('--overwrite', args.overwrite), ('--jobs', args.jobs > 1), ('--threads', args.threads),
                        ('--device', args.device != 'auto'), ('--speed-rounds', args.speed_rounds != 10)):
        if value:
            raise UsageError(f"{flag} with --set in1k: the set is planned here, not trained, timed or published (the "
                             "printed torchrun commands run each cell on its own GPUs); leave it out")
    if args.train_flags:
        raise UsageError(f"{', '.join(sorted(args.train_flags))} with --set in1k: every in1k row trains at its own "
                         "paper recipe (pass them to the printed commands instead)")
    if not args.dry_run:
        raise UsageError("--set in1k is planned here, not run (no GPU, no ImageNet): add --dry-run for each cell's "
                         "torchrun command and its GPU-hours")
    keys = resolve_keys(args.models)
    seeds = list(range(args.seeds or 1))
    data = args.data or 'imagefolder:IMAGENET'
    from ..data.spec import parse_data_spec
    try:
        form, _ = parse_data_spec(data)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if form not in IMAGENET_FORMS:          # the recipes are ImageNet-1k's (1,000 classes at 224 px)
        raise UsageError(f"--data {data}: --set in1k plans the ImageNet-1k recipes; accepted "
                         f"{' | '.join(f + ':PATH' for f in IMAGENET_FORMS)} (the path as the cluster sees it)")
    output = Path(args.output or 'outputs/compare_in1k')
    cells = plan(keys, seeds, data, output, args.gpu_tflops)
    width = max(len(c['row']) for c in cells)
    print(f"compare --set in1k: {len(cells)} cell(s), {len(seeds)} seed(s); GPU-hours at an assumed "
          f"{args.gpu_tflops:g} TFLOP/s sustained per GPU (3 × forward FLOPs × images × epochs)")
    print(f"{'row':<{width}} seed {'GFLOPs':>7} {'epochs':>6} {'GPUs':>4} {'GPU-hours':>10}  paper's devices")
    for c in cells:
        print(f"{c['row']:<{width}} {c['seed']:>4} {c['gflops_per_image']:>7.2f} {c['epochs']:>6} {c['processes']:>4} "
              f"{c['gpu_hours']:>10.1f}  {c['devices']}")
    print(f"total: {sum(c['gpu_hours'] for c in cells):,.0f} GPU-hours\n")
    print("commands, in order (a teacher's cell before its student's; after an interruption add --resume):")
    for c in cells:
        print(c['command'])
    return 0
