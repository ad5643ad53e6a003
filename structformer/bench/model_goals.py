"""The verdicts of `structformer bench models`: CRATE-T's float32 training speed against ViT-T's (the goal of
issue 44, judged per CPU kind), and with `--amp` each family's speed-up over float32 and CRATE-T's over ViT-T's in
that dtype, beside what this CPU computes natively in it. The rows come from `bench.models`; nothing here times."""
from __future__ import annotations

from typing import Optional

from .kinds import flop_rate_split, goal_entry

VIT_T = 'vit_tiny_patch16_224'         # the reference, timm's own ViT-T
CRATE_T = 'crate_tiny_patch16_224'     # judged with its default kwargs (its auto attention path), no transform
PAIR = ((VIT_T, {}), (CRATE_T, {}))    # (model, kwargs) of the reference and of CRATE-T as `bench models` runs them
GOAL_RATIO = 0.9                       # CRATE-T's training speed over ViT-T's, eager or compiled
GOAL_AMP_SPEEDUP = 2.0                 # each family's --amp training speed over its float32 speed
GOAL_AMP_CRATE = 1.25                  # CRATE-T's --amp training speed over ViT-T's --amp speed


def _is(row, model_and_kwargs) -> bool:
    return row['model'] == model_and_kwargs[0] and row['kwargs'] == model_and_kwargs[1] and not row.get('transforms')


def goal(rows, pair=PAIR) -> str:
    """The CRATE-T goal (≥ 0.9× ViT-T's training speed, eager or compiled, float32) judged on the paired
    ratios when they were taken (steadier on a drifting machine), else on the best-of-rounds ratios."""
    rows = [r for r in rows if r.get('dtype', 'float32') == 'float32']
    crate = [r for r in rows if _is(r, pair[1])]
    if not crate or not any(r['model'] == pair[0][0] for r in rows):
        return ''
    source = 'paired' if all(r.get('paired_train') for r in crate) else 'best-of-rounds'
    measured = {r['mode']: r['paired_train']['ratio'] if source == 'paired' else r['train_ratio'] for r in crate}
    best = max(measured.values())
    found = ", ".join(f"{value:.3f}× {mode}" for mode, value in measured.items())   # 0.896 is not 0.90
    return (f"goal: CRATE-T trains at >= {GOAL_RATIO}x ViT-T's speed (eager or compiled): "
            f"{'met' if best >= GOAL_RATIO else 'not met'} ({source}: {found})")


def vit_over_crate_flops(img_size: int, pair=PAIR) -> Optional[float]:
    """ViT-T's forward FLOPs per image over CRATE-T's. (A training step's ratio depends on CRATE's attention path:
    1/1.37 with the shared backward, 1/1.46 with SDPA, against 1/1.44 forward at 224 px; docs/crate.md.)"""
    from .flops import model_flops
    vit, crate = (model_flops(name, img_size=img_size, **kwargs)['flops'] for name, kwargs in pair)
    return vit / crate if crate else None


def kind_goals(rows, load, batch_size: int, img_size: int = 224, pair=PAIR) -> list:
    """The CRATE-T goal as a `kinds.goal_entry` (float32; the best mode, paired where measured), [] where CRATE-T
    or ViT-T was not measured. Missed, it carries the FLOP / FLOP-rate split (`kinds.flop_rate_split`)."""
    crate = [r for r in rows if r.get('dtype', 'float32') == 'float32' and _is(r, pair[1])]
    if not crate or not any(r['model'] == pair[0][0] for r in rows):
        return []
    paired = all(r.get('paired_train') for r in crate)
    value = lambda r: r['paired_train']['ratio'] if paired else r['train_ratio']       # noqa: E731
    best = max(crate, key=value)
    quartiles = [best['paired_train']['ratio_q1'], best['paired_train']['ratio_q3']] if paired else None
    detail = f"{best['mode']}, {'paired' if paired else 'best-of-rounds'}, batch {batch_size}"
    rates, bound = flop_rate_split('crate_vit', value(best), vit_over_crate_flops(img_size, pair))
    return [goal_entry('crate_vit', value(best), quartiles, best.get('threads'), detail, bound,
                       busy=bool(load and load.get('busy')), rates=rates)]


def cpu_capability(dtype: str) -> dict:
    """Whether this CPU computes `dtype` in hardware, and the plain sentence printed beside the verdicts."""
    from ..train.precision import cpu_bfloat16_native, cpu_bfloat16_note, cpu_float16_supported
    if dtype == 'float16':
        native = cpu_float16_supported()
        text = ('this CPU has float16 arithmetic in hardware (AVX-512 FP16 or AMX-FP16)' if native else
                'this CPU has no AVX-512 FP16 or AMX-FP16: float16 is emulated through float32, no speed-up is '
                'expected')
    else:
        native = cpu_bfloat16_native()
        note = '' if native else cpu_bfloat16_note()
        text = ('this CPU has AVX512-BF16/AMX (bfloat16 dot products in hardware)' if native else
                (note.replace(': expect no speed-up', '') if 'capped off' in note else
                 'this CPU has no AVX512-BF16 or AMX') + ': a bfloat16 matmul is emulated, so no speed-up is expected')
    return {'dtype': dtype, 'native': native, 'text': text}


def _judge(selected, ratio_key, paired_key, target) -> dict:
    """{mode: ratio} of `selected` rows, judged on the paired ratios when every row has them (steadier on a
    drifting machine), else on the best-of-rounds ones; met when the best mode reaches `target`."""
    paired = all(r.get(paired_key) for r in selected)
    measured = {r['mode']: (r[paired_key]['ratio'] if paired else r[ratio_key]) for r in selected}
    quartiles = {r['mode']: [r[paired_key]['ratio_q1'], r[paired_key]['ratio_q3']] for r in selected} if paired else {}
    source = 'paired' if paired else 'best-of-rounds'
    met = max(measured.values()) >= target
    found = ", ".join(f"{value:.3f}× {mode}" + (f" (quartiles {quartiles[mode][0]:.3f}–{quartiles[mode][1]:.3f})"
                                                if mode in quartiles else '')
                      for mode, value in measured.items())            # 0.896 is not 0.90
    return {'target': target, 'measured': measured, 'quartiles': quartiles, 'source': source, 'met': met,
            'text': f"{'met' if met else 'not met'} ({source}: {found})"}


def amp_goals(rows, families, amp: str, pair=PAIR) -> list:
    """The --amp verdicts, each a dict with its printed 'line': with --families, every family's training speed
    in `amp` over its float32 speed (goal >= 2.0x, eager or compiled), headed by what this CPU does in `amp`;
    and CRATE-T's `amp` training speed over ViT-T's `amp` speed (goal >= 1.25x)."""
    capability = cpu_capability(amp)
    out = []
    if families:
        out.append({'goal': 'family_speedup', 'target': GOAL_AMP_SPEEDUP, 'cpu': capability,
                    'line': f"goal: each family trains >= {GOAL_AMP_SPEEDUP}x faster in {amp} than in float32 "
                            f"(eager or compiled); {capability['text']}"})
        for family, label, name, _, _ in families:
            selected = [r for r in rows if r['dtype'] == amp and r['label'] in (label, f'{label}, compiled')]
            if not selected:
                continue
            verdict = _judge(selected, 'train_over_float32', 'paired_over_float32', GOAL_AMP_SPEEDUP)
            out.append(dict(verdict, goal='family_speedup', family=family, label=label, model=name, cpu=capability,
                            line=f"  {family} ({label}): {verdict['text']}"))
    crate = [r for r in rows if r['dtype'] == amp and _is(r, pair[1])]
    if crate and any(r['dtype'] == amp and r['model'] == pair[0][0] for r in rows):
        verdict = _judge(crate, 'train_ratio', 'paired_train', GOAL_AMP_CRATE)
        out.append(dict(verdict, goal='crate_over_vit', label='CRATE-T', cpu=capability,
                        line=f"goal: CRATE-T in {amp} trains at >= {GOAL_AMP_CRATE}x ViT-T's {amp} speed "
                             f"(eager or compiled): {verdict['text']}"))
    return out
