"""`structformer compare`: the command line of the comparison (structformer/compare/__init__.py).

The parser imports neither torch nor timm (`structformer --help` builds it).
"""
from __future__ import annotations

import argparse
import ast
import math
import shlex
import sys
from pathlib import Path
from typing import Dict

from ..cli_args import positive_int, thread_count
from ..errors import UsageError

DESCRIPTION = ('Train every (model, seed) cell of a grid with one shared recipe (each an ordinary run folder: '
               'resumed, never retrained), time the rows on this machine, and write the record: JSON, a markdown '
               'table and two plots with the Pareto front.')
EXAMPLES = """examples:
  structformer compare --dry-run                                  # the quick set on digits: the grid and its time
  structformer compare --set quick --output outputs/compare_quick  # every family, one seed, a few minutes
  structformer compare --set mnist --data mnist:/data/mnist --threads 2 --output outputs/compare_mnist
  structformer compare --set mnist --data mnist:/data/mnist --output outputs/compare_mnist --measure-only  # quiet window
  structformer compare --models vit sparsifiner vit_linformer --data digits --seeds 3 --epochs 4
  structformer compare --set in1k --data imagefolder:/data/imagenet --dry-run    # torchrun commands, GPU-hours"""

S = argparse.SUPPRESS
# the training settings every cell shares, as `structformer train` names them: (flag, config key, type, nargs)
TRAIN_FLAGS = (
    ('--epochs', 'epochs', int, None), ('-b/--batch-size', 'batch_size', int, None),
    ('--eval-batch-size', 'eval_batch_size', int, None), ('--opt', 'opt', str, None), ('--lr', 'lr', float, None),
    ('--weight-decay', 'weight_decay', float, None), ('--momentum', 'momentum', float, None),
    ('--sched', 'sched', str, None), ('--warmup-epochs', 'warmup_epochs', float, None),
    ('--warmup-lr', 'warmup_lr', float, None), ('--min-lr', 'min_lr', float, None),
    ('--smoothing', 'label_smoothing', float, None), ('--clip-grad', 'clip_grad', float, None),
    ('--clip-mode', 'clip_mode', str, None),
    ('--limit-train-batches', 'limit_train_batches', int, None), ('--val-fraction', 'val_fraction', float, None),
    ('--workers', 'num_workers', int, None), ('--grad-accum-steps', 'grad_accum_steps', int, None),
    ('--amp-dtype', 'amp_dtype', str, None), ('--aa', 'aa', str, None), ('--reprob', 'reprob', float, None),
    ('--remode', 'remode', str, None), ('--recount', 'recount', int, None),
    ('--color-jitter', 'color_jitter', float, None), ('--scale', 'scale', float, 2), ('--ratio', 'ratio', float, 2),
    ('--hflip', 'hflip', float, None), ('--train-interpolation', 'train_interpolation', str, None),
    ('--aug-repeats', 'aug_repeats', int, None), ('--mixup', 'mixup', float, None),
    ('--cutmix', 'cutmix', float, None), ('--cutmix-minmax', 'cutmix_minmax', float, 2),
    ('--mixup-prob', 'mixup_prob', float, None), ('--mixup-switch-prob', 'mixup_switch_prob', float, None),
    ('--mixup-mode', 'mixup_mode', str, None), ('--mixup-off-epoch', 'mixup_off_epoch', int, None),
    ('--drop', 'drop', float, None), ('--drop-path', 'drop_path', float, None),
    ('--model-ema-decay', 'model_ema_decay', float, None), ('--init', 'factorize_init', str, None),
    ('--factorize-include', 'factorize_include', str, '+'), ('--factorize-lr-scale', 'factorize_lr_scale', float, None),
    ('--factor-decay', 'factor_decay', str, None), ('--predictor-epochs', 'predictor_epochs', int, None),
    ('--keep-last', 'keep_last', int, None), ('--log-interval', 'log_interval', int, None),
)
SWITCHES = (('--amp', 'amp'), ('--decay-everything', 'decay_everything'), ('--channels-last', 'channels_last'),
            ('--model-ema', 'model_ema'), ('--model-ema-warmup', 'model_ema_warmup'))
TRAIN_KEYS = tuple(key for _, key, _, _ in TRAIN_FLAGS) + tuple(key for _, key in SWITCHES) + ('data_kwargs',)
MAX_SEEDS = 1000             # a cell per row and seed: beyond that the grid's plan alone fills memory
RECORD = 'compare.json'
SPEED = 'speed.json'


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .catalogue import ENTRIES, SETS
    p.add_argument('--set', default=None, metavar='NAME',
                   help='a predefined grid: ' + '; '.join(f"{name}: {s['about']}" for name, s in SETS.items())
                        + ' (default quick, unless --models names the rows)')
    p.add_argument('--models', nargs='+', default=None, metavar='NAME',
                   help="rows of the grid (a subset of --set's): " + ', '.join(e.key for e in ENTRIES)
                        + "; --set in1k: its recipes' rows. The rows they depend on are added (Sparsifiner's ViT "
                          "teacher, the dense start of a pre-trained low-rank row)")
    p.add_argument('--data', default=None, help='digits | mnist:PATH (a folder of MNIST IDX files); --set in1k: '
                                                'imagefolder:PATH')
    p.add_argument('--recipe', default=None, metavar='NAME',
                   help="a shipped training recipe (`structformer recipes`) as the shared recipe, over the set's; its "
                        'model, data and other per-cell keys are left out')
    p.add_argument('-c', '--config', default=None, metavar='FILE', help='a YAML configuration over the recipe')
    p.add_argument('--seeds', type=positive_int('--seeds', most=MAX_SEEDS), default=None, metavar='N',
                   help="seeds 0 .. N-1, the same for every row (default: the set's)")
    p.add_argument('--budget', type=positive_int('--budget'), default=None, metavar='PARAMS',
                   help="the parameter count every matched row is sized to, within ±15 %% (default: the set's)")
    p.add_argument('--no-match', action='store_true', help="keep the registry's sizes instead of matching them")
    p.add_argument('--output', default=None, metavar='DIR', help='the grid folder (default outputs/compare_<set>)')
    p.add_argument('--threads', type=thread_count, default=0, help="torch threads for training and timing (0: torch's own)")
    p.add_argument('--jobs', type=positive_int('--jobs'), default=1, metavar='N',
                   help='train up to N cells at a time, each in its own process with --threads threads (1: one '
                        'after the other in this process); e.g. --jobs 2 --threads 1 on two cores')
    p.add_argument('--device', default='auto', help='auto (default: CUDA if present), cpu, cuda or cuda:N')
    p.add_argument('--dry-run', action='store_true',
                   help='print the grid, each row\'s size and the estimated time (one measured step per row) and '
                        'exit; nothing is trained or written')
    p.add_argument('--overwrite', action='store_true',
                   help='retrain cells trained with another recipe, budget or matching (refused without it), '
                        'cells that diverged (kept as diverged without it), and cells trained by other code '
                        '(kept and marked stale without it)')
    p.add_argument('--measure-only', action='store_true',
                   help='train nothing: time the trained rows again (e.g. in a quiet window) and rewrite the record')
    p.add_argument('--skip-speed', action='store_true',
                   help='train and record accuracy only; time later with --measure-only')
    p.add_argument('--speed-rounds', type=positive_int('--speed-rounds'), default=10, metavar='N',
                   help='paired timing rounds of every row (10)')
    p.add_argument('--publish', default=None, metavar='DOCS',
                   help='also write DOCS/leaderboard.md and DOCS/leaderboard/ (the record and its plots)')
    p.add_argument('--gpu-tflops', type=float, default=30.0, metavar='T',
                   help='--set in1k: the sustained TFLOP/s per GPU its GPU-hours assume (30; an assumption: pass '
                        'the rate your cluster measures)')
    g = p.add_argument_group('the shared recipe: training settings every cell takes (`structformer train --help`)')
    for flag, key, kind, nargs in TRAIN_FLAGS:
        name = flag.split('/')[-1].lstrip('-').upper().replace('-', '_')
        g.add_argument(*flag.split('/'), dest=key, type=kind, nargs=nargs, default=S,
                       metavar=name if nargs != 2 else (name + '_MIN', name + '_MAX'))
    for flag, key in SWITCHES:
        g.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction, default=S)
    g.add_argument('--data-kwargs', dest='data_kwargs', nargs='*', default=S, metavar='KEY=VALUE',
                   help='dataset options, e.g. augment=True')


def _train_flags(args) -> Dict:
    flags = {k: getattr(args, k) for k in TRAIN_KEYS if hasattr(args, k)}
    if 'data_kwargs' in flags:
        parsed = {}
        for item in flags['data_kwargs']:
            key, sep, value = item.partition('=')
            if not sep or not key.isidentifier():
                raise UsageError(f"--data-kwargs {item!r}: expected KEY=VALUE with KEY a Python name")
            try:
                parsed[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                parsed[key] = value
        flags['data_kwargs'] = parsed
    return flags


def _data(args, set_name) -> str:
    from .catalogue import SETS
    data = args.data or (SETS[set_name]['data'] if set_name else 'digits')
    if data is None:
        raise UsageError(f"--data mnist:PATH is required for --set {set_name} (a folder of MNIST IDX files, e.g. "
                         "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz)")
    form, _, path = data.partition(':')
    if form.strip().lower() == 'mnist' and path and not Path(path).is_dir():
        raise UsageError(f"--data {data}: no such folder; point it at a folder holding the MNIST IDX files")
    return data


def _this_command(args, set_name, data: str, output: str = 'DIR', publish: str = None) -> str:
    """The command that made a record, from its parsed flags: the data's path written as PATH and the folders as
    DIR (records are committed; paths are the user's); with `output` and `publish`, the line that makes this record
    again and publishes it (the page's "Regenerate" command)."""
    spec = data.partition(':')[0] + ':PATH' if ':' in data else data
    parts = ['structformer', 'compare'] + (['--set', set_name] if set_name else []) + ['--data', spec]
    if args.models:
        parts += ['--models', *args.models]
    for flag, value in (('--seeds', args.seeds), ('--budget', args.budget), ('--recipe', args.recipe),
                        ('--jobs', args.jobs if args.jobs > 1 else None),
                        ('-c', args.config and 'FILE'), ('--threads', args.threads or None),
                        ('--speed-rounds', args.speed_rounds if args.speed_rounds != 10 else None),
                        ('--device', None if args.device == 'auto' else args.device)):
        if value is not None:
            parts += [flag, str(value)]
    if args.no_match:
        parts.append('--no-match')
    names = {key: flag.split('/')[-1] for flag, key, _, _ in TRAIN_FLAGS}
    names.update({key: flag for flag, key in SWITCHES}, data_kwargs='--data-kwargs')
    for key, value in args.train_flags.items():
        if isinstance(value, bool):
            parts.append(names[key] if value else names[key].replace('--', '--no-', 1))
        elif isinstance(value, dict):
            parts += [names[key], *(f"{k}={v}" for k, v in value.items())]
        else:
            parts += [names[key], *(map(str, value) if isinstance(value, list) else [str(value)])]
    return shlex.join(parts + ['--output', output] + (['--publish', publish] if publish else []))


def _preflight(cells, data: str) -> None:
    """Every row built for the data as its first cell will be, and one forward of two held-out samples: a model
    that cannot take the recipe (its factorisation, its options, the data's images) is refused by name before any
    cell trains."""
    import torch
    from torch.utils.data import default_collate

    from ..data import build_datasets
    from ..data.augment import Augmentation
    from ..errors import one_line
    from ..models.factory import build_model
    first = {}
    for cell in cells:
        first.setdefault(cell.row.key, cell)
    cfg0 = next(iter(first.values())).config
    augmentation = Augmentation.from_config(cfg0)
    extra = {'augmentation': augmentation} if augmentation.requested() else {}
    _, val, info = build_datasets(data, seed=cfg0.seed, val_fraction=cfg0.val_fraction, **extra, **cfg0.data_kwargs)
    batch = default_collate([val[i] for i in range(min(2, len(val)))])[0]
    for key, cell in first.items():
        cfg = cell.config
        kwargs = dict(cfg.model_kwargs)
        for flag, name in (('drop', 'drop_rate'), ('drop_path', 'drop_path_rate')):
            if getattr(cfg, flag) is not None:
                kwargs[name] = getattr(cfg, flag)
        transforms = list(cfg.transforms) + ([cfg.factorize_spec()] if cfg.factorize_spec() else [])
        try:
            with torch.random.fork_rng(devices=[]):
                model, _ = build_model(cfg.model, kwargs, info, transforms)
                model.eval()
                with torch.no_grad():
                    model(batch)
        except (ValueError, TypeError, RuntimeError, AssertionError) as e:
            raise UsageError(f"--models {key}: {cfg.model} cannot take this recipe and data: {one_line(e)}") from None


def _print_stale(cells, args) -> None:
    """The note on cells kept from other code (records.source_digest differs): what this run does with them."""
    from .grid import stale_code
    stale = [c.name for c in cells if stale_code(c)]
    if stale and not args.measure_only:
        print(f"note: {len(stale)} cell(s) were trained by other code than this ({', '.join(stale[:4])}"
              f"{', ...' if len(stale) > 4 else ''}): "
              + ('trained anew (--overwrite)' if args.overwrite else
                 'kept and marked stale in the record; --overwrite trains them anew'))


def _dry_run(args, set_name, kind, rows, cells, shared, data, notes) -> int:
    from ..bench.load import LoadWatch, summary_line
    from .grid import cell_state
    from .speed import estimate
    watch = LoadWatch(args.threads or None)
    estimates = {e['key']: e for e in estimate(cells, data, shared, args.device)}
    load = watch.record()
    seeds = sorted({c.seed for c in cells})
    print(f"compare {'--set ' + set_name if set_name else '--models'}: {len(rows)} row(s) x {len(seeds)} seed(s) on "
          f"{kind}; budget {rows[0].budget or 'registry sizes'}; output {args.output or '(default)'}")
    for note in notes:
        print(f"note: {note}")
    _print_stale(cells, args)
    print('recipe: ' + ', '.join(f"{k} {v}" for k, v in sorted(shared.items())))
    width = max(len(r.key) for r in rows)
    print(f"{'row':<{width}}  {'model':<18} {'size':<15} {'params':>8} {'step ms':>8} {'cpu ms':>8} {'epoch s':>8} "
          f"{'to go':>6}  cells")
    total = total_cpu = 0.0
    for row in rows:
        e = estimates[row.key]
        states = ' '.join(cell_state(c)[0] for c in cells if c.row.key == row.key)
        total, total_cpu = total + e['remaining_s'], total_cpu + e['remaining_cpu_s']
        print(f"{row.key:<{width}}  {row.model:<18} {row.role:<15} {e['params']:>8,} {e['train_step_ms']:>8.1f} "
              f"{e['train_step_cpu_ms']:>8.1f} {e['epoch_s']:>8.1f} {e['remaining_epochs']:>6}  {states}")
    print("(step: one training step of the batch, wall and CPU time per thread; cells: n new, p partial, "
          "f finished, d diverged, c changed)")
    jobs = f", over {args.jobs} jobs at once" if args.jobs > 1 else ''
    print(f"estimated training time{jobs}: {total / 3600 / args.jobs:.2f} h ({total / 60 / args.jobs:.0f} min) of wall "
          f"time as this machine ran now; {total_cpu / 3600 / args.jobs:.2f} h ({total_cpu / 60 / args.jobs:.0f} min) "
          f"from the CPU time, what it takes with {load['threads']} thread(s) per job to itself (one measured step per "
          "row; steps and evaluations only, Sparsifiner with its teacher's forward"
          + (', the cells spread evenly over the jobs)' if args.jobs > 1 else ')'))
    print(summary_line(load))
    return 0


def run(args) -> int:
    from .catalogue import SETS, data_kind, match_rows, resolve_keys
    if args.jobs > 1 and not args.threads:
        raise UsageError(f"--jobs {args.jobs} needs --threads (the threads of each cell's process, e.g. --jobs 2 "
                         "--threads 1 on two cores): a resumed cell must run on as many threads as it started with")
    if not math.isfinite(args.gpu_tflops) or args.gpu_tflops <= 0:      # --set in1k's alone, but never nonsense
        raise UsageError(f"--gpu-tflops {args.gpu_tflops}: accepted a sustained rate > 0 (TFLOP/s per GPU)")
    if args.measure_only and (args.skip_speed or args.dry_run or args.overwrite):
        raise UsageError("--measure-only times the rows already trained: leave out --skip-speed, --dry-run and "
                         "--overwrite")
    args.train_flags = _train_flags(args)
    if args.set is not None and args.set not in SETS:
        raise UsageError(f"--set {args.set!r} is not a set: accepted {', '.join(SETS)}")
    if args.set == 'in1k':
        from .in1k import run as run_in1k
        return run_in1k(args)
    set_name = args.set or (None if args.models else 'quick')
    data = _data(args, set_name)
    kind = data_kind(data)
    defaults = SETS[set_name or ('quick' if kind == 'digits' else 'mnist')]
    keys = resolve_keys(set_name, args.models)
    seeds = list(range(args.seeds or defaults['seeds']))
    budget = args.budget or defaults['budget']
    from .grid import check_cells, check_manifest, check_shared, manifest, plan_cells, pretrain_epochs, shared_recipe
    shared, notes = shared_recipe(defaults['recipe'], args.recipe, args.config, args.train_flags)
    check_shared(shared)                   # a value out of range at once, before torch and the rows' sizing
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    output = Path(args.output or f"outputs/compare_{set_name or 'custom'}")
    rows = match_rows(keys, kind, budget, match=not args.no_match)
    if any(r.entry.pretrained for r in rows) and int(shared.get('epochs', 1)) < 2:
        raise UsageError(f"--epochs {shared.get('epochs')}: the pre-trained low-rank rows train dense for the first "
                         f"{pretrain_epochs(2)} epoch(s) and need at least 2; raise --epochs or leave them out")
    cells = plan_cells(rows, seeds, shared, data, output, args.device, args.recipe)
    wanted = manifest(set_name, kind, budget if not args.no_match else None, not args.no_match, shared)
    recipe_changes = check_manifest(output, wanted, args.overwrite)
    check_cells(cells, args.overwrite)
    _preflight(cells, data)
    if args.dry_run:
        return _dry_run(args, set_name, kind, rows, cells, shared, data, notes)
    for note in notes:
        print(f"note: {note}")
    _print_stale(cells, args)
    from ..records import check_writable
    from .grid import CellFailed, run_cell, run_parallel, write_manifest
    check_writable(output, '--output')
    if args.publish:                       # before the training and timing: a long run never dies at its publish
        check_writable(Path(args.publish), '--publish')
    trained = False
    if not args.measure_only:
        if recipe_changes:                 # timings of the models trained with the old recipe
            (output / SPEED).unlink(missing_ok=True)
        write_manifest(output, wanted)
        if args.jobs > 1:
            try:
                trained = run_parallel(cells, args.jobs, args.threads, args.overwrite, output / 'logs')
            except CellFailed as e:
                print(f"structformer compare: {e}", file=sys.stderr)
                return 1
        else:
            for cell in cells:
                outcome = run_cell(cell, overwrite=args.overwrite)
                trained = trained or outcome in ('trained', 'diverged')
    from .report import current_timings, measure, write_record
    speed_path = output / SPEED
    from ..records import read_record
    speed = read_record(speed_path, "the comparison's timings (speed.json)", (),
                        'delete it to time the rows again') if speed_path.is_file() else None
    speed = current_timings(speed, cells)       # None when a timed model was retrained since: re-timed, or left out
    if args.measure_only or (not args.skip_speed and (trained or not _covers(speed, rows, args))):
        speed = measure(cells, rows, data, shared, args, output)
    record = write_record(output, set_name, kind, rows, cells, shared, speed, data, args,
                          _this_command(args, set_name, data),
                          # the flags this record was made with (another --epochs, --models or --seeds than the
                          # set's makes another record; a grid of --models has no --set to name)
                          _this_command(args, set_name, data, f"outputs/compare_{set_name or 'custom'}", 'docs'))
    print(f"wrote {output / RECORD}, {output / 'leaderboard.md'} and the plots in {output}")
    if args.publish:
        from .report import publish
        page = publish(record, output, Path(args.publish))
        print(f"published {page}")
    return 0


def _covers(speed, rows, args) -> bool:
    """Whether an earlier speed record times every row of this grid as this command asks: its --speed-rounds, and
    its --threads where given (another value re-times: it was left unused, and the record's command named it)."""
    if not speed or not all(r.key in speed.get('train', {}) for r in rows):
        return False
    threads = (speed.get('environment') or {}).get('threads')
    return speed.get('rounds') == args.speed_rounds and (not args.threads or threads == args.threads)
