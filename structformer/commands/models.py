"""`structformer models`: the registered models with parameter counts (and, with --flops, multiply-adds by
component)."""
import fnmatch
import json

from ..cli_args import positive_int
from ..errors import UsageError

EXAMPLES = """examples:
  structformer models                 # every structformer model with its parameter count
  structformer models --filter crate  # only names containing 'crate'
  structformer models --filter 'soft*_mnist'   # timm's wildcards, as timm.list_models takes them
  structformer models --json
  structformer models --filter soft_tiny --flops   # + multiply-adds per image, by component"""


def add_arguments(p) -> None:
    p.add_argument('--filter', default='', help="substring of the name, or a pattern with timm's wildcards "
                                                "(* ? [...]) matched against the whole name, as timm.list_models")
    p.add_argument('--json', action='store_true',
                   help='print the rows as one JSON list (name, params, effective_params, input_size, task; with '
                        '--flops also macs, flops and breakdown_macs)')
    p.add_argument('--flops', action='store_true',
                   help='also count forward multiply-adds of one image, split by component (builds each model)')
    p.add_argument('--img-size', type=positive_int('--img-size'), default=None,
                   help="input side for --flops, which builds each model for it (a language model: its context "
                        "length T); default: the model's own")


def human_count(n: int) -> str:
    """A parameter count people can read: 812, 4.1K, 3.60M, 1.20G."""
    n = int(n)
    if abs(n) < 1000:
        return str(n)
    for scale, unit, digits in ((1e9, 'G', 2), (1e6, 'M', 2), (1e3, 'K', 1)):
        if round(abs(n) / scale, digits) >= 1:        # 999,999 is 1.00M, not 1000.0K
            return f"{n / scale:.{digits}f}{unit}"
    return str(n)


def macs_text(n: float) -> str:
    """A multiply-add count in its own unit, three decimals: 2.964G, 652.312K, 320. One unit for the table (GMACs)
    printed 0.000 for every count of the digits models (mixer_digits: 0.2 M), whose table was all zeros."""
    n = float(n)
    for scale, unit in ((1e9, 'G'), (1e6, 'M'), (1e3, 'K')):
        if round(abs(n) / scale, 3) >= 1:          # 999,999.9 is 1.000M, not 1000.000K
            return f"{n / scale:.3f}{unit}"
    return f"{n:.0f}"


def matches(name: str, pattern: str) -> bool:
    """--filter: a substring ('crate'), or with a wildcard a pattern for the whole name ('crate_*_224'), as a timm
    user writes it for timm.list_models; a pattern read as a substring would match nothing, silently."""
    if any(c in pattern for c in '*?['):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


def _flops(model_flops, name: str, img_size, unit: str = 'px') -> dict:
    """model_flops of `name` at --img-size, its failures for that size named by the flag: a size the model cannot
    take (not a multiple of its patch) or cannot hold in memory (--img-size 100000 allocated 640 GB: a traceback)."""
    try:
        return model_flops(name, img_size=img_size)
    except (ValueError, AssertionError) as e:
        if img_size is None:
            raise
        raise UsageError(f"--img-size {img_size}: {name} cannot be built for it ({str(e).splitlines()[0]})") from None
    except (MemoryError, RuntimeError) as e:
        if img_size is None or not (isinstance(e, MemoryError) or 'alloc' in str(e)):
            raise
        raise UsageError(f"--img-size {img_size}: {name} at {img_size} {unit} does not fit in memory "
                         f"({str(e).splitlines()[0][:120]})") from None


def run(args) -> int:
    if args.img_size is not None and not args.flops:     # the table counts each model as registered: never at a size
        raise UsageError(f"--img-size {args.img_size}: sizes the models for --flops only; add --flops (the parameter "
                         "count then is the model's at that size)")
    from ..models import list_structformer_language_models, list_structformer_models
    from ..models.inventory import model_inventory
    language = set(list_structformer_language_models())
    names = [n for n in list_structformer_models() + sorted(language) if matches(n, args.filter)]
    if not names:        # an empty table reads as "no such models" without saying the filter caused it
        raise UsageError(f"--filter {args.filter!r} matches no structformer model (a substring of the name, or a "
                         "pattern with * ? [...] for the whole name); `structformer models` lists them all, and "
                         "timm's own models are in timm.list_models()")
    rows = model_inventory(names)
    for row in rows:
        row['task'] = 'language model' if row['name'] in language else 'image classification'
    if args.flops:
        from ..bench.flops import COMPONENTS, model_flops
        for row in rows:
            unit = 'tokens' if row['name'] in language else 'px'          # a language model's size is its T
            row.update(_flops(model_flops, row['name'], args.img_size, unit))    # params of the model at that size
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    width = max(len(r['name']) for r in rows) if rows else 10
    header = f"{'model':<{width}}  {'params':>12}  input"
    if args.flops:
        columns = COMPONENTS + ('other',)
        col = max(9, *(len(c) for c in columns))            # whole component names: no truncated headers
        parts = ''.join(f"  {c:>{col}}" for c in columns)
        header = f"{'model':<{width}}  {'params':>12}  {'input':>10}  {'MACs':>9}{parts}"
    print(header)
    for r in rows:
        # a language model reads token ids [B, T]: its "input" is the context length
        size = f"T={r['input_size'][-1]}" if r['task'] == 'language model' else 'x'.join(map(str, r['input_size']))
        if args.flops:
            parts = ''.join(f"  {macs_text(r['breakdown_macs'][c]):>{col}}" for c in columns)
            print(f"{r['name']:<{width}}  {human_count(r['params']):>12}  {size:>10}  {macs_text(r['macs']):>9}{parts}")
        else:
            print(f"{r['name']:<{width}}  {human_count(r['params']):>12}  {size}")
    for r in rows:         # SW-MLP: a dense weight of which its mask keeps a share p; the rest is zero, never trained
        if r['effective_params'] != r['params']:
            print(f"{r['name']}: {human_count(r['effective_params'])} of its {human_count(r['params'])} weights are kept "
                  "by its masks (the rest are zero and get no gradient)")
    if args.flops:
        print("MACs: multiply-adds of one image's forward (a language model: one sequence of T tokens; "
              "FlopCounterMode, matmul/conv only; papers quote these as FLOPs), split by component; "
              "K, M, G: 10^3, 10^6, 10^9")
    return 0


