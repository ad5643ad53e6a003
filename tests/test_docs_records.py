"""The numbers the docs state equal the committed records they were made from.

Each table below is parsed from the markdown as a reader sees it and compared cell by cell with the JSON
record beside it, to the precision the table prints (half a unit of its last digit). A number retyped by
hand, a table left over from an earlier run, or a record replaced without its table fails here.
"""
import json
import re
import statistics
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / 'docs'
NUMBER = re.compile(r'-?\d+(?:\.\d+)?')


def tables(page: str) -> list:
    """Every markdown table of a page, as lists of cell lists (header first, the --- row dropped)."""
    found, current = [], []
    for line in (DOCS / page).read_text().splitlines():
        if line.startswith('|'):
            cells = [c.strip() for c in line.strip().strip('|').split('|')]
            if not all(set(c) <= set('-: ') for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    if current:
        found.append(current)
    return found


def table_with(page: str, header_start: str) -> list:
    matches = [t for t in tables(page) if ' | '.join(t[0]).startswith(header_start)]
    assert len(matches) == 1, f"{page}: {len(matches)} tables start with {header_start!r}"
    return matches[0]


def printed_equal(cell: str, value: float, index: int = 0) -> None:
    """The index-th number printed in `cell` equals `value` to the precision it is printed with."""
    numbers = NUMBER.findall(cell.replace(',', '').replace('−', '-'))
    assert len(numbers) > index, f"no number {index} in {cell!r}"
    text = numbers[index]
    decimals = len(text.split('.')[1]) if '.' in text else 0
    assert abs(float(text) - value) <= 0.5 * 10 ** -decimals + 1e-9, f"{cell!r}: record says {value}"


def record(path: str) -> dict:
    return json.loads((DOCS / path).read_text())


# ---- benchmarks.md ------------------------------------------------------------------------------------

@pytest.mark.parametrize('name, header', [('bench_models_bf16.json', 'model | params | train img/s fp32'),
                                          ('kinds/amd-avx512-bf16/models_bf16.json',
                                           'model | parameters | train img/s fp32')])
def test_bf16_table_is_the_committed_run(name, header):
    rows = record(name)['rows']
    table = table_with('benchmarks.md', header)[1:]
    labels = list(dict.fromkeys(r['label'] for r in rows))
    assert len(table) == len(labels)
    for cells, label in zip(table, labels):
        fp32, bf16 = (next(r for r in rows if r['label'] == label and r['dtype'] == d) for d in ('float32', 'bfloat16'))
        printed_equal(cells[1], fp32['params'] / 1e6)
        printed_equal(cells[2], fp32['train_img_per_s'])
        printed_equal(cells[3], bf16['train_img_per_s'])
        over = bf16['paired_over_float32']
        for i, key in enumerate(('ratio', 'ratio_q1', 'ratio_q3')):
            printed_equal(cells[4], over[key], i)
        printed_equal(cells[5], bf16['infer_over_float32'])
        printed_equal(cells[6], fp32['paired_train']['ratio'])
        printed_equal(cells[7], bf16['paired_train']['ratio'])


SOFT_NAMES = {'softmax (SDPA)': 'softmax', 'softmax (naive)': 'softmax_naive', 'Linformer': 'linformer',
              'Performer': 'performer', 'Nyströmformer': 'nystrom', 'SOFT': 'soft', 'SOFT++': 'softpp'}


def test_soft_attention_table_is_the_committed_sweep():
    rows = record('soft_attention_fig1b.json')['rows']
    names = {r['attention'] for r in rows}
    table = table_with('benchmarks.md', 'attention | n = 784 fwd')
    sizes = [int(NUMBER.findall(h.replace(',', ''))[0]) for h in table[0][1:4]]
    assert sizes == [784, 3136, 12544]
    for cells in table[1:]:
        name = SOFT_NAMES[cells[0]]
        assert name in names, (name, names)
        by_n = {r['tokens']: r for r in rows if r['attention'] == name}
        for cell, n in zip(cells[1:4], sizes):
            printed_equal(cell, by_n[n]['forward_ms'], 0)
            printed_equal(cell, by_n[n]['forward_backward_ms'], 1)
        printed_equal(cells[4], by_n[12544]['peak_mib'])


GPU_TABLES = {'gpu_h100_fp32_batch64.json': ('n | keep | dense SDPA ms | masked | gather', 197),
              'gpu_h100_fp32_n4097_batch8.json': ('n | keep | dense SDPA ms | masked | gather', 4097),
              'gpu_h100_bf16_batch64.json': ('n | keep | dense SDPA ms | masked | flex', None),
              'gpu_h100_bf16_batch64_forward_lists.json': ('n | keep | dense SDPA ms | flex', None)}


@pytest.mark.parametrize('name', sorted(GPU_TABLES))
def test_gpu_tables_are_their_records(name):
    header, first_n = GPU_TABLES[name]
    candidates = [t for t in tables('benchmarks.md') if ' | '.join(t[0]).startswith(header)
                  and (first_n is None or int(t[1][0]) == first_n)]
    assert len(candidates) == 1, name
    table = candidates[0]
    rows = {(r['tokens'], r['keep'], r['path']): r for r in record(f'sparsifiner/{name}')['rows']}
    checked = 0
    for cells in table[1:]:
        n, keep = int(cells[0]), float(cells[1])
        printed_equal(cells[2], rows[n, keep, 'dense SDPA']['ms'])
        for path, cell in zip(table[0][3:], cells[3:]):
            if cell == 'skip':
                assert (n, keep, path) not in rows or rows[n, keep, path].get('ms') is None
                continue
            printed_equal(cell, rows[n, keep, path]['ms'], 0)
            printed_equal(cell, rows[n, keep, path]['vs_dense'], 1)
            checked += 1
    assert checked >= 3 * len(table[1:])


def test_gpu_section_is_the_render_of_the_newest_gpu_record():
    """benchmarks.md's `bench gpu` section is exactly `render_markdown` of the newest record in docs/gpu/ (by the
    date in its name), or the sentence saying there is none yet (`structformer bench gpu --render RECORD --doc`)."""
    from structformer.bench.gpu_report import BEGIN, END, latest_record, render_markdown, section_of
    name, newest = latest_record(DOCS / 'gpu')
    rendered = render_markdown(newest, f'docs/gpu/{name}' if name else None)
    assert section_of((DOCS / 'benchmarks.md').read_text(), BEGIN, END) == rendered


# ---- mixer.md -----------------------------------------------------------------------------------------

def test_mixer_width_table_is_the_committed_study():
    rows = [r for r in record('mixer/reproduce_mixer.json')['rows'] if r['group'] == 'width']
    table = table_with('mixer.md', 'C | S | m = SC | S-Mixer | RP S-Mixer')
    for cells in table[1:]:
        channels, tokens, width = (int(c) for c in cells[:3])
        for kind, cell in zip(('S-Mixer', 'RP S-Mixer'), cells[3:5]):
            errors = [100 - r['val_top1'] for r in rows
                      if r['kind'] == kind and r['channels'] == channels and r['tokens'] == tokens]
            assert len(errors) >= 2 and all(r['width'] == width for r in rows if r['channels'] == channels
                                            and r['kind'] == kind)
            printed_equal(cell, statistics.mean(errors), 0)
            printed_equal(cell, min(errors), 1)
            printed_equal(cell, max(errors), 2)


# ---- data.md ------------------------------------------------------------------------------------------

@pytest.mark.parametrize('name, header', [('bench_data.json', 'transform | workers | our ImageFolder img/s'),
                                          ('bench_data_amd_avx512.json', 'transform | workers | ImageFolder img/s')])
def test_loader_table_is_the_committed_bench_data_run(name, header):
    rows = {(r['recipe'], r['workers'], r['loader']): r['images_per_s'] for r in record(name)['rows']}
    recipes = {'RRC + flip': 'rrc_flip', 'RRC + flip + RandAugment + erasing': 'rrc_flip_ra_re'}
    table = table_with('data.md', header)
    assert len(table) == 5
    for cells in table[1:]:
        recipe, workers = recipes[cells[0]], int(cells[1])
        ours, shards, timm = (rows[recipe, workers, kind] for kind in ('imagefolder', 'shards', 'timm'))
        for cell, value in zip(cells[2:], (ours, shards, timm, ours / timm, shards / timm)):
            printed_equal(cell, value)


# ---- the Sparsifiner CPU speed tables (benchmarks.md, sparsifiner.md) ----------------------------------

def _sparse_row(rec, n, keep, path):
    return next(r for r in rec['rows'] if r['tokens'] == n and r['keep'] == keep and r['path'] == path)


def test_sparse_attention_sweep_table_is_its_records():
    sweeps = {t: record(f'sparsifiner/cpu_sweep_t{t}.json') for t in (1, 2)}
    table = table_with('benchmarks.md', 'n | keep | realised density')
    assert len(table) == 13
    paths = ('block-kernel', 'block-gather', 'block-kernel core', 'block-gather core')
    for cells in table[1:]:
        n, keep = int(cells[0]), float(cells[1])
        printed_equal(cells[2], _sparse_row(sweeps[1], n, keep, 'block-kernel')['density'])
        printed_equal(cells[3], _sparse_row(sweeps[1], n, keep, 'block-kernel')['flops_vs_dense'], 0)
        printed_equal(cells[3], _sparse_row(sweeps[1], n, keep, 'block-kernel core')['flops_vs_dense'], 1)
        for cell, path in zip(cells[4:8], paths):
            for i, t in enumerate((1, 2)):
                printed_equal(cell, _sparse_row(sweeps[t], n, keep, path)['vs_dense'], i)
        for i, t in enumerate((1, 2)):
            printed_equal(cells[8], _sparse_row(sweeps[t], n, keep, 'dense SDPA')['ms'], i)


def test_sparsifiner_goal_table_is_its_records():
    table = table_with('sparsifiner.md', 'threads | block-kernel attention alone')
    assert [c[0] for c in table[1:]] == ['1', '2']
    for cells in table[1:]:
        runs = [record(f'sparsifiner/cpu_577_t{cells[0]}_run{r}.json') for r in (1, 2, 3)]
        for cell, path in zip(cells[1:4], ('block-kernel core', 'block-kernel', 'block-gather core')):
            for i, rec in enumerate(runs):
                printed_equal(cell, _sparse_row(rec, 577, 0.25, path)['vs_dense'], i)
        printed_equal(cells[4], _sparse_row(runs[0], 577, 0.25, 'block-kernel')['density'])
        assert all(rec['machine_load'] and not rec['machine_load']['busy'] for rec in runs)


# ---- crate.md -----------------------------------------------------------------------------------------

def test_demo_spread_table_is_its_record():
    """`make demo`'s top-1 across CPUs and threads (issue 45): the rows measured here, then the ones reported."""
    rec = record('crate/demo_spread.json')
    rows = rec['runs'] + rec['reported']
    table = table_with('crate.md', 'CPU | threads | final top-1')[1:]
    assert len(table) == len(rows)
    for cells, row in zip(table, rows):
        assert str(row['threads']) == cells[1]
        printed_equal(cells[2], row['final_val_top1'])
        printed_equal(cells[3], row['best_val_top1'])
    low, high = min(r['final_val_top1'] for r in rows), max(r['final_val_top1'] for r in rows)
    readme = (DOCS.parent / 'README.md').read_text()
    assert f"{low:.1f}–{high:.1f} % top-1 on digits" in readme and f"**{low:.1f}–{high:.1f} %**" in \
        (DOCS / 'crate.md').read_text()
