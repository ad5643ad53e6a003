"""docs/leaderboard.md, rendered from a comparison's record (`render`), and each paper's headline claim checked
against the table (`claims`). tests/test_compare.py checks that the committed page is exactly the render of the
committed record.

A difference of two rows' top-1 is read against two standard errors of the difference, √(SE_a² + SE_b²), each
row's SE from its seeds where it has several finished ones, else the binomial standard error of its accuracy on the
held-out images.
Beyond that margin the claim agrees or disagrees; inside it the table cannot tell at this scale.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

from .record import markdown_table, reference_name

# the papers' headline claims that the table can check, with the paper's own numbers
PAPER = {
    'soft': 'SOFT Table 2 (ImageNet, Tiny backbone, equal parameters): SOFT 80.9 % vs softmax 80.0 % top-1, and '
            'faster training (1,730 vs 1,073 img/s) in less memory',
    'sparsifiner': 'Sparsifiner Table 4 (ImageNet, DeiT-S): at an equal attention budget, learned sparse connectivity '
                   'beats Linformer\'s low-rank projection',
    'lowrank': 'Low-rank training (seed 004): a factorised network keeps near-dense accuracy with fewer parameters and '
               'less compute; pre-training dense and then factorising helps the LM, not the WRN (Tables 2, 8-9)',
    'crate': 'CRATE (Table 1): a white-box transformer close to ViT accuracy at comparable parameters (CRATE-B 70.8 % '
             'vs ViT-S 72.4 % top-1 on ImageNet at 22.8M vs 22.05M parameters: 1.6 points below)',
    'mixer': 'MLP-Mixer as a wide sparse MLP (§5): random permutations (RP-Mixer) keep the Mixer\'s accuracy at the '
             'same connections, and a wider sparse MLP does better',
}


# how far below ViT the paper's CRATE is at equal parameters, in points (Table 1: CRATE-B 70.8 vs ViT-S 72.4): what
# "close to ViT accuracy" means in the paper's own numbers
CRATE_PAPER_GAP = 72.4 - 70.8


def record_command(set_name: str, data: str) -> str:
    """The one line that makes a set's record and publishes it (the data's path written as PATH)."""
    spec = data.partition(':')[0] + ':PATH' if ':' in data else data
    return (f"structformer compare --set {set_name} --data {spec} --jobs 2 --threads 1 --output "
            f"outputs/compare_{set_name} --publish docs")


def _row(record: Dict, key: str) -> Optional[Dict]:
    return next((r for r in record['rows'] if r['key'] == key and r.get('top1_mean') is not None), None)


def difference(a: Dict, b: Dict, held_out: int) -> Dict:
    """a's top-1 minus b's, its standard error and the reading: 'higher', 'lower' or 'no clear difference'."""
    delta = a['top1_mean'] - b['top1_mean']

    def binomial(row):
        p = row['top1_mean'] / 100
        return 100 * math.sqrt(p * (1 - p) / max(held_out, 1))
    # each row's own: its seeds' SE where it has several finished seeds, else the binomial one (a row left with one
    # seed, the others diverged, does not take away the other row's seed-to-seed spread)
    own = [(r['top1_se'], 'seeds') if r.get('top1_se') is not None else (binomial(r), 'binomial') for r in (a, b)]
    se = math.sqrt(own[0][0] ** 2 + own[1][0] ** 2)
    kinds = {kind for _, kind in own}
    basis = ('seeds' if kinds == {'seeds'} else f'binomial, {held_out} images' if kinds == {'binomial'}
             else f'seeds and binomial, {held_out} images')
    reading = 'higher' if delta > 2 * se else 'lower' if delta < -2 * se else 'no clear difference'
    return {'delta': delta, 'se': se, 'basis': basis, 'reading': reading}


def _vs(a: Dict, b: Dict, held_out: int) -> str:
    d = difference(a, b, held_out)
    return (f"{a['label']} {a['top1_mean']:.2f} % vs {b['label']} {b['top1_mean']:.2f} % "
            f"({d['delta']:+.2f} ± {d['se']:.2f}, {d['basis']}: {d['reading']})")


def _speed(a: Dict, b: Dict) -> str:
    if not (a.get('train_ms_per_image') and b.get('train_ms_per_image')):
        return 'not timed'
    return f"trains at {b['train_ms_per_image'] / a['train_ms_per_image']:.2f}× the speed of {b['label']}"


def _verdict(readings: List[str], want: str) -> str:
    if all(r == want for r in readings):
        return 'agrees'
    if any(r not in (want, 'no clear difference') for r in readings):
        return 'disagrees'
    return 'cannot tell at this scale' if all(r == 'no clear difference' for r in readings) else 'partly agrees'


def crate_verdict(crate: Dict, vit: Dict, held_out: int) -> str:
    """'CRATE is close to ViT' against the paper's own gap: agrees when CRATE's top-1 is above ViT's minus the gap
    by more than two standard errors of the difference, disagrees when it is below that by more than two, and
    cannot tell in between (a difference with wide error bars is no evidence of closeness)."""
    d = difference(crate, vit, held_out)
    margin = d['delta'] + CRATE_PAPER_GAP
    return 'agrees' if margin > 2 * d['se'] else 'disagrees' if margin < -2 * d['se'] else 'cannot tell at this scale'


def claims(record: Dict) -> List[Dict]:
    """Each paper's headline claim against the rows present: {'claim', 'paper', 'verdict', 'text'}."""
    held_out = int(record.get('data', {}).get('val_images') or 0)
    out = []
    vit = _row(record, 'vit')
    soft = [r for r in (_row(record, 'soft'), _row(record, 'softpp')) if r]
    if vit and soft:
        readings = [difference(r, vit, held_out)['reading'] for r in soft]
        text = '; '.join(f"{_vs(r, vit, held_out)}, {_speed(r, vit)}" for r in soft)
        out.append({'claim': 'SOFT vs softmax at equal parameters', 'paper': PAPER['soft'],
                    'verdict': _verdict(readings, 'higher'),
                    'text': text + ". Here SOFT is its own pyramid backbone and softmax timm's ViT, both at the "
                                   "budget; the paper swaps the attention inside one backbone (`reproduce soft`)."})
    sparse, linformer = _row(record, 'sparsifiner'), _row(record, 'vit_linformer')
    if sparse and linformer:
        d = difference(sparse, linformer, held_out)
        out.append({'claim': 'Sparsifiner vs Linformer at equal budget', 'paper': PAPER['sparsifiner'],
                    'verdict': _verdict([d['reading']], 'higher'),
                    'text': f"{_vs(sparse, linformer, held_out)}; k = B keys per query. Sparsifiner starts from the "
                            "trained ViT of its seed and trains as many epochs again, so it has had twice the training "
                            f"of every other row; {_speed(sparse, linformer)} (teacher excluded)."})
    lowrank = [r for r in record['rows'] if r['family'] == 'low-rank' and r.get('top1_mean') is not None]
    dense = [r for r in record['rows'] if r['family'] != 'low-rank' and r.get('top1_mean') is not None]
    if lowrank:
        parts, readings = [], []
        for r in lowrank:
            base = _row(record, r['role'].split()[-1])          # the dense row it is the factorisation of
            if r.get('train_ms_per_image') is None or base is None or base.get('train_ms_per_image') is None:
                continue
            better = [d for d in dense if d.get('train_ms_per_image') is not None
                      and d['train_ms_per_image'] <= r['train_ms_per_image'] and d['top1_mean'] >= r['top1_mean']]
            readings.append('higher' if not better else 'lower')
            parts.append(f"{r['label']}: {r['top1_mean']:.2f} % at {r['train_ms_per_image']:.3f} ms/image "
                         f"({r['train_ms_per_image'] / base['train_ms_per_image']:.2f}× the time of {base['label']}, "
                         f"{r['params'] / base['params']:.2f}× its parameters, {r['top1_mean'] - base['top1_mean']:+.2f} "
                         "points), " + ('on the accuracy-time front' if not better else
                                        'dominated by ' + ', '.join(d['label'] for d in better[:3])))
        for r in (r for r in lowrank if r.get('pretrained')):
            scratch = next((s for s in lowrank if not s.get('pretrained') and s['rank'] == r['rank']
                            and s['role'] == r['role']), None)
            if scratch:
                parts.append(f"pre-trained vs from the start at rank {r['rank']:g}: {_vs(r, scratch, held_out)}")
        if parts:
            out.append({'claim': 'low-rank at equal time rather than equal rank', 'paper': PAPER['lowrank'],
                        'verdict': _verdict(readings, 'higher'),
                        'text': '; '.join(parts) + '. "Dominated": a dense row is at least as accurate and no '
                                                   'slower per image.'})
    crate = _row(record, 'crate')
    if crate and vit:
        out.append({'claim': 'CRATE vs ViT at equal parameters', 'paper': PAPER['crate'],
                    'verdict': crate_verdict(crate, vit, held_out),
                    'text': f"{_vs(crate, vit, held_out)}, {_speed(crate, vit)}; 'close' read as no more than the "
                            f"paper's own {CRATE_PAPER_GAP:.1f} points below, beyond two standard errors."})
    mixer = _row(record, 'mixer')
    structured = [r for r in (_row(record, 'rp_mixer'), _row(record, 'swmlp')) if r]
    if mixer and structured:
        # the paper: RP-Mixer keeps the Mixer's accuracy at the same connections, the wider sparse MLP does better.
        # A difference within two standard errors is no evidence that a row keeps up (it is what too few images or
        # seeds give whatever the truth), so it reads 'cannot tell', as the CRATE claim's does; only a row below
        # by more than two standard errors disagrees.
        out.append({'claim': 'RP-Mixer and SW-MLP vs MLP-Mixer at equal parameters', 'paper': PAPER['mixer'],
                    'verdict': _verdict([difference(r, mixer, held_out)['reading'] for r in structured], 'higher'),
                    'text': '; '.join(_vs(r, mixer, held_out) for r in structured) + '.'})
    return out


def readings(record: Dict) -> List[str]:
    """What the table says about itself, beyond the papers' claims: lines for 'Reading this table'."""
    held_out = int(record.get('data', {}).get('val_images') or 0)
    out = []
    vit, linformer = _row(record, 'vit'), _row(record, 'vit_linformer')
    if vit and linformer and difference(linformer, vit, held_out)['reading'] == 'higher':
        # the same backbone, width and recipe with cheaper attention learns more: the softmax ViT is under-trained
        # here, which says more about the recipe than about its capacity
        seeds = ', '.join(f"{c['top1']:.2f}" for c in vit.get('cells', []) if c.get('top1') is not None)
        out.append(f"timm's softmax ViT trails the same ViT with Linformer attention ({_vs(linformer, vit, held_out)}"
                   f"{'; its seeds ' + seeds if seeds else ''}): at this size and under this one recipe softmax "
                   "attention has not finished learning, so a row compared with the ViT, and the rows built from it "
                   "(the attention swaps, Sparsifiner's teacher, the factorised ViTs), measure how each trains under "
                   "this recipe as much as what it can reach. The recipe is shared by design, not tuned per row.")
    return out


def _placeholders(record: Dict) -> str:
    """What the commands' placeholders stand for, where they appear (the record keeps no user's paths)."""
    said = ' '.join(str(record.get(key) or '') for key in ('record_command', 'command'))
    meant = [(f'`{word}`: {what}') for word, what in (
        ('mnist:PATH', "a folder of MNIST's four IDX files as downloaded"),
        ('DIR', 'the grid folder the record was made in (not committed)')) if word in said]
    return (' ' + '; '.join(meant) + '.') if meant else ''


def render(record: Dict, figures: str = 'leaderboard') -> str:
    """The leaderboard page of `record` (figures under the folder `figures`, relative to the page)."""
    recipe = record['recipe']
    data = record.get('data', {})
    placeholder = record.get('set') != 'mnist'
    lines = ['# Leaderboard: one table across the families', '']
    if placeholder:
        lines += [f"> **Placeholder.** This page is rendered from a `{record.get('set')}` record, a smoke-scale run, "
                  "not the MNIST comparison: its numbers say that the pipeline works, not which model is better. "
                  "The MNIST record (18 rows x 3 seeds, about 1.2 hours on two quiet cores by the dry run's CPU-time "
                  "estimate) and this page from it:", '', '```text', record_command('mnist', 'mnist:PATH'), '```',
                  '']
    lines += ['Every structured model beside its dense baselines, trained by one recipe on one split with the same '
              'seeds, sized to one parameter budget, and timed on one machine (`structformer compare`, '
              '[design](design.md)). Regenerate the record, its plots and this page with:', '',
              '```text', record['record_command'], '```', '',
              'Run again, it reuses what its folder holds only where that is still this code\'s: a finished cell is '
              'kept while its configuration and the stamp of the code that trained it (the release, timm\'s version '
              'and every source file that builds, feeds or trains a model: `records.source_digest`) are this '
              'command\'s, and the timings while theirs are; a cell trained by other code is kept, marked † in the '
              'table and named below it, and `--overwrite` trains it anew; timings taken by other code are taken '
              'again.', '',
              f"This record: `{record.get('command')}`." + _placeholders(record), '',
              f"- data: {data.get('kind')} ({data.get('train_images')} training / {data.get('val_images')} held-out "
              f"images{', the split follows the seed' if data.get('kind') == 'digits' else ''}); seeds "
              f"{', '.join(map(str, record['seeds']))}, shared by every row",
              f"- budget: {record['budget']:,} parameters, matched within ±15 % per row (a masked layer counts the "
              "weights its mask keeps); the low-rank rows are the matched ViT / WRN factorised, and say so"
              if record.get('budget') else '- sizes: the registry\'s (`--no-match`)',
              '- recipe (every cell): ' + ', '.join(f"{k} {v}" for k, v in sorted(recipe.items())),
              f"- trained on: {record['environment'].get('cpu')}, {record['environment'].get('threads')} thread(s), "
              f"torch {record['environment'].get('torch')}"
              + ''.join(f"; some cells on {other}" for other in record['environment'].get('others', [])), '',
              '## Table', '',
              'Top-1 on the held-out images after the last epoch: mean ± standard error over seeds, then each seed\'s. '
              'Speeds: one batch of training images, the row\'s own training step (forward, backward, optimiser) and '
              'inference forward, every row timed back to back in one process (paired rounds; ratio to the '
              f"{reference_name(record)} with its interquartile range). "
              'Memory: growth of the process\'s peak memory over three training steps, one '
              'process per row. FLOPs: FlopCounterMode of one image\'s forward (a multiply-add is 2; SDPA\'s CPU '
              'kernel by torch\'s SDPA formula; Sparsifiner\'s masked path computes the dense products; SOFT\'s Newton '
              'iterations stop at convergence, so its count is that of the first training image). Front: on the '
              'Pareto front of accuracy against training time per image (T) or parameters (P).', '',
              markdown_table(record).rstrip('\n'), '']
    for fix in record.get('corrections', []):              # a count fixed after the run, said where it is shown
        lines += [f"Corrected on {fix['date']}: {fix['text']}", '']
    for name in record.get('figures', []):
        lines.append(f"![{name.rsplit('.', 1)[0].replace('_', ' ')}]({figures}/{name})")
    lines += ['', '## The papers\' claims against this table', '']
    for c in claims(record):
        lines += [f"- **{c['claim']}: {c['verdict']}.** {c['text']} *Paper:* {c['paper']}."]
    notes = readings(record)
    if notes:
        lines += ['', '## Reading this table', ''] + [f"- {n}" for n in notes]
    if record.get('code'):                              # records from before the stamps say nothing here
        stale = [f"{r['key']}/seed_{c['seed']} ({c['stale']})" for r in record['rows'] for c in r['cells']
                 if c.get('stale')]
        lines += ['', f"Code: every cell's run and the timings are kept for reuse keyed on its configuration and the "
                      f"stamp of the code that made it (the release, timm's version and the source that builds, feeds "
                      f"and trains a model; this record's is `{record['code']['source']}`). Cells trained by other "
                      f"code, kept and marked † (`--overwrite` trains them anew): "
                      + ('; '.join(stale) if stale else 'none') + '.']
    lines += ['', 'Cells that did not finish: ' + (', '.join(
        f"{r['key']}/seed_{c['seed']} ({c['state']})" for r in record['rows'] for c in r['cells']
        if c['state'] != 'finished') or 'none') + '.', '']
    return '\n'.join(lines)
