"""`python -m structformer.run_script SCRIPT.py ARGS...`: run a Python script with structformer's models registered
with timm, as `python SCRIPT.py ARGS...` would run it otherwise (same `sys.argv`, `__name__ == '__main__'`, the
script's folder first on `sys.path`).

For timm's `validate.py` and `inference.py`, which have no flag that imports a module (timm's `train.py` has one:
`--device-modules structformer`):

    python -m structformer.run_script validate.py --model local-dir:weights/crate_s --pretrained --data-dir /data/val
    python -m structformer.run_script inference.py --model crate_small_patch16_224 --checkpoint ckpt.pth.tar ...

Importing structformer installs the import hook that registers our models when timm is imported, so the script's
own `timm.create_model('crate_...')` finds them. docs/weights.md.
"""
import os
import runpy
import sys
from typing import List, Optional

USAGE = ("usage: python -m structformer.run_script SCRIPT.py [ARGS ...]\n"
         "runs SCRIPT.py (e.g. timm's validate.py or inference.py) with structformer's models registered with timm")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(USAGE)
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"structformer.run_script: error: SCRIPT {script}: no such file (give the path of timm's validate.py, "
              "inference.py or another script)", file=sys.stderr)
        return 2
    import structformer  # noqa: F401  (registers the models with timm when the script imports timm)
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name='__main__')
    return 0


if __name__ == '__main__':
    sys.exit(main())
