"""The command line's verbs: one module per verb, and `COMMANDS`, the one table of them.

A row names a module (by import path, so `structformer --help` imports only what builds parsers) and the verb's
one-line help. The module defines `add_arguments(parser)`, `run(args) -> int` and, optionally, `EXAMPLES` (the
epilog), `DESCRIPTION` and `FLAG_HINTS` (a flag of another tool, timm's `train.py`, that is not one of ours -> where
its setting is here). Flags are never abbreviated (`allow_abbrev=False`): timm's `--dataset` would otherwise be
read as our `--dataset-size`. `structformer bench TARGET` and `structformer reproduce PAPER` are tables of the same
shape (commands/bench.py, commands/reproduce.py), built and dispatched by the same two functions here.

Command modules sit on top of everything: no library module imports one (tests/test_layout.py). None of them
imports torch or timm at module level: `structformer --help` builds every parser (tests/test_lazy_imports.py).
"""
import argparse
import importlib
from typing import Dict, Optional, Tuple

Table = Dict[str, Tuple[str, str]]

COMMANDS: Table = {
    'train': ('structformer.commands.train', 'train any registered model on a dataset'),
    'eval': ('structformer.commands.eval', 'top-1 / top-5 / loss of a checkpoint'),
    'analyze': ('structformer.analysis.cli', 'white-box analysis of a CRATE checkpoint'),
    'bench': ('structformer.commands.bench', 'speed / memory benchmarks (ratios measured in one run)'),
    'reproduce': ('structformer.commands.reproduce', "small-scale reproductions of the papers' tables"),
    'compare': ('structformer.compare.cli', 'one table across the families: every model by one recipe, seeds, cost'),
    'data': ('structformer.commands.data', 'dataset tools: webdataset shards of an image folder, hfds, ImageNet, timm'),
    'design': ('structformer.design_cli', 'Mixer widths at a fixed number of connections Ω (Mixer paper §4.2)'),
    'models': ('structformer.commands.models', 'list registered models with parameter counts'),
    'convert': ('structformer.weights.cli', "the papers' public checkpoints (and timm's DeiT) into our models"),
    'export': ('structformer.export.cli', 'a trained model as ONNX, a torch.export program or a timm Hugging Face folder'),
    'recipes': ('structformer.commands.recipes', "the papers' training settings, for `structformer train --recipe NAME`"),
}


def add_commands(sub: argparse._SubParsersAction, table: Table, epilog: Optional[str] = None) -> None:
    """One sub-parser per row of `table`, in order: the row's help, the module's DESCRIPTION and EXAMPLES
    (else `epilog`), and the module's flags."""
    for name, (module_name, help_text) in table.items():
        module = importlib.import_module(module_name)
        parser = sub.add_parser(name, help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter,
                                description=getattr(module, 'DESCRIPTION', None),
                                epilog=getattr(module, 'EXAMPLES', epilog), allow_abbrev=False)
        parser.flag_hints = getattr(module, 'FLAG_HINTS', {})      # the CLI's net reads them (cli.unrecognized)
        module.add_arguments(parser)


def run_command(table: Table, name: str, args: argparse.Namespace) -> int:
    """The `run` of the row `name` (the verb or target the user typed), looked up when it runs."""
    return importlib.import_module(table[name][0]).run(args)
