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
this machine at their goal settings, one after the other, writes their records into `docs/kinds/<this kind>/`
(a busy run's record is refused there: `kinds.write_record`), collects the kind record and updates the docs.
It prints how long it took: 21 minutes at 1 thread on the project's 2-core machine while other work shared it
(`kinds.RECORDS_MINUTES`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

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
               'intel-avx512-vnni': 'Intel Xeon, AVX-512 VNNI'}


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


def collect(kind: str, folder: Path) -> dict:
    """The kind record of `kind` from the benchmark records in `folder` (their 'kind_goals' and environment), one
    entry per goal in `GOALS` order; a goal with no record yet is an entry without a value."""
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
                shown = ' '.join(command_line(_as_run(arguments, record.get('settings') or {}), env.get('threads', 1),
                                              f'docs/kinds/{kind}/{name}'))
                entries[entry['goal']] = dict(entry, record=_display(path), command=shown)
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
    from .models import vit_over_crate_flops
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


def render_summary(records: Dict[str, dict]) -> str:
    """README's speed table: one row per goal of `kinds.GOALS`, one column per kind record (KIND_LABELS' order,
    then any other), each cell the record's ratio and verdict, marked BUSY for a busy run's record and 'no record'
    where the number was transcribed without a committed JSON; each column says how its numbers were obtained."""
    order = [k for k in KIND_LABELS if k in records] + sorted(k for k in records if k not in KIND_LABELS)
    head = ['goal (1 thread unless said)', 'target'] + [KIND_LABELS.get(k, k) for k in order]
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head),
             '| how measured | | ' + ' | '.join(_provenance((KINDS_DIR / k).is_dir(), records[k]) for k in order) + ' |']
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
    records = kind_records()
    BENCHMARKS_MD.write_text(update_docs(BENCHMARKS_MD.read_text(), records))
    README_MD.write_text(update_readme(README_MD.read_text(), records))


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


def record_kind(threads: int, allow_busy: bool = False) -> int:
    """Run every benchmark of `RECORDS` on this machine into docs/kinds/<kind>/, then collect and update the docs."""
    from ..records import cpu_kind, write_json
    kind = cpu_kind()['kind']
    folder = KINDS_DIR / kind
    began = time.monotonic()
    failed = []
    for name, _, arguments in RECORDS:
        out = folder / name
        argv = command_line(arguments, threads, out) + (['--allow-busy'] if allow_busy else [])
        print(f"[{(time.monotonic() - began) / 60:5.1f} min] {' '.join(argv)}", flush=True)
        before = out.stat().st_mtime_ns if out.exists() else None
        code = subprocess.call([sys.executable, '-m', 'structformer', *argv[1:]])
        if code or not out.exists() or out.stat().st_mtime_ns == before:      # failed, or refused as busy
            failed.append(name)
    record = collect(kind, folder)
    write_json(KINDS_DIR / f'{kind}.json', record)
    text = BENCHMARKS_MD.read_text()
    if START.format(kind=kind) not in text:
        text = text.rstrip() + f"\n\n{START.format(kind=kind)}\n{END}\n"
    BENCHMARKS_MD.write_text(text)
    write_docs()
    minutes = (time.monotonic() - began) / 60
    print(f"\nrecords of {kind} in {_display(folder)}, tables in {_display(BENCHMARKS_MD)} and "
          f"{_display(README_MD)}: {minutes:.1f} min"
          + (f"; not updated (failed, or refused because the machine was busy): {', '.join(failed)}" if failed else ''))
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog='python -m structformer.bench.kind_tables', description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest='action', required=True)
    rec = sub.add_parser('record', help="re-measure this CPU kind's records (quiet machine) and update the docs")
    rec.add_argument('--threads', type=int, default=1, help='torch threads for every benchmark (1)')
    rec.add_argument('--allow-busy', action='store_true',
                     help='write the records even from a busy run (their tables then say BUSY per goal)')
    sub.add_parser('render', help="rewrite every kind table in docs/benchmarks.md and README's speed table from "
                                  "docs/kinds/*.json")
    args = parser.parse_args(argv)
    if args.action == 'record':
        return record_kind(args.threads, args.allow_busy)
    write_docs()
    return 0


if __name__ == '__main__':
    sys.exit(main())
