"""Benchmarks judged per kind of CPU: the kind printed with every result, each goal's verdict in one standard
form, the hardware facts that bound a goal on this kind, and the rule that keeps busy runs out of docs/.

The same commit gives different speed ratios on different CPUs (issue 44): which GEMM library is fastest, whether
bfloat16 is computed in hardware, how much a second core gives a compute-bound kernel against a memory-bound
one. So a verdict is only meaningful beside the kind it was measured on (`records.cpu_kind`: vendor, model,
AVX2 / AVX-512 / VNNI / BF16 / AMX), and docs/benchmarks.md keeps one goals table per kind met
(`bench/kind_tables.py` renders them from the committed records).

- `GOALS`: the speed goals, each measured by one benchmark; `goal_entry` is the standard record of a verdict
  that every benchmark JSON carries under 'kind_goals' (the tables are rendered from these).
- `header_lines(env)`: the CPU kind, its hardware facts and the kernel choices, printed by every benchmark.
- `add_record_arguments` / `write_record`: `--allow-busy`; a record bound for the project's docs/ is written
  only from a quiet run unless `--allow-busy` says otherwise, and a refused one goes to a temporary file with
  the time a quiet rerun takes.

Only the standard library at import: `structformer --help` imports the benchmarks' parsers.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

from ..machine import ISA_FLAGS, capped_below_avx512

# goal id: (benchmark, what is measured, comparison, target)
GOALS = {
    'crate_vit': ('models', "CRATE-T / ViT-T training speed, float32, paired", '>=', 0.9),
    'soft_sdpa': ('attention', "SDPA / SOFT forward time at 12,544 tokens, 1 thread, paired", '>=', 40.0),
    'sparsifiner_sdpa': ('sparse-attention', "Sparsifiner attention / SDPA time at n 577, keep 0.25", '<=', 0.6),
    'lowrank_layer': ('lowrank', "nn.Linear / rank-0.25 FactorizedLinear step, 1024 -> 4096 on 4096 tokens", '>=', 3.0),
    'lowrank_stack': ('lowrank', "dense / rank-0.25 ViT-S block stack step", '>=', 2.0),
    'rp_mixer_step': ('mlp', "RP-Mixer / Mixer training step (CIFAR setting), paired", '<=', 1.15),
    'monarch_step': ('mlp', "nn.Linear / MonarchLinear training step at n 4096, paired", '>=', 4.0),
}
# the project's docs folder: records written here must come from a quiet run (tests point it elsewhere)
DOCS_DIR = Path(__file__).resolve().parents[2] / 'docs'
RECORDS_COMMAND = 'make bench-records'
RECORDS_MINUTES = 9             # without committed records to go by: the quiet 2-core Zen 5 took 7.7 min, 9.1 min with
                                # its kernels capped to AVX2, and the AVX2-only Zen 1 26.9 min (docs/benchmarks.md)


# the records `make bench-records` writes into docs/kinds/KIND/ (kind_tables.RECORDS runs them; a test keeps the two
# lists equal); a kind's folder may hold others beside them (models_bf16.json), which that run does not make
RECORD_FILES = ('sparse_attention.json', 'attention.json', 'lowrank.json', 'mlp/mlp.json', 'models.json')


def records_minutes(kind: Optional[str] = None, docs: Optional[Path] = None) -> str:
    """How long `make bench-records` takes, as a phrase, from the committed records rather than one machine's
    figure: the wall time of `kind`'s records (docs/kinds/KIND/`RECORD_FILES`, each benchmark's measuring time) where that
    kind has them, else the range over every kind measured, else `RECORDS_MINUTES`. Records are read as JSON only;
    an unreadable one is skipped."""
    import json
    folder = (docs or DOCS_DIR) / 'kinds'

    def minutes(kind_folder: Path) -> Optional[float]:
        total = 0.0
        for path in (kind_folder / name for name in RECORD_FILES):
            try:
                wall = (json.loads(path.read_text()).get('machine_load') or {}).get('wall_s')
            except (OSError, ValueError, AttributeError, RecursionError):
                continue
            total += wall if isinstance(wall, (int, float)) else 0.0
        return total / 60 if total > 0 else None

    own = minutes(folder / kind) if kind and (folder / kind).is_dir() else None
    if own:
        return f"about {own:.0f} min on this kind of CPU (its committed records' measuring time)"
    known = sorted(m for m in (minutes(f) for f in (folder.iterdir() if folder.is_dir() else []) if f.is_dir()) if m)
    if known:
        return (f"{known[0]:.0f}–{known[-1]:.0f} min by CPU kind (the committed records' measuring time; "
                f"this kind has none yet)" if known[-1] - known[0] >= 1 else f"about {known[0]:.0f} min")
    return f"about {RECORDS_MINUTES} min"


def met(goal: str, value: Optional[float]) -> Optional[bool]:
    if value is None:
        return None
    _, _, comparison, target = GOALS[goal]
    return value >= target if comparison == '>=' else value <= target


def goal_entry(goal: str, value: Optional[float], quartiles=None, threads: Optional[int] = None,
               detail: str = '', bound: str = '', busy: Optional[bool] = None,
               rates: Optional[dict] = None) -> dict:
    """The standard verdict of one goal: its id, what it measures, the target, the measured value (a paired median
    where the benchmark pairs) with its quartiles, the threads, met or not (None: not measured), a detail (e.g.
    the realised density), `bound`: why the goal cannot hold on this kind, from the hardware, where it cannot,
    whether the machine was busy, and `rates` (`flop_rate_split`) where the benchmark counted both sides' FLOPs."""
    bench, what, comparison, target = GOALS[goal]
    entry = {'goal': goal, 'bench': bench, 'what': what, 'target': f"{comparison} {target:g}", 'value': value,
             'quartiles': list(quartiles) if quartiles else None, 'threads': threads, 'met': met(goal, value),
             'detail': detail, 'bound': bound, 'busy': busy}
    if rates is not None:
        entry['rates'] = rates
    return entry


# goal id: (the structured path, its baseline, how both were counted, what bounds the structured path's FLOP rate)
SPLITS = {
    'crate_vit': ('CRATE-T', 'ViT-T', 'forward matmul FLOPs per image, FlopCounterMode',
                  "CRATE-T's layers run on the kernels chosen for this machine (functional/autotune.py), ViT-T's on "
                  "nn.Linear and SDPA"),
    'soft_sdpa': ('SOFT', 'SDPA', "matmul FLOPs, FlopCounterMode",
                  "SOFT's thin products against m landmarks and its element-wise passes over n × m, which the count "
                  "leaves out, are bound by memory bandwidth; SDPA's n × n tiles by the FMA units"),
    'sparsifiner_sdpa': ('the sparse attention', 'SDPA',
                         "analytic matmul FLOPs at the measured nnz of its mask, predictor included: "
                         "bench/sparse_flops.py",
                         "its kept key tiles are gathered and multiplied a few rows at a time, with the predictor and "
                         "the top-k beside them, where SDPA streams dense tiles through one fused kernel"),
    'rp_mixer_step': ('RP-Mixer', 'the Mixer', 'forward matmul FLOPs per image, FlopCounterMode',
                      "its random permutations move every activation through memory once more per mixing layer and "
                      "do no arithmetic"),
    'monarch_step': ('MonarchLinear', 'nn.Linear', 'forward matmul FLOPs per row, FlopCounterMode',
                     "its 64 × 64 block products are small batched GEMMs with two permutations between them, where "
                     "nn.Linear is one large GEMM near the FMA units' peak"),
}


def flop_rate_split(goal: str, value: Optional[float], flop_ratio: Optional[float]) -> tuple:
    """A speed goal split into what the arithmetic fixes and what this machine's kernels give: ``(rates, bound)``.

    Every goal times a structured path against a baseline doing the same job. With `flop_ratio` = the baseline's
    FLOPs / the structured path's (one counter for both, named in `SPLITS`), a speed-up goal (time of the baseline
    / time of the structured path) is ``flop_ratio × rate`` and a time-fraction goal (structured / baseline) is
    ``1 / (flop_ratio × rate)``, where ``rate`` is the structured path's FLOPs per second over the baseline's: the
    hardware's verdict on the two sets of kernels (a large dense GEMM or attention tile runs near the FMA units'
    peak; thin products, gathers and passes over memory do not). `rates` records ``flop_ratio``, ``rate`` and
    ``rate_needed`` (the rate at which the goal would just hold); `bound` is the sentence a missed goal carries:
    the FLOPs, the rate it needed against the rate it got, and what bounds the structured path's rate (`SPLITS`);
    '' where the goal is met or either number is missing. (The low-rank goals carry their own, finer split:
    bench/lowrank.py measures the dense layer on the factorised layer's kernels too.)"""
    if value is None or not flop_ratio or flop_ratio <= 0 or value <= 0:
        return None, ''
    fast, base, counted, why = SPLITS[goal]
    _, _, comparison, target = GOALS[goal]
    if comparison == '>=':                       # value = time(base) / time(fast)
        rate, needed = value / flop_ratio, target / flop_ratio
    else:                                        # value = time(fast) / time(base)
        rate, needed = 1 / (flop_ratio * value), 1 / (flop_ratio * target)
    rates = {'flop_ratio': flop_ratio, 'rate': rate, 'rate_needed': needed}
    if met(goal, value):
        return rates, ''
    work = (f"{flop_ratio:.3g}× fewer FLOPs than {base}" if flop_ratio >= 1
            else f"{1 / flop_ratio:.3g}× the FLOPs of {base}")
    bound = (f"{fast} does {work} ({counted}): the goal needs {fast} at {needed:.0%} of {base}'s FLOP rate"
             + (" (above the baseline's own: only kernels faster than the baseline's can meet it)" if needed > 1 else '')
             + f", it ran at {rate:.0%} ({why})")
    return rates, bound


def soft_goal_entries(goals: dict, env: dict, load) -> list:
    """`bench attention`'s goal (b), SDPA / SOFT forward time, as a `goal_entry` ([] where not measured). Measured
    at other than 12,544 tokens, off the CPU or at more than one thread it is recorded with that said, since the
    goal is stated at 12,544 tokens and 1 thread (a second core speeds SDPA's compute-bound kernel more than
    SOFT's memory-bound passes)."""
    found = goals.get('sdpa_over_soft_forward_time')
    if not found:
        return []
    stated = []
    if found['tokens'] != 12544:
        stated.append(f"measured at {found['tokens']} tokens, the goal is stated at 12,544")
    if env.get('threads') != 1:
        stated.append(f"measured at {env.get('threads')} threads, the goal is stated at 1")
    if env.get('device', 'cpu') != 'cpu':
        stated.append(f"measured on {env['device']}, the goal is stated for a CPU")
    detail = f"{found['source']}" + (f"; {'; '.join(stated)}" if stated else '')
    rates, bound = flop_rate_split('soft_sdpa', found['ratio'], found.get('flop_ratio'))
    return [goal_entry('soft_sdpa', found['ratio'], found.get('quartiles'), env.get('threads'), detail, bound,
                       busy=bool(load and load.get('busy')), rates=rates)]


def verdict_line(entry: dict) -> str:
    """'goal crate_vit (CRATE-T / ViT-T ..., >= 0.9): met (0.931×, quartiles 0.91–0.95, 1 thread)'."""
    if entry['value'] is None:
        state = 'not measured'
    else:
        q = entry.get('quartiles')
        numbers = f"{entry['value']:.3f}×" + (f", quartiles {q[0]:.3f}–{q[1]:.3f}" if q else '')
        numbers += f", {entry['threads']} thread{'s' if entry['threads'] != 1 else ''}" if entry.get('threads') else ''
        state = f"{'met' if entry['met'] else 'not met'} ({numbers}{'; ' + entry['detail'] if entry['detail'] else ''})"
    bound = f"; on this kind: {entry['bound']}" if entry.get('bound') else ''
    busy = ' [BUSY machine: re-measure quietly before judging]' if entry.get('busy') else ''
    return f"goal {entry['goal']} ({entry['what']}, {entry['target']}): {state}{bound}{busy}"


# ---- the kind, printed by every benchmark ----------------------------------------------------------------------

def hardware_facts(kind: dict) -> list:
    """What this kind's hardware means for the goals, one sentence each, from its flags alone."""
    flags = set(kind.get('flags') or ())
    caps = kind.get('isa_caps') or {}
    # the facts below are about the GEMM libraries (MKL, oneDNN); ATEN_CPU_CAPABILITY reaches only ATen's own vector
    # kernels (softmax, elementwise), so under it alone MKL and oneDNN still run AVX-512 (machine.bf16_capped). Each
    # library has its own cap: MKL_ENABLE_INSTRUCTIONS holds MKL alone, ONEDNN_MAX_CPU_ISA (DNNL_) oneDNN alone
    held = {library: sorted(f"{k}={caps[k]}" for k in names if k in caps)
            for library, names in (('MKL', ('MKL_ENABLE_INSTRUCTIONS',)),
                                   ('oneDNN', ('ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA')))
            if capped_below_avx512({k: caps[k] for k in names if k in caps})}
    width = lambda libraries: ('128-bit' if all(cap.split('=', 1)[1].strip().lower().startswith('sse')  # noqa: E731
                                                for library in libraries for cap in held[library]) else '256-bit')
    avx512_cpu = 'avx512f' in flags
    if len(held) == 2:
        flags = {f for f in flags if not f.startswith(('avx512', 'amx'))}     # capped below AVX-512: its kernels idle
    facts = []
    if flags and not flags & set(ISA_FLAGS):             # an Arm CPU: none of the x86 kernels' questions apply
        facts.append("not an x86-64 CPU: oneDNN's linear kernel and the Sparsifiner tile kernel do not run here, "
                     "torch's own kernels do")
        if 'bf16' in flags:
            facts.append("Arm BF16 instructions: whether torch's bfloat16 matmuls use them depends on its build; "
                         "bfloat16 is judged not native here (its speed-ups were measured on AVX-512 BF16 / AMX only)")
        return facts
    if kind.get('bf16_native'):
        facts.append('bfloat16 dot products in hardware (' + ('AMX' if kind.get('amx') else 'AVX-512 BF16') +
                     '): bfloat16 matmuls can beat float32')
    elif set(kind.get('flags') or ()) & {'avx512_bf16', 'amx_bf16'}:
        facts.append('AVX-512 BF16 / AMX present but capped off ('
                     + ', '.join(f"{k}={v}" for k, v in sorted(caps.items()))
                     + '): a bfloat16 matmul is emulated, no bfloat16 speed-up is possible')
    elif flags:
        facts.append('no AVX-512 BF16 or AMX: a bfloat16 matmul is emulated, no bfloat16 speed-up is possible')
    if 'avx512f' in flags and held:                     # one library held below AVX-512, the other not
        (capped, why), = held.items()
        free = 'oneDNN' if capped == 'MKL' else 'MKL'
        facts.append(f"AVX-512 CPU with {capped} held below it ({', '.join(why)}): {capped}'s kernels run "
                     f"{width([capped])} code, {free}'s (not capped) still use AVX-512, so which is faster is "
                     "measured, not assumed")
    elif 'avx512f' in flags and 'amd' in kind.get('kind', ''):
        facts.append("AVX-512 on an AMD CPU: torch's MKL GEMMs (nn.Linear, bmm) run their non-Intel code, oneDNN's "
                     "JIT kernels use AVX-512, so which is faster is measured, not assumed (functional/autotune.py)")
    elif 'avx512f' in flags:
        facts.append("AVX-512 on an Intel CPU: MKL's GEMMs (nn.Linear) run AVX-512 code, so a dense baseline is on "
                     "the fastest GEMM available and a structured layer gains at most its FLOP ratio")
    elif avx512_cpu:                                    # both libraries held below the AVX-512 the CPU has
        facts.append(f"MKL and oneDNN both held below the CPU's AVX-512: they run {width(held)} kernels")
    elif 'avx2' in flags:
        facts.append('AVX2 only: MKL and oneDNN both run 256-bit kernels')
    if caps:
        facts.append('kernels capped by ' + ', '.join(f"{k}={v}" for k, v in sorted(caps.items())) +
                     ': these ratios are those of the capped kernels on this CPU (its caches, FMA units and clocks), '
                     'not those of a CPU whose widest ISA is the cap')
    return facts


def header_lines(env: dict) -> list:
    """The CPU kind, its hardware facts and this run's kernel choices, for the top of a benchmark's report."""
    kind = env.get('cpu_kind') or {}
    lines = [f"CPU kind {kind.get('kind', '?')}: {kind.get('summary', env.get('cpu', '?'))}; ATen kernels "
             f"{env.get('aten_cpu_capability', '?')}, {env.get('threads')} thread(s), torch {env.get('torch')}"]
    lines += [f"  {fact}" for fact in hardware_facts(kind)]
    choices = env.get('choices') or {}
    overrides = choices.get('overrides') or {}
    if overrides:
        lines.append('  kernel overrides: ' + ', '.join(f"{k}={v}" for k, v in sorted(overrides.items())))
    cached = cache_summary(choices.get('cached') or {})
    if cached:
        lines.append(f"  kernel choices cached for this machine (shape classes per choice; every class in the "
                     f"record's environment.choices, file {choices.get('cache_file', '?')}): {cached}")
    if choices.get('timing') == 'off':
        lines.append('  kernel choices: timing off (STRUCTFORMER_AUTOTUNE=off): every choice takes its default rule')
    return lines


def cache_summary(cached: dict) -> str:
    """The cached kernel choices in one short line: per choice, how many shape classes took each candidate
    (`linear_kernel 78 onednn, 2 torch; ssa_impl 19 sdpa, 2 shared`). The cache grows with every shape a process on
    this machine met (tests, other runs), so listing each class would bury the header; the record keeps them all."""
    parts = []
    for name, entries in sorted(cached.items()):
        counts = {}
        for choice in entries.values():
            counts[choice] = counts.get(choice, 0) + 1
        if counts:
            parts.append(f"{name} " + ', '.join(f"{n} {choice}" for choice, n in
                                                 sorted(counts.items(), key=lambda item: (-item[1], item[0]))))
    return '; '.join(parts)


def print_header(env: dict) -> None:
    print('\n'.join(header_lines(env)))


# ---- records: quiet runs only into docs/ ----------------------------------------------------------------------

def add_record_arguments(p) -> None:
    p.add_argument('--allow-busy', action='store_true',
                   help="write the record into the project's docs/ even when the machine was busy while measuring "
                        "(by default a busy run's record goes to a temporary file instead)")


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def write_record(path, obj: dict, allow_busy: bool = False) -> str:
    """Write a benchmark's JSON record to `path` (atomically), unless `path` is inside the project's docs/ and the
    run was busy (`obj['machine_load']['busy']`) without `allow_busy`: then it goes to a temporary file, and the
    message says where, why and how long a quiet rerun takes. Returns the path written."""
    from ..records import write_json
    load = obj.get('machine_load') or {}
    target = Path(path)
    if load.get('busy') and not allow_busy and _inside(target, DOCS_DIR):
        elapsed = load['wall_s'] / 60 if load.get('wall_s') else None
        folder = Path(tempfile.gettempdir()) / 'structformer-busy-records'
        written = write_json(folder / target.name, obj)
        took = f"this run took {elapsed:.1f} min, a quiet rerun about as long; " if elapsed else ''
        print(f"not written to {path}: the machine was BUSY while this was measured (other processes used "
              f"{load.get('other_cores')} cores); the record is in {written}. Re-run on a quiet machine ({took}"
              f"`{RECORDS_COMMAND}` re-measures every record of this CPU kind in "
              f"{records_minutes(((obj.get('environment') or {}).get('cpu_kind') or {}).get('kind'))} on a "
              f"quiet machine), or "
              f"pass --allow-busy to write it anyway", file=sys.stderr)
        return written
    return write_json(path, obj)


def docs_path(*parts) -> str:
    return os.path.join(str(DOCS_DIR), *parts)
