"""What onnxscript's graph optimiser costs and buys in an ONNX export (the numbers docs/export.md quotes): the same
model exported by `torch.onnx.export(dynamo=True)` with `optimize=False` and with `optimize=True` (the exporter's
default, which `structformer export` keeps); for each, the export's seconds, the graph's node count, ONNX Runtime's
median time over `--rounds` calls (CPU provider, after one warm-up call, the two graphs' calls alternated) and its
error against eager torch. Writes `--output` (JSON with the environment and machine load; a busy run is kept out of docs/).

    .venv/bin/python tools/onnx_export_cost.py --model soft_tiny_224 --output docs/export/onnx_soft_tiny_224.json
"""
import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import timm
import torch

import structformer  # noqa: F401  (registers the models)
from structformer.bench.kinds import write_record
from structformer.bench.load import start_watch, summary_line
from structformer.export.graphs import _batch_dim, example_input, relative_error, require_onnx
from structformer.records import cpu_model, environment


def export(model, example, optimize: bool, folder: Path) -> dict:
    start = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')                   # the exporter's deprecation and dynamic-shape chatter
        program = torch.onnx.export(model, (example,), dynamic_shapes=_batch_dim(example), dynamo=True,
                                    input_names=['input'], output_names=['output'], verbose=False, optimize=optimize)
    export_s = time.perf_counter() - start
    path = folder / f'optimize_{optimize}.onnx'
    program.save(str(path))
    return {'optimize': optimize, 'export_s': export_s, 'nodes': len(program.model.graph), 'path': path}


def time_sessions(rows: list, model, inputs, rounds: int) -> None:
    """ONNX Runtime's median seconds per call for each exported graph, the graphs' calls alternated round by round
    (so a slow moment of the machine falls on both), and each graph's error against eager torch."""
    import onnxruntime
    feed = {'input': inputs.numpy()}
    sessions = [onnxruntime.InferenceSession(str(r['path']), providers=['CPUExecutionProvider']) for r in rows]
    times = [[] for _ in rows]
    outputs = [s.run(None, feed)[0] for s in sessions]       # one warm-up call each
    for _ in range(rounds):
        for session, kept in zip(sessions, times):
            start = time.perf_counter()
            session.run(None, feed)
            kept.append(time.perf_counter() - start)
    with torch.no_grad():
        want = model(inputs)
    for row, kept, got in zip(rows, times, outputs):
        row.update(ort_ms=statistics.median(kept) * 1e3, ort_ms_q1=statistics.quantiles(kept, n=4)[0] * 1e3,
                   ort_ms_q3=statistics.quantiles(kept, n=4)[2] * 1e3,
                   error=relative_error(torch.from_numpy(got), want))
        del row['path']


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--model', default='soft_tiny_224', help='a registered model (default soft_tiny_224)')
    parser.add_argument('--batch', type=int, default=4, help='images per ONNX Runtime call (default 4)')
    parser.add_argument('--rounds', type=int, default=30, help='timed ONNX Runtime calls per graph (default 30)')
    parser.add_argument('--output', default=None, help='the JSON record to write')
    args = parser.parse_args(argv)
    if args.batch < 1 or args.rounds < 1:
        parser.error('--batch and --rounds must be integers >= 1')
    if args.model not in timm.list_models():
        parser.error(f'--model {args.model!r} is not a registered model (structformer models list)')
    require_onnx(runtime=True)
    model = timm.create_model(args.model).eval()
    example = example_input(model, batch=2)
    inputs = example_input(model, batch=args.batch, seed=args.batch)
    watch = start_watch(torch.get_num_threads())
    print(f"{cpu_model()}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, {args.model}")
    with tempfile.TemporaryDirectory() as folder:
        rows = [export(model, example, optimize, Path(folder)) for optimize in (False, True)]
        time_sessions(rows, model, inputs, args.rounds)
    for r in rows:
        print(f"optimize={r['optimize']}: export {r['export_s']:.1f} s, {r['nodes']} nodes, ONNX Runtime "
              f"{r['ort_ms']:.1f} ms ({r['ort_ms_q1']:.1f}-{r['ort_ms_q3']:.1f}) for {args.batch} images, "
              f"error {r['error']:.1e}", flush=True)
    load = watch.record()
    print(summary_line(load))
    if args.output:
        written = write_record(args.output, {'environment': environment('cpu'), 'model': args.model,
                                             'batch': args.batch, 'rounds': args.rounds, 'rows': rows,
                                             'machine_load': load})
        print(f"wrote {written}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
