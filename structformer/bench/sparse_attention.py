"""`structformer bench sparse-attention`: Sparsifiner MHSA paths against dense SDPA, time and FLOPs.

One SparsifinerAttention layer at DeiT-S shape (d = 384, 6 heads of 64) per token count n, its predictor
included (Eq. 1–3), run on each execution path of Eq. 4–6: 'masked' (n² logits, −∞ off the mask), 'gather'
(each query's B keys gathered), 'flex' (FlexAttention; on CPU eager it materialises the scores), 'block' (the
layer's block connectivity, masked), 'block-gather' (`block_sparse_attention`: block connectivity with the
predictor on tile means and attention on gathered tiles, no n×n tensor; impl='gather' with block connectivity,
the layer's default on CUDA and under attention dropout), 'block-kernel' (the same predictor, the kept tiles
attended where they lie by the CPU tile kernel, `functional/tile_kernel.py`: impl='kernel', the layer's CPU
default) and 'block-flex' (the same predictor, the kept tiles as FlexAttention's full tiles: impl='flex').
`--device cuda` runs everything on the GPU,
where 'flex' and 'block-flex' are compiled; `--dtype bfloat16` for half-precision rows. Beside them, 'dense
SDPA': timm's Attention with `F.scaled_dot_product_attention` on the same qkv and proj weights, so the
projections are in every row. Inference (eval, no_grad) by default; --train times
forward + backward of out.sum().

Every path is timed back to back with the dense module, round by round (`harness.paired_ratios`, `--repeats`
rounds, rotated order), so that the machine's drift within a run does not decide a ratio: 'vs SDPA' is the
median of the per-round time ratios (quartiles in the JSON), 'ms' the path's median time, and the dense row's
'ms' the median of the dense module's medians over its pairings. FLOPs are the sparse (paper)
count of `sparse_flops.py` over the dense MHSA count, at the measured nnz(M) for the block rows. 'density' is
the realised key density nnz(M) / n² (dense cls row included), printed beside the nominal keep ratio: a block
mask keeps whole tiles, so it attends to between B − bs and B + bs keys per query, not B; a speed ratio is read
at that density, and the goal's verdict names it.
"""
from __future__ import annotations

import statistics
import sys

from ..cli_args import thread_count
from ..errors import UsageError
from .harness import median_seconds, paired_ratios
from .load import run_record
from ..records import check_output_file, environment
from .kinds import add_record_arguments, flop_rate_split, goal_entry, print_header, verdict_line, write_record

PATHS = ('masked', 'gather', 'flex', 'block', 'block-gather', 'block-kernel', 'block-flex')
DTYPES = ('float32', 'bfloat16')
BLOCK_TILE_PATHS = ('block-gather', 'block-kernel', 'block-flex')    # tile-mean predictor, no n×n tensor
GOAL = (577, 0.25, 0.6)                  # at n = 577, keep 0.25: fastest path ≤ 0.6 × dense SDPA

EXAMPLES = """examples:
  structformer bench sparse-attention --threads 1                       # n 197 577 1025 4097, keep 0.1 0.25 0.5
  structformer bench sparse-attention --tokens 577 --keep 0.25 --paths block-gather block-kernel --repeats 30   # the goal
  structformer bench sparse-attention --tokens 65 --keep 0.5 --repeats 1 --warmup 0 --json /tmp/sparse.json
  structformer bench sparse-attention --train --tokens 197 577          # forward + backward
  structformer bench sparse-attention --device cuda --batch 64 --repeats 50 --paths masked flex block-flex"""


def add_arguments(p):
    p.add_argument('--tokens', type=int, nargs='+', default=[197, 577, 1025, 4097], metavar='N',
                   help='token counts n (default 197 577 1025 4097)')
    p.add_argument('--keep', type=float, nargs='+', default=[0.1, 0.25, 0.5], metavar='RATIO',
                   help='keep ratios, B = ⌈keep·n⌉ keys per query (default 0.1 0.25 0.5)')
    p.add_argument('--paths', nargs='+', default=list(PATHS), metavar='PATH', help=f"of {' '.join(PATHS)} (all)")
    p.add_argument('--dim', type=int, default=384, help='embedding width (DeiT-S: 384)')
    p.add_argument('--heads', type=int, default=6, help='heads (DeiT-S: 6 of 64)')
    p.add_argument('--block-size', type=int, default=64, help='tile size of the block connectivity (64)')
    p.add_argument('--batch', type=int, default=1, help='batch size (1)')
    p.add_argument('--threads', type=thread_count, default=0, help="torch threads (0 = torch's current setting)")
    p.add_argument('--device', default='cpu', help='cpu | cuda (cpu)')
    p.add_argument('--dtype', default='float32', help=f"{' | '.join(DTYPES)} (float32)")
    p.add_argument('--train', action='store_true', help='time forward + backward instead of inference')
    p.add_argument('--repeats', type=int, default=5,
                   help='paired rounds per row, each timing the path and dense SDPA once (5)')
    p.add_argument('--warmup', type=int, default=1, help='untimed calls before timing (1)')
    p.add_argument('--max-gib', type=float, default=4.0,
                   help='skip a path whose largest intermediates would exceed this many GiB (4)')
    p.add_argument('--json', default=None, metavar='PATH', help='also write the rows as JSON here')
    add_record_arguments(p)


def _check(args) -> None:
    if not args.tokens or any(n < 2 for n in args.tokens):
        raise UsageError(f"--tokens must be integers >= 2, got {args.tokens}")
    if not args.keep or any(not 0 < k <= 1 for k in args.keep):
        raise UsageError(f"--keep must be ratios in (0, 1], got {args.keep}")
    unknown = [p for p in args.paths if p not in PATHS]
    if unknown or not args.paths:
        raise UsageError(f"--paths: unknown {', '.join(map(repr, unknown))}; accepted: {' '.join(PATHS)}")
    for flag in ('dim', 'heads', 'block_size', 'batch', 'repeats'):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be an integer >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.dim % args.heads:
        raise UsageError(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    if not args.max_gib > 0:
        raise UsageError(f"--max-gib must be > 0, got {args.max_gib}")
    for n in args.tokens:            # what every path holds (the layer, its input and output): refused, not skipped
        need = _fixed_gib(n, args)
        if need > args.max_gib:
            raise UsageError(f"--tokens {n} with --batch {args.batch} and --dim {args.dim}: the layer and its input "
                             f"alone need ~{need:.1f} GiB > --max-gib {args.max_gib:g}; give fewer tokens or a smaller "
                             "batch or width")
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.device not in ('cpu', 'cuda'):
        raise UsageError(f"--device must be cpu or cuda, got {args.device!r}")
    import torch
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here")


def _fixed_gib(n: int, args) -> float:
    """GiB of float32 every path holds at n tokens: the input, its q, k, v and output (and their gradients in
    training) and the predictor's two [32, n] bases, beside the two layers' weights."""
    activations = 5 * args.batch * n * args.dim * 4
    return (activations * (2 if args.train else 1) + 2 * 32 * n * 4 + 2 * 4 * args.dim ** 2 * 4) / 2 ** 30


def _gib(path: str, n: int, keys: int, args) -> float:
    """The largest float32 intermediates of a path (GiB): n×n per head for the predictor and masked
    logits, the gathered [n, B, d] keys and values, the gathered tiles; ×3 in training."""
    from ..functional.sparsifiner import tile_budget
    b, h, d, bs = args.batch, args.heads, args.dim // args.heads, args.block_size
    tiles = -(-n // bs)
    square = b * h * (tiles * bs) ** 2 * 4                   # a tile mask covers whole tiles (--block-size > n too)
    kept = tile_budget(n, bs, keys / n) * bs                 # keys of a query tile
    size = {'masked': 4 * square, 'flex': 4 * square, 'block': 4 * square,
            'gather': square + 2 * b * h * n * keys * d * 4,
            'block-gather': b * h * tiles * kept * (2 * d + bs) * 4,     # gathered K, V tiles; tile logits
            'block-kernel': b * h * n * d * 4 * 4,                        # q, k, v, out; a tile's logits per thread
            'block-flex': b * h * n * d * 4 * 4}[path]                    # q, k, v, out: no n×n, no copies
    return size * (3 if args.train else 1) / 2 ** 30


def _dense_twin(layer):
    """timm's Attention (SDPA) with the layer's qkv and proj weights."""
    from timm.models.vision_transformer import Attention
    dense = Attention(layer.qkv.in_features, layer.num_heads, qkv_bias=layer.qkv.bias is not None)
    dense.qkv.load_state_dict(layer.qkv.state_dict())
    dense.proj.load_state_dict(layer.proj.state_dict())
    return dense


def _block_forward(layer, impl: str):
    """The module with `block_sparse_attention` (impl 'gather' or 'flex') as its attention."""
    def forward(x):
        q, k, v = layer.project(x)
        return layer.merge(_block_core(layer, q, k, v, impl))
    return forward


def _block_core(layer, q, k, v, impl: str):
    from ..functional.sparsifiner import block_sparse_attention
    return block_sparse_attention(q, k, v, *layer.scoring_basis(q), layer.tau, layer.up_threshold,
                                  layer.keep_ratio, layer.block_size, int(layer.dense_cls_row), impl=impl,
                                  coef_topk=layer.coef_topk, scale=layer.logit_scale(q))


def _block_gather_flops(layer, x) -> dict:
    """The sparse count of the block-gather path: its tile-mean predictor and the measured nnz of its mask."""
    import math

    import torch

    from ..functional.sparsifiner import block_indices_to_mask, predicted_tiles
    from .sparse_flops import layer_mhsa_flops
    with torch.no_grad():
        q, k, _ = layer.project(x)
        indices = predicted_tiles(q, k, *layer.scoring_basis(q), layer.tau, layer.up_threshold,
                                  layer.keep_ratio, layer.block_size, coef_topk=layer.coef_topk,
                                  scale=layer.logit_scale(q))
        n = q.shape[-2]
        mask = block_indices_to_mask(indices, n, layer.block_size, int(layer.dense_cls_row))
        nnz = int(mask.sum()) // (mask.shape[0] * mask.shape[1])
    counts = layer_mhsa_flops(layer, n, nnz)
    t, p, h = math.ceil(n / layer.block_size), layer.basis.n_down, layer.num_heads
    pooled = 2 * h * p * n * layer.head_dim * 2 + 2 * h * t * p * t
    counts['sparse'] += pooled - counts['predictor']
    return counts


def _layer_flops(layer, x, path: str) -> dict:
    import torch

    from .sparse_flops import layer_mhsa_flops
    if path in BLOCK_TILE_PATHS:
        return _block_gather_flops(layer, x)
    if path == 'block':
        layer.keep_scores = True
        with torch.no_grad():
            layer(x)
        mask = layer.last_mask
        layer.keep_scores, layer.last_mask, layer.last_scores = False, None, None
        return layer_mhsa_flops(layer, x.shape[1], int(mask.sum()) // (mask.shape[0] * mask.shape[1]))
    return layer_mhsa_flops(layer, x.shape[1])


def _timer(fn, x, train: bool, module):
    import torch

    if train:
        def call():
            fn(x).sum().backward()
            module.zero_grad(set_to_none=True)
            x.grad = None
        return call

    def call():
        with torch.no_grad():
            fn(x)
    return call


def _configure(layer, path: str, keep: float) -> None:
    layer.keep_ratio = float(keep)
    layer.connectivity = 'block' if path.startswith('block') else 'token'
    layer.impl = {'block': 'masked', 'block-gather': 'gather', 'block-kernel': 'kernel', 'block-flex': 'flex'}.get(path, path)


def measure(args) -> list:
    import warnings

    import torch

    from ..functional.sparsifiner import budget
    from ..layers.attention.sparsifiner import SparsifinerAttention
    rows = []
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    for n in args.tokens:
        torch.manual_seed(0)
        # the 'scaled' basis init: its tiles vary with the query as a trained predictor's do (the public code's
        # trunc-normal(0.02) init scores every tile 0 before training, and every query would keep the first tiles)
        layer = SparsifinerAttention(args.dim, args.heads, qkv_bias=True, seq_len=n, block_size=args.block_size,
                                     basis_init='scaled')
        dense = _dense_twin(layer)
        layer, dense = layer.to(device, dtype), dense.to(device, dtype)
        x = torch.randn(args.batch, n, args.dim, device=device, dtype=dtype, requires_grad=args.train)
        for module in (layer, dense):
            module.train(args.train)
        for keep in args.keep:
            dense_call = _timer(dense, x, args.train, dense)
            dense_times, dense_flops = [], None
            base = {'tokens': n, 'keep': keep, 'keys': budget(n, keep)}
            for path in args.paths:
                row = dict(base, path=path)
                need = _gib(path, n, row['keys'], args)
                if need > args.max_gib:
                    rows.append(dict(row, ms=None, note=f"skipped: ~{need:.1f} GiB > --max-gib {args.max_gib:g}"))
                    continue
                _configure(layer, path, keep)
                fn = _block_forward(layer, layer.impl) if path in BLOCK_TILE_PATHS else layer
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter('ignore')            # flex's "without torch.compile" notice
                        # the dense module re-timed in every round, next to the path (`paired_ratios`)
                        paired = paired_ratios({'dense SDPA': dense_call, path: _timer(fn, x, args.train, layer)},
                                               'dense SDPA', args.repeats, args.warmup, device)
                except Exception as e:                             # e.g. flex unsupported here: mark, go on
                    rows.append(dict(row, ms=None, note=_failure(e)))
                    continue
                dense_times.append(paired['dense SDPA']['median_s'])
                stats = paired[path]
                flops = _layer_flops(layer, x[:1].detach(), path)
                dense_flops = flops['dense']
                note = 'CPU eager: materialises the scores' if 'flex' in path and not x.is_cuda else ''
                rows.append(dict(row, ms=stats['median_s'] * 1e3, vs_dense=1 / stats['ratio'],
                                 vs_dense_q1=1 / stats['ratio_q3'], vs_dense_q3=1 / stats['ratio_q1'],
                                 flops_vs_dense=flops['sparse'] / flops['dense'], nnz=flops['nnz'],
                                 density=flops['nnz'] / (n * n), note=note))
            if not dense_times:                                # every path skipped or failed: time dense alone
                dense_times.append(median_seconds(dense_call, args.repeats, args.warmup, device))
            dense_s = statistics.median(dense_times)
            rows.append(dict(base, path='dense SDPA', ms=dense_s * 1e3, vs_dense=1.0,
                             flops_vs_dense=1.0 if dense_flops else None, density=1.0, note=''))
            # the attention alone on each tile executor the device has (inference rows)
            core_paths = ('block-flex', 'block-gather') if x.is_cuda else ('block-gather', 'block-kernel')
            for block_path in [p for p in core_paths if p in args.paths and not args.train]:
                _configure(layer, block_path, keep)
                try:
                    rows += _core_rows(layer, x, base, args, block_path)
                except Exception as e:
                    rows.append(dict(base, path=f'{block_path} core', ms=None, note=_failure(e)))
            print(f"measured n={n} keep={keep:g}", file=sys.stderr, flush=True)
    return rows


def _failure(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [''])[0]
    return f"did not run: {type(e).__name__}: {first[:80]}"


def core_parts(layer, q, k, v) -> tuple:
    """(predict, attend): `_block_core`'s two parts on the layer's current path, `predict()` the kept tiles
    (`predicted_tiles`) and `attend(tiles)` the attention on them (`tile_attention`); attend(predict()) is the core."""
    from ..functional.sparsifiner import predicted_tiles, tile_attention

    def predict():
        return predicted_tiles(q, k, *layer.scoring_basis(q), layer.tau, layer.up_threshold, layer.keep_ratio,
                               layer.block_size, layer.impl == 'kernel', layer.coef_topk, layer.logit_scale(q))

    def attend(indices):
        return tile_attention(q, k, v, indices, layer.block_size, int(layer.dense_cls_row), 0.0, layer.impl)
    return predict, attend


def _core_rows(layer, x, base: dict, args, block_path: str) -> list:
    """The attention operation alone, projections excluded: `block_sparse_attention` (predictor included; on
    `block_path`'s executor) against `F.scaled_dot_product_attention` on the same q, k, v, timed back to back
    (`harness.paired_ratios`, `--repeats` rounds). The projections are the same dense GEMMs in both
    modules (at n = 577 they are 0.57 of dense MHSA FLOPs), so this is the part a sparse path can shorten.
    Its two parts are timed in the same rounds, each against SDPA: the predictor (`predicted_tiles`, Eq. 1-3 on
    tile means and the top tiles) and the attention on the tiles it picked (`tile_attention`, Eq. 4-6), so a
    kind of CPU where the goal is missed shows which part misses it ('predictor_vs_dense', 'tiles_vs_dense')."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        q, k, v = layer.project(x)
        predict, attend = core_parts(layer, q, k, v)
        indices = predict()
    label = f'{block_path} core'
    calls = {'dense SDPA core': lambda: F.scaled_dot_product_attention(q, k, v),
             label: lambda: _block_core(layer, q, k, v, layer.impl),
             'predictor': predict, 'tiles': lambda: attend(indices)}
    with torch.no_grad():
        paired = paired_ratios(calls, 'dense SDPA core', args.repeats, args.warmup, x.device)
    parts = {f'{part}_ms': paired[part]['median_s'] * 1e3 for part in ('predictor', 'tiles')}
    parts.update({f'{part}_vs_dense': 1 / paired[part]['ratio'] for part in ('predictor', 'tiles')})
    counts = _block_gather_flops(layer, x[:1].detach())
    core_flops = (counts['sparse'] - counts['projections']) / (counts['dense'] - counts['projections'])
    note = (f"attention alone (projections excluded), paired with SDPA alone: predictor "
            f"{parts['predictor_vs_dense']:.2f}× + tiles {parts['tiles_vs_dense']:.2f}× SDPA's time")
    n = x.shape[1]
    return [dict(base, path=label, ms=paired[label]['median_s'] * 1e3, **parts,
                 vs_dense=1 / paired[label]['ratio'], flops_vs_dense=core_flops, nnz=counts['nnz'],
                 vs_dense_q1=1 / paired[label]['ratio_q3'], vs_dense_q3=1 / paired[label]['ratio_q1'],
                 density=counts['nnz'] / (n * n), note=note),
            dict(base, path='dense SDPA core', ms=paired['dense SDPA core']['median_s'] * 1e3, vs_dense=1.0,
                 flops_vs_dense=1.0, density=1.0, note='')]


def goal(rows, train: bool, device: str = 'cpu') -> dict:
    """The CPU goal's verdict; on CUDA, where no goal is set, the fastest path at the goal's setting."""
    n, keep, limit = GOAL
    timed = [r for r in rows if r['tokens'] == n and r['keep'] == keep and r['path'] in PATHS
             and r.get('ms') is not None]
    if device != 'cpu':
        if not timed:
            return {'line': f"on {device} (the ≤ {limit}× goal is stated for the CPU): n={n} keep {keep:g} not measured"}
        best = min(timed, key=lambda r: r['vs_dense'])
        return {'path': best['path'], 'ratio': best['vs_dense'], 'met': None,
                'line': f"on {device} (the ≤ {limit}× goal is stated for the CPU): at n={n} keep {keep:g} the fastest "
                        f"path is {best['path']} at {best['vs_dense']:.2f}× dense SDPA"}
    if not timed:
        return {'line': f"goal: at n={n} keep {keep:g}, MHSA time with the predictor included ≤ {limit}× fused dense "
                        f"SDPA: n/a (needs --tokens {n} --keep {keep:g})"}
    best = min(timed, key=lambda r: r['vs_dense'])
    met = best['vs_dense'] <= limit
    mode = ' [measured with --train; the goal is stated for inference]' if train else ''
    verdict = {'path': best['path'], 'ratio': best['vs_dense'], 'met': met, 'density': best.get('density')}
    lines = [f"goal: at n={n} keep {keep:g}, MHSA time with the predictor included ≤ {limit}× fused dense SDPA{mode}"]
    core = [r for r in rows if r['tokens'] == n and r['keep'] == keep and r['path'].endswith(' core')
            and r['path'] != 'dense SDPA core' and r.get('ms') is not None]
    if core:
        c = min(core, key=lambda r: r['vs_dense'])
        verdict.update(core_path=c['path'][:-5], core_ratio=c['vs_dense'], core_met=c['vs_dense'] <= limit)
        verdict.update(core_density=c.get('density'))
        lines.append(f"      attention alone (vs F.scaled_dot_product_attention on the same q, k, v): "
                     f"{'met' if verdict['core_met'] else 'not met'} ({c['vs_dense']:.2f}×, {c['path'][:-5]}"
                     f"{_density_text(c)})")
    lines.append(f"      whole module (vs timm's Attention: the same qkv and proj GEMMs in both; sparse FLOPs "
                 f"{best['flops_vs_dense']:.2f}× dense): {'met' if met else 'not met'} "
                 f"({best['vs_dense']:.2f}×, {best['path']}{_density_text(best)})")
    return dict(verdict, line='\n'.join(lines))


def kind_goals(rows, args, env: dict, load) -> list:
    """The goal as a `kinds.goal_entry`: the fastest path's attention alone against SDPA alone at n 577, keep 0.25,
    inference on the CPU, with its realised key density ([] where that was not measured)."""
    n, keep, _ = GOAL
    core = [r for r in rows if r['tokens'] == n and r['keep'] == keep and r['path'].endswith(' core')
            and r['path'] != 'dense SDPA core' and r.get('ms') is not None]
    if not core or args.train or args.device != 'cpu':
        return []
    best = min(core, key=lambda r: r['vs_dense'])
    whole = [r for r in rows if r['tokens'] == n and r['keep'] == keep and r['path'] == best['path'][:-5]]
    detail = (f"{best['path'][:-5]}, realised key density {best['density']:.3f}"
              + (f"; predictor {best['predictor_vs_dense']:.2f}× + tiles {best['tiles_vs_dense']:.2f}× SDPA's time"
                 if 'tiles_vs_dense' in best else '')
              + (f"; whole module {whole[0]['vs_dense']:.2f}×" if whole else ''))
    quartiles = [best['vs_dense_q1'], best['vs_dense_q3']] if 'vs_dense_q1' in best else None
    share = best.get('flops_vs_dense')
    rates, bound = flop_rate_split('sparsifiner_sdpa', best['vs_dense'], 1 / share if share else None)
    return [goal_entry('sparsifiner_sdpa', best['vs_dense'], quartiles, env.get('threads'), detail, bound,
                       busy=bool(load and load.get('busy')), rates=rates)]


def _density_text(row: dict) -> str:
    """', realised key density 0.312 for nominal keep 0.25': the work the ratio was measured at."""
    if row.get('density') is None:
        return ''
    return f", realised key density {row['density']:.3f} for nominal keep {row['keep']:g}"


def format_table(rows) -> str:
    """One line per row; 'density' is the realised key density (attended (query, key) pairs / n², dense cls
    row included) beside the nominal keep ratio: a block mask keeps whole tiles, so the two differ."""
    lines = [f"{'n':>5} {'keep':>5} {'B':>5} {'density':>7} {'path':<17} {'ms':>9} {'vs SDPA':>8} "
             f"{'FLOPs vs dense':>14}  note"]
    for r in rows:
        ms = f"{r['ms']:>9.2f}" if r.get('ms') is not None else f"{'-':>9}"
        ratio = f"{r['vs_dense']:>7.2f}×" if r.get('vs_dense') is not None else f"{'-':>8}"
        fl = f"{r['flops_vs_dense']:>13.2f}×" if r.get('flops_vs_dense') is not None else f"{'-':>14}"
        density = f"{r['density']:>7.3f}" if r.get('density') is not None else f"{'-':>7}"
        lines.append(f"{r['tokens']:>5} {r['keep']:>5g} {r['keys']:>5} {density} {r['path']:<17} {ms} {ratio} {fl}  "
                     f"{r['note']}")
    return '\n'.join(lines)


def run(args) -> int:
    import torch
    _check(args)
    if args.json:                  # before measuring: minutes of timings never die at the write
        check_output_file(args.json, '--json')
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(args)
    env = environment(args.device)                 # after measuring: its kernel choices are made by now
    verdict = goal(rows, args.train, args.device)
    mode = 'forward + backward (train)' if args.train else 'inference (eval, no_grad)'
    where = (f"{env['device']}, CUDA {env['cuda']}" if args.device == 'cuda'
             else f"{env['threads']} threads, {env['cpu']}")
    print()
    print_header(env)
    print(f"Sparsifiner MHSA (predictor included) vs dense SDPA, same qkv/proj weights; d {args.dim}, {args.heads} "
          f"heads, batch {args.batch}, block {args.block_size}, {args.dtype}, {mode}; {where}, torch {env['torch']}")
    print("ms: median; vs SDPA: median over paired rounds of time / dense SDPA time; FLOPs: sparse (paper) MHSA "
          "count / dense MHSA count (projections included)")
    print(format_table(rows))
    print(verdict['line'])
    entries = kind_goals(rows, args, env, run_record())
    print('\n'.join(verdict_line(entry) for entry in entries))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ('func', 'command', 'target')}
        write_record(args.json, {'settings': settings, 'environment': env, 'goal': verdict, 'kind_goals': entries,
                                 'rows': rows, 'machine_load': run_record()}, args.allow_busy)
        print(f"wrote {args.json}")
    return 0
