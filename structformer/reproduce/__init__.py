"""Reproductions of the papers' tables at a scale that runs on the embedded data.

Each module offers `add_arguments(parser)` and `run(args) -> int` for `structformer reproduce NAME`.
"""
