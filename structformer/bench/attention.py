"""`structformer bench attention`: time, memory and FLOPs of one attention layer vs token count.

The axis of SOFT Fig. 1b (memory vs n = 784×1 … 784×8), extended to 784×16 = 12,544 tokens, at
SOFT-Tiny stage-1 widths (dim 64, 2 heads of 32, Table 1), batch 1, m = 49 landmarks / projected
length for the linear attentions. Tokens lie on an H×W grid with H·W = n (28×28, 28×56, 56×56,
56×112, 112×112): the base grid scaled by a×b with a·b = multiplier, passed as `grid_size`.

Per (attention, n): median forward time (eval, no_grad) and forward+backward time (of out.sum())
after warm-up; peak memory of forward+backward; FLOPs counted by FlopCounterMode beside the analytic
count (SOFT §3 complexity; see `flops.py`). Each measurement runs in a fresh subprocess so that
the peak resident memory of one cannot hide another's (nor share its allocator caches); on CPU the
peak is the growth of the high-water mark (VmHWM = ru_maxrss) over the baseline taken after
building the layer and the input. The high-water mark is reset there first (Linux clear_refs):
imports and one tiny warm-up run of the same class (so one-time library start-up is not charged
to the first n) leave it above what a small n reaches, which would read as 0 growth. On
CUDA it is max_memory_allocated over the same baseline. Subprocess, timer, memory readers and
writers are the shared ones of `harness.py`.

Configurations whose n×n buffers alone would exceed `--max-quadratic-gib` are skipped and marked
so. Only `softmax_naive` holds n×n buffers: we charge it 4 per head in float32 (logits, their
scaled copy / probabilities kept for backward, and the two gradients that coexist in backward),
so 12,544 tokens need 4 × 2 × 12,544² × 4 B ≈ 4.7 GiB and still run under the default 8 GiB.
SDPA (`softmax`) runs fused, blockwise kernels on CPU and CUDA and holds no n×n buffer.

Two goal ratios are printed from this one run, never asserted: (a) SOFT memory at the largest /
smallest n (goal: linear growth, ≤ 1.25 × the token ratio, i.e. ≤ 20 at 16×784 / 784), and
(b) SDPA forward time / SOFT forward time at the largest n (goal ≥ 40×, stated at 12,544 tokens).
(b) is judged on paired timing (`--pairs`, `harness.paired_ratios`): after the sweep, one more
subprocess times every attention's forward at the largest n back to back and takes the ratio within
each round; the sweep's medians come from separate processes minutes apart, which a machine whose
speed drifts can move by tens of percent. Without pairs, (b) falls back to the sweep's medians.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import List, Optional, Tuple

from .harness import MeasurementFailed, PeakMemory, measure_in_subprocess, median_seconds, paired_ratios
from .load import run_record
from ..cli_args import thread_count
from ..records import check_output_file, environment, write_png
from .attention_report import FOLDED_PROJECTIONS, plot, print_report
from .kinds import add_record_arguments, soft_goal_entries, verdict_line, write_record

DEFAULT_ATTENTIONS = ('softmax', 'softmax_naive', 'linformer', 'performer', 'nystrom', 'soft', 'softpp')
QUADRATIC_BUFFERS = {'softmax_naive': 4}     # n×n float32 matrices per head alive at the fwd+bwd peak
GOAL_MEMORY_SLACK = 1.25                     # (a) passes at <= 1.25 × token ratio (20 at 16×)
GOAL_SPEEDUP = 40.0                          # (b) SDPA / SOFT forward time at the largest n

EXAMPLES = """examples:
  structformer bench attention                                  # 784×{1,2,4,8,16} tokens, all attentions
  structformer bench attention --multipliers 1 2 4 --attn softmax soft --output out/attention.json
  structformer bench attention --base-tokens 64 --multipliers 1 4 --repeats 1   # a quick smoke run
  structformer bench attention --attn soft --multipliers 16 --profile           # where SOFT's time goes
  structformer bench attention --attn softmax soft softpp --multipliers 16 --pairs 20   # goal (b) alone

Writes a table; with --output also JSON and a PNG (memory and time vs tokens, log-log, like
SOFT Fig. 1b). FLOPs: 'counted' = torch FlopCounterMode (matmul/conv only, multiply-add = 2),
'core' = counted minus the qkv/proj Linear layers, 'analytic' = closed form (SOFT §3 complexity)."""


def add_arguments(p):
    p.add_argument('--attn', nargs='+', default=list(DEFAULT_ATTENTIONS), metavar='NAME',
                   help=f"registered attention names (default: {' '.join(DEFAULT_ATTENTIONS)})")
    p.add_argument('--multipliers', nargs='+', type=int, default=[1, 2, 4, 8, 16], metavar='K',
                   help='token counts n = base-tokens × K (default 1 2 4 8 16)')
    p.add_argument('--base-tokens', type=int, default=784, help='tokens at multiplier 1 (default 784 = 28×28)')
    p.add_argument('--dim', type=int, default=64, help='embedding width (SOFT-Tiny stage 1: 64)')
    p.add_argument('--heads', type=int, default=2, help='heads (SOFT-Tiny stage 1: 2, of width 32)')
    p.add_argument('--landmarks', type=int, default=49, help='m: landmarks / projected length / features (49)')
    p.add_argument('--repeats', type=int, default=5, help='timed runs per measurement; the median is reported')
    p.add_argument('--warmup', type=int, default=2, help='untimed runs before timing')
    p.add_argument('--max-quadratic-gib', type=float, default=8.0,
                   help='skip configurations whose n×n buffers would exceed this (GiB, default 8)')
    p.add_argument('--device', default='cpu', help='cpu | cuda')
    p.add_argument('--threads', type=thread_count, default=0, help='torch threads (0 = torch default)')
    p.add_argument('--in-process', action='store_true',
                   help='measure in this process (fast; peaks then share one allocator, so less clean)')
    p.add_argument('--compile', nargs='?', const='inductor', default=None, metavar='BACKEND',
                   help='also time each layer under torch.compile (BACKEND, inductor when bare), printed beside '
                        'eager; compiling costs seconds per configuration, reported as "compile s"')
    p.add_argument('--pairs', type=int, default=10, metavar='N',
                   help='after the sweep, N rounds of every attention\'s forward at the largest n timed back to '
                        'back in one process; goal (b) is judged on these paired ratios (default 10, 0 skips)')
    p.add_argument('--profile', action='store_true',
                   help='after the sweep, torch.profiler breakdown of the SOFT forward at the largest n')
    p.add_argument('--output', default=None, help='write JSON here (e.g. DIR/attention.json) and a PNG beside it')
    add_record_arguments(p)


def _check_args(args) -> None:
    import torch
    from ..layers.attention import ATTENTION_LAYERS
    if not args.multipliers or any(k < 1 for k in args.multipliers):
        raise ValueError(f"--multipliers must be integers >= 1, got {args.multipliers}")
    unknown = [a for a in args.attn if a not in ATTENTION_LAYERS]
    if unknown:
        raise ValueError(f"--attn: unknown attention {', '.join(map(repr, unknown))}; "
                         f"accepted: {', '.join(sorted(ATTENTION_LAYERS))}")
    for flag in ('base_tokens', 'dim', 'heads', 'landmarks', 'repeats'):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.pairs < 0:
        raise ValueError(f"--pairs must be >= 0 (0 skips the paired timing), got {args.pairs}")
    if args.dim % args.heads:
        raise ValueError(f"--dim {args.dim} must be divisible by --heads {args.heads}")
    if args.landmarks > args.base_tokens:
        raise ValueError(f"--landmarks {args.landmarks} exceeds --base-tokens {args.base_tokens}")
    if not args.max_quadratic_gib > 0:
        raise ValueError(f"--max-quadratic-gib must be > 0, got {args.max_quadratic_gib}")
    if args.device not in ('cpu', 'cuda'):
        raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    if args.compile is not None:         # here, not as a FAILED row per configuration minutes later
        backends = torch._dynamo.list_backends(exclude_tags=())
        if args.compile not in backends:
            raise ValueError(f"--compile {args.compile!r} is not a torch.compile backend: accepted "
                             f"{', '.join(backends)}")


def _near_square(n: int) -> Tuple[int, int]:
    """(a, b) with a·b = n, a ≤ b, a as large as possible."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return a, n // a


def grid_for(base_tokens: int, multiplier: int) -> Tuple[int, int]:
    """H×W grid of base_tokens × multiplier tokens: the base grid scaled by a near-square a×b = multiplier."""
    (h, w), (a, b) = _near_square(base_tokens), _near_square(multiplier)
    return h * a, w * b


def quadratic_gib(name: str, tokens: int, heads: int, batch: int = 1) -> float:
    """GiB of the n×n float32 buffers an attention holds at its forward+backward peak (0 if linear)."""
    return QUADRATIC_BUFFERS.get(name, 0) * batch * heads * tokens ** 2 * 4 / 2 ** 30


def build_layer(name: str, dim: int, heads: int, landmarks: int, grid: Tuple[int, int], device='cpu'):
    """The attention under test, with its n- or grid-dependent parameters fixed at construction."""
    from ..layers.attention import get_attention, select_options
    n = grid[0] * grid[1]
    cls = get_attention(name)
    # m landmarks / projected length / random features, and the grid: each class takes what it accepts
    kwargs = select_options(cls, {'num_landmarks': landmarks, 'grid_size': grid, 'seq_len': n,
                                  'num_features': landmarks})
    return cls(dim, num_heads=heads, device=device, **kwargs)


def effective_landmarks(layer, grid: Tuple[int, int], landmarks: int) -> int:
    """m actually used: SOFT's conv/avgpool sampler gives ⌈H/k⌉·⌈W/k⌉, which may differ from --landmarks."""
    from ..layers.attention.soft import SoftAttention, sampling_ratio_for
    if isinstance(layer, SoftAttention) and layer.sampler != 'random':
        k = layer.conv.kernel_size if layer.conv is not None else sampling_ratio_for(*grid, landmarks)
        return math.ceil(grid[0] / k) * math.ceil(grid[1] / k)
    return landmarks


def _compiled_times(layer, fwd_bwd_of, fwd_of, repeats: int, warmup: int, device: str, backend: str) -> dict:
    """Forward and forward+backward times of `torch.compile(layer)`, and the time of its first call."""
    import time

    import torch
    compiled = torch.compile(layer, backend=backend)
    layer.train()
    start = time.perf_counter()
    fwd_bwd_of(compiled)()                                  # compiles the training graph
    compile_s = time.perf_counter() - start
    fwd_bwd_s = median_seconds(fwd_bwd_of(compiled), repeats, max(warmup - 1, 0), device)
    layer.eval()
    fwd_of(compiled)()                                      # eval + no_grad: a graph of its own
    fwd_s = median_seconds(fwd_of(compiled), repeats, warmup, device)
    return {'forward_ms_compiled': fwd_s * 1e3, 'forward_backward_ms_compiled': fwd_bwd_s * 1e3,
            'compile_s': compile_s}


def measure_one(name: str, grid, dim: int, heads: int, landmarks: int, repeats: int, warmup: int,
                device: str = 'cpu', threads: int = 0, compiled: Optional[str] = None) -> dict:
    """Time, peak memory and FLOPs of one (attention, n); meant to run in its own process."""
    import torch
    from .flops import analytic_core_flops, counted_flops, linear_flops
    import structformer  # noqa: F401  (registers the attentions)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    grid = tuple(grid)
    n = grid[0] * grid[1]
    # one tiny run of the same class first, so code loading and thread pools are not charged to n
    small = _near_square(max(landmarks, 16))
    tiny = build_layer(name, dim, heads, min(landmarks, small[0] * small[1]), small, device)
    tiny(torch.randn(1, small[0] * small[1], dim, device=device, requires_grad=True), grid_size=small).sum().backward()
    del tiny

    layer = build_layer(name, dim, heads, landmarks, grid, device)
    x = torch.randn(1, n, dim, device=device, requires_grad=True)
    memory = PeakMemory(device)

    def fwd_bwd_of(module):
        def run():
            module(x, grid_size=grid).sum().backward()
            layer.zero_grad(set_to_none=True)
            x.grad = None
        return run

    def fwd_of(module):
        def run():
            with torch.no_grad():
                module(x, grid_size=grid)
        return run

    fwd_bwd, fwd = fwd_bwd_of(layer), fwd_of(layer)

    layer.train()
    fwd_bwd()                                            # the peak is reached here; later runs reuse it
    peak = memory.growth_mib()
    fwd_bwd_s = median_seconds(fwd_bwd, repeats, max(warmup - 1, 0), device)
    layer.eval()
    fwd_s = median_seconds(fwd, repeats, warmup, device)
    compiled_row = _compiled_times(layer, fwd_bwd_of, fwd_of, repeats, warmup, device, compiled) if compiled else {}

    m_eff = effective_landmarks(layer, grid, landmarks)
    flops_fwd = counted_flops(layer, x, grid)
    layer.train()
    flops_fwd_bwd = counted_flops(layer, x, grid, backward=True)
    linear = linear_flops(layer, n)
    head_dim = dim // heads
    analytic = analytic_core_flops(name, n, m_eff, head_dim, heads, getattr(layer, 'newton_iter', 20))
    return {'attention': name, 'tokens': n, 'grid': list(grid), 'landmarks': m_eff,
            'params': sum(p.numel() for p in layer.parameters()),
            'forward_ms': fwd_s * 1e3, 'forward_backward_ms': fwd_bwd_s * 1e3, 'peak_mib': peak,
            'flops_counted_forward': flops_fwd, 'flops_counted_forward_backward': flops_fwd_bwd,
            'flops_linear_forward': linear, 'flops_counted_core_forward': flops_fwd - linear,
            'flops_analytic_core_forward': analytic['flops'] if analytic else None,
            'flops_analytic_formula': analytic['formula'] if analytic else None,
            # SOFT folds v and proj into its products, so its 'core' is not a tally of attention ops (it can
            # be < 0 at small n): a low value there is not a missed op
            'flops_counter_missed': bool(analytic and name not in FOLDED_PROJECTIONS
                                         and flops_fwd - linear < 0.5 * analytic['flops']),
            'threads': torch.get_num_threads(), 'skipped': False, **compiled_row}


def _measure_subprocess(name, grid, args) -> dict:
    try:
        return measure_in_subprocess('structformer.bench.attention:measure_one', name, list(grid), args.dim,
                                     args.heads, args.landmarks, args.repeats, args.warmup, args.device, args.threads,
                                     args.compile)
    except MeasurementFailed as e:
        # e.g. killed for memory: record it and go on, so one failure does not lose the sweep
        return {'error': str(e)}


def measure_paired_forward(names, grid, dim: int, heads: int, landmarks: int, rounds: int, device: str = 'cpu',
                           threads: int = 0) -> dict:
    """Forward time (eval, no_grad) of every attention in `names` at one grid, all in this process and timed
    back to back (`harness.paired_ratios`, reference: the first name): {name: median_s, ratio = time of
    the reference / time of name, quartiles}. On CUDA each call ends with a synchronise."""
    import torch
    import structformer  # noqa: F401  (registers the attentions)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    grid = tuple(grid)
    x = torch.randn(1, grid[0] * grid[1], dim, device=device)
    calls = {}
    for name in names:
        layer = build_layer(name, dim, heads, landmarks, grid, device).eval()

        def forward(layer=layer):
            with torch.no_grad():
                layer(x, grid_size=grid)
            if device == 'cuda':
                torch.cuda.synchronize()
        calls[name] = forward
    return paired_ratios(calls, names[0], rounds)


def run_paired(rows, args) -> dict:
    """`measure_paired_forward` at the largest n for the attentions the sweep measured there (SDPA first),
    in a subprocess unless --in-process; {} when fewer than two qualify or --pairs is 0."""
    if not args.pairs:
        return {}
    hi = max(r['tokens'] for r in rows)
    names = [a for a in args.attn if _find(rows, a, hi)]
    names.sort(key=lambda a: a != 'softmax')                 # the reference of the ratios
    if len(names) < 2:
        return {}
    grid = next(r['grid'] for r in rows if r['tokens'] == hi)
    call = (args.pairs, args.device, args.threads)
    if args.in_process:
        paired = measure_paired_forward(names, grid, args.dim, args.heads, args.landmarks, *call)
    else:
        try:
            paired = measure_in_subprocess('structformer.bench.attention:measure_paired_forward', names, list(grid),
                                           args.dim, args.heads, args.landmarks, *call)
        except MeasurementFailed as e:
            print(f"paired timing FAILED: {str(e).splitlines()[-1] if str(e) else ''}", file=sys.stderr, flush=True)
            return {}
    print(f"paired: {args.pairs} rounds at n={hi} measured", file=sys.stderr, flush=True)
    return {'tokens': hi, 'reference': names[0], 'ratios': paired}


def run_sweep(args) -> List[dict]:
    rows = []
    for k in sorted(set(args.multipliers)):
        grid = grid_for(args.base_tokens, k)
        n = grid[0] * grid[1]
        for name in args.attn:
            need = quadratic_gib(name, n, args.heads)
            base = {'attention': name, 'tokens': n, 'multiplier': k, 'grid': list(grid), 'quadratic_gib': need}
            if need > args.max_quadratic_gib:
                row = dict(base, skipped=True,
                           reason=f"n×n buffers need {need:.1f} GiB > --max-quadratic-gib {args.max_quadratic_gib}")
            elif args.in_process:
                row = {**base, **measure_one(name, grid, args.dim, args.heads, args.landmarks, args.repeats,
                                             args.warmup, args.device, args.threads, args.compile)}
            else:
                row = {**base, 'skipped': False, **_measure_subprocess(name, grid, args)}
            rows.append(row)
            state = 'skipped' if row.get('skipped') else ('FAILED' if 'error' in row else 'measured')
            print(f"{state} {name} n={n} ({grid[0]}×{grid[1]})", file=sys.stderr, flush=True)
    return rows


def _find(rows, name, tokens) -> Optional[dict]:
    for r in rows:
        if r['attention'] == name and r['tokens'] == tokens and not r.get('skipped') and 'error' not in r:
            return r
    return None


def goal_ratios(rows, attentions, paired: Optional[dict] = None) -> dict:
    """(a) SOFT memory growth over the sweep and (b) SDPA / SOFT forward time at the largest n: the paired
    median ratio where `paired` (from `run_paired`) has one for SOFT against SDPA, else the ratio of the
    sweep's medians."""
    tokens = sorted({r['tokens'] for r in rows})
    lo, hi = tokens[0], tokens[-1]
    out = {}
    if 'soft' in attentions and hi > lo:
        a, b = _find(rows, 'soft', lo), _find(rows, 'soft', hi)
        # both growths above zero: the high-water mark lags the resident set by a few pages, so a tiny n can read
        # below its baseline, and a negative ratio passed the goal
        if a and b and (a.get('peak_mib') or 0) > 0 and (b.get('peak_mib') or 0) > 0:
            goal = GOAL_MEMORY_SLACK * hi / lo
            ratio = b['peak_mib'] / a['peak_mib']
            out['soft_memory_growth'] = {'ratio': ratio, 'goal_max': goal, 'tokens': [lo, hi],
                                         'pass': ratio <= goal}
    if 'soft' in attentions and 'softmax' in attentions:
        a, b = _find(rows, 'softmax', hi), _find(rows, 'soft', hi)
        pair = (paired or {}).get('ratios', {}).get('soft') if (paired or {}).get('reference') == 'softmax' else None
        if a and b:
            sweep = a['forward_ms'] / b['forward_ms']
            ratio = pair['ratio'] if pair else sweep
            from .flops import row_forward_flops
            fa, fb = row_forward_flops(a), row_forward_flops(b)
            out['sdpa_over_soft_forward_time'] = {
                'ratio': ratio, 'source': 'paired' if pair else 'sweep medians', 'sweep_ratio': sweep,
                'flop_ratio': fa / fb if fa and fb else None,
                'quartiles': [pair['ratio_q1'], pair['ratio_q3']] if pair else None,
                'goal_min': GOAL_SPEEDUP, 'tokens': hi, 'pass': ratio >= GOAL_SPEEDUP}
    return out


def profile_forward(name, grid, args, top: int = 15) -> str:
    """torch.profiler table of one forward (eval, no_grad) grouped by op and input shape."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    layer = build_layer(name, args.dim, args.heads, args.landmarks, grid, args.device).eval()
    x = torch.randn(1, grid[0] * grid[1], args.dim, device=args.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == 'cuda' else [])
    with torch.no_grad():
        for _ in range(2):
            layer(x, grid_size=grid)
        with profile(activities=acts, record_shapes=True) as prof:
            for _ in range(args.repeats):
                layer(x, grid_size=grid)
    key = 'self_cuda_time_total' if args.device == 'cuda' else 'self_cpu_time_total'
    return prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=top, max_name_column_width=30)


def run(args) -> int:
    import torch
    _check_args(args)
    if args.output:                # before measuring: a sweep of minutes never dies at the write
        check_output_file(args.output, '--output')
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run_sweep(args)
    paired = run_paired(rows, args)
    goals = goal_ratios(rows, args.attn, paired)
    env = environment(args.device)
    print_report(rows, goals, args, env, paired)
    entries = soft_goal_entries(goals, env, run_record())
    print('\n'.join(verdict_line(entry) for entry in entries))
    profiled = None
    if args.profile:                # kept in the record: on a kind that misses the SOFT goal, where the time went
        target = next((a for a in args.attn if a in ('soft', 'softpp')), args.attn[0])
        grid = grid_for(args.base_tokens, max(args.multipliers))
        print(f"\nprofile: {target} forward at {grid[0] * grid[1]} tokens ({args.repeats} runs)")
        profiled = {'attention': target, 'tokens': grid[0] * grid[1], 'table': profile_forward(target, grid, args)}
        print(profiled['table'])
    if args.output:
        settings = {k: v for k, v in vars(args).items() if k not in ('func', 'command', 'target')}
        record = {'settings': settings, 'torch': env['torch'], 'environment': env, 'goals': goals,
                  'kind_goals': entries, 'rows': rows, 'paired': paired, 'profile': profiled,
                  'machine_load': run_record()}
        written = write_record(args.output, record, args.allow_busy)      # elsewhere if busy and bound for docs/
        png = os.path.splitext(written)[0] + '.png'
        drawn = write_png(png, lambda plt: plot(rows, plt))
        print(f"\nwrote {written}" + (f" and {png}" if drawn else ''))
    return 1 if any('error' in r for r in rows) else 0


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
