"""ISTA's two paths at small batch: the fused product (one GEMM with the d×d effective matrix I + η(D − DᵀD) formed
every forward) against the three products of Eq. 17, which `ISTA.fusing_pays` picks when the rows R = B·N are at
most d. Each case runs the same CRATE model twice, as shipped and with every ISTA forced onto the fused path, timed
back to back (`bench.harness.paired_ratios`). The numbers quoted in docs/crate.md come from this script and its
record (`--output`: JSON with the environment and machine load; a busy run is kept out of docs/).

    .venv/bin/python tools/ista_paths.py --threads 1 --rounds 10 --output docs/crate/ista_paths.json
"""
import argparse
import copy
import sys

import timm
import torch

import structformer  # noqa: F401  (registers the models)
from structformer.bench.harness import paired_ratios
from structformer.bench.kinds import write_record
from structformer.bench.load import start_watch, summary_line
from structformer.layers import ISTA
from structformer.records import cpu_model, environment

CASES = [  # (label, model, image side, batch, training step?)
    ('CRATE-T, inference, 1 image of 224 px (197 rows, d 384)', 'crate_tiny_patch16_224', 224, 1, False),
    ('CRATE-B, inference, 1 image of 224 px (197 rows, d 768)', 'crate_base_patch16_224', 224, 1, False),
    ('CRATE-T, training step, 2 images of 64 px (34 rows, d 384)', 'crate_tiny_patch16_224', 64, 2, True),
]


def _always_fused(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, ISTA):
            module.fusing_pays = lambda x: True              # the instance's rule: fused at every batch
    return model


def _call(model, images, train: bool):
    if not train:
        def infer():
            with torch.no_grad():
                model(images)
        return infer
    model.train()
    optimizer = torch.optim.AdamW(model.parameters())
    targets = torch.zeros(images.shape[0], dtype=torch.long)

    def step():
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), targets).backward()
        optimizer.step()
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--threads', type=int, default=1, help='torch threads (default 1)')
    parser.add_argument('--rounds', type=int, default=10, help='back-to-back rounds per case (default 10)')
    parser.add_argument('--output', help='also write the rows as JSON here')
    args = parser.parse_args(argv)
    if args.threads < 1 or args.rounds < 1:
        parser.error('--threads and --rounds must be integers >= 1')
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    watch = start_watch(args.threads)
    print(f"{cpu_model()}, {args.threads} thread(s), torch {torch.__version__}, {args.rounds} paired rounds")
    rows = []
    for label, name, side, batch, train in CASES:
        shipped = timm.create_model(name, img_size=side).eval()
        fused = _always_fused(copy.deepcopy(shipped))
        images = torch.randn(batch, 3, side, side)
        result = paired_ratios({'fused': _call(fused, images, train), 'by rows': _call(shipped, images, train)},
                               'fused', args.rounds)
        ours = result['by rows']
        rows.append({'case': label, 'model': name, 'img_size': side, 'batch': batch, 'train': train,
                     'fused_ms': result['fused']['median_s'] * 1e3, 'by_rows_ms': ours['median_s'] * 1e3,
                     'speedup': ours['ratio'], 'speedup_q1': ours['ratio_q1'], 'speedup_q3': ours['ratio_q3']})
        print(f"{label}: fused {rows[-1]['fused_ms']:.1f} ms, by rows {rows[-1]['by_rows_ms']:.1f} ms, "
              f"speed-up {ours['ratio']:.2f}× ({ours['ratio_q1']:.2f}–{ours['ratio_q3']:.2f})")
    load = watch.record()
    print(summary_line(load))
    if args.output:
        written = write_record(args.output, {'environment': environment('cpu'), 'rounds': args.rounds, 'rows': rows,
                                             'machine_load': load})
        print(f"wrote {written}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
