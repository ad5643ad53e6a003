"""`structformer export`: arguments and the command (no torch at import: `structformer --help` builds this parser)."""
import argparse
import json

DESCRIPTION = ('Export a run or checkpoint: onnx and torch-export are checked against eager torch before they are '
               'kept (docs/export.md).')

EXAMPLES = """examples:
  structformer export outputs/demo --format onnx --output demo.onnx            # checked with ONNX Runtime
  structformer export outputs/demo --format torch-export --output demo.pt2     # torch.export.load(...)
  structformer export outputs/demo/checkpoints/epoch_0010 --format hf --output demo_hf
  python -c "import structformer, timm; timm.create_model('local-dir:demo_hf', pretrained=True)"

SOURCE: a run folder from `structformer train` (its latest checkpoint), a checkpoint folder or its
model.safetensors. onnx and torch-export leave the batch dimension free and are checked against eager torch
at two other batch sizes before they are kept; hf writes the timm Hugging Face layout (docs/export.md: uploading
it, TorchScript)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from . import FORMATS
    p.add_argument('source', metavar='SOURCE', help='run folder, checkpoint folder or its model.safetensors')
    p.add_argument('--format', required=True, metavar='FORMAT', dest='export_format',
                   help=f"one of {', '.join(FORMATS)}")
    p.add_argument('--output', required=True, metavar='OUT', help='file (onnx, torch-export) or folder (hf) to write')
    p.add_argument('--overwrite', action='store_true',
                   help='replace OUT if it is an earlier export (a .onnx / .pt2 file, or a folder of only the files '
                        'an hf export writes)')
    p.add_argument('--ema', action='store_true',
                   help='export the weight average of a run trained with --model-ema instead of its weights')
    p.add_argument('--json', action='store_true', help='print one JSON object')


def run(args) -> int:
    from . import export
    report = export(args.source, args.export_format, args.output, overwrite=args.overwrite, ema=args.ema)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['model']} ({report['source']}) -> {report['output']} [{report['format']}]")
    for line in report.get('notes') or ():
        print(f"  {line}")
    if 'max_relative_error' in report:
        print(f"checked against eager torch at batch sizes {report['batch_sizes_checked']}: max relative error "
              f"{report['max_relative_error']:.1e}")
    else:
        print(f"files: {', '.join(report['files'])}")
    return 0
