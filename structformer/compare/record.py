"""The comparison's record: one JSON object, a markdown table and two plots with the Pareto front marked.

Per row: its model and constructor arguments, how its size was chosen and its parameters against the budget
(a masked layer counts the weights its mask keeps), FLOPs per image, held-out top-1 as the mean over seeds ± the
standard error of that mean (sample standard deviation / √n; none for one seed) and each seed's, the weight
average's top-1 where the recipe keeps one, training and inference images/s from the paired timing with the ratio
to the reference row and whether the machine was busy, and peak training memory. A row is on the Pareto front of
a plot when no other row is at least as accurate at no more cost, and better in one of the two.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple


def mean_se(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    """(mean, standard error of the mean) of `values`: SE = s / √n with s the sample standard deviation (n − 1);
    None where there is nothing to average (mean) or a single value (SE)."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def pareto_front(points: Sequence[Tuple[Optional[float], Optional[float]]]) -> List[bool]:
    """For (cost, accuracy) points, whether each is on the front: no other point has cost <= and accuracy >=
    with one of them strict. A point with a missing coordinate is not on it."""
    flags = []
    for i, (cost, acc) in enumerate(points):
        if cost is None or acc is None:
            flags.append(False)
            continue
        dominated = any(j != i and c is not None and a is not None and c <= cost and a >= acc and (c < cost or a > acc)
                        for j, (c, a) in enumerate(points))
        flags.append(not dominated)
    return flags


def summarise_row(row_facts: Dict, cells: List[Dict], speed: Optional[Dict], memory: Optional[Dict]) -> Dict:
    """One row of the record from its facts (model, kwargs, role, costs), its cells' results and its timings."""
    finished = [c for c in cells if c.get('state') == 'finished']
    top1, top1_se = mean_se([c['top1'] for c in finished])
    ema = [c['ema_top1'] for c in finished if c.get('ema_top1') is not None]
    ema_mean, ema_se = mean_se(ema) if ema else (None, None)
    row = dict(row_facts, seeds=[c['seed'] for c in cells], cells=cells, finished=len(finished),
               stale=sum(1 for c in cells if c.get('stale')),
               top1_mean=top1, top1_se=top1_se, ema_top1_mean=ema_mean, ema_top1_se=ema_se)
    train, infer = (speed or {}).get('train'), (speed or {}).get('infer')
    row['train_img_per_s'] = train['img_per_s'] if train else None
    row['infer_img_per_s'] = infer['img_per_s'] if infer else None
    row['train_ms_per_image'] = 1e3 / train['img_per_s'] if train else None
    row['train_ratio'] = {k: train[k] for k in ('ratio', 'ratio_q1', 'ratio_q3')} if train else None
    row['infer_ratio'] = {k: infer[k] for k in ('ratio', 'ratio_q1', 'ratio_q3')} if infer else None
    row['peak_train_mib'] = (memory or {}).get('peak_train_mib')
    row['memory_busy'] = ((memory or {}).get('machine_load') or {}).get('busy')
    return row


def mark_fronts(rows: List[Dict]) -> None:
    for name, cost in (('front_time', 'train_ms_per_image'), ('front_params', 'params')):
        flags = pareto_front([(r.get(cost), r.get('top1_mean')) for r in rows])
        for row, flag in zip(rows, flags):
            row[name] = flag


def _fmt_top1(mean, se) -> str:
    if mean is None:
        return '–'
    return f"{mean:.2f}" + (f" ± {se:.2f}" if se is not None else '')


def _count(n) -> str:
    if n is None:
        return '–'
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _size(row: Dict) -> str:
    budget = row.get('budget')
    share = f" ({row['params'] / budget - 1:+.0%})" if budget and row.get('params') else ''
    role = row['role']
    return f"{_count(row.get('params'))}{share}, {role}"


def reference_name(record: Dict) -> str:
    """The row the speed ratios are to: the ViT, or the grid's first timed row where it has no ViT."""
    reference = (record.get('speed') or {}).get('reference') or 'vit'
    return 'ViT' if reference == 'vit' else next((r['label'] for r in record['rows'] if r['key'] == reference),
                                                  reference)


def markdown_table(record: Dict) -> str:
    """The record's rows as one markdown table (the order of the set), fronts marked T (time) and P (parameters)."""
    speed = record.get('speed') or {}
    busy = (speed.get('machine_load') or {}).get('busy')
    lines = ['| model | parameters (vs budget), size | MFLOPs / image | top-1 % (mean ± SE) | per seed | EMA top-1 % '
             f"| train img/s | infer img/s | train ms / image | × {reference_name(record)} train (IQR) | peak train MiB "
             '| front |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for r in record['rows']:
        seeds = ', '.join('–' if c.get('top1') is None else f"{c['top1']:.2f}" for c in r['cells'])
        ratio = r.get('train_ratio')
        ratio_text = f"{ratio['ratio']:.2f} ({ratio['ratio_q1']:.2f}–{ratio['ratio_q3']:.2f})" if ratio else '–'
        front = ''.join(flag for flag, on in (('T', r.get('front_time')), ('P', r.get('front_params'))) if on)
        flops = f"{r['flops_per_image'] / 1e6:.2f}" if r.get('flops_per_image') is not None else '–'
        number = (lambda v, f: '–' if v is None else format(v, f))
        lines.append(
            f"| {r['label']}{' †' if r.get('stale') else ''} | {_size(r)} | {flops} | "
            f"{_fmt_top1(r['top1_mean'], r['top1_se'])} | {seeds} | "
            f"{_fmt_top1(r.get('ema_top1_mean'), r.get('ema_top1_se'))} | {number(r.get('train_img_per_s'), '.0f')} | "
            f"{number(r.get('infer_img_per_s'), '.0f')} | {number(r.get('train_ms_per_image'), '.3f')} | {ratio_text} | "
            f"{number(r.get('peak_train_mib'), '.0f')}{' BUSY' if r.get('memory_busy') else ''} | {front} |")
    env = speed.get('environment') or {}
    if speed:
        lines += ['', f"Speed: batch {speed.get('batch_size')}, {speed.get('rounds')} paired rounds, "
                      f"{env.get('threads')} thread(s) on {env.get('device')} ({env.get('cpu')}), torch "
                      f"{env.get('torch')}; machine {'BUSY while timing: re-measure in a quiet window' if busy else 'quiet'}."]
    return '\n'.join(lines) + '\n'


def label_offsets(points: Sequence[Tuple[float, float]], widths: Sequence[float], height: float = 8.0
                  ) -> List[Tuple[float, float]]:
    """Offsets (dx, dy) in points for labels beside `points` (positions in points; each label `widths[i]` wide
    and `height` high), so that no two labels overlap: from the highest point down, each label takes the first
    free place of right-above, right-below, left-above, left-below, then the same a line further down, and so on."""
    boxes: List[Tuple[float, float, float, float]] = []
    out: List[Tuple[float, float]] = [(4.0, 3.0)] * len(points)
    for i in sorted(range(len(points)), key=lambda i: -points[i][1]):
        (x, y), w = points[i], widths[i]
        for line in range(len(points) + 1):
            down = line * height
            for dx, dy in ((4.0, 3.0 - down), (4.0, -height - 3.0 - down), (-w - 4.0, 3.0 - down),
                           (-w - 4.0, -height - 3.0 - down)):
                box = (x + dx, y + dy, x + dx + w, y + dy + height)
                if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes):
                    break
            else:
                continue
            break
        boxes.append(box)
        out[i] = (dx, dy)
    return out


def plot_fronts(record: Dict, folder: Path) -> List[str]:
    """accuracy_vs_time.png and accuracy_vs_params.png, the Pareto front drawn as a line through its rows."""
    from ..records import write_png
    written = []
    for name, cost, front, xlabel, log in (
            ('accuracy_vs_time.png', 'train_ms_per_image', 'front_time', 'measured training time per image (ms)', False),
            ('accuracy_vs_params.png', 'params', 'front_params', 'parameters (a mask counts what it keeps)', True)):
        rows = [r for r in record['rows'] if r.get(cost) is not None and r.get('top1_mean') is not None]
        if not rows:
            continue

        def draw(plt, rows=rows, cost=cost, front=front, xlabel=xlabel, log=log):
            fig, ax = plt.subplots(figsize=(7.5, 5))
            families = sorted({r['family'] for r in rows})
            markers = dict(zip(families, 'osD^vP*XhH'))
            for r in rows:
                ax.errorbar(r[cost], r['top1_mean'], yerr=r.get('top1_se') or 0, fmt=markers[r['family']],
                            color='C3' if r.get(front) else 'C0', ms=7, capsize=3)
            if log:
                ax.set_xscale('log')
            ax.autoscale_view()
            to_points = 72 / fig.dpi                    # display pixels -> typographic points, as offsets are given
            at = [tuple(v * to_points for v in ax.transData.transform((r[cost], r['top1_mean']))) for r in rows]
            widths = [4.0 * len(r['key']) for r in rows]        # 7-point text: about 4 points a character
            for r, offset in zip(rows, label_offsets(at, widths)):
                ax.annotate(r['key'], (r[cost], r['top1_mean']), fontsize=7, xytext=offset,
                            textcoords='offset points')
            line = sorted((r[cost], r['top1_mean']) for r in rows if r.get(front))
            if line:
                ax.plot(*zip(*line), '--', color='C3', lw=1, label='Pareto front')
            for family in families:
                ax.plot([], [], markers[family], color='gray', label=family)
            ax.set_xlabel(xlabel)
            ax.set_ylabel('held-out top-1 % (mean ± SE over seeds)')
            ax.set_title(f"{record.get('title', 'compare')}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            return fig

        if write_png(folder / name, draw):
            written.append(name)
    return written
