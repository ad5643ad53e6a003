"""`structformer reproduce sparsifiner`: Sparsifiner's accuracy / MHSA-FLOPs trade-off (Wei et al., CVPR 2023,
Table 1 and Table 4) at MNIST scale.

The paper converts an ImageNet-pretrained DeiT-S / LV-ViT-S and trains 5 epochs of stage 1 (the predictor
alone on attention distillation) and 40 of stage 2 (everything, CE + token + logit distillation). Here:

  teacher     `vit_mnist` (d = 96, 6 blocks, 3 heads, patch 4: 49 + 1 tokens) trained on the real MNIST at
              --data (e.g. the MNIST test set: the first 8,000 of its 10,000 images train, the last 2,000 are held out);
  sparsifiner `sparsifiner_mnist` (the same network plus the predictor, n_down = 16) started from the
              teacher's weights, stage 1 then stage 2, at each keep ratio (B = ⌈keep · 50⌉ keys per query);
  linformer   the same backbone with Linformer attention at rank k = B (Table 4: "the low-rank dimension of
              Linformer equals the sparse budget"), started from the teacher, every epoch in stage 2's recipe
              (it has no predictor to train alone);
  dense       the teacher fine-tuned with stage 2's recipe for as many epochs: the accuracy a student is
              compared with, so that extra training is not mistaken for the method's effect.

Per row: held-out top-1, MHSA FLOPs per image (the paper's count: projections, predictor, and QKᵀ / ÃV at
the kept entries only) and the measured time of one attention layer (inference, its `auto` path).
Verdicts, computed from the numbers, each read against two standard errors (2 SE) of a difference of two
accuracies on the held-out set (binomial, one seed): (1) "small accuracy drop at keep 0.25" (the paper: ≤ 0.4
points on ImageNet; our bar max(0.4, 0.5)): holds when the drop plus 2 SE is inside the bar, does not hold when
the drop minus 2 SE is beyond it, and otherwise cannot tell at this scale; (2) "better than Linformer at equal
budget": holds when Sparsifiner's top-1 is above Linformer's by more than 2 SE at every keep ratio, does not
hold when it is below by more than 2 SE at one, and otherwise cannot tell. `holds` is True, False or None
(cannot tell); a difference inside its noise is never read as a result, and neither is a run whose teacher did not
learn (held-out top-1 within two binomial standard errors of the most frequent class's share, `reproduce.learned`):
both claims then cannot tell.
Finished runs in --output are reused when their recipe matches.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Dict, List, Optional

from . import check_distinct, command_line, learned, start, trained_on
from ..cli_args import thread_count
from ..records import environment, label_axes, write_json, write_png, write_text

EXAMPLES = """examples:
  structformer reproduce sparsifiner --data /data/mnist --threads 1    # the study (about 65 min at 1 thread)
  structformer reproduce sparsifiner --data /data/mnist --teacher-epochs 1 --epochs 2 --keep 0.25 \\
      --limit-train-batches 3 --output /tmp/sparsifiner_quick                                     # a smoke run"""

SEQ_LEN = 50                     # 49 patches + cls of a 28 px image at patch 4
PAPER_DROP = 0.4                 # the paper's "small accuracy drop": ≤ 0.4 top-1 points from DeiT-S on ImageNet
PREDICTOR_OPTIONS = ('up_basis', 'stage1', 'basis_init', 'predictor_dim', 'tau', 'up_threshold')


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument('--data', default=None, help='a folder of MNIST IDX files (required; see `structformer train --help` or docs/data.md for where to get them)')
    p.add_argument('--keep', type=float, nargs='+', default=[0.1, 0.25, 0.5], help='keep ratios (0, 1]')
    p.add_argument('--teacher-epochs', type=int, default=15, help='epochs of the dense teacher (15)')
    p.add_argument('--epochs', type=int, default=6, help='epochs of every student, both stages (6)')
    p.add_argument('--predictor-epochs', type=int, default=1, help='of which stage 1 (1)')
    p.add_argument('--batch-size', type=int, default=64)
    p.add_argument('--lr', type=float, default=2e-3, help='AdamW peak learning rate of the teacher (2e-3)')
    p.add_argument('--student-lr', type=float, default=5e-4, help='AdamW peak learning rate of the students')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--limit-train-batches', type=int, default=0, help='0 = every batch')
    p.add_argument('--threads', type=thread_count, default=0,
                   help="torch threads (default: torch's own; 1 shares a busy machine far better)")
    p.add_argument('--output', default='outputs/reproduce_sparsifiner')


def _check(args) -> None:
    for flag in ('teacher_epochs', 'epochs', 'batch_size'):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0 <= args.predictor_epochs < args.epochs:
        raise ValueError(f"--predictor-epochs must be in [0, --epochs={args.epochs}), got {args.predictor_epochs}")
    check_distinct([f'{k:g}' for k in args.keep], '--keep')     # as the run folders name them (sparsifiner_0.25)
    for keep in args.keep:
        if not 0 < keep <= 1:
            raise ValueError(f"--keep {keep}: keep ratios must be in (0, 1]")
    if args.limit_train_batches < 0:
        raise ValueError(f"--limit-train-batches must be >= 0, got {args.limit_train_batches}")
    if not args.lr > 0 or not args.student_lr > 0:
        raise ValueError(f"--lr and --student-lr must be > 0, got {args.lr}, {args.student_lr}")


def _common(args) -> Dict:
    return dict(batch_size=args.batch_size, weight_decay=0.05, label_smoothing=0.1, seed=args.seed, val_fraction=0.2,
                limit_train_batches=args.limit_train_batches, keep_last=1)


def _rows(args, teacher_dir: Path) -> List[Dict]:
    """(label, kind, keep, config values) of every student."""
    student = dict(_common(args), epochs=args.epochs, lr=args.student_lr, teacher=str(teacher_dir))
    rows = [dict(label='dense (fine-tuned teacher)', kind='dense', keep=1.0,
                 config=dict(student, model='vit_mnist', predictor_epochs=0))]
    for keep in args.keep:
        budget = math.ceil(keep * SEQ_LEN - 1e-9)
        rows.append(dict(label=f'Sparsifiner keep {keep:g} (B = {budget})', kind='sparsifiner', keep=keep,
                         config=dict(student, model='sparsifiner_mnist', model_kwargs={'keep_ratio': keep},
                                     predictor_epochs=args.predictor_epochs)))
        rows.append(dict(label=f'Linformer k = {budget}', kind='linformer', keep=keep,
                         config=dict(student, model='vit_mnist', predictor_epochs=0,
                                     transforms=[{'name': 'swap_attention',
                                                  'kwargs': {'attn': 'linformer', 'num_landmarks': budget}}])))
    return rows


TEACHER_STAMP = 'teacher_summary.sha256'    # in a student's folder: the teacher's summary.json it was distilled from


def _teacher_stamp(config: Dict) -> str:
    """The sha256 of the summary.json of the teacher a student config names ('' for none). A retrained teacher
    writes a new summary (its timings and metrics), so a student stamped with the old one is not reused."""
    import hashlib
    teacher = config.get('teacher')
    summary = Path(teacher) / 'summary.json' if teacher else None
    return hashlib.sha256(summary.read_bytes()).hexdigest() if summary is not None and summary.is_file() else ''


def _finished(run_dir: Path, config: Dict, spec: str) -> bool:
    """A run in `run_dir` that finished with `config` on `spec`, and, for a student, from the teacher now in
    --output (its `TEACHER_STAMP`): the teacher's path is the same after --teacher-epochs or --lr change and the
    teacher retrains, so comparing the config alone reused students distilled from the old teacher."""
    summary = run_dir / 'summary.json'
    if not summary.is_file():
        return False
    if config.get('teacher'):
        stamp = run_dir / TEACHER_STAMP
        if not stamp.is_file() or stamp.read_text().strip() != _teacher_stamp(config):
            return False
    import yaml
    saved = yaml.safe_load((run_dir / 'config.yaml').read_text()) or {}
    if not trained_on(saved, spec):
        return False
    for key, value in config.items():
        if key in ('data', 'teacher', 'output'):
            continue
        if key == 'transforms':
            if [(t['name'], t.get('kwargs')) for t in saved.get(key) or []] != [(t['name'], t['kwargs']) for t in value]:
                return False
        elif saved.get(key) != value:
            return False
    return json.loads(summary.read_text()).get('epochs') == config['epochs']


def _train(config: Dict, run_dir: Path, spec: str) -> Dict:
    from ..train import TrainConfig, train
    if _finished(run_dir, config, spec):
        print(f'reusing the finished run in {run_dir}', flush=True)
    else:
        print(f'training {run_dir.name} ...', flush=True)
        train(TrainConfig(data=spec, output=str(run_dir), **config), progress=False, overwrite=True)
        if config.get('teacher'):
            write_text(run_dir / TEACHER_STAMP, _teacher_stamp(config) + '\n')
    return json.loads((run_dir / 'summary.json').read_text())


def _attention_ms(model, batch: int = 64) -> float:
    """Median inference time of the first attention layer on this model's token count (ms)."""
    import torch
    from ..bench.harness import median_seconds
    layer = model.blocks[0].attn.eval()
    x = torch.randn(batch, SEQ_LEN, model.embed_dim)
    with torch.no_grad():
        return 1e3 * median_seconds(lambda: layer(x), repeats=7, warmup=2)


def _predictor_options(model) -> Dict:
    """The Sparsifiner options a row was trained with (public code's or ours, docs/sparsifiner.md), {} for others."""
    from ..layers.attention.sparsifiner import SparsifinerAttention
    layer = next((m for m in model.modules() if isinstance(m, SparsifinerAttention)), None)
    if layer is None:
        return {}
    options = {name: getattr(layer, name, None) for name in PREDICTOR_OPTIONS if name != 'basis_init'}
    options['basis_init'] = layer.basis.init
    options['predictor_dim'] = layer.predictor_q.out_features if layer.predictor_q is not None else None
    return {'predictor': options}


def _mhsa_flops(model) -> Dict[str, float]:
    from ..bench.sparse_flops import model_mhsa_flops
    return model_mhsa_flops(model, seq_len=SEQ_LEN)


SMALL_DROP_BAR = 0.5              # our bar for the "small drop" at this scale (the paper's 0.4, rounded up)


def _two_se(a: float, b: float, val_images: int) -> float:
    """Two binomial standard errors, in points, of the difference of two top-1 % on `val_images` images."""
    p1, p2 = a / 100, b / 100
    return 200 * math.sqrt((p1 * (1 - p1) + p2 * (1 - p2)) / max(val_images, 1))


def _reading(holds) -> str:
    return 'holds' if holds else 'cannot tell at this scale' if holds is None else 'does not hold'


def _verdicts(rows: List[Dict], val_images: int, teacher: Optional[Dict] = None) -> Dict:
    """The two claims of the module docstring. `teacher` (`reproduce.learned` of the teacher's held-out top-1): every
    student is converted from the teacher, as the paper converts a trained DeiT-S; a teacher that did not learn leaves
    nothing to test (a run too short reads as no result, not as a refutation), so both claims cannot tell."""
    dense = next(r for r in rows if r['kind'] == 'dense')
    by_keep = {}
    for r in rows:
        by_keep.setdefault(r['keep'], {})[r['kind']] = r
    out = {}
    if teacher is not None and not teacher['learned']:
        text = (f"cannot tell at this scale: the teacher did not learn (held-out top-1 {teacher['top1']:.2f}% is "
                f"within two standard errors, {teacher['two_standard_errors']:.2f} points, of the most frequent class's share "
                f"{teacher['majority_class']:.2f}%), so its students test no conversion of a trained network")
        return {claim: {'holds': None, 'text': text} for claim in ('small_drop_at_0.25', 'beats_linformer')}
    if 0.25 in by_keep and 'sparsifiner' in by_keep[0.25]:
        s = by_keep[0.25]['sparsifiner']
        drop = dense['top1'] - s['top1']
        two_se = _two_se(dense['top1'], s['top1'], val_images)
        holds = True if drop + two_se <= SMALL_DROP_BAR else False if drop - two_se > SMALL_DROP_BAR else None
        paper = drop <= PAPER_DROP
        out['small_drop_at_0.25'] = {
            'holds': holds, 'drop_points': drop, 'two_standard_errors': two_se, 'bar_points': SMALL_DROP_BAR,
            'paper_bar_points': PAPER_DROP, 'holds_at_paper_bar': paper,
            'text': (f"{_reading(holds)}: keep 0.25 reaches {s['top1']:.2f}% against {dense['top1']:.2f}% dense, a "
                     f"drop of {drop:.2f} ± {two_se:.2f} points (2 SE, {val_images} held-out images) against our bar "
                     f"of {SMALL_DROP_BAR} (the paper's: ≤ {PAPER_DROP} points on ImageNet; the point estimate is "
                     f"{'inside' if paper else 'outside'} it)")}
    else:                       # said, not left out: a report without the line reads as if nothing was claimed
        out['small_drop_at_0.25'] = {'holds': None, 'text': "not tested: --keep has no 0.25, the keep ratio of the "
                                                            "paper's small-drop claim (add it to test the claim)"}
    margins = {k: v['sparsifiner']['top1'] - v['linformer']['top1'] for k, v in by_keep.items()
               if 'sparsifiner' in v and 'linformer' in v}
    if margins:
        noise = {k: _two_se(v['sparsifiner']['top1'], v['linformer']['top1'], val_images) for k, v in by_keep.items()
                 if k in margins}
        if all(m > noise[k] for k, m in margins.items()):
            holds = True
        elif any(m < -noise[k] for k, m in margins.items()):
            holds = False
        else:
            holds = None
        out['beats_linformer'] = {
            'holds': holds, 'margins_points': margins, 'two_standard_errors': noise,
            'text': (f"{_reading(holds)}: Sparsifiner minus Linformer top-1 at equal budget (± 2 SE, {val_images} "
                     "held-out images): " + ', '.join(f'keep {k:g}: {m:+.2f} ± {noise[k]:.2f}'
                                                      for k, m in sorted(margins.items())))}
    return out


def _plot(rows: List[Dict], path: Path) -> bool:
    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        for kind, marker in (('sparsifiner', 'o'), ('linformer', 's'), ('dense', '*')):
            pts = sorted((r['mhsa_mflops'], r['top1']) for r in rows if r['kind'] == kind)
            if pts:
                ax.plot(*zip(*pts), marker=marker, label=kind, linestyle='-' if len(pts) > 1 else 'none')
        label_axes(ax, 'MHSA MFLOPs per image (sparse count)', 'held-out top-1 (%)',
                   'Sparsifiner vs Linformer on MNIST (vit_mnist backbone)')
        ax.grid(alpha=0.3)
        ax.legend()
        return fig
    return write_png(path, draw)


def run(args: argparse.Namespace) -> int:
    _check(args)
    spec, output = start(args)
    import torch

    from ..train.checkpoint import load_model
    teacher_dir = output / 'teacher'
    teacher_config = dict(_common(args), model='vit_mnist', epochs=args.teacher_epochs, lr=args.lr)
    teacher_summary = _train(teacher_config, teacher_dir, spec)
    results = []
    from ..bench.load import LoadWatch, row_flag
    watch = LoadWatch(torch.get_num_threads())
    for row in _rows(args, teacher_dir):
        run_dir = output / f"{row['kind']}_{row['keep']:g}"
        summary = _train(row['config'], run_dir, spec)
        model, _ = load_model(run_dir)
        flops = _mhsa_flops(model)
        mark = watch.mark()                  # was the machine busy while the layer was timed? (bench/load.py)
        attention_ms = _attention_ms(model)
        results.append({'label': row['label'], 'kind': row['kind'], 'keep': row['keep'], 'run': run_dir.name,
                        'top1': summary['final_val_top1'], 'best_top1': summary['best_val_top1'],
                        'mhsa_mflops': flops['mhsa'] / 1e6, 'total_mflops': flops['total'] / 1e6,
                        'attention_ms': attention_ms, 'load': watch.since(mark), **_predictor_options(model)})
    from ..data import build_datasets
    held_out = build_datasets(spec, seed=args.seed, val_fraction=0.2)[1]
    val_images = len(held_out)
    verdicts = _verdicts(results, val_images, learned(teacher_summary['final_val_top1'],
                                                      [int(y) for y in held_out.targets]))
    dense = next(r for r in results if r['kind'] == 'dense')
    header = ('| model | top-1 % (best) | Δ vs dense | MHSA MFLOPs | vs dense | total MFLOPs | attention layer ms '
              '(batch 64) |\n|---|---|---|---|---|---|---|')
    lines = [f"| {r['label']} | {r['top1']:.2f} ({r['best_top1']:.2f}) | {r['top1'] - dense['top1']:+.2f} | "
             f"{r['mhsa_mflops']:.2f} | {r['mhsa_mflops'] / dense['mhsa_mflops']:.2f}× | {r['total_mflops']:.1f} | "
             f"{r['attention_ms']:.2f}{row_flag(r['load'])} |" for r in results]
    figure = output / 'pareto.png'
    drew = _plot(results, figure)
    report = [f'# reproduce sparsifiner on MNIST ({spec})', '',
              f"teacher vit_mnist: {teacher_summary['final_val_top1']:.2f}% after {args.teacher_epochs} epochs; "
              f"students: {args.epochs} epochs ({args.predictor_epochs} of stage 1), lr {args.student_lr}", '',
              header, *lines, '', *[f"**{k}: {v['text']}.**" for k, v in verdicts.items()]]
    busy = [r['label'] for r in results if r['load'].get('busy')]
    if busy:
        report += ['', f"BUSY: other processes used the cores while the attention layer of {', '.join(busy)} was "
                       "timed: its ms are not comparable; re-run on a quiet machine."]
    if drew:
        report += ['', f'![pareto]({figure.name})']
    write_text(output / 'report.md', '\n'.join(report) + '\n')
    write_json(output / 'results.json', {'command': command_line(args, 'sparsifiner'), 'teacher': teacher_summary,
                                          'rows': results, 'verdicts': verdicts,
                                          'args': {k: v for k, v in vars(args).items() if k != 'func'},
                                          'environment': environment(torch.device('cpu'))}, default=str)
    print('\n'.join(report))
    print(f"wrote {output / 'report.md'}, {output / 'results.json'}" + (f' and {figure}' if drew else ''))
    return 0
