"""The kind of CPU a number was measured on: vendor, model, the ISA features that decide which kernels are fast.
A module of its own, below `records` (which re-exports `cpu_kind` beside `cpu_model`), because
`functional.autotune` keys its cache on it and `records.environment` reports autotune's choices: both import this,
neither the other. Only the standard library: `structformer --help` must not pay for torch.
"""
import os
import platform


# /proc/cpuinfo flags that decide which kernels are fast, by the names a reader knows them by
ISA_FLAGS = {'avx2': 'AVX2', 'fma': 'FMA', 'avx512f': 'AVX-512', 'avx512bw': 'AVX-512 BW', 'avx512vl': 'AVX-512 VL',
             'avx512dq': 'AVX-512 DQ', 'avx512_vnni': 'AVX-512 VNNI', 'avx_vnni': 'AVX-VNNI',
             'avx512_bf16': 'AVX-512 BF16', 'avx512_fp16': 'AVX-512 FP16', 'amx_tile': 'AMX',
             'amx_bf16': 'AMX-BF16', 'amx_int8': 'AMX-INT8', 'amx_fp16': 'AMX-FP16'}


# environment variables that make the kernels use less of the ISA than the CPU has (ATen's dispatch, oneDNN's JIT,
# MKL's code path): a run under them takes other kernels than the CPU's own kind, so it is a kind of its own
ISA_CAPS = ('ATEN_CPU_CAPABILITY', 'ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA', 'MKL_ENABLE_INSTRUCTIONS')


def isa_caps() -> dict:
    """The ISA caps set in this process's environment ({} for none): {variable: value}."""
    return {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name, '').strip()}


def _below_avx512(value: str) -> bool:
    """Whether a cap's value (ATen 'default'/'avx2', oneDNN 'AVX2'/'AVX512_CORE_BF16'/'ALL', MKL 'AVX2'/'AVX512')
    keeps the kernels off AVX-512."""
    return not value.strip().lower().startswith(('avx512', 'avx10', 'amx', 'all'))


def capped_below_avx512(caps: dict) -> bool:
    """Whether any of `isa_caps()`'s values keeps some kernel library off AVX-512 (and so off AVX-512 BF16 / AMX)."""
    return any(_below_avx512(v) for v in caps.values())


def _cpuinfo_fields() -> dict:
    """The first processor's fields of /proc/cpuinfo ({} off Linux)."""
    fields = {}
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break                      # one processor is enough: the others are alike
                    continue
                key, _, value = line.partition(':')
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def kind_id(vendor: str, flags) -> str:
    """A short name for a kind of CPU: the vendor and the widest vector ISA with its dot-product extensions,
    e.g. 'amd-avx2', 'amd-avx512-bf16', 'intel-avx512-vnni', 'intel-amx'. Two CPUs of one kind run the same
    kernels (MKL's, oneDNN's and ATen's dispatch on these features), so their speed ratios are comparable."""
    flags = set(flags)
    if 'amx_tile' in flags:
        isa = 'amx'
    elif 'avx512f' in flags:
        isa = 'avx512' + ('-bf16' if 'avx512_bf16' in flags else '-vnni' if 'avx512_vnni' in flags else '')
    elif 'avx2' in flags:
        isa = 'avx2'
    else:
        isa = platform.machine().lower() or 'unknown'
    name = vendor.lower()
    name = 'amd' if 'amd' in name else 'intel' if 'intel' in name else (name or 'unknown')
    return f"{name}-{isa}"


def cpu_kind() -> dict:
    """The kind of CPU this is: vendor, model (with family / model numbers: 'AMD EPYC' names several
    generations), the ISA flags of `ISA_FLAGS` it has, and `kind` (`kind_id`) with a one-line `summary`.
    Where /proc/cpuinfo is missing (not Linux) the flags are empty and the kind says so."""
    fields = _cpuinfo_fields()
    flags = set(fields.get('flags', '').split())
    vendor = fields.get('vendor_id') or platform.machine()
    present = [name for flag, name in ISA_FLAGS.items() if flag in flags]
    numbers = ', '.join(f"{label} {fields[key]}" for key, label in (('cpu family', 'family'), ('model', 'model'))
                        if key in fields)
    model = fields.get('model name') or platform.processor() or platform.machine()   # as records.cpu_model
    kind = kind_id(vendor, flags) if flags else f"unknown-{platform.machine().lower() or 'cpu'}"
    isa = ', '.join(n for n in present if n not in ('FMA', 'AVX-512 BW', 'AVX-512 VL', 'AVX-512 DQ')) or 'no flags read'
    caps = isa_caps()
    capped = capped_below_avx512(caps)
    summary = f"{model}{f' ({numbers})' if numbers else ''}: {isa}"
    if caps:
        # the CPU's kind with what was capped: 'amd-avx512-bf16+cap-avx2' runs AVX2 kernels on an AVX-512 core,
        # which is neither this kind nor an AVX2 CPU (caches, FMA units and clocks stay this CPU's)
        kind += '+cap-' + '-'.join(sorted({v.strip().lower() for v in caps.values()}))
        summary += '; kernels capped by ' + ', '.join(f"{k}={v}" for k, v in sorted(caps.items()))
    return {'kind': kind, 'vendor': vendor, 'model': model, 'family_model': numbers,
            'flags': sorted(flag for flag in ISA_FLAGS if flag in flags), 'isa_caps': caps,
            'bf16_native': bool(flags & {'avx512_bf16', 'amx_bf16'}) and not capped,
            'amx': 'amx_tile' in flags and not capped, 'summary': summary}
