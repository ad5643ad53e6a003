"""The comparison's outputs: the timing phase (`measure`), the record with its table and plots (`write_record`) and
the published page (`publish`). Timings go to OUTPUT/speed.json, apart from the cells, so that they can be taken
again without training (`compare --measure-only`), each timed model's weights stamped (SHA-256), so that timings of
a model retrained since are not reused; the record OUTPUT/compare.json is rebuilt from the cells and the last
timings each time.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import UsageError
from .record import mark_fronts, plot_fronts, summarise_row

RECORD, SPEED, PAGE = 'compare.json', 'speed.json', 'leaderboard.md'


def _first_finished(cells, key):
    from .grid import cell_state
    return next((c for c in cells if c.row.key == key and cell_state(c) == 'finished'), None)


def _relative(path, output: Path):
    if not path:
        return path
    try:
        return str(Path(path).resolve().relative_to(output.resolve()))
    except ValueError:
        return str(path)


def training_environment(cells) -> Optional[Dict]:
    """The environment the finished cells trained in (their last checkpoint's `environment`: CPU, threads, torch),
    not the one writing the record (a `--measure-only` on another machine or at other --threads); with `others`
    listing the other CPU / threads / torch combinations where the cells differ. None when no cell says."""
    from ..train.checkpoint import committed_checkpoints
    from .grid import cell_state
    found = []
    for cell in cells:
        checkpoints = committed_checkpoints(cell.folder / 'checkpoints') if cell_state(cell) == 'finished' else []
        try:
            env = json.loads((checkpoints[-1] / 'state.json').read_text()).get('environment') if checkpoints else None
        except (OSError, ValueError):
            env = None
        if isinstance(env, dict):
            found.append(env)
    if not found:
        return None

    def said(env):
        return f"{env.get('cpu')}, {env.get('threads')} thread(s), torch {env.get('torch')}"
    others = sorted({said(e) for e in found} - {said(found[0])})
    return dict(found[0], others=others) if others else found[0]


def model_stamp(folder) -> Optional[str]:
    """SHA-256 of the weights of a run's last committed checkpoint (None: no checkpoint): which trained model a
    timing was taken of."""
    import hashlib

    from ..train.checkpoint import committed_checkpoints
    found = committed_checkpoints(Path(folder) / 'checkpoints')
    if not found:
        return None
    digest = hashlib.sha256()
    with open(found[-1] / 'model.safetensors', 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
    return digest.hexdigest()


def current_timings(speed: Optional[Dict], cells) -> Optional[Dict]:
    """`speed` when every model it timed is still the model its row's first finished cell holds, else None: a cell
    retrained since (--overwrite after its configuration changed, with --skip-speed) makes the paired timings,
    taken together against the ViT, another grid's. Timings written before model stamps were kept are taken as they
    are; timings taken by other code than this (their environment's `source` stamp) are not."""
    from ..records import source_digest
    if speed and (speed.get('environment') or {}).get('source') != source_digest():
        return None                    # timed by other code (or before its stamp was kept): a kernel may have changed
    stamps = (speed or {}).get('models')
    if not speed or not stamps:
        return speed
    for key, stamp in stamps.items():
        cell = _first_finished(cells, key)
        if cell is not None and model_stamp(cell.folder) != stamp:
            return None
    return speed


def measure(cells, rows, data: str, shared: Dict, args, output: Path) -> Dict:
    """Time every row with a finished cell (its first seed's): paired training and inference in one fresh process,
    then peak training memory in a fresh process per row, each phase with its machine-load record. Written to
    OUTPUT/speed.json and returned."""
    from ..bench.harness import MeasurementFailed, measure_in_subprocess
    from ..bench.load import LoadWatch, summary_line
    from ..records import write_json
    from ..train.data_paths import absolute_data
    from .speed import RECIPE_KEYS
    runs = {}
    for row in rows:
        cell = _first_finished(cells, row.key)
        if cell is not None:
            runs[row.key] = str(cell.folder)
    missing = [r.key for r in rows if r.key not in runs]
    if args.measure_only and missing:
        raise UsageError(f"--measure-only: no finished cell to time for {', '.join(missing)}; train them first "
                         "(the same command without --measure-only)")
    if not runs:
        return {}
    data = absolute_data(data)[0]
    recipe = {k: shared[k] for k in RECIPE_KEYS if k in shared}
    recipe['val_fraction'] = shared.get('val_fraction', 0.2)
    batch = int(shared.get('batch_size', 64))
    print(f"timing {len(runs)} row(s): {args.speed_rounds} paired rounds of batch {batch}, then peak memory", flush=True)
    watch = LoadWatch(args.threads or None)
    try:
        paired = measure_in_subprocess('structformer.compare.speed:measure_paired', runs, data, batch,
                                       args.speed_rounds, recipe, args.threads, args.device, 'vit')
    except MeasurementFailed as e:
        raise RuntimeError(f"the paired timing failed: {e}") from None
    load = watch.record()
    memory = {}
    for key, run in runs.items():
        mark = watch.mark()
        try:
            memory[key] = measure_in_subprocess('structformer.compare.speed:measure_memory', run, data, batch, recipe,
                                                args.threads, args.device)
        except MeasurementFailed as e:
            raise RuntimeError(f"measuring the memory of {key} failed: {e}") from None
        memory[key]['machine_load'] = watch.since(mark)
    speed = dict(paired, memory=memory, machine_load=load, runs={k: _relative(v, output) for k, v in runs.items()},
                 models={k: model_stamp(v) for k, v in runs.items()})
    write_json(output / SPEED, speed)
    print(summary_line(load))
    return speed


def write_record(output: Path, set_name: Optional[str], kind: str, rows, cells, shared: Dict, speed: Optional[Dict],
                 data: str, args, command: str, record_command: str) -> Dict:
    """OUTPUT/compare.json, accuracy_vs_time.png, accuracy_vs_params.png and leaderboard.md from the cells and the
    last timings; returns the record."""
    import torch

    from ..data import build_datasets
    from ..records import environment, source_digest, write_json, write_text
    from ..train.checkpoint import load_model
    from .grid import cell_result
    from .leaderboard import render
    from .speed import costs, data_batch
    train_set, val_set, _ = build_datasets(data, seed=0, val_fraction=shared.get('val_fraction', 0.2))
    sample, _, _ = data_batch(data, 1, val_fraction=shared.get('val_fraction', 0.2))
    speed = speed or {}
    out_rows = []
    for row in rows:
        results = []
        for cell in (c for c in cells if c.row.key == row.key):
            result = cell_result(cell)
            result['run'] = _relative(result['run'], output)
            if result.get('teacher'):
                result['teacher'] = _relative(result['teacher'], output)
            results.append(result)
        first = next((c for c in cells if c.row.key == row.key), None)
        facts = {'key': row.key, 'label': row.entry.label, 'family': row.entry.family, 'model': row.model,
                 'model_kwargs': json.loads(json.dumps(row.kwargs_for(first.seed))), 'transforms': row.transforms,
                 'role': row.role, 'budget': row.budget, 'rank': row.entry.rank, 'pretrained': row.entry.pretrained,
                 'teacher': row.entry.depends if row.entry.teacher else None, 'baseline': row.entry.baseline,
                 'switch_epoch': first.config.factorize_at if row.entry.pretrained else None,
                 'params': None, 'flops_per_image': None}
        finished = _first_finished(cells, row.key)
        if finished is not None:
            model, _ = load_model(finished.folder)
            with torch.random.fork_rng(devices=[]):
                facts.update(costs(model, sample))
        timing = None
        if row.key in speed.get('train', {}):
            timing = {'train': speed['train'][row.key], 'infer': speed['infer'][row.key]}
        out_rows.append(summarise_row(facts, results, timing, speed.get('memory', {}).get(row.key)))
    mark_fronts(out_rows)
    title = f"compare {set_name or 'custom'} on {kind}: {len(rows)} rows x {len(set(c.seed for c in cells))} seed(s)"
    record = {'title': title, 'set': set_name, 'data': {'kind': kind, 'train_images': len(train_set),
                                                        'val_images': len(val_set)},
              'seeds': sorted({c.seed for c in cells}), 'budget': rows[0].budget, 'match': not args.no_match,
              'recipe': json.loads(json.dumps(shared)), 'rows': out_rows,
              'speed': {k: speed.get(k) for k in ('environment', 'machine_load', 'batch_size', 'rounds', 'reference')}
              if speed else None,
              'environment': training_environment(cells) or environment(torch.device('cpu')),
              'code': {'source': source_digest()}, 'command': command,
              'record_command': record_command}
    record['figures'] = plot_fronts(record, output)
    write_json(output / RECORD, record)
    write_text(output / PAGE, render(record, figures='.'))
    return record


def publish(record: Dict, output: Path, docs: Path) -> Path:
    """DOCS/leaderboard.md and DOCS/leaderboard/ (record.json and the plots) from the record in OUTPUT, all or
    nothing (`atomic.replace_together`): the folder is built beside the old one and swapped in with the page, so a
    failed or interrupted publish leaves DOCS as it was, and a plot the new record no longer has does not stay."""
    from ..atomic import replace_together
    from ..records import write_json
    from .leaderboard import render

    def fill(staging: Path) -> dict:
        for name in record.get('figures', []):
            shutil.copyfile(output / name, staging / name)
        write_json(staging / 'record.json', record)
        return {docs / PAGE: render(record, figures='leaderboard')}

    replace_together(docs / 'leaderboard', fill, '--publish')
    return docs / PAGE
