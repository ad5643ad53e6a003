"""`structformer reproduce crate`: CRATE's layer-wise compression and sparsity (Yu et al., 2023, §3.1, Fig. 3–5).

The paper's claim: in a trained CRATE each layer's MSSA step lowers the coding rate R_c of the tokens
against that layer's subspaces and each ISTA step makes them sparser, so R_c and ‖Z‖₀/(dN) fall with
depth, and this emerges over training (Fig. 4: flat at init, falling by the last epoch).

This trains a deeper CRATE (`crate_mnist` with depth 12 by default: d = 96, K = 6 heads of p = 16,
49 patch tokens + cls) on the real MNIST in --data (e.g. its 10,000 images: the first 8,000 train,
the last 2,000 held out) with the paper's recipe — Lion, weight decay 0.5 on every parameter (as the
official code), label smoothing 0.1, cosine schedule with warm-up — keeping every epoch's checkpoint.
It then measures, on `--num-samples` held-out images (1,000 as the paper), per layer and per saved
epoch: R_c with the chosen estimator (`official` by default, see `structformer.analysis.whitebox`),
R_c before and after each MSSA step, sparsity before and after each ISTA step, token norms and ‖U_k‖;
writes results.json, report.md (trained vs init, per-operator deltas, verdict) and curves.png
(R_c and sparsity per layer, one line per epoch, as Fig. 4).

The verdict is computed from the numbers: "reproduces" when the trained network's R_c (measured at the
MSSA input, as the official code's qkv hook) and sparsity at the last layer are below layer 1's AND below the
init network's at the last layer, each by more than two standard errors of the difference of the two means
over the measured images (a fall inside that is noise). It "cannot tell" when there is nothing to test: one
measured image (no standard error), or a network that did not learn (held-out top-1 within two binomial
standard errors of the most frequent class's share: a run too short reads as no result, not as a refutation).
A finished training run in --output is reused (its recipe must match), so `--report-only`-style
re-analysis costs only the measurement.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Dict, List, Optional

from . import command_line, learned, start, trained_on
from ..cli_args import thread_count
from ..records import environment, write_json, write_text

EXAMPLES = """examples:
  structformer reproduce crate --data /data/mnist --threads 1      # depth 12, 15 epochs (~20 min, 2 busy cores)
  structformer reproduce crate --data /data/mnist --depth 2 --epochs 1 --limit-train-batches 5 --num-samples 32 \\
      --output /tmp/crate_quick                                      # a smoke run"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument('--data', default=None, help='a folder of MNIST IDX files (required; see `structformer train --help` or docs/data.md for where to get them)')
    p.add_argument('--depth', type=int, default=12, help='CRATE layers L (default 12)')
    p.add_argument('--epochs', type=int, default=15)
    p.add_argument('--batch-size', type=int, default=64)
    p.add_argument('--lr', type=float, default=2.4e-4, help="Lion learning rate (the paper's ImageNet value)")
    p.add_argument('--weight-decay', type=float, default=0.5, help="(the paper's 0.5, every parameter decayed)")
    p.add_argument('--smoothing', type=float, default=0.1, help='label smoothing (0.1)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--limit-train-batches', type=int, default=0, help='0 = every batch')
    p.add_argument('--num-samples', type=int, default=1000, help='held-out images measured (1000, as the paper)')
    p.add_argument('--estimator', default='official', choices=['official', 'paper'],
                   help='R_c estimator (see structformer.analysis.whitebox; default official)')
    p.add_argument('--threads', type=thread_count, default=0,
                   help="torch threads (default: torch's own; 1 shares a busy machine far better)")
    p.add_argument('--output', default='outputs/reproduce_crate')


def _check(args) -> None:
    from ..analysis.whitebox import ESTIMATORS
    for flag in ('depth', 'epochs', 'batch_size', 'num_samples'):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.lr > 0 or args.weight_decay < 0 or not 0 <= args.smoothing < 1:
        raise ValueError(f"--lr must be > 0, --weight-decay >= 0, --smoothing in [0, 1); got {args.lr}, "
                         f"{args.weight_decay}, {args.smoothing}")
    if args.estimator not in ESTIMATORS:
        raise ValueError(f"--estimator {args.estimator!r}: accepted {', '.join(ESTIMATORS)}")


def _recipe(args) -> Dict:
    return dict(model='crate_mnist', model_kwargs={'depth': args.depth}, epochs=args.epochs,
                batch_size=args.batch_size, opt='lion', lr=args.lr, weight_decay=args.weight_decay,
                decay_everything=True, sched='cosine', warmup_epochs=min(1.0, args.epochs / 3),
                label_smoothing=args.smoothing, seed=args.seed, val_fraction=0.2,
                limit_train_batches=args.limit_train_batches, keep_last=1, save_every=1)


def _finished(run_dir: Path, recipe: Dict, spec: str) -> bool:
    """A run in `run_dir` that finished with this recipe on this data: its summary.json is written (last, when the run
    ends) and its checkpoint's configuration has the recipe's values and data."""
    summary = run_dir / 'summary.json'
    if not summary.is_file():
        return False
    from ..train.checkpoint import load_model
    _, state = load_model(run_dir)
    config = state.get('config') or {}
    return trained_on(config, spec) and all(config.get(k) == v for k, v in recipe.items() if k != 'data')


def _below(a: Dict, b: Dict, num_samples: int) -> bool:
    """Whether mean a is below mean b by more than two standard errors of their difference; a and b are
    {'mean', 'std'} over the same `num_samples` images, std the population one (measure_layers), so the sample
    standard deviation of the mean is std / √(n − 1). Fewer than two images give no standard error: never."""
    if num_samples < 2:
        return False
    se = math.sqrt((a['std'] ** 2 + b['std'] ** 2) / (num_samples - 1))
    return b['mean'] - a['mean'] > 2 * se


def _verdict(layers_trained: List[Dict], layers_init: List[Dict], num_samples: int,
             trained: Optional[Dict] = None) -> Dict:
    """The rule of the module docstring; `trained` (from `learned`) says whether there is a trained network to
    test at all: a run too short to learn, or one measured image, cannot tell either way."""
    if trained is not None and not trained['learned']:
        return {'R_c_falls': False, 'sparsity_falls': False, 'testable': False, 'text': (
            f"cannot tell at this scale: the network did not learn (held-out top-1 {trained['top1']:.2f}% is within "
            f"two standard errors, {trained['two_standard_errors']:.2f} points, of the most frequent class's share "
            f"{trained['majority_class']:.2f}%), so there is no trained network to test the claim on")}
    if num_samples < 2:
        return {'R_c_falls': False, 'sparsity_falls': False, 'testable': False,
                'text': 'cannot tell at this scale: one measured image gives no standard error (raise --num-samples)'}
    first, last, init_last = layers_trained[0], layers_trained[-1], layers_init[-1]
    falls = {m: _below(last[m], first[m], num_samples) and _below(last[m], init_last[m], num_samples)
             for m in ('R_c', 'sparsity')}
    rc_falls, sp_falls = falls['R_c'], falls['sparsity']
    rule = (f'below: by more than two standard errors over the {num_samples} measured image(s)')
    if rc_falls and sp_falls:
        text = ('reproduces: after training, R_c and the sparsity ‖Z‖₀/(dN) at the last layer are below layer 1 '
                'and below the random init at the last layer')
    elif rc_falls:
        text = ('partly reproduces: compression (R_c) falls with depth and below init, sparsity does not '
                '(last layer not below both layer 1 and init)')
    elif sp_falls:
        text = ('partly reproduces: sparsity falls with depth and below init, R_c does not '
                '(last layer not below both layer 1 and init)')
    else:
        text = 'does not reproduce: neither R_c nor sparsity at the last layer is below both layer 1 and init'
    return {'R_c_falls': rc_falls, 'sparsity_falls': sp_falls, 'testable': True, 'text': f'{text} ({rule})'}


def run(args: argparse.Namespace) -> int:
    _check(args)
    spec, output = start(args)
    import torch

    from ..analysis.samples import load_samples
    from ..train import TrainConfig, train
    run_dir = output / 'run'
    recipe = _recipe(args)
    if _finished(run_dir, recipe, spec):
        print(f'reusing the finished run in {run_dir}', flush=True)
    else:
        train(TrainConfig(data=spec, output=str(run_dir), **recipe), progress=False, overwrite=True)
    from ..analysis.curves import curves_table, measure_run, plot_curves   # after training: analysis code may change meanwhile
    summary = json.loads((run_dir / 'summary.json').read_text())
    images, info, idx = load_samples(spec, {}, args.seed, 0.2, args.num_samples, args.seed)
    curves = measure_run(run_dir, images, estimator=args.estimator)
    figure = plot_curves(curves, output / 'curves.png',
                         f'CRATE depth {args.depth} on MNIST: per layer over training ({args.estimator} R_c)')
    epochs = curves['epochs']
    from ..data import build_datasets
    held_out = build_datasets(spec, seed=args.seed, val_fraction=recipe['val_fraction'])[1]
    trained = learned(summary.get('final_val_top1'), [int(y) for y in held_out.targets])
    verdict = _verdict(curves['per_epoch'][-1]['layers'], curves['per_epoch'][0]['layers'], len(idx), trained)
    results = {'command': command_line(args, 'crate'), 'recipe': recipe, 'data': info.description,
               'num_samples': len(idx), 'estimator': args.estimator,
               'val_top1': summary.get('final_val_top1'), 'best_val_top1': summary.get('best_val_top1'),
               'epochs': epochs, 'curves': curves, 'learned': trained, 'verdict': verdict, 'figure': figure.name,
               'environment': environment(torch.device('cpu'))}
    write_json(output / 'results.json', results, default=str)
    lines = [f'# reproduce crate: CRATE depth {args.depth} on MNIST ({info.description})', '',
             f"recipe: {json.dumps(recipe)}", '',
             f"held-out top-1: {summary.get('final_val_top1'):.2f}% (best {summary.get('best_val_top1'):.2f}%); "
             f"measured on {len(idx)} held-out images, estimator `{args.estimator}`", '',
             curves_table(curves), '', f'**Verdict: {verdict["text"]}.**', '', f'![curves]({figure.name})']
    write_text(output / 'report.md', '\n'.join(lines) + '\n')
    print('\n'.join(lines[4:-2]))
    print(f"wrote {output / 'results.json'}, {output / 'report.md'} and {figure}")
    return 0
