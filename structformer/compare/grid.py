"""The (model, seed) cells of a comparison, each an ordinary run folder, `OUTPUT/cells/<row>/seed_<s>`.

Running the command again continues where it stopped: a finished cell (its summary at the planned epochs) is not
trained again, an interrupted one resumes from its last committed epoch through the engine's `--resume` (bit for
bit on the same machine and thread count), a new one starts. The shared recipe is written to `OUTPUT/grid.json`
at the first start; another recipe, budget or matching into the same folder is refused by name, as is a cell
whose own configuration differs from the plan, unless `--overwrite` (then the changed cells are trained anew).

Dependencies inside the grid, in the order cells run (seeds outermost, rows in the set's order):
  Sparsifiner  `--teacher` is the dense ViT cell of the same seed (the student starts from its weights, §4);
  pre-trained low-rank  starts from the dense ViT cell's checkpoint at the switch (`factorize_at` = a third of
               the epochs, at least one): that checkpoint and its metrics lines are copied into the cell, which
               then resumes with the factorisation planned, exactly what `--factorize-at` from scratch would do
               (the dense epochs are the dense cell's, bit for bit), without training them twice.
A cell whose loss diverges is recorded as such (`diverged.json`) and the grid goes on.

Reuse is keyed on the code as well as the configuration: each cell keeps in `code.json` the stamps
(`records.source_digest`: the release, timm's version and every source file that builds, feeds or trains a model) of
the code that trained it, one per start or resume. A cell trained by other code than the command's (or before the
stamps were kept) is stale: it is not retrained silently, nor taken as current, but kept and marked in the record
(`stale` in its result, a † on its row), and `--overwrite` trains it anew.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..errors import UsageError
from ..train.config_checks import FACTORISATION_SETTINGS
from .catalogue import Row

# keys each cell sets for itself: a recipe's or a config file's values for them are dropped (noted), never shared
CELL_OWNED = ('model', 'model_kwargs', 'transforms', 'factorize_rank', 'factorize_at', 'teacher', 'initial_checkpoint',
              'pretrained', 'pretrained_path', 'teacher_pretrained', 'output', 'data', 'data_as_given', 'seed',
              'recipe', 'dataset_size', 'device')
# what may differ between a cell's saved configuration and the plan without it being another recipe
NOT_COMPARED = ('output', 'data', 'data_as_given', 'teacher', 'recipe', 'keep_last', 'save_every', 'num_workers',
                'device', 'log_interval', 'log_tb', 'compile', 'eval_batch_size', 'allow_world_size_change',
                'transforms')
DIVERGED = 'diverged.json'
CODE = 'code.json'          # the source stamps of the code that trained the cell, oldest first
UNKNOWN_CODE = 'unknown'    # a part trained before the stamps were kept
MANIFEST = 'grid.json'


def pretrain_epochs(epochs: int) -> int:
    """Dense epochs before the switch of a pre-trained low-rank cell: a third, at least one (as reproduce lowrank)."""
    return max(1, epochs // 3)


def shared_recipe(defaults: Dict, recipe: Optional[str], config_file: Optional[str], flags: Dict) -> Tuple[Dict, List[str]]:
    """The one recipe of every cell: the set's defaults < --recipe NAME < -c FILE < the training flags given.
    Keys a cell owns (its model, seed, teacher, ...) are taken out of the recipe and the file, with a note."""
    from ..train.config import check_values, load_config_file
    from ..train.recipes import load_recipe
    values, notes = dict(defaults), []
    for where, source in ((f'--recipe {recipe}', load_recipe(recipe)[0] if recipe else {}),
                          (f'-c {config_file}', load_config_file(config_file) if config_file else {})):
        dropped = sorted(k for k in source if k in CELL_OWNED)
        if dropped:
            notes.append(f"{where}: {', '.join(dropped)} not shared (each cell sets its own)")
        values.update({k: v for k, v in source.items() if k not in CELL_OWNED})
    values.update(check_values(flags, 'flags'))
    return values, notes


def check_shared(shared: Dict) -> None:
    """The shared recipe's plain ranges (epochs, lr, batch size, augmentation, ...) as `structformer train` names
    them, without torch: each cell's whole validation (`plan_cells`) comes after the rows are sized."""
    from ..train.config import TrainConfig
    TrainConfig.from_dict(shared, source='the shared recipe').check_ranges()


@dataclass
class Cell:
    row: Row
    seed: int
    folder: Path
    config: object                     # TrainConfig
    depends: Optional['Cell'] = None

    @property
    def name(self) -> str:
        return f"{self.row.key}/seed_{self.seed}"


def _plain(value):
    """JSON's view of a value (tuples as lists), as config.yaml stores it."""
    return json.loads(json.dumps(value))


def plan_cells(rows: List[Row], seeds: List[int], shared: Dict, data: str, output: Path, device: str = 'auto',
               recipe_name: Optional[str] = None) -> List[Cell]:
    """Every cell, seeds outermost, each row's dependencies before it."""
    from ..train.config import TrainConfig
    from ..train.data_paths import absolute_data
    data = absolute_data(data)[0]
    epochs = int(shared.get('epochs', TrainConfig.epochs))
    switch = pretrain_epochs(epochs)
    needs_switch = {r.entry.depends for r in rows if r.entry.pretrained}
    cells: List[Cell] = []
    for seed in seeds:
        by_key: Dict[str, Cell] = {}
        for row in rows:
            folder = output / 'cells' / row.key / f'seed_{seed}'
            values = dict(shared, model=row.model, model_kwargs=_plain(row.kwargs_for(seed)),
                          transforms=_plain(row.transforms), data=data, seed=seed, output=str(folder), device=device,
                          recipe=recipe_name)
            depends = by_key.get(row.entry.depends) if row.entry.depends else None
            if row.entry.rank is not None:
                values.update(factorize_rank=row.entry.rank, factorize_at=switch if row.entry.pretrained else None)
            else:                                     # the recipe's factorisation is the low-rank rows' alone: a
                for key in FACTORISATION_SETTINGS:    # dense row would refuse settings it has nothing to apply to
                    values.pop(key, None)
            if row.entry.teacher:
                values['teacher'] = str(depends.folder)
            else:                                     # the stages of a distilled cell only
                values.pop('predictor_epochs', None)
            if row.key in needs_switch:               # the dense checkpoint a pre-trained low-rank cell starts from
                values['save_every'] = switch
            config = TrainConfig.from_dict(values, source=f'cell {row.key}/seed_{seed}').validate()
            cell = Cell(row, seed, folder, config, depends)
            by_key[row.key] = cell
            cells.append(cell)
    return cells


# ---- the grid's own record of its recipe ----------------------------------------------------------------------
def manifest(set_name: Optional[str], kind: str, budget: Optional[int], match: bool, shared: Dict) -> Dict:
    return {'set': set_name, 'data': kind, 'budget': budget, 'match': match, 'recipe': _plain(shared)}


def _differences(saved: Dict, planned: Dict, skip=()) -> List[str]:
    keys = sorted(set(saved) | set(planned))
    return [f"{k}: {saved.get(k)!r} -> {planned.get(k)!r}" for k in keys
            if k not in skip and _plain(saved.get(k)) != _plain(planned.get(k))]


def check_manifest(output: Path, wanted: Dict, overwrite: bool) -> bool:
    """Refuse another recipe, budget or matching in a folder that holds a grid, unless --overwrite; returns
    whether the grid's recipe changes (with --overwrite)."""
    path = output / MANIFEST
    if not path.is_file():
        return False
    from ..records import read_record
    saved = read_record(path, "the grid's recipe (compare's grid.json)", ('recipe',),
                        'delete it and run again: each cell is still checked against its own config.yaml')
    facts = ('data', 'budget', 'match')
    diff = (_differences({k: saved.get(k) for k in facts}, {k: wanted.get(k) for k in facts})
            + _differences(saved.get('recipe') or {}, wanted['recipe'], skip=NOT_COMPARED))
    if diff and overwrite:
        return True
    if diff:
        raise UsageError(f"--output {output} holds a comparison with another recipe ({'; '.join(diff[:3])}"
                         f"{'; ...' if len(diff) > 3 else ''}); pass --overwrite to retrain its cells with this one, "
                         "or give another --output")
    return False


def write_manifest(output: Path, wanted: Dict) -> None:
    from ..records import write_json
    write_json(output / MANIFEST, wanted)


# ---- one cell's state -----------------------------------------------------------------------------------------
def epochs_done(cell: Cell) -> int:
    from ..train.run_dir import committed_checkpoints
    found = committed_checkpoints(cell.folder / 'checkpoints')
    return int(found[-1].name.split('_')[1]) if found else 0


def config_differences(cell: Cell) -> List[str]:
    """How the configuration saved in the cell's folder differs from the plan (empty: the same recipe)."""
    import yaml
    path = cell.folder / 'config.yaml'
    if not path.is_file():
        return []
    saved = yaml.safe_load(path.read_text()) or {}
    planned = _plain(cell.config.to_dict())
    # a key the cell's config.yaml lacks is an option added by a later release: the cell trained with its default
    # (as `train --resume` reads that file), so a grid begun on an older release goes on after an upgrade
    saved = {**{k: v for k, v in _config_defaults().items() if k not in saved}, **saved}
    # a distilled run records the stage-1 length it resolved from --epochs (so a resume keeps it): the plan's
    # "not given" is that same length
    if planned.get('predictor_epochs') is None and saved.get('predictor_epochs') == \
            cell.config.default_predictor_epochs():
        saved['predictor_epochs'] = None
    diff = _differences(saved, planned, skip=NOT_COMPARED)
    if [(t['name'], t.get('kwargs')) for t in saved.get('transforms') or []] != \
            [(t['name'], t.get('kwargs')) for t in planned['transforms']]:
        diff.append(f"transforms: {saved.get('transforms')!r} -> {planned['transforms']!r}")
    if saved.get('data') != planned['data']:
        diff.append(f"data: {saved.get('data')!r} -> {planned['data']!r}")
    if planned.get('teacher') and not _inside(saved.get('teacher'), planned['teacher']):
        diff.append(f"teacher: {saved.get('teacher')!r} -> {planned['teacher']!r}")
    return diff


def _config_defaults() -> Dict:
    from ..train.config import TrainConfig
    from ..train.config_file import config_defaults
    return _plain(config_defaults(TrainConfig))


def _inside(path, folder) -> bool:
    return bool(path) and Path(path).resolve().is_relative_to(Path(folder).resolve())


def _read_cell_record(cell: Cell, name: str, what: str, keys) -> Dict:
    from ..records import read_record
    return read_record(cell.folder / name, what, keys, f'delete the cell folder {cell.folder} to train it anew')


def _summary(cell: Cell, keys) -> Dict:
    return _read_cell_record(cell, 'summary.json', "a finished run's summary", keys)


def cell_state(cell: Cell) -> str:
    """'new', 'partial', 'finished', 'diverged' or 'changed' (trained with another configuration)."""
    from ..train.run_dir import holds_run
    if (cell.folder / DIVERGED).is_file():
        return 'changed' if config_differences(cell) else 'diverged'
    if not holds_run(cell.folder):
        return 'new'
    if config_differences(cell):
        return 'changed'
    summary = cell.folder / 'summary.json'
    done = epochs_done(cell)
    if summary.is_file() and _summary(cell, ()).get('epochs') == cell.config.epochs == done:
        return 'finished'
    return 'partial'


def cell_code(cell: Cell) -> Optional[List[str]]:
    """The source stamps of the code that trained the cell (code.json), or None where it keeps none."""
    if not (cell.folder / CODE).is_file():
        return None
    stamps = _read_cell_record(cell, CODE, 'the code stamps of a cell (code.json)', ('source',))['source']
    if not isinstance(stamps, list) or not all(isinstance(s, str) for s in stamps):
        raise UsageError(f"{cell.folder / CODE}: 'source' is not a list of stamps; delete the cell folder "
                         f"{cell.folder} to train it anew")
    return stamps


def stale_code(cell: Cell) -> Optional[str]:
    """Why the cell's run was made by other code than this process's, or None (no run yet, or every part of it
    trained by this code)."""
    from ..records import source_digest
    from ..train.run_dir import holds_run
    if not holds_run(cell.folder) and not (cell.folder / DIVERGED).is_file():
        return None
    stamps = cell_code(cell)
    if stamps is None:
        return 'trained before compare kept code stamps'
    current = source_digest()
    other = [s for s in dict.fromkeys(stamps) if s != current]
    if not other:
        return None
    return f"trained by other code (source {', '.join(other)}; this code is {current})"


def _stamp_code(cell: Cell, fresh: bool) -> None:
    """Add this code's stamp to the cell's code.json as it starts (fresh: a new run, the earlier stamps go) or
    resumes. A pre-trained low-rank cell starts from the dense cell's epochs, and takes that cell's stamps."""
    from ..records import source_digest, write_json
    if fresh:
        earlier = []
        if cell.row.entry.pretrained and (cell.folder / 'checkpoints').is_dir():     # its start copied in
            earlier = cell_code(cell.depends) or [UNKNOWN_CODE]
    else:
        earlier = cell_code(cell) or [UNKNOWN_CODE]
    stamps = earlier + [source_digest()] if (earlier[-1:] != [source_digest()]) else earlier
    cell.folder.mkdir(parents=True, exist_ok=True)
    write_json(cell.folder / CODE, {'source': stamps})


def check_cells(cells: List[Cell], overwrite: bool) -> None:
    """Before anything trains: a cell trained with another configuration is refused by name (unless --overwrite)."""
    if overwrite:
        return
    for cell in cells:
        diff = config_differences(cell)
        if diff:
            raise UsageError(f"--output: cell {cell.name} ({cell.folder}) was trained with another configuration "
                             f"({'; '.join(diff[:3])}); pass --overwrite to retrain it, or give another --output")


# ---- training -------------------------------------------------------------------------------------------------
def _start_from_dense(cell: Cell) -> bool:
    """Copy the dense cell's checkpoint at the switch (and the init, and the metrics lines up to it) into a new
    pre-trained low-rank cell, so that it resumes there. False when the dense cell no longer holds that checkpoint
    (then the cell trains its dense epochs itself: the same numbers, twice the time)."""
    from ..train.checkpoint import checkpoint_name, mark_latest
    from ..train.run_dir import read_metrics
    switch = cell.config.factorize_at
    source = cell.depends.folder / 'checkpoints'
    wanted = [source / checkpoint_name(e) for e in (0, switch)]
    if not all((p / 'state.json').is_file() and (p / 'model.safetensors').is_file() for p in wanted):
        return False
    target = cell.folder / 'checkpoints'
    target.mkdir(parents=True, exist_ok=True)
    for path in wanted:
        temporary = target / f'{path.name}.tmp-copy'
        shutil.rmtree(temporary, ignore_errors=True)
        shutil.copytree(path, temporary)
        temporary.rename(target / path.name)
    lines = [r for r in read_metrics(cell.depends.folder / 'metrics.jsonl') if r['epoch'] <= switch]
    from ..atomic import write_text_atomically
    write_text_atomically(cell.folder / 'metrics.jsonl', ''.join(json.dumps(r) + '\n' for r in lines))
    mark_latest(target, target / checkpoint_name(switch))
    return True


class CellFailed(RuntimeError):
    """A cell's training process ended without finishing or diverging (killed, out of memory, a bug): the grid
    stops; the command run again continues every cell where it stopped."""


def prepare_cell(cell: Cell, overwrite: bool = False):
    """What a cell needs before it trains: None (finished, diverged, or its dependency did not finish; the
    reason is printed) or (resume, overwrite) for the engine. A new pre-trained low-rank cell gets its start
    copied from the dense cell here."""
    state = cell_state(cell)
    if state == 'diverged' and not overwrite:
        return None
    stale = overwrite and state in ('finished', 'partial') and stale_code(cell)
    if state == 'finished' and not stale:
        return None
    if cell.depends is not None and cell_state(cell.depends) != 'finished':
        print(f"== {cell.name}: skipped, {cell.depends.name} did not finish ({cell_state(cell.depends)})", flush=True)
        return None
    if stale:                                  # another code's run, retrained from the start: it goes first
        print(f"== {cell.name}: {stale}: trained anew (--overwrite)", flush=True)
        shutil.rmtree(cell.folder, ignore_errors=True)
        state = 'new'
    if state in ('changed', 'diverged'):
        (cell.folder / DIVERGED).unlink(missing_ok=True)
        if cell.row.entry.pretrained:          # its start is copied in: the old run goes first
            shutil.rmtree(cell.folder, ignore_errors=True)
            state = 'new'
    resume = state == 'partial'
    if state == 'new' and cell.row.entry.pretrained:
        resume = _start_from_dense(cell)
    _stamp_code(cell, fresh=not resume or state == 'new')
    print(f"== {cell.name}: {'resuming' if resume else 'training'} {cell.row.model} ({cell.config.epochs} epochs)",
          flush=True)
    # the engine's overwrite: a changed or diverged cell's folder holds the old run, which it replaces
    return resume, state in ('changed', 'diverged')


def train_planned(config: Dict, resume: bool, overwrite: bool, threads: int = 0) -> str:
    """Train one cell from its planned configuration (a TrainConfig's values): 'trained', or 'diverged' with the
    engine's message kept in the cell's diverged.json. Also the body of a `--jobs` worker process."""
    from ..records import write_json
    from ..train.config import TrainConfig
    from ..train.engine import Trainer, TrainingDiverged
    if threads:
        import torch
        torch.set_num_threads(threads)
    config = TrainConfig.from_dict(config)
    try:
        Trainer(config, resume=True if resume else None, overwrite=overwrite, progress=False).fit()
    except TrainingDiverged as e:
        write_json(Path(config.output) / DIVERGED, {'message': str(e)})
        print(f"== {config.output}: diverged ({e})", flush=True)
        return 'diverged'
    return 'trained'


def run_cell(cell: Cell, overwrite: bool = False) -> str:
    """Train, resume or skip one cell in this process; returns what happened ('finished', 'trained', 'diverged',
    'skipped')."""
    plan = prepare_cell(cell, overwrite)
    if plan is None:
        state = cell_state(cell)
        return state if state in ('finished', 'diverged') else 'skipped'
    return train_planned(cell.config.to_dict(), *plan)


def run_parallel(cells: List[Cell], jobs: int, threads: int, overwrite: bool, logs: Path) -> bool:
    """Train the cells in up to `jobs` worker processes at a time (each with `threads` torch threads, its output in
    LOGS/<row>-seed_<s>.log), a cell starting once the cell it depends on has finished. Returns whether any cell
    trained. A worker that ends otherwise stops the grid (CellFailed) once the others have ended."""
    import subprocess
    import time

    from ..bench.harness import python_command
    from ..train.run_dir import sigterm_as_interrupt
    pending, running, trained, failed = list(cells), {}, False, []
    logs.mkdir(parents=True, exist_ok=True)
    # SIGTERM (kill, a scheduler's stop) must reach the except below: Python's default ends this process on the
    # spot and leaves the workers training on as orphans, holding their cells' run locks
    with sigterm_as_interrupt():
        try:
            while pending or running:
                for cell in list(pending):
                    if len(running) >= jobs or failed:
                        break
                    if cell.depends is not None and (cell.depends in pending or cell.depends in running.values()):
                        continue
                    pending.remove(cell)
                    plan = prepare_cell(cell, overwrite)
                    if plan is None:
                        continue
                    payload = json.dumps([json.loads(json.dumps(cell.config.to_dict())), plan[0], plan[1], threads])
                    code = ("import json, sys\nfrom structformer.compare.grid import train_planned\n"
                            f"train_planned(*json.loads({payload!r}))")
                    log = open(logs / f"{cell.row.key}-seed_{cell.seed}.log", 'a')
                    env = dict(__import__('os').environ)
                    if threads:
                        env['OMP_NUM_THREADS'] = str(threads)
                    running[subprocess.Popen(python_command(code), stdout=log, stderr=subprocess.STDOUT,
                                             env=env)] = cell
                    log.close()
                if not running and failed:
                    break
                time.sleep(0.2)
                for process in [p for p in running if p.poll() is not None]:
                    cell = running.pop(process)
                    if process.returncode == 0:
                        trained = True
                        print(f"== {cell.name}: {cell_state(cell)}", flush=True)
                    else:
                        failed.append(f"{cell.name} (exit status {process.returncode}; log "
                                      f"{logs / f'{cell.row.key}-seed_{cell.seed}.log'})")
                if failed and not running:
                    break
        except BaseException:
            for process in running:
                process.terminate()              # SIGTERM: the engine stops like Ctrl-C, its checkpoints intact
            for process in running:
                process.wait()
            raise
    if failed:
        raise CellFailed(f"stopped: {', '.join(failed)}; checkpoints already written are intact: run the command "
                         "again to continue")
    return trained


def cell_result(cell: Cell) -> Dict:
    """What the record keeps of one cell: its seed, folder, state and, when it finished, its held-out top-1
    (final and best, and the weight average's where the recipe keeps one), epochs, training seconds and teacher."""
    import yaml

    from ..train.run_dir import read_metrics
    state = cell_state(cell)
    out = {'seed': cell.seed, 'run': str(cell.folder), 'state': state}
    stale = stale_code(cell)
    if stale:
        out['stale'] = stale
    if state == 'diverged':
        out['message'] = _read_cell_record(cell, DIVERGED, 'the message of a diverged cell', ()).get('message')
    if state != 'finished':
        return out
    summary = _summary(cell, ('final_val_top1', 'best_val_top1', 'epochs'))
    history = read_metrics(cell.folder / 'metrics.jsonl')
    saved = yaml.safe_load((cell.folder / 'config.yaml').read_text()) or {}
    out.update(top1=summary['final_val_top1'], best_top1=summary['best_val_top1'],
               ema_top1=summary.get('final_ema_val_top1'), epochs=summary['epochs'],
               train_seconds=sum(r.get('epoch_time_s', 0.0) for r in history), teacher=saved.get('teacher'))
    return out
