"""How far each family's exported graphs are from eager torch (the numbers docs/export.md quotes): one model per
family saved as a weights folder and exported by `structformer.export.export` to ONNX and to torch.export, which
check the graph against eager torch at batch 1 and 3 (max |y - y_torch| / max |y_torch|) and report that error.
Weights: each model's initialisation with noise on its constant parameters (zero heads, unit LayerNorm gains), so
every output depends on every weight. An error does not depend on the machine's load; the record says the load.

    .venv/bin/python tools/export_errors.py --output docs/export/export_errors.json
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

import structformer  # noqa: F401  (registers the models)
from structformer.export import export
from structformer.export.graphs import randomised_constants, require_onnx
from structformer.models.factory import build_model
from structformer.records import cpu_model, environment, write_json
from structformer.weights import save_weights_folder

FACTORIZE = [{'name': 'factorize', 'kwargs': {'rank': 0.5}}]
# (label, registered name, model kwargs, transforms)
MODELS = [('CRATE', 'crate_digits', {}, []),
          ('SOFT (20 Newton-Schulz steps)', 'soft_digits', {}, []),
          ('Sparsifiner', 'sparsifiner_digits', {}, []),
          ('Sparsifiner DeiT-T, 224 px, keep 0.25', 'sparsifiner_deit_tiny_patch16_224', {'keep_ratio': 0.25}, []),
          ('Mixer', 'mixer_digits', {}, []),
          ('RP-Mixer', 'rp_mixer_digits', {}, []),
          ('SW-MLP', 'swmlp_digits', {}, []),
          ('low-rank ViT', 'vit_digits', {}, FACTORIZE),
          ('low-rank WRN', 'wrn_10_2_digits', {}, FACTORIZE)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--only', nargs='*', default=None, metavar='NAME',
                        help='registered names to measure (default: all)')
    parser.add_argument('--output', default=None, help='the JSON record to write')
    args = parser.parse_args(argv)
    require_onnx(runtime=True)
    print(f"{cpu_model()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for label, name, kwargs, transforms in MODELS:
            if args.only and name not in args.only:
                continue
            torch.manual_seed(0)
            model, recipe = build_model(name, kwargs, transforms=transforms)
            weights = save_weights_folder(randomised_constants(model), Path(folder) / name, recipe=recipe)
            row = {'family': label, 'model': name, 'model_kwargs': kwargs, 'transforms': transforms}
            for fmt, suffix in (('onnx', '.onnx'), ('torch-export', '.pt2')):
                start = time.perf_counter()
                report = export(weights, fmt, Path(folder) / f'{name}{suffix}')
                row[fmt] = {'max_relative_error': report['max_relative_error'],
                            'batch_sizes_checked': report['batch_sizes_checked'],
                            'seconds': round(time.perf_counter() - start, 1)}
            rows.append(row)
            print(f"{label}: ONNX Runtime {row['onnx']['max_relative_error']:.1e}, torch.export "
                  f"{row['torch-export']['max_relative_error']:.1e}", flush=True)
    if args.output:
        written = write_json(args.output, {'environment': environment('cpu'), 'command': ' '.join(sys.argv),
                                           'measure': 'max |y - y_torch| / max |y_torch| at batch 1 and 3',
                                           'rows': rows})
        print(f"wrote {written}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
