"""`structformer bench gpu`: the paper-scale speed figures on one GPU, in one command, inside a time budget.

A GPU is lent to this project for minutes at a time, so this command measures everything the GPU table of
docs/benchmarks.md shows in one run of at most `--budget-s` seconds (default 230: with the GPU test suite it fits
8 minutes, docs/gpu.md) and writes one JSON record, `docs/gpu/<device>_<date>.json` (`<date>-2`, ... after the first
of a day, `default_record`):

- the goals' model pairs (CRATE-T / ViT-T, factorised / dense ViT-S), eager training steps timed back to back
  round by round in one process: the ratios the two training goals are judged on;
- training images/s and peak memory, 224 px, batch 128, bfloat16 autocast, timm's AdamW: ViT-T, CRATE-T, ViT-S,
  SOFT-T, Sparsifiner DeiT-S (keep 0.25), ViT-S factorised at rank 0.25 and 0.5, Mixer-B/16 and RP-Mixer-B/16;
- attention alone: SDPA (flash under bfloat16) against SOFT and SOFT++ from 784 to 50,176 tokens (forward time,
  forward + backward time and peak memory; an out-of-memory is a cell that says so);
- every Sparsifiner path against dense SDPA at n = 577, 1025, 4097, keep 0.25, with the realised key density;
- every row again under torch.compile, where it compiles in the time left.

The rows run in two worker processes (`gpu_measure.py`: eager rows, then compiled ones) that stream each row as it
is measured; each section has a share of the budget, and what a section leaves unused passes to the next. An item
not started in time is recorded as `not timed`; a worker still running at its deadline (a compile that does not
end) is killed, and what it had measured is kept. The goals below are judged and printed, never asserted:
CRATE-T trains at >= 0.9x ViT-T's images/s; SOFT's forward beats SDPA from 8,192 tokens and is >= 4x faster at
50,176; a Sparsifiner path at keep 0.25 is no slower than SDPA at n = 4097; factorised ViT-S at rank 0.25 trains
>= 1.5x faster than dense ViT-S.

`--device cpu` is the dry path: the same plan at a tiny size (two models at 32 px, attention at 16 tokens,
one Sparsifiner size, `--compile-backend eager`), so the default test suite runs this code. `--render RECORD`
prints the markdown of a record; with `--doc docs/benchmarks.md` it rewrites the generated section there
(tests/test_docs_records.py checks that the page equals the render of the newest committed record).

Only the standard library at import: `structformer --help` builds this parser.
"""
from __future__ import annotations

import collections
import datetime
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

from ..errors import UsageError
from .gpu_measure import ROW_PREFIX
from .harness import python_command
from .gpu_report import ATTENTIONS, BEGIN, END, GOAL_SOFT_FROM, goals, render_markdown, replace_section

FACTORIZE = lambda rank: [{'name': 'factorize', 'kwargs': {'rank': rank}}]     # noqa: E731
MODELS = [
    # (label, registered model, model kwargs, transforms), in the order measured: Sparsifiner last, as its training
    # step compiles FlexAttention's kernels first (tens of seconds) and must not cost the others their time
    ('ViT-T', 'vit_tiny_patch16_224', {}, []),
    ('CRATE-T', 'crate_tiny_patch16_224', {}, []),
    ('ViT-S', 'vit_small_patch16_224', {}, []),
    ('ViT-S factorised rank 0.25', 'vit_small_patch16_224', {}, FACTORIZE(0.25)),
    ('ViT-S factorised rank 0.5', 'vit_small_patch16_224', {}, FACTORIZE(0.5)),
    ('SOFT-T', 'soft_tiny_224', {}, []),
    ('Mixer-B/16', 'sparse_mixer_b16_224', {}, []),
    ('RP-Mixer-B/16', 'rp_mixer_b16_224', {}, []),
    ('Sparsifiner DeiT-S keep 0.25', 'sparsifiner_deit_small_patch16_224', {'keep_ratio': 0.25}, []),
]
# the goals' model pairs (subject, reference), timed back to back in one process (`gpu_measure.measure_pair`)
PAIRS = (('CRATE-T', 'ViT-T'), ('ViT-S factorised rank 0.25', 'ViT-S'))
# the paths that compile FlexAttention kernels (seconds each) last
SPARSE_PATHS = ('masked', 'gather', 'block', 'block-gather', 'flex', 'block-flex')
SPARSE_KEEP = 0.25
SIZES = {
    'gpu': dict(batch_size=128, img_size=224, steps=10, warmup=3, repeats=20, attention_batch=8, attention_dim=64,
                attention_heads=2, attention_landmarks=49, sparse_batch=8, sparse_max_gib=20.0,
                grids=[[28, 28], [56, 56], [64, 128], [112, 112], [224, 224]], sparse_tokens=[577, 1025, 4097],
                sparse_paths=list(SPARSE_PATHS), models=[m[0] for m in MODELS], pairs=[list(p) for p in PAIRS],
                pair_rounds=20),
    # the dry path: every section's code at a size a 2-core CPU runs in seconds (no flex: eager flex on a CPU
    # materialises the scores and takes seconds per call)
    'tiny': dict(batch_size=2, img_size=32, steps=1, warmup=1, repeats=2, attention_batch=1, attention_dim=16,
                 attention_heads=2, attention_landmarks=4, sparse_batch=1, sparse_max_gib=1.0,
                 grids=[[4, 4]], sparse_tokens=[65], sparse_paths=['masked', 'block-gather'],
                 models=['ViT-T', 'ViT-S factorised rank 0.25'], pairs=[['CRATE-T', 'ViT-T']], pair_rounds=2,
                 # two blocks of each model: a block's code is what runs, depth only repeats it (ViT-S's 12 blocks
                 # took 12 s a row on a Zen 1 core, 6 of them the 36 SVDs of its spectral factorisation)
                 model_kwargs={'depth': 2}),
}
# each section's share of the budget; a section's deadline is the sum of the shares up to it, so time one leaves
# unused passes on
# (compiled, in the order of the goals they can decide: the attention rows first, as SOFT's launch-bound eager rows
# make its compiled rows the ones that answer a question; then the goals' models (CRATE-T and ViT-T, dense and
# factorised ViT-S: on an H200 these took 18-25 s of compiling each, and first they left the others no time); then
# Sparsifiner's, whose compiled masked path was 46x SDPA's time at n = 4097 and whose flex paths compile in eager
# rows too. On 2026-11-27 (H200, budgets 150 and 180 s) the compiled attention rows were stopped at their deadline
# after SDPA and SOFT at 8,192 tokens (3.6 and 8-11 s of compiling each with CUDA graphs); so the eager shares give
# up 0.08 to the compiled attention rows, about 40 s at 200 s. The eager pairs come first, as they decide two
# goals: on that H200 a ViT-T and a CRATE-T step took ~20 ms, so 20 rounds of a pair are about 2 s after setup, but
# the worker's first item also pays CUDA's start (seconds); the models' cumulative deadline is as before.)
SHARES = (('pairs', 'eager', 0.08), ('models', 'eager', 0.24), ('attention', 'eager', 0.09),
          ('sparse', 'eager', 0.21), ('attention', 'compiled', 0.17), ('models', 'compiled', 0.14),
          ('sparse', 'compiled', 0.07))
COMPILED_ORDER = ('attention', 'models', 'sparse')
RECORDS = Path('docs') / 'gpu'                 # under the folder it is run from: the repository's root

EXAMPLES = """examples:
  structformer bench gpu                                   # everything, <= 230 s, record in docs/gpu/
  structformer bench gpu --budget-s 120 --no-compile       # eager rows only
  structformer bench gpu --device cpu --output /tmp/dry.json   # the dry path: the code at a tiny size
  structformer bench gpu --render docs/gpu/h100-80gb-hbm3_2026-12-01.json --doc docs/benchmarks.md"""


def add_arguments(p):
    p.add_argument('--device', default='cuda', help='cuda (default) | cpu: the dry path at a tiny size')
    p.add_argument('--budget-s', type=float, default=None,
                   help='wall-clock seconds for all measurements (default 230 on CUDA, 120 on the CPU)')
    p.add_argument('--no-compile', action='store_true', help='eager rows only')
    p.add_argument('--compile-backend', default=None,
                   help="torch.compile backend of the compiled rows (default inductor; 'eager' on the CPU)")
    p.add_argument('--output', default=None,
                   help='the JSON record (default on CUDA docs/gpu/<device>_<date>.json, then <date>-2, -3, ... for '
                        'the same device and day: a record is never replaced; on a CPU none)')
    p.add_argument('--render', default=None, metavar='RECORD', help='print the markdown of RECORD and stop')
    p.add_argument('--doc', default=None, metavar='PAGE', help="with --render: rewrite PAGE's generated section")


# ---- the plan ------------------------------------------------------------------------------------------------

GOAL_ATTENTIONS = ('softmax', 'soft')          # the two the SOFT goal compares


def _compiled_attention_order(item: dict) -> tuple:
    """The compiled attention rows' order: first SDPA and SOFT at the SOFT goal's sizes (from GOAL_SOFT_FROM
    tokens), smallest first, as the goal's crossover is where the launch-bound eager forward lost (0.17x at 8,192 on
    an H200); then SOFT++ at those sizes; then the rest, largest first. Each compile with CUDA graphs took 3.6-11 s
    there, so the budget may end part-way, and on 2026-11-27 it ended after 8,192 tokens with SOFT++ in between."""
    n = item['grid'][0] * item['grid'][1]
    if n >= GOAL_SOFT_FROM:
        return (0 if item['attention'] in GOAL_ATTENTIONS else 1, n, list(ATTENTIONS).index(item['attention']))
    return (2, -n, list(ATTENTIONS).index(item['attention']))


def _spec(model: tuple) -> dict:
    label, name, kwargs, transforms = model
    return dict(label=label, model=name, kwargs=kwargs, transforms=transforms)


def make_plan(size: dict, compiled: bool) -> List[dict]:
    """Every item to measure, in order: eager (the goals' model pairs, models, attention, Sparsifiner), then the
    compiled ones in `COMPILED_ORDER`, the same order as their `SHARES` (a section's deadline is cumulative)."""
    extra = size.get('model_kwargs', {})
    models = {label: (label, name, dict(kwargs, **extra), transforms) for label, name, kwargs, transforms in MODELS}
    items = []
    for mode in ('eager', 'compiled') if compiled else ('eager',):
        sections = {'pairs': [], 'models': [], 'attention': [], 'sparse': []}
        model_labels = size['models']
        if mode == 'compiled':        # the goals' models first: the rest only if time is left
            first = ['ViT-T', 'CRATE-T', 'ViT-S', 'ViT-S factorised rank 0.25']
            model_labels = [m for m in first if m in model_labels] + [m for m in model_labels if m not in first]
        for label in model_labels:
            _, name, kwargs, transforms = models[label]
            sections['models'].append(dict(section='models', mode=mode, label=label, model=name, kwargs=kwargs,
                                           transforms=transforms))
        if mode == 'eager':          # compiled pairs would compile both models again: the compiled rows are each
            for subject, reference in size.get('pairs', []):      # model's own graph, steady from step to step
                sections['pairs'].append(dict(section='pairs', mode=mode, label=f"{subject} / {reference}",
                                              subject=_spec(models[subject]), reference=_spec(models[reference])))
        for grid in size['grids']:
            for attention in ATTENTIONS:
                sections['attention'].append(dict(section='attention', mode=mode, attention=attention, grid=grid))
        if mode == 'compiled':
            sections['attention'].sort(key=_compiled_attention_order)
        for n in sorted(size['sparse_tokens'], reverse=True):       # the goal's n = 4097 first
            for path in size['sparse_paths']:
                sections['sparse'].append(dict(section='sparse', mode=mode, tokens=n, keep=SPARSE_KEEP, path=path))
        for section in (('pairs', 'models', 'attention', 'sparse') if mode == 'eager' else COMPILED_ORDER):
            items += sections[section]
    return items


def deadlines(start: float, budget: float, compiled: bool) -> dict:
    """{(section, mode): its deadline}: the cumulative shares (renormalised without the compiled ones)."""
    shares = [s for s in SHARES if compiled or s[1] == 'eager']
    total, out, acc = sum(s[2] for s in shares), {}, 0.0
    for section, mode, share in shares:
        acc += share / total
        out[section, mode] = start + acc * budget
    return out


# ---- the workers ---------------------------------------------------------------------------------------------

def _pump(stream, sink, tag):
    for line in stream:
        sink.put((tag, line))
    sink.put((tag, None))


def stream_rows(payload: dict, hard_deadline: float, echo=sys.stderr) -> tuple:
    """Run `gpu_measure.main(payload)` in a worker process; (rows it printed, a note or None). The worker is
    killed (its whole process group: compile workers too) when `hard_deadline` (time.time()) passes."""
    code = "import json, sys; from structformer.bench.gpu_measure import main; main(json.loads(sys.argv[1]))"
    proc = subprocess.Popen(python_command(code, json.dumps(payload)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    for stream, tag in ((proc.stdout, 'out'), (proc.stderr, 'err')):
        threading.Thread(target=_pump, args=(stream, lines, tag), daemon=True).start()
    rows, tail, open_streams, note = [], collections.deque(maxlen=20), 2, None
    while open_streams:
        remaining = hard_deadline - time.time()
        try:
            tag, line = lines.get(timeout=max(remaining, 0.01))
        except queue.Empty:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:                     # it ended just now
                pass
            note = 'the worker was stopped at its deadline (a row that had not finished is marked not timed)'
            break
        if line is None:
            open_streams -= 1
        elif tag == 'out' and line.startswith(ROW_PREFIX):
            rows.append(json.loads(line[len(ROW_PREFIX):]))
            print(f"  {describe(rows[-1])}: {rows[-1]['status']}", file=echo, flush=True)
        elif tag == 'err':
            tail.append(line.rstrip())
    code = proc.wait()
    if code and note is None:
        note = f"the worker exited with status {code}: " + ' | '.join(list(tail)[-3:])
    return rows, note


def describe(row: dict) -> str:
    if row['section'] == 'pairs':
        return f"{row['label']} paired ({row['mode']})"
    if row['section'] == 'models':
        return f"{row['label']} ({row['mode']})"
    if row['section'] == 'attention':
        return f"{ATTENTIONS.get(row['attention'], row['attention'])} n={row['grid'][0] * row['grid'][1]} ({row['mode']})"
    return f"sparsifiner {row['path']} n={row['tokens']} ({row['mode']})"


def _key(row: dict) -> tuple:
    return (row['section'], row['mode'], row.get('label'), row.get('attention'), tuple(row.get('grid') or ()),
            row.get('tokens') if row['section'] == 'sparse' else None, row.get('path'))


def measure(items: List[dict], settings: dict, start: float, budget: float, compiled: bool) -> tuple:
    """All rows of `items`; items without a row (their worker was stopped) get a `not timed` row."""
    ends = deadlines(start, budget, compiled)
    for item in items:
        item['deadline'] = ends[item['section'], item['mode']]
    rows, notes = [], []
    for mode in ('eager', 'compiled'):
        batch = [i for i in items if i['mode'] == mode]
        if not batch:
            continue
        hard = max(i['deadline'] for i in batch) + (15.0 if mode == 'eager' else 0.0)
        got, note = stream_rows({'settings': settings, 'items': batch}, hard)
        rows += got
        if note:
            notes.append(f"{mode} worker: {note}")
        seen = {_key(r) for r in got}
        for item in batch:
            if _key(item) not in seen:
                rows.append(dict({k: v for k, v in item.items() if k != 'deadline'}, status='not timed',
                                 note='its worker was stopped at the budget'))
    return rows, notes


# ---- the command ---------------------------------------------------------------------------------------------

def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3' (a record's file name)."""
    name = re.sub(r'^nvidia\s+', '', name.strip().lower())
    return re.sub(r'[^a-z0-9]+', '-', name).strip('-') or 'device'


def default_record(folder: Path, slug: str, day: str) -> Path:
    """`folder`/<slug>_<day>.json, or with -2, -3, ... where a record of that device and day is there already: a
    second run on one day (a second call of the device check) must not replace the first's record, which the docs
    may quote; `gpu_report.latest_record` orders <day>-2 after <day>."""
    path, n = folder / f"{slug}_{day}.json", 1
    while path.exists():
        n += 1
        path = folder / f"{slug}_{day}-{n}.json"
    return path


def record_label(path) -> str:
    """How the docs name a record: `docs/gpu/NAME` for one in this project's docs/gpu, else its path."""
    path = Path(path)
    return f"docs/gpu/{path.name}" if path.resolve().parent == RECORDS.resolve() else str(path)


def _check(args) -> None:
    if args.device not in ('cuda', 'cpu'):
        raise UsageError(f"--device {args.device!r}: accepted cuda or cpu (the dry path at a tiny size)")
    if args.budget_s is not None and not args.budget_s > 0:
        raise UsageError(f"--budget-s must be > 0 seconds, got {args.budget_s:g}")
    if args.doc and not args.render:
        raise UsageError("--doc PAGE rewrites PAGE's section from a record: give the record with --render RECORD")
    if args.device == 'cuda' and not args.render:
        import torch
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available here; --device cpu runs the dry path")


def render(args) -> int:
    path = Path(args.render)
    if not path.is_file():
        raise UsageError(f"--render {args.render}: no such record")
    try:
        record = json.loads(path.read_text())
        text = render_markdown(record, record_label(path))
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--render {args.render}: not a `bench gpu` record ({type(e).__name__}: {e})") from None
    if not args.doc:
        print(text)
        return 0
    from ..records import write_text
    page = Path(args.doc)
    try:
        updated = replace_section(page.read_text(), text, BEGIN, END)
    except (OSError, ValueError) as e:
        raise UsageError(f"--doc {args.doc}: {e}") from None
    write_text(page, updated)
    print(f"rewrote the `bench gpu` section of {page} from {path.name}")
    return 0


def run(args) -> int:
    _check(args)
    if args.render:
        return render(args)
    from ..records import check_output_file, environment, write_json
    from .load import run_record
    size = dict(SIZES['gpu' if args.device == 'cuda' else 'tiny'])
    budget = args.budget_s or (230.0 if args.device == 'cuda' else 120.0)
    backend = args.compile_backend or ('inductor' if args.device == 'cuda' else 'eager')
    env = environment(args.device)
    today = datetime.date.today().isoformat()
    output = args.output or (str(default_record(RECORDS, device_slug(env['device']), today)) if args.device == 'cuda'
                             else None)
    if output:                     # before measuring: minutes of timings never die at the write
        check_output_file(output, '--output')
    settings = dict(size, device=args.device, dtype='bfloat16', compile_backend=backend,
                    threads=1 if args.device == 'cpu' else 0)
    items = make_plan(size, not args.no_compile)
    print(f"bench gpu: {len(items)} rows on {env['device']} within {budget:.0f} s", file=sys.stderr, flush=True)
    start = time.time()
    rows, notes = measure(items, settings, start, budget, not args.no_compile)
    wall = time.time() - start
    verdicts = goals(rows)
    command = 'structformer bench gpu' + ''.join(f" {a}" for a in sys.argv[3:]) if sys.argv[1:3] == ['bench', 'gpu'] \
        else 'structformer bench gpu'
    record = {'command': command, 'date': today, 'budget_s': budget, 'wall_s': wall, 'environment': env,
              'settings': settings, 'rows': rows, 'goals': verdicts, 'notes': notes, 'machine_load': run_record()}
    print()
    print(render_markdown(record, record_label(output) if output else None))
    if output:
        write_json(output, record)
        print(f"\nwrote {output}; `structformer bench gpu --render {output} --doc docs/benchmarks.md` puts its "
              "tables into the docs")
    if args.device == 'cpu':
        print("(the dry path: tiny sizes on a CPU, for testing the code; these are not GPU figures)")
    return 1 if any(r['status'] == 'error' for r in rows) else 0
