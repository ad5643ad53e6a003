"""`structformer reproduce PAPER`: one row of `REPRODUCE_TARGETS` per family, a module in reproduce/ that
defines add_arguments(parser), run(args) -> int and, optionally, EXAMPLES (else the examples here); its module
must not import torch at module level (`structformer --help` builds every parser)."""
from . import add_commands, run_command

DESCRIPTION = "Train the paper's comparison at a scale this machine runs."

EXAMPLES = """examples:
  structformer reproduce soft --data /data/mnist --epochs 1 --limit-train-batches 40
  structformer reproduce soft --data /data/mnist --attn softmax soft softpp --epochs 3 --output outputs/reproduce_soft"""

REPRODUCE_TARGETS = {
    'soft': ('structformer.reproduce.soft', 'SOFT Table 2 analogue: the Tiny backbone with each attention on MNIST'),
    'lowrank': ('structformer.reproduce.lowrank', 'low-rank training: inits, Frobenius decay vs L2, pre-training, '
                'interpolation (WRN on MNIST, GPT on the standard library)'),
    'mixer': ('structformer.reproduce.mixer', 'Mixer as a wide sparse MLP: fixed-Ω width, depth and init spectra on MNIST'),
    'crate': ('structformer.reproduce.crate', 'CRATE Fig. 3–5: R_c and sparsity per layer over training, depth 12 on MNIST'),
    'sparsifiner': ('structformer.reproduce.sparsifiner', 'Sparsifiner Tables 1 and 4: keep ratio vs accuracy and MHSA '
                    'FLOPs, against Linformer at equal budget, distilled from a dense ViT on MNIST'),
}


def add_arguments(p) -> None:
    papers = p.add_subparsers(dest='target', metavar='PAPER')
    papers.required = True
    add_commands(papers, REPRODUCE_TARGETS, epilog=EXAMPLES)


def run(args) -> int:
    return run_command(REPRODUCE_TARGETS, args.target, args)
