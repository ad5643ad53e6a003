"""One goals table per kind of CPU in docs/benchmarks.md, each rendered from a committed record, and the command
that re-measures a kind's records on a quiet machine.

A kind record is `docs/kinds/<kind>.json`: the kind (`records.kind_id`), a line on the CPU, and one entry per goal
of `kinds.GOALS` (`kinds.goal_entry` fields plus `record`, the JSON it comes from, and `command`). For a kind
measured by `record_kind` the entries are collected from the benchmarks' own records in `docs/kinds/<kind>/`
(their 'kind_goals'), so the table equals what the benchmarks wrote; records from before the kind existed are
transcribed by hand into their kind's record, each entry naming the file it was read from (or, where none was
committed, saying so). `render` turns a kind record into its table; `update_docs` writes every table into
docs/benchmarks.md between `<!-- kind-table KIND -->` and `<!-- /kind-table -->`, and `update_readme` README's
table of every kind's verdicts side by side (`render_summary`); the tests check that each equals its render.

`python -m structformer.bench.kind_tables record` (`make bench-records`) runs the benchmarks behind every goal on
this machine at their goal settings, one after the other, into a staging folder. Only when every one wrote its
record and none was measured on a busy machine (unless `--allow-busy`) does it publish them (`publish`): the kind's
folder `docs/kinds/<this kind>/`, its kind record and both tables, swapped in together with signals held. A failed,
refused (busy) or interrupted run leaves docs/ as it was and names the staged records; a kind met for the first
time gets its table's markers appended to docs/benchmarks.md and a column in README's table. It prints how long
it took (quiet: `kinds.records_minutes`, from the committed records).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from .gpu_report import replace_section, section_of
from .kinds import DOCS_DIR, GOALS

KINDS_DIR = DOCS_DIR / 'kinds'
BENCHMARKS_MD = DOCS_DIR / 'benchmarks.md'
# (record file in docs/kinds/<kind>/, the goals it judges, the benchmark's arguments at the goal settings)
RECORDS = [
    ('sparse_attention.json', ('sparsifiner_sdpa',),
     ['sparse-attention', '--tokens', '577', '--keep', '0.25', '--paths', 'block-gather', 'block-kernel',
      '--repeats', '30', '--json', '{out}']),
    ('attention.json', ('soft_sdpa',),
     ['attention', '--attn', 'softmax', 'soft', 'softpp', '--multipliers', '1', '16', '--repeats', '3',
      '--pairs', '20', '--profile', '--output', '{out}']),
    ('lowrank.json', ('lowrank_layer', 'lowrank_stack'), ['lowrank', '--ranks', '0.25', '--output', '{out}']),
    ('mlp/mlp.json', ('rp_mixer_step', 'monarch_step'), ['mlp', '--rounds', '1', '--pairs', '10', '--output', '{dir}']),
    ('models.json', ('crate_vit',),
     ['models', '--pairs', '20', '--rounds', '1', '--steps', '3', '--modes', 'eager', '--output', '{out}']),
]
START, END = '<!-- kind-table {kind} -->', '<!-- /kind-table -->'
README_MD = DOCS_DIR.parent / 'README.md'
# README's speed table: every kind's verdicts side by side (`render_summary`), between these markers
SUMMARY_START, SUMMARY_END = '<!-- kind-summary -->', '<!-- /kind-summary -->'
# the README's column names of the kinds met so far (a kind not named here is headed by its id), in this order
KIND_LABELS = {'amd-avx2': 'AMD EPYC, AVX2 only', 'amd-avx512-bf16': 'AMD EPYC, AVX-512 + BF16 (Zen 5)',
               'amd-avx512-bf16+cap-avx2': 'the same Zen 5, kernels capped to AVX2',
               'intel-avx512-vnni': 'Intel Xeon, AVX-512 VNNI',
               'intel-amx': 'Intel Xeon, AVX-512 BF16 + AMX (family 6 model 207)',
               'intel-amx+cap-avx512_core_vnni-avx512_e1': "the same Xeon, kernels capped to Cascade Lake's"}


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(DOCS_DIR.parent.resolve()))
    except ValueError:
        return str(path)


def command_line(arguments: List[str], threads: int, out) -> List[str]:
    """`structformer bench ...` writing to `out` (its folder for a benchmark that takes one)."""
    out = str(out)
    filled = [a.replace('{out}', out).replace('{dir}', os.path.dirname(out)) for a in arguments]
    return ['structformer', 'bench', *filled, '--threads', str(threads)]


def _as_run(arguments: List[str], settings: dict) -> List[str]:
    """`arguments` without the switches (a flag with no value after it) the record's `settings` say were off: the
    command shown beside a record is the one that made it, also where RECORDS has gained a switch since."""
    out = []
    for i, token in enumerate(arguments):
        switch = token.startswith('--') and (i + 1 == len(arguments) or arguments[i + 1].startswith('--'))
        key = token[2:].replace('-', '_')
        if switch and key in settings and not settings[key]:
            continue
        out.append(token)
    return out


def collect(kind: str, folder: Path, shown: Optional[Path] = None) -> dict:
    """The kind record of `kind` from the benchmark records in `folder` (their 'kind_goals' and environment), one
    entry per goal in `GOALS` order; a goal with no record yet is an entry without a value. Each entry names its
    record as in `shown` (default `folder`: the folder the records are read from before they are published)."""
    shown = folder if shown is None else shown
    entries: Dict[str, dict] = {}
    cpu = None
    for name, goals, arguments in RECORDS:
        path = folder / name
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        env = record.get('environment') or {}
        found = (env.get('cpu_kind') or {}).get('kind')
        if found != kind:
            raise ValueError(f"{path} was measured on a {found!r} CPU, not {kind!r}: it belongs in docs/kinds/{found}/")
        cpu = cpu or (env.get('cpu_kind') or {}).get('summary')
        for entry in record.get('kind_goals') or []:
            if entry['goal'] in goals:
                command = ' '.join(command_line(_as_run(arguments, record.get('settings') or {}),
                                                env.get('threads', 1), f'docs/kinds/{kind}/{name}'))
                entries[entry['goal']] = dict(entry, record=_display(shown / name), command=command)
    goals = [entries.get(goal) or {'goal': goal, 'what': GOALS[goal][1], 'value': None,
                                   'target': f"{GOALS[goal][2]} {GOALS[goal][3]:g}", 'record': None}
             for goal in GOALS]
    return {'kind': kind, 'cpu': cpu, 'provenance': f"Collected from docs/kinds/{kind}/ by `make bench-records`.",
            'goals': goals}


# the measured kind whose benchmark records give each goal's FLOP ratio to the kinds transcribed by hand
COUNTS_FROM = 'amd-avx512-bf16'


def goal_flop_ratios(folder: Path = KINDS_DIR / COUNTS_FROM) -> Dict[str, float]:
    """The baseline's FLOPs over the structured path's at each goal of `kinds.SPLITS`, at the goal's settings: read
    from a measured kind's benchmark records (a FLOP count is arithmetic, the same on every CPU), CRATE-T / ViT-T
    counted here (`bench models` records no FLOPs)."""
    from .flops import row_forward_flops
    from .model_goals import vit_over_crate_flops
    read = lambda name: json.loads((folder / name).read_text())          # noqa: E731
    sweep = {r['attention']: r for r in read('attention.json')['rows'] if r['tokens'] == 12544}
    core = next(r for r in read('sparse_attention.json')['rows'] if r['tokens'] == 577 and r['keep'] == 0.25
                and r['path'].endswith(' core') and r['path'] != 'dense SDPA core')
    mlp = read('mlp/mlp.json')
    models = {m['model']: m for m in mlp['models']}
    return {'crate_vit': vit_over_crate_flops(224),
            'soft_sdpa': row_forward_flops(sweep['softmax']) / row_forward_flops(sweep['soft']),
            'sparsifiner_sdpa': 1 / core['flops_vs_dense'],
            'rp_mixer_step': models['mixer_cifar']['macs_per_image'] / models['rp_mixer_cifar']['macs_per_image'],
            'monarch_step': next(r for r in mlp['layers'] if r['layer'] == 'monarch')['flop_ratio']}


def with_splits(record: dict, ratios: Dict[str, float]) -> dict:
    """A transcribed kind record with each measured goal of `kinds.SPLITS` split into FLOPs and FLOP rates
    (`kinds.flop_rate_split`, as the benchmarks now record it): `rates` and, where missed, the `bound`."""
    from .kinds import SPLITS, flop_rate_split
    goals = []
    for entry in record['goals']:
        entry = dict(entry)
        if entry['goal'] in SPLITS and entry.get('value') is not None:
            entry['rates'], entry['bound'] = flop_rate_split(entry['goal'], entry['value'], ratios[entry['goal']])
        goals.append(entry)
    return dict(record, goals=goals)


def _cell(entry: dict) -> str:
    if entry.get('value') is None:
        return '—'
    q = entry.get('quartiles')
    return f"{entry['value']:.3f}" + (f" ({q[0]:.3f}–{q[1]:.3f})" if q else '')


def render(record: dict) -> str:
    """The Markdown of one kind record: a heading line, then one table row per goal."""
    lines = [f"**{record['kind']}**: {record.get('cpu') or 'CPU not recorded'}. {record.get('provenance', '')}".rstrip(),
             '',
             '| goal | target | measured (quartiles) | threads | verdict | machine | notes | record |',
             '|---|---|---|---|---|---|---|---|']
    for entry in record['goals']:
        verdict = ('—' if entry.get('value') is None else 'met' if entry.get('met') else 'not met')
        machine = {True: 'BUSY', False: 'quiet'}.get(entry.get('busy'), '—')
        notes = '; '.join(part for part in (entry.get('detail'), entry.get('bound') and f"on this kind: {entry['bound']}",
                                            entry.get('source')) if part)
        record_cell = f"`{entry['record']}`" if entry.get('record') else 'none committed'
        lines.append(f"| {entry['what']} | {entry['target'].replace('>=', '≥').replace('<=', '≤')} | {_cell(entry)} "
                     f"| {entry.get('threads') or '—'} | {verdict} | {machine} | {notes or ''} | {record_cell} |")
    return '\n'.join(lines)


def _provenance(folder_exists: bool, record: dict) -> str:
    if folder_exists:
        return 'measured by `make bench-records`'
    if any(entry.get('record') for entry in record['goals']):
        return 'transcribed from older records'
    return 'transcribed, no record committed'


def _summary_cell(entry: dict) -> str:
    if entry.get('value') is None:
        return '— (none committed)' if not entry.get('record') else '—'
    value = entry['value']
    text = f"{value:.2f}×" if value < 10 else f"{value:.1f}×"
    threads = entry.get('threads')
    notes = [note for note, on in ((f"{threads} threads", bool(threads) and threads != 1),
                                   ('BUSY', entry.get('busy') is True), ('no record', not entry.get('record'))) if on]
    return f"{text} {'met' if entry.get('met') else '**not met**'}" + (f" ({', '.join(notes)})" if notes else '')


def render_summary(records: Dict[str, dict], measured: Optional[set] = None) -> str:
    """README's speed table: one row per goal of `kinds.GOALS`, one column per kind record (KIND_LABELS' order,
    then any other), each cell the record's ratio and verdict, marked BUSY for a busy run's record and 'no record'
    where the number was transcribed without a committed JSON; each column says how its numbers were obtained
    (`measured`: the kinds with a folder of benchmark records, default those in docs/kinds/)."""
    if measured is None:
        measured = {k for k in records if (KINDS_DIR / k).is_dir()}
    order = [k for k in KIND_LABELS if k in records] + sorted(k for k in records if k not in KIND_LABELS)
    head = ['goal (1 thread unless said)', 'target'] + [KIND_LABELS.get(k, k) for k in order]
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head),
             '| how measured | | ' + ' | '.join(_provenance(k in measured, records[k]) for k in order) + ' |']
    for goal in GOALS:
        entries = [next(e for e in records[k]['goals'] if e['goal'] == goal) for k in order]
        target = entries[0]['target'].replace('>=', '≥').replace('<=', '≤') if entries else ''
        lines.append(f"| {entries[0]['what'] if entries else goal} | {target} | "
                     + ' | '.join(_summary_cell(e) for e in entries) + ' |')
    return '\n'.join(lines)


def update_readme(text: str, records: Dict[str, dict]) -> str:
    """`text` (README.md) with its speed table between SUMMARY_START and SUMMARY_END rendered from `records` (the
    marker helpers `bench gpu` uses for its section of docs/benchmarks.md; ValueError without the markers)."""
    return replace_section(text, render_summary(records), SUMMARY_START, SUMMARY_END)


def summary_in_readme(text: str) -> str:
    return section_of(text, SUMMARY_START, SUMMARY_END) if SUMMARY_START in text else ''


def write_docs() -> None:
    """Every kind table in docs/benchmarks.md and README's speed table, from docs/kinds/*.json."""
    from ..atomic import write_text_atomically
    records = kind_records()
    benchmarks, readme = update_docs(BENCHMARKS_MD.read_text(), records), update_readme(README_MD.read_text(), records)
    write_text_atomically(BENCHMARKS_MD, benchmarks)
    write_text_atomically(README_MD, readme)


def kind_records() -> Dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(KINDS_DIR.glob('*.json'))}


def update_docs(text: str, records: Dict[str, dict]) -> str:
    """`text` with each kind's table between its markers replaced by the render of its record (a kind with no
    markers yet is left out: where its table goes is the page's choice)."""
    for kind, record in records.items():
        pattern = re.compile(re.escape(START.format(kind=kind)) + r'\n.*?' + re.escape(END), re.S)
        text = pattern.sub(lambda _: f"{START.format(kind=kind)}\n{render(record)}\n{END}", text)
    return text


def table_in_docs(text: str, kind: str) -> str:
    """The rendered table of `kind` as docs/benchmarks.md holds it ('' where it has no markers for it)."""
    match = re.search(re.escape(START.format(kind=kind)) + r'\n(.*?)\n' + re.escape(END), text, re.S)
    return match.group(1) if match else ''


def _busy(path: Path) -> bool:
    """Whether the benchmark record at `path` says the machine was busy while it measured."""
    try:
        return bool((json.loads(path.read_text()).get('machine_load') or {}).get('busy'))
    except (OSError, ValueError, AttributeError):
        return False


def _name_published(folder: Path, staged: Path, published: Path) -> None:
    """Rewrite, in every JSON record under `folder`, each path inside the staging folder `staged` (a benchmark's
    `args.output`, `json`: where it was told to write) as the path it is published at, relative to the repository
    (docs/kinds/KIND/...): a committed record names where it lives, not a temporary folder since deleted."""
    prefix = str(staged.absolute())

    def renamed(value):
        if isinstance(value, dict):
            return {k: renamed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [renamed(v) for v in value]
        if isinstance(value, str) and (value == prefix or value.startswith(prefix + os.sep)):
            return str(published / os.path.relpath(value, prefix)) if value != prefix else str(published)
        return value

    for path in folder.rglob('*.json'):
        record = json.loads(path.read_text())
        fixed = renamed(record)
        if fixed != record:
            path.write_text(json.dumps(fixed, indent=1))


def publish(kind: str, staged: Path) -> Path:
    """Make the benchmark records in `staged` this kind's records: docs/kinds/<kind>/ (replacing the old folder), its
    kind record docs/kinds/<kind>.json, its table in docs/benchmarks.md (for a kind met for the first time, a
    heading and the table's markers after the last kind's table) and README's speed table. Everything is read, checked, rendered and written to temporaries beside
    its target first; then, with signals held, the folder is swapped and each file renamed into place, so a failed
    or interrupted publish leaves the docs as they were. Returns the kind's folder."""
    from ..atomic import replace_together
    folder = KINDS_DIR / kind

    def fill(staging: Path) -> dict:
        shutil.copytree(staged, staging, dirs_exist_ok=True)
        _name_published(staging, staged, folder.relative_to(KINDS_DIR.parent.parent))
        record = collect(kind, staging, shown=folder)       # a record of another kind raises here
        records = dict(kind_records(), **{kind: record})
        measured = {k for k in records if (KINDS_DIR / k).is_dir()} | {kind}
        text = BENCHMARKS_MD.read_text()
        if START.format(kind=kind) not in text:             # a kind met for the first time: after the other kinds
            at = text.rfind(END) + len(END) if END in text else len(text.rstrip())
            text = text[:at] + f"\n\n### {KIND_LABELS.get(kind, kind)}\n\n{START.format(kind=kind)}\n{END}" + text[at:]
        return {KINDS_DIR / f'{kind}.json': json.dumps(record, indent=1), BENCHMARKS_MD: update_docs(text, records),
                README_MD: replace_section(README_MD.read_text(), render_summary(records, measured),
                                           SUMMARY_START, SUMMARY_END)}

    replace_together(folder, fill, 'docs/kinds')
    return folder


def record_kind(threads: int, allow_busy: bool = False) -> int:
    """Run every benchmark of `RECORDS` on this machine into a staging folder; when all of them wrote their record
    and none was busy (or `allow_busy`), publish them as this kind's records and tables (`publish`). Otherwise the
    docs stay as they were, and the staged records are kept and named. Returns 0, or 1 when nothing was published."""
    from ..records import cpu_kind
    from .kinds import RECORDS_COMMAND, records_minutes
    kind = cpu_kind()['kind']
    began = time.monotonic()
    staged = Path(tempfile.mkdtemp(prefix=f'structformer-records-{kind}-'))
    failed, busy = [], []
    try:
        for name, _, arguments in RECORDS:
            out = staged / name
            argv = command_line(arguments, threads, out)
            print(f"[{(time.monotonic() - began) / 60:5.1f} min] {' '.join(argv)}", flush=True)
            code = subprocess.call([sys.executable, '-m', 'structformer', *argv[1:]])
            if code or not out.exists():
                failed.append(name)
            elif _busy(out):
                busy.append(name)
    except KeyboardInterrupt:
        shutil.rmtree(staged, ignore_errors=True)
        print(f"\ninterrupted: nothing published, the records and tables of {kind} are as they were", file=sys.stderr)
        return 130
    minutes = (time.monotonic() - began) / 60
    if failed or (busy and not allow_busy):
        reasons = ([f"failed: {', '.join(failed)}"] if failed else []) + (
            [f"measured while the machine was BUSY: {', '.join(busy)} "
             f"(`make bench-records RECORDS_FLAGS=--allow-busy` publishes them anyway)"]
            if busy and not allow_busy else [])
        print(f"\nnothing published for {kind} after {minutes:.1f} min ({'; '.join(reasons)}); the records and tables "
              f"in docs/ are as they were, this run's records are in {staged}. Re-run `{RECORDS_COMMAND}` on a quiet "
              f"machine: {records_minutes(kind, KINDS_DIR.parent)} at {threads} thread(s)", file=sys.stderr)
        return 1
    try:
        folder = publish(kind, staged)
    except (ValueError, OSError) as e:         # a record of another kind, another run publishing, docs not writable
        print(f"\nnothing published for {kind} after {minutes:.1f} min: {e}; the records and tables in docs/ are as "
              f"they were, this run's records are in {staged}", file=sys.stderr)
        return 1
    shutil.rmtree(staged, ignore_errors=True)
    print(f"\nrecords of {kind} in {_display(folder)}, tables in {_display(BENCHMARKS_MD)} and "
          f"{_display(README_MD)}: {minutes:.1f} min"
          + (f" (BUSY, published as asked: {', '.join(busy)})" if busy else ''))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m structformer.bench.kind_tables', description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='action', required=True)
    rec = sub.add_parser('record', help="re-measure this CPU kind's records (quiet machine) and update the docs")
    rec.add_argument('--threads', type=int, default=1, help='torch threads for every benchmark, >= 1 (1)')
    rec.add_argument('--allow-busy', action='store_true',
                     help='publish the records even from a busy run (their tables then say BUSY per goal)')
    sub.add_parser('render', help="rewrite every kind table in docs/benchmarks.md and README's speed table from "
                                  "docs/kinds/*.json")
    args = parser.parse_args(argv)
    if args.action == 'record':
        if args.threads < 1:
            rec.error(f"--threads: accepted integers >= 1, got {args.threads}")
        if SUMMARY_START not in README_MD.read_text():         # found now, not after the benchmarks' minutes
            rec.error(f"{_display(README_MD)} has no {SUMMARY_START} ... {SUMMARY_END} section for the speed table")
        from ..functional.autotune import check_environment
        try:                                                    # each benchmark would refuse them, one by one
            check_environment()
        except ValueError as e:
            rec.error(str(e))
        return record_kind(args.threads, args.allow_busy)
    try:
        write_docs()
    except (ValueError, KeyError, TypeError, OSError) as e:      # a page without its markers, a foreign kind record
        print(f"{parser.prog} render: error: {type(e).__name__}: {e}; docs/ left as it was", file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
