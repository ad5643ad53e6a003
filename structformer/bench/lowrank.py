"""`structformer bench lowrank`: training-step time and memory of dense vs factorised layers (seed 004).

Two parts, each a set of candidates whose training steps are timed back to back, `--rounds` × `--steps`
rounds after 2 warm-up steps each (`harness.paired_ratios`): a speed-up is the median of the per-round
ratios dense / candidate (quartiles beside it), which a machine whose speed drifts moves far less than a
ratio of medians taken apart:

1. One layer, `--in-features` → `--out-features` on `--tokens` tokens: nn.Linear (the reference), the
   same dense layer on oneDNN's kernels (`functional.onednn_linear.linear`, which FactorizedLinear runs
   on for float32 CPU tensors), and at each rank FactorizedLinear, FactorizedLinear on torch's own
   kernels (`torch_kernels()`) and the naive factorisation as two plain nn.Linear layers. A training
   step is forward, backward (the input requires grad, as inside a network) and an SGD-momentum step.
2. A ViT-S block stack (timm's `Block`, dim 384, 6 heads, MLP 1536, `--depth` blocks) on
   `--batch-size` × 197 tokens: dense, dense with its linears on oneDNN's kernels, and
   `factorize(..., include='all')` (QKV, attention output, both FFN matrices) at each rank.

The goals are speed-ups over torch's nn.Linear. Part of a factorised layer's speed-up is the kernels, not
the rank, so the report also gives it over the dense layer on the same kernels ('same kernels'): the
factorisation's own share.

Memory is what a step holds beyond the input: parameters, gradients and momentum (3 × parameter bytes)
plus the activations autograd saves for backward (distinct storages; parameters and the input, which
the step holds anyway, not counted), which is exact and independent of the allocator. FLOP ratios are the matmul multiply-adds, for comparison with the measured ratios.
"""
from __future__ import annotations

import statistics
import sys
from typing import List, Optional, Tuple

from .harness import median_seconds, paired_ratios
from .load import run_record
from ..cli_args import thread_count
from ..records import check_output_file, environment
from .kinds import add_record_arguments, goal_entry, print_header, verdict_line, write_record

EXAMPLES = """examples:
  structformer bench lowrank                                   # the goals: 1024x4096 layer, ViT-S stack
  structformer bench lowrank --tokens 256 --in-features 64 --out-features 256 --depth 1 --batch-size 1 --steps 1 --rounds 1
  structformer bench lowrank --ranks 0.25 --threads 2 --output outputs/bench/lowrank.json"""

GOALS = {'layer': (0.25, 3.0), 'stack': (0.25, 2.0)}     # rank: minimum speed-up over dense
SAME_KERNELS = {'layer': 'dense, oneDNN kernels', 'stack': 'ViT-S blocks, dense, oneDNN kernels'}


def _on_onednn(module):
    """A deep copy of `module` whose nn.Linear layers run `functional.onednn_linear.linear` (the kernels
    FactorizedLinear uses), same weights: the dense baseline on equal kernels."""
    import copy

    from torch import nn

    from ..functional.onednn_linear import linear

    class OneDnnLinear(nn.Linear):
        def forward(self, x):
            return linear(x, self.weight, self.bias)

    module = copy.deepcopy(module)
    for target in module.modules():                      # the module itself included
        if type(target) is nn.Linear:
            target.__class__ = OneDnnLinear
    return module


def _on_torch_kernels(module):
    """A deep copy of `module` run inside `onednn_linear.torch_kernels()`: FactorizedLinear on torch's matmul,
    its reference path."""
    import copy

    from torch import nn

    from ..functional.onednn_linear import torch_kernels

    class TorchKernels(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with torch_kernels():
                return self.inner(x)

    return TorchKernels(copy.deepcopy(module))


def add_arguments(p):
    p.add_argument('--tokens', type=int, default=4096, help='tokens through the single layer (4096)')
    p.add_argument('--in-features', type=int, default=1024)
    p.add_argument('--out-features', type=int, default=4096)
    p.add_argument('--ranks', type=float, nargs='+', default=[0.1, 0.25, 0.5],
                   help='fractions of min(m, n) (0.1 0.25 0.5)')
    p.add_argument('--depth', type=int, default=12, help='ViT-S blocks in the stack (12); 0 skips the stack')
    p.add_argument('--batch-size', type=int, default=8, help='images of 197 tokens through the stack (8)')
    p.add_argument('--steps', type=int, default=5, help='paired rounds = --rounds x --steps, after 2 warm-up steps (5)')
    p.add_argument('--rounds', type=int, default=3, help='see --steps (3)')
    p.add_argument('--threads', type=thread_count, default=0, help='torch threads (0 = torch default)')
    p.add_argument('--output', default=None, help='write the results as JSON here')
    add_record_arguments(p)


def _check(args) -> None:
    for flag in ('tokens', 'in_features', 'out_features', 'batch_size', 'steps', 'rounds'):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.depth < 0:
        raise ValueError(f"--depth must be >= 0, got {args.depth}")
    for rank in args.ranks:
        if not 0 < rank <= 1:
            raise ValueError(f"--ranks: {rank} is out of range: accepted fractions in (0, 1]")
    _check_memory(args)


def _check_memory(args) -> None:
    """Refuse sizes whose step cannot fit in this machine's memory, before allocating (where torch's allocator
    failed with a trace, or the kernel's OOM killer ended the run). A rough upper estimate, float32: the layer's
    candidates (dense, its oneDNN copy and the factorised ones: weights, gradients, momentum) and the tokens'
    activations and their gradients; the stack's blocks with ~40 activations per token and channel."""
    from ..machine import check_fits_memory
    n, m = args.in_features, args.out_features
    layer = 4 * (12 * n * m + 6 * args.tokens * (n + m))
    stack = 4 * args.depth * (40 * args.batch_size * 197 * 384 + 8 * 1_800_000)
    for need, sizes in ((layer, f"--tokens {args.tokens}, --in-features {n} and --out-features {m}"),
                        (stack, f"--depth {args.depth} and --batch-size {args.batch_size}")):
        check_fits_memory(need, f"{sizes}: the step", 'give smaller sizes')


def _step_fn(module, inputs):
    """One training step of `module` on `inputs` (which require grad): forward, backward of a fixed
    upstream gradient, SGD with momentum."""
    import torch
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-4, momentum=0.9)
    grad_out = None

    def step():
        nonlocal grad_out
        out = module(inputs)
        if grad_out is None:
            grad_out = torch.randn_like(out) / out.numel() ** 0.5
        out.backward(grad_out)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        inputs.grad = None
    return step


def _memory_bytes(module, inputs) -> int:
    """3 × parameter bytes (weights, gradients, momentum) + the activations autograd saves for backward
    (distinct storages, parameters and the input not counted again)."""
    import torch
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    known = {p.untyped_storage().data_ptr() for p in module.parameters()} | {inputs.untyped_storage().data_ptr()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in known:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    module.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(inputs).sum().backward()
    module.zero_grad(set_to_none=True)
    inputs.grad = None
    return 3 * params + sum(seen.values())


def _layer_candidates(args):
    import torch
    from torch import nn

    from ..layers.linear.factorized import FactorizedLinear, resolve_rank
    n, m = args.in_features, args.out_features
    dense = nn.Linear(n, m)
    rows = [('dense nn.Linear', None, dense, n * m), (SAME_KERNELS['layer'], None, _on_onednn(dense), n * m)]
    for frac in args.ranks:
        r = resolve_rank(frac, m, n)
        factorized = FactorizedLinear(n, m, rank=r)
        rows.append((f'FactorizedLinear r={r} ({frac:g})', frac, factorized, r * (m + n)))
        rows.append((f'FactorizedLinear r={r} ({frac:g}), torch kernels', frac, _on_torch_kernels(factorized),
                     r * (m + n)))
        rows.append((f'two nn.Linear r={r} ({frac:g})', frac, nn.Sequential(nn.Linear(n, r, bias=False),
                                                                           nn.Linear(r, m)), r * (m + n)))
    inputs = torch.randn(args.tokens, n, requires_grad=True)
    return [(label, frac, module, macs * args.tokens, inputs) for label, frac, module, macs in rows]


def _stack_candidates(args):
    import copy

    import torch
    from timm.models.vision_transformer import Block
    from torch import nn

    from ..models.factorize import factorize
    from .flops import flop_counter

    def count_macs(module, x):
        with flop_counter() as counter:
            module(x)
        return counter.get_total_flops() // 2
    dense = nn.Sequential(*[Block(384, 6, mlp_ratio=4.0, qkv_bias=True) for _ in range(args.depth)])
    inputs = torch.randn(args.batch_size, 197, 384, requires_grad=True)
    rows = [('ViT-S blocks, dense', None, dense), (SAME_KERNELS['stack'], None, _on_onednn(dense))]
    for frac in args.ranks:
        # every linear, also where the rank saves nothing (r >= mn/(m+n), e.g. attn.proj above rank 0.5): the
        # stack measures what that rank costs, so nothing is skipped behind the title's back
        model = factorize(copy.deepcopy(dense), rank=frac, init='spectral', include='all', skip_no_saving=False,
                          verbose=False)
        rows.append((f'ViT-S blocks, rank {frac:g}', frac, model))
    with torch.no_grad():
        return [(label, frac, module, count_macs(module, inputs.detach()), inputs) for label, frac, module in rows]


def _measure(candidates, args, part: str):
    """Every candidate's training step timed back to back, `--rounds` × `--steps` rounds
    (`harness.paired_ratios`): the step time is the median, the speed-up the median per-round ratio to
    dense, with its quartiles."""
    for _, _, module, _, _ in candidates:
        module.train()
    steps = {label: _step_fn(module, inputs) for label, _, module, _, inputs in candidates}
    paired = paired_ratios(steps, candidates[0][0], args.rounds * args.steps)
    print(f"{part}: {args.rounds * args.steps} paired rounds measured", file=sys.stderr, flush=True)
    rows = []
    for label, frac, module, macs, inputs in candidates:
        rows.append({'label': label, 'rank': frac, 'step_s': paired[label]['median_s'], 'macs': macs,
                     'params': sum(p.numel() for p in module.parameters()),
                     'memory_mib': _memory_bytes(module, inputs) / 2 ** 20,
                     'speedup': paired[label]['ratio'], 'speedup_q1': paired[label]['ratio_q1'],
                     'speedup_q3': paired[label]['ratio_q3']})
    dense = rows[0]
    same = paired.get(SAME_KERNELS[part])
    for row in rows:
        row['flop_ratio'] = dense['macs'] / row['macs']
        row['memory_ratio'] = row['memory_mib'] / dense['memory_mib']
        if same is not None:       # the median per-round ratio to the dense layer on oneDNN's kernels
            row['speedup_same_kernels'] = statistics.median(
                d / t for d, t in zip(same['times_s'], paired[row['label']]['times_s']))
    return rows


def gemm_products(tokens: int, n: int, m: int, rank: Optional[int]) -> List[Tuple[str, Tuple[int, int, int]]]:
    """The matrix products of one training step of a linear layer n -> m on `tokens` rows, input grad included,
    as (name, (rows, inner, columns)): the dense layer's three (forward, input grad, weight grad), or for
    rank r the factorised layer's six (h = x Vᵀ, y = h Uᵀ; back: dh = dy U, dU = dyᵀ h, dx = dh V, dV = dhᵀ x)."""
    if rank is None:
        return [('y = x Wᵀ', (tokens, n, m)), ('dx = dy W', (tokens, m, n)), ('dW = dyᵀ x', (m, tokens, n))]
    r = rank
    return [('h = x Vᵀ', (tokens, n, r)), ('y = h Uᵀ', (tokens, r, m)), ('dh = dy U', (tokens, m, r)),
            ('dU = dyᵀ h', (m, tokens, r)), ('dx = dh V', (tokens, r, n)), ('dV = dhᵀ x', (r, tokens, n))]


def _time_products(products, repeats: int = 3) -> List[dict]:
    """Each product timed by itself on `torch.mm` (MKL's GEMM, what nn.Linear runs), median of `repeats`."""
    import torch
    rows = []
    for name, (a, k, b) in products:
        left, right = torch.randn(a, k), torch.randn(k, b)
        seconds = median_seconds(lambda: torch.mm(left, right), repeats=repeats, warmup=1)
        rows.append({'product': name, 'shape': [a, k, b], 'ms': seconds * 1e3,
                     'gflops': 2 * a * k * b / seconds / 1e9})
    return rows


def _gemm_ceiling(args, rounds: int = 5) -> List[dict]:
    """The speed-up the layer's GEMMs alone allow, per rank: the dense step's three products against the factorised
    step's six, the two sets timed back to back for `rounds` paired rounds (`harness.paired_ratios`: the machine's
    speed drifts by more than the effect between two unpaired timings). A step that adds nothing to its GEMMs
    reaches the ceiling; past it only faster GEMMs go. `efficiency` is the factorised products' FLOP rate over the
    dense ones' (the ceiling over the FLOP ratio): where the goal needs more than it, the kernels, not our code,
    decide the goal. Each product's own rate (timed by itself, median of 3) is the breakdown."""
    import torch

    from ..layers.linear.factorized import resolve_rank
    n, m, t = args.in_features, args.out_features, args.tokens

    def runner(products):
        operands = [(torch.randn(a, k), torch.randn(k, b)) for _, (a, k, b) in products]
        return lambda: [torch.mm(left, right) for left, right in operands]

    dense_products = gemm_products(t, n, m, None)
    dense = _time_products(dense_products)
    found = []
    for frac in args.ranks:
        r = resolve_rank(frac, m, n)
        products = gemm_products(t, n, m, r)
        paired = paired_ratios({'dense': runner(dense_products), 'factorised': runner(products)}, 'dense',
                               rounds, warmup=1)['factorised']
        ceiling = paired['ratio']
        found.append({'rank': frac, 'r': r, 'ceiling': ceiling, 'ceiling_q1': paired['ratio_q1'],
                      'ceiling_q3': paired['ratio_q3'], 'rounds': rounds,
                      'efficiency': ceiling / (m * n / (r * (m + n))), 'dense': dense,
                      'products': _time_products(products)})
    return found


def _print_ceiling(ceilings: List[dict]) -> None:
    if not ceilings:
        return
    print("\nthe layer's GEMMs alone on torch.mm (the dense step's 3 against the factorised step's 6, paired rounds): "
          "what a step adding nothing to them would reach; each product's GFLOP/s timed by itself")
    rates = ', '.join(f"{p['product']} {p['gflops']:.1f}" for p in ceilings[0]['dense'])
    print(f"  dense: {rates}")
    for c in ceilings:
        rates = ', '.join(f"{p['product']} {p['gflops']:.1f}" for p in c['products'])
        print(f"  rank {c['rank']:g} (r={c['r']}): {rates}; ceiling {c['ceiling']:.2f}x (quartiles "
              f"{c['ceiling_q1']:.2f}–{c['ceiling_q3']:.2f}, {c['rounds']} rounds): the thin products at "
              f"{c['efficiency']:.0%} of the dense ones' FLOP rate")


def _print(title: str, rows) -> None:
    print(f"\n{title}")
    width = max(len(r['label']) for r in rows)
    print(f"{'':<{width}}  {'params':>9}  {'step ms':>9}  {'speed-up':>8}  {'quartiles':>11}  {'same kernels':>12}  "
          f"{'FLOP ratio':>10}  {'memory MiB':>10}  {'memory ratio':>12}")
    for r in rows:
        quartiles = f"{r['speedup_q1']:.2f}–{r['speedup_q3']:.2f}"
        same = f"{r['speedup_same_kernels']:>11.2f}x" if 'speedup_same_kernels' in r else f"{'-':>12}"
        print(f"{r['label']:<{width}}  {r['params'] / 1e6:>8.2f}M  {r['step_s'] * 1e3:>9.1f}  {r['speedup']:>7.2f}x  "
              f"{quartiles:>11}  {same}  {r['flop_ratio']:>9.2f}x  {r['memory_mib']:>10.1f}  {r['memory_ratio']:>12.2f}")


def _goal(rows, part: str):
    rank, target = GOALS[part]
    match = [r for r in rows if r['rank'] == rank and not r['label'].startswith('two')
             and not r['label'].endswith('torch kernels')]
    if not match:
        return None
    measured = match[0]['speedup']
    return {'part': part, 'rank': rank, 'target_speedup': target, 'measured_speedup': measured,
            'met': measured >= target, 'same_kernels_speedup': match[0].get('speedup_same_kernels')}


def run(args) -> int:
    import torch
    _check(args)
    if args.output:                # before measuring: minutes of timings never die at the write
        check_output_file(args.output, '--output')
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer_rows = _measure(_layer_candidates(args), args, 'layer')
    stack_rows = _measure(_stack_candidates(args), args, 'stack') if args.depth else []
    ceilings = _gemm_ceiling(args)
    env = environment('cpu')                       # after measuring: its kernel choices are made by now
    print()
    print_header(env)
    print(f"{env['cpu']}, {env['threads']} threads, torch {env['torch']}; training step = forward + backward "
          f"(input grad included) + SGD momentum; speed-up: median of {args.rounds * args.steps} back-to-back rounds")
    _print(f"one layer {args.in_features} -> {args.out_features}, {args.tokens} tokens", layer_rows)
    if stack_rows:
        _print(f"ViT-S block stack: {args.depth} blocks, {args.batch_size} x 197 tokens, every linear factorised",
               stack_rows)
    _print_ceiling(ceilings)
    goals = [g for g in (_goal(layer_rows, 'layer'), _goal(stack_rows, 'stack') if stack_rows else None) if g]
    if goals and (args.tokens, args.in_features, args.out_features) == (4096, 1024, 4096):
        print()
        for g in goals:
            same = g['same_kernels_speedup']
            share = f" (over the dense {g['part']} on the same oneDNN kernels: {same:.2f}x)" if same else ''
            print(f"goal {g['part']}: rank {g['rank']} at least {g['target_speedup']:.1f}x faster than dense: "
                  f"measured {g['measured_speedup']:.2f}x, {'met' if g['met'] else 'NOT met'}{share}")
    entries = kind_goals(layer_rows, stack_rows, args, env, run_record(), ceilings)
    print('\n'.join(verdict_line(entry) for entry in entries))
    if args.output:
        write_record(args.output, {'environment': env, 'args': {k: v for k, v in vars(args).items() if k != 'func'},
                                   'layer': layer_rows, 'stack': stack_rows, 'gemms': ceilings, 'goals': goals,
                                   'kind_goals': entries,
                                   'machine_load': run_record()}, args.allow_busy)
    return 0


def kind_goals(layer_rows, stack_rows, args, env: dict, load, ceilings=()) -> list:
    """The two goals as `kinds.goal_entry`s (at the goal's 1024 -> 4096 layer on 4096 tokens; [] otherwise). Where
    one is not met, `bound` says what the hardware leaves: the speed-up is the FLOP ratio × how fast the kernels
    FactorizedLinear runs on are against nn.Linear's (the dense layer on them, measured here) × the factorised
    products' efficiency against the dense GEMM's, and the last cannot exceed about 1. With `ceilings`
    (`_gemm_ceiling`) the layer's bound also says what its GEMMs alone allow."""
    if (args.tokens, args.in_features, args.out_features) != (4096, 1024, 4096):
        return []
    entries = []
    for part, rows in (('layer', layer_rows), ('stack', stack_rows)):
        rank, target = GOALS[part]
        match = [r for r in rows if r['rank'] == rank and not r['label'].startswith('two')
                 and not r['label'].endswith('torch kernels')]
        same = [r for r in rows if r['label'] == SAME_KERNELS[part]]
        if not match:
            continue
        row, bound = match[0], ''
        if same and row['speedup'] < target:
            kernels = 1 / same[0]['step_s'] * rows[0]['step_s']          # dense on those kernels over nn.Linear
            needed = target / (row['flop_ratio'] * kernels)
            bound = (f"{row['flop_ratio']:.2f}× fewer FLOPs on kernels {kernels:.2f}× nn.Linear's: the goal needs the "
                     f"factorised products at {needed:.0%} of the dense GEMM's efficiency"
                     + (" (more than 100 %: it cannot hold here)" if needed > 1 else ''))
            ceiling = [c for c in ceilings if c['rank'] == rank]
            if part == 'layer' and ceiling:
                c = ceiling[0]
                bound += (f"; its GEMMs alone on torch.mm, paired, allow {c['ceiling']:.2f}× (the thin products "
                          f"at {c['efficiency']:.0%} of the dense ones' FLOP rate)"
                          + (": the kernels, not the layer's code, keep it under the goal" if c['ceiling'] < target
                             else ''))
        entries.append(goal_entry(f'lowrank_{part}', row['speedup'], [row['speedup_q1'], row['speedup_q3']],
                                  env.get('threads'), f"rank {rank}, over the same kernels "
                                  f"{row.get('speedup_same_kernels', float('nan')):.2f}×", bound,
                                  busy=bool(load and load.get('busy'))))
    return entries
