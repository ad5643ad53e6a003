"""The goals and the markdown of a `structformer bench gpu` record (bench/gpu.py): pure functions of the record,
so docs/benchmarks.md's GPU section is `render_markdown` of the committed record, and tests/test_docs_records.py
checks exactly that. Only the standard library."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import List, Optional

ATTENTIONS = {'softmax': 'SDPA', 'soft': 'SOFT', 'softpp': 'SOFT++'}
GOAL_CRATE, GOAL_SOFT_FROM, GOAL_SOFT_AT, GOAL_SOFT_SPEEDUP, GOAL_SPARSE_N, GOAL_LOWRANK = (0.9, 8192, 50176, 4.0,
                                                                                            4097, 1.5)
BEGIN, END = '<!-- bench gpu: begin -->', '<!-- bench gpu: end -->'      # docs/benchmarks.md's generated section
NO_RECORD = ("No GPU record exists yet: `structformer bench gpu` has not run on a GPU. [gpu.md](gpu.md) gives the "
             "one command that runs the GPU test suite and this benchmark on a lent GPU in under 8 minutes.")


def _ok(row: Optional[dict], key: str) -> bool:
    return bool(row) and row.get('status') == 'ok' and row.get(key) is not None


def _forward(row: Optional[dict]) -> bool:
    """The forward was timed (an attention row's forward + backward may still have run out of memory)."""
    return bool(row) and row.get('status') in ('ok', 'oom') and row.get('forward_ms') is not None


def _model(rows, label, mode) -> Optional[dict]:
    return next((r for r in rows if r['section'] == 'models' and r['label'] == label and r['mode'] == mode), None)


def _attention(rows, name, tokens, mode) -> Optional[dict]:
    return next((r for r in rows if r['section'] == 'attention' and r['attention'] == name and r['mode'] == mode
                 and r['grid'][0] * r['grid'][1] == tokens), None)


def _pair(rows, label, reference) -> Optional[dict]:
    return next((r for r in rows if r['section'] == 'pairs' and r['subject']['label'] == label
                 and r['reference']['label'] == reference), None)


def _ratio_goal(rows, label, reference, target, name, text) -> dict:
    """A training-speed goal: images/s of `label` over `reference`'s, per mode. Eager, the paired row (both steps
    timed back to back in each round) is the measurement when it was taken; the `models` rows' ratio (each model
    timed in turn) only without it, as a host's drift between them moves it."""
    measured = {}
    pair = _pair(rows, label, reference)
    if _ok(pair, 'ratio'):
        measured['eager, paired'] = pair['ratio']
    for mode in ('eager', 'compiled') if 'eager, paired' not in measured else ('compiled',):
        a, b = _model(rows, label, mode), _model(rows, reference, mode)
        if _ok(a, 'train_img_per_s') and _ok(b, 'train_img_per_s'):
            measured[mode] = a['train_img_per_s'] / b['train_img_per_s']
    met = max(measured.values()) >= target if measured else None
    return {'goal': name, 'target': target, 'measured': measured, 'met': met, 'text': text}


def goals(rows: List[dict]) -> List[dict]:
    """The four goals, each {'goal', 'text', 'target', 'measured': {mode: value}, 'met': True / False / None
    (not measured)}. Ratios compare rows of the same mode; a goal is met if it is met eager or compiled."""
    out = [_ratio_goal(rows, 'CRATE-T', 'ViT-T', GOAL_CRATE, 'crate_over_vit',
                       f"CRATE-T trains at >= {GOAL_CRATE}x ViT-T's images/s (bfloat16)")]
    soft = {}
    for mode in ('eager', 'compiled'):
        speedups = {}
        for n in sorted({r['grid'][0] * r['grid'][1] for r in rows if r['section'] == 'attention'}):
            s, d = _attention(rows, 'soft', n, mode), _attention(rows, 'softmax', n, mode)
            if n >= GOAL_SOFT_FROM and _forward(s):
                if d and d.get('status') == 'oom' and not _forward(d):
                    speedups[n] = float('inf')             # SDPA's forward ran out of memory: SOFT wins outright
                elif _forward(d):
                    speedups[n] = d['forward_ms'] / s['forward_ms']
        if speedups:
            soft[mode] = speedups
    met = None
    if soft:
        met = any(all(v > 1 for v in s.values()) and s.get(GOAL_SOFT_AT, 0) >= GOAL_SOFT_SPEEDUP for s in soft.values())
    out.append({'goal': 'soft_over_sdpa', 'target': GOAL_SOFT_SPEEDUP, 'measured': soft, 'met': met,
                'text': f"SOFT's forward beats SDPA from {GOAL_SOFT_FROM:,} tokens and is >= {GOAL_SOFT_SPEEDUP:g}x "
                        f"faster at {GOAL_SOFT_AT:,}"})
    sparse = {f"{r['path']} ({r['mode']})": r['vs_dense'] for r in rows
              if r['section'] == 'sparse' and r.get('tokens') == GOAL_SPARSE_N and _ok(r, 'vs_dense')
              and r['path'] != 'dense SDPA' and not r['path'].endswith('core')}
    out.append({'goal': 'sparsifiner_at_4097', 'target': 1.0, 'measured': sparse,
                'met': (min(sparse.values()) <= 1.0) if sparse else None,
                'text': f"a Sparsifiner path at keep 0.25 is no slower than SDPA at n = {GOAL_SPARSE_N} (bfloat16, "
                        "time over SDPA's)"})
    out.append(_ratio_goal(rows, 'ViT-S factorised rank 0.25', 'ViT-S', GOAL_LOWRANK, 'lowrank_over_dense',
                           f"factorised ViT-S at rank 0.25 trains >= {GOAL_LOWRANK}x faster than dense ViT-S"))
    return out


def goal_line(goal: dict) -> str:
    state = {True: 'met', False: 'not met', None: 'not measured'}[goal['met']]
    if goal['goal'] == 'soft_over_sdpa':
        found = '; '.join(f"{mode}: " + ', '.join(f"{v:.2f}x at {n:,}" if v != float('inf') else f"SDPA OOM at {n:,}"
                                                  for n, v in sorted((int(n), v) for n, v in s.items()))
                          for mode, s in goal['measured'].items())
    else:
        found = ', '.join(f"{v:.2f}x {k}" for k, v in goal['measured'].items())
    return f"{goal['text']}: **{state}**" + (f" ({found})" if found else '')


# ---- the markdown --------------------------------------------------------------------------------------------

def _cell(row: Optional[dict], value: str) -> str:
    if row is None:
        return '-'
    if row.get('status') == 'oom':
        return 'OOM'
    if row.get('status') == 'not timed':
        return 'not timed'
    if row.get('status') != 'ok':
        return 'error'
    return value


def _model_table(rows, record) -> List[str]:
    s = record['settings']
    labels = list(dict.fromkeys(r['label'] for r in rows if r['section'] == 'models'))
    lines = [f"Training step (forward, cross-entropy, backward, AdamW), {s['img_size']} px, batch {s['batch_size']}, "
             f"{s['dtype']} autocast; peak = the most memory allocated during the steps (on a CPU: the resident set):", '',
             '| model | params (M) | img/s eager | peak GiB eager | img/s compiled | peak GiB compiled | compile s |',
             '|---|---|---|---|---|---|---|']
    for label in labels:
        e, c = _model(rows, label, 'eager'), _model(rows, label, 'compiled')
        params = next((r['params'] for r in (e, c) if _ok(r, 'params')), None)
        lines.append(' | '.join([
            f"| {label}", f"{params / 1e6:.2f}" if params else '-',
            _cell(e, f"{e['train_img_per_s']:.0f}" if _ok(e, 'train_img_per_s') else ''),
            _cell(e, f"{e['peak_gib']:.1f}" if _ok(e, 'peak_gib') else ''),
            _cell(c, f"{c['train_img_per_s']:.0f}" if _ok(c, 'train_img_per_s') else ''),
            _cell(c, f"{c['peak_gib']:.1f}" if _ok(c, 'peak_gib') else ''),
            _cell(c, f"{c['compile_s']:.0f}" if _ok(c, 'compile_s') else '')]) + ' |')
    return lines


def _pair_table(rows) -> List[str]:
    pairs = [r for r in rows if r['section'] == 'pairs']
    if not pairs:
        return []
    lines = ["The goals' pairs, eager, the two training steps timed back to back in each round (one process): "
             "images/s of the first over the second's, median of the rounds (quartiles), and each step's median ms:",
             '', '| pair | speed ratio | rounds | ms | reference ms |', '|---|---|---|---|---|']
    for r in pairs:
        if _ok(r, 'ratio'):
            cells = [f"{r['ratio']:.3f} ({r['ratio_q1']:.3f}–{r['ratio_q3']:.3f})", str(r['rounds']),
                     f"{r['subject_ms']:.1f}", f"{r['reference_ms']:.1f}"]
        else:
            cells = [_cell(r, '')] + ['-'] * 3
        lines.append(f"| {r['label']} | " + ' | '.join(cells) + ' |')
    return lines


def _attention_cell(r: Optional[dict]) -> str:
    if not _forward(r):
        return _cell(r, '')
    if r.get('forward_backward_ms') is None:
        return f"{r['forward_ms']:.2f} (fwd+bwd OOM)"
    return f"{r['forward_ms']:.2f} ({r['forward_backward_ms']:.2f}, {r['peak_mib']:.0f})"


def _attention_table(rows, record) -> List[str]:
    s = record['settings']
    tokens = sorted({r['grid'][0] * r['grid'][1] for r in rows if r['section'] == 'attention'})
    lines = [f"Attention alone (SOFT-Tiny stage 1: dim {s['attention_dim']}, {s['attention_heads']} heads, "
             f"m = {s['attention_landmarks']}; batch {s['attention_batch']}, {s['dtype']} autocast): forward ms "
             "(forward + backward ms, its peak MiB):", '',
             '| attention | ' + ' | '.join(f"n = {n:,}" for n in tokens) + ' |', '|---|' + '---|' * len(tokens)]
    graphs = any(r.get('compile_mode') == 'reduce-overhead' for r in rows if r['section'] == 'attention')
    compiled_label = ', compiled (CUDA graphs)' if graphs else ', compiled'
    for mode in ('eager', 'compiled'):
        for name, label in ATTENTIONS.items():
            cells = [_attention_cell(_attention(rows, name, n, mode)) for n in tokens]
            if any(c != '-' for c in cells):
                lines.append(f"| {label}{compiled_label if mode == 'compiled' else ''} | " + ' | '.join(cells) + ' |')
    return lines


def _parts(row: dict) -> str:
    """'; predictor 0.50x + tiles 0.40x': a core row's two parts, each against SDPA's time (bench sparse-attention)."""
    if row.get('predictor_vs_dense') is None or row.get('tiles_vs_dense') is None:
        return ''
    return f"; predictor {row['predictor_vs_dense']:.2f}x + tiles {row['tiles_vs_dense']:.2f}x"


def _sparse_table(rows, record, mode) -> List[str]:
    s = record['settings']
    mine = [r for r in rows if r['section'] == 'sparse' and r['mode'] == mode]
    if not mine:
        return []
    tokens = sorted({r['tokens'] for r in mine})
    paths = list(dict.fromkeys(r['path'] for r in mine if not r['path'].startswith('dense SDPA')))
    split = ("; in `core` rows also its predictor's and its tiles' times over SDPA's" if any(_parts(r) for r in mine)
             else '')
    title = ('eager (flex paths compile their kernel in any case)' if mode == 'eager'
             else 'the layer and the dense module both under torch.compile')
    lines = [f"Sparsifiner MHSA (DeiT-S layer: d 384, 6 heads, predictor included; batch {s['sparse_batch']}, "
             f"{s['dtype']}, inference), keep {mine[0]['keep']:g}, {title}: ms (time over dense SDPA's, realised key "
             f"density{split}); `core` rows: the attention alone against SDPA alone:", '',
             '| n | dense SDPA ms | ' + ' | '.join(paths) + ' |', '|---|---|' + '---|' * len(paths)]
    for n in tokens:
        dense = [r['ms'] if 'ms' in r and r['path'] == 'dense SDPA' else r.get('dense_ms')
                 for r in mine if r['tokens'] == n and _ok(r, 'ms' if r['path'] == 'dense SDPA' else 'dense_ms')]
        cells = [f"{statistics.median(dense):.2f}" if dense else '-']
        for path in paths:
            r = next((x for x in mine if x['tokens'] == n and x['path'] == path), None)
            value = (f"{r['ms']:.2f} ({r['vs_dense']:.2f}x, {r['density']:.3f}{_parts(r)})" if _ok(r, 'ms') and
                     r.get('density') is not None else '')
            if r and r.get('status') == 'ok' and not value:       # measure's own skip or failure note
                value = 'skipped (memory)' if str(r.get('note', '')).startswith('skipped') else 'did not run'
            cells.append(_cell(r, value))
        lines.append(f"| {n} | " + ' | '.join(cells) + ' |')
    return lines


def render_markdown(record: Optional[dict], where: Optional[str] = None) -> str:
    """The generated section of docs/benchmarks.md: the record's tables and goal verdicts (`where`: the record's
    path as the page names it), or NO_RECORD."""
    if record is None:
        return NO_RECORD
    env, rows = record['environment'], record['rows']
    head = (f"Record: `{where}`. " if where else '') + (
        f"{env['device']}, torch {env['torch']}, CUDA {env['cuda']}, {record['date']}: `{record['command']}`, "
        f"{record['wall_s']:.0f} s of its {record['budget_s']:.0f} s budget.")
    pairs = _pair_table(rows)
    parts = [head, '', *_model_table(rows, record), *([''] + pairs if pairs else []), '',
             *_attention_table(rows, record)]
    for mode in ('eager', 'compiled'):
        table = _sparse_table(rows, record, mode)
        if table:
            parts += ['', *table]
    parts += ['', 'Goals (judged by the bench, not tests):', '']
    parts += [f"- {goal_line(g)}" for g in record['goals']]
    if record.get('notes'):
        parts += ['', 'Notes: ' + '; '.join(record['notes'])]
    return '\n'.join(parts)


def latest_record(folder: Path) -> tuple:
    """(file name, record) of the newest record in `folder` (by the date in its name, then the name), or
    (None, None) when there is none."""
    import json
    found = sorted(Path(folder).glob('*.json'), key=lambda p: (p.stem.rsplit('_', 1)[-1], p.name)) \
        if Path(folder).is_dir() else []
    if not found:
        return None, None
    return found[-1].name, json.loads(found[-1].read_text())


def replace_section(page: str, rendered: str, begin: str, end: str) -> str:
    """`page` with the text between its `begin` and `end` markers replaced by `rendered`."""
    if page.count(begin) != 1 or page.count(end) != 1 or page.index(begin) > page.index(end):
        raise ValueError(f"the page must hold one {begin} ... {end} section")
    head, rest = page.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{rendered}\n{end}{tail}"


def section_of(page: str, begin: str, end: str) -> str:
    """The text between the markers (without the newlines that frame it)."""
    return page.split(begin, 1)[1].split(end, 1)[0].strip('\n')
