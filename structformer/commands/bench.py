"""`structformer bench TARGET`: one row of `BENCH_TARGETS` per benchmark, a module in bench/ that defines
add_arguments(parser), run(args) -> int and, optionally, EXAMPLES; its module must not import torch at module
level (`structformer --help` builds every parser). Every benchmark ends with a line saying whether other work
shared the machine while it ran (bench/load.py)."""
from . import add_commands, run_command

DESCRIPTION = 'Benchmarks print measured ratios; they are not tests.'

EXAMPLES = """examples:
  structformer bench models                      # CRATE-T vs ViT-T, train/infer img/s and peak memory
  structformer bench models --batch-size 16 --img-size 224 --steps 5
  structformer bench attention --threads 1 --output outputs/bench/attention.json   # SOFT Fig. 1b sweep"""

BENCH_TARGETS = {
    'models': ('structformer.bench.models', 'CRATE-T vs ViT-T training / inference speed'),
    'attention': ('structformer.bench.attention', 'attention time / memory / FLOPs vs token count (SOFT Fig. 1b)'),
    'lowrank': ('structformer.bench.lowrank', 'dense vs factorised (W = UVᵀ) layer and ViT-S block stack step time / memory'),
    'mlp': ('structformer.bench.mlp', 'structured linear layers at equal width; Mixer Table S.3 (RP-Mixer vs SW-MLP)'),
    'sparse-attention': ('structformer.bench.sparse_attention', 'Sparsifiner MHSA paths vs dense SDPA: time and FLOPs vs n, keep'),
    'data': ('structformer.bench.data', 'loader images/s (decode + train transform): our folder and shards vs timm, '
             'against what a training step needs'),
    'gpu': ('structformer.bench.gpu', 'one GPU in one command: 224-px training img/s, SOFT and Sparsifiner vs SDPA, compiled'),
}


def add_arguments(p) -> None:
    targets = p.add_subparsers(dest='target', metavar='TARGET')
    targets.required = True
    add_commands(targets, BENCH_TARGETS)


def run(args) -> int:
    import os
    import tempfile

    from ..bench.load import start_watch, summary_line
    from ..functional.autotune import ENV_LOG
    watch = start_watch(getattr(args, 'threads', 0) or None)     # every benchmark says whether others were busy
    # the kernel choices of the benchmark's measuring subprocesses reach its record through one shared log
    handle, log = tempfile.mkstemp(prefix='structformer-choices-', suffix='.jsonl')
    os.close(handle)
    previous, os.environ[ENV_LOG] = os.environ.get(ENV_LOG), log
    try:
        status = run_command(BENCH_TARGETS, args.target, args)
    except KeyboardInterrupt as e:          # the CLI's line: a benchmark has records, not checkpoints
        e.said = 'a record is written whole at the end of a run, or not at all'
        raise
    finally:
        if previous is None:
            os.environ.pop(ENV_LOG, None)
        else:
            os.environ[ENV_LOG] = previous
        os.unlink(log)
    print(summary_line(watch.record()))
    return status
