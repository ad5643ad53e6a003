"""The kind of CPU a number was measured on: vendor, model, the ISA features that decide which kernels are fast.
A module of its own, below `records` (which re-exports `cpu_kind` beside `cpu_model`), because
`functional.autotune` keys its cache on it and `records.environment` reports autotune's choices: both import this,
neither the other. Only the standard library: `structformer --help` must not pay for torch.
"""
import os
import platform
import re
from typing import Optional


# /proc/cpuinfo flags that decide which kernels are fast, by the names a reader knows them by
ISA_FLAGS = {'avx2': 'AVX2', 'fma': 'FMA', 'avx512f': 'AVX-512', 'avx512bw': 'AVX-512 BW', 'avx512vl': 'AVX-512 VL',
             'avx512dq': 'AVX-512 DQ', 'avx512_vnni': 'AVX-512 VNNI', 'avx_vnni': 'AVX-VNNI',
             'avx512_bf16': 'AVX-512 BF16', 'avx512_fp16': 'AVX-512 FP16', 'amx_tile': 'AMX',
             'amx_bf16': 'AMX-BF16', 'amx_int8': 'AMX-INT8', 'amx_fp16': 'AMX-FP16'}


# Arm's /proc/cpuinfo 'Features' that decide which kernels run (x86 names above; an Arm CPU has none of those)
ARM_FLAGS = {'asimd': 'NEON', 'sve': 'SVE', 'sve2': 'SVE2', 'bf16': 'Arm BF16', 'i8mm': 'I8MM'}
# 'CPU implementer' of Arm's /proc/cpuinfo (there is no vendor_id or model name there)
ARM_IMPLEMENTERS = {'0x41': 'Arm', '0x42': 'Broadcom', '0x43': 'Cavium', '0x46': 'Fujitsu', '0x48': 'HiSilicon',
                    '0x4e': 'NVIDIA', '0x51': 'Qualcomm', '0x61': 'Apple', '0xc0': 'Ampere'}
# oneDNN's ISA levels (ONEDNN_MAX_CPU_ISA) below the one with AVX-512 BF16 dot products, and AMX needs one naming AMX
_ONEDNN_BELOW_BF16 = ('avx512_core', 'avx512_core_vnni')
_ONEDNN_CAPS = ('ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA')


# environment variables that make the kernels use less of the ISA than the CPU has (ATen's dispatch, oneDNN's JIT,
# MKL's code path): a run under them takes other kernels than the CPU's own kind, so it is a kind of its own
ISA_CAPS = ('ATEN_CPU_CAPABILITY', 'ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA', 'MKL_ENABLE_INSTRUCTIONS')


# where a container's or a batch scheduler's memory limit is kept (cgroup v2, then v1); "max" or a v1 value near
# 2^63 means none
_CGROUP_LIMITS = ('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory/memory.limit_in_bytes')


def memory_bytes() -> int:
    """The memory this process may use: the machine's physical memory, or a cgroup's limit where that is lower
    (a container, a SLURM job), which is where the kernel's OOM killer acts. What sizes are checked against before
    allocating."""
    physical = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    return min([physical] + [limit for limit in map(_read_limit, _CGROUP_LIMITS) if limit])


def _read_limit(path: str) -> Optional[int]:
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and 0 < int(text) < 2 ** 62 else None


def check_fits_memory(need: float, what: str, remedy: str = '', error: type = ValueError) -> None:
    """Refuse `need` bytes beyond `memory_bytes()` before anything is allocated (where torch's allocator failed
    with a traceback, or the kernel's OOM killer ended the run without a word): one message naming `what` asked
    for it (the arguments, then the thing that needs the memory) and `remedy`."""
    have = memory_bytes()
    if need > have:
        raise error(f"{what} needs about {need / 2 ** 30:.3g} GiB, more than this machine's {have / 2 ** 30:.3g} GiB "
                    f"of memory" + (f"; {remedy}" if remedy else ''))


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


def bf16_capped(caps: dict) -> bool:
    """Whether the caps keep the kernels off bfloat16 dot products (AVX-512 BF16 / AMX) the CPU may have: oneDNN,
    which runs torch's bfloat16 GEMMs, held below AVX-512 or at an AVX-512 level without BF16 (AVX512_CORE, _VNNI).
    ATEN_CPU_CAPABILITY and MKL_ENABLE_INSTRUCTIONS do not reach those GEMMs: measured on an AVX-512 BF16 EPYC
    (Zen 5), a 1024² bfloat16 matmul stayed ~4x faster than float32 under ATEN_CPU_CAPABILITY=default or
    MKL_ENABLE_INSTRUCTIONS=AVX2, and fell to 0.75x under ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI."""
    return any(name in caps and (_below_avx512(caps[name]) or caps[name].strip().lower() in _ONEDNN_BELOW_BF16)
               for name in _ONEDNN_CAPS)


def fp16_capped(caps: dict) -> bool:
    """Whether the caps keep oneDNN, which runs torch's float16 GEMMs on a CPU, off its float16 arithmetic
    (AVX512_CORE_FP16 and AMX-FP16): `bf16_capped`, or a oneDNN level at AVX512_CORE_BF16."""
    return bf16_capped(caps) or any(name in caps and caps[name].strip().lower() == 'avx512_core_bf16'
                                    for name in _ONEDNN_CAPS)


def amx_capped(caps: dict) -> bool:
    """Whether the caps keep oneDNN off AMX: `bf16_capped`, or a oneDNN level that does not name AMX (or ALL)."""
    return bf16_capped(caps) or any(name in caps and 'amx' not in caps[name].lower()
                                    and caps[name].strip().lower() != 'all' for name in _ONEDNN_CAPS)


def _cpuinfo_fields(text: Optional[str] = None) -> dict:
    """The first processor's fields of /proc/cpuinfo (or of `text`, its contents; {} off Linux)."""
    if text is None:
        try:
            with open('/proc/cpuinfo') as f:
                text = f.read()
        except OSError:
            return {}
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break                              # one processor is enough: the others are alike
            continue
        key, _, value = line.partition(':')
        fields.setdefault(key.strip(), value.strip())
    return fields


def kind_id(vendor: str, flags) -> str:
    """A short name for a kind of CPU: the vendor and the widest vector ISA with its dot-product extensions,
    e.g. 'amd-avx2', 'amd-avx512-bf16', 'intel-avx512-vnni', 'intel-amx', 'arm-sve' (Graviton 3).
    Two CPUs of one kind run the same
    kernels (MKL's, oneDNN's and ATen's dispatch on these features), so their speed ratios are comparable."""
    flags = set(flags)
    if 'amx_tile' in flags:
        isa = 'amx'
    elif 'avx512f' in flags:
        isa = 'avx512' + ('-bf16' if 'avx512_bf16' in flags else '-vnni' if 'avx512_vnni' in flags else '')
    elif 'avx2' in flags:
        isa = 'avx2'
    elif 'sve' in flags:                            # Arm: scalable vectors, else NEON
        isa = 'sve'
    elif 'asimd' in flags:
        isa = 'neon'
    else:
        isa = platform.machine().lower() or 'unknown'
    name = vendor.lower()
    # a file-name-safe word: the kind names a folder of docs/kinds/ ('Arm implementer 0x6d' -> 'arm-implementer-0x6d')
    name = 'amd' if 'amd' in name else 'intel' if 'intel' in name else (re.sub(r'[^a-z0-9]+', '-', name).strip('-')
                                                                         or 'unknown')
    return f"{name}-{isa}"


def cpu_kind(cpuinfo: Optional[str] = None) -> dict:
    """The kind of CPU this is (or the one whose /proc/cpuinfo `cpuinfo` is): vendor, model (with family / model
    numbers: 'AMD EPYC' names several generations; an Arm CPU's implementer and part), the ISA flags of `ISA_FLAGS` /
    `ARM_FLAGS` it has, and `kind` (`kind_id`) with a one-line `summary`. `bf16_native` / `amx`: bfloat16 dot products
    in hardware the kernels may use (AVX-512 BF16 or AMX-BF16, not capped off by `ISA_CAPS`), AMX likewise;
    `fp16_native`: float16 arithmetic in hardware (AVX-512 FP16, Sapphire Rapids on, or AMX-FP16), likewise. Where
    /proc/cpuinfo is missing (not Linux) the flags are empty and the kind says so."""
    fields = _cpuinfo_fields(cpuinfo)
    flags = set(fields.get('flags', '').split()) | set(fields.get('Features', '').split())     # x86 | Arm
    implementer = fields.get('CPU implementer', '').lower()
    vendor = (fields.get('vendor_id') or (ARM_IMPLEMENTERS.get(implementer, f'Arm implementer {implementer}')
                                          if implementer else '') or platform.machine())
    present = [name for flag, name in {**ISA_FLAGS, **ARM_FLAGS}.items() if flag in flags]
    labels = ((('cpu family', 'family'), ('model', 'model')) if 'vendor_id' in fields else
              (('CPU implementer', 'implementer'), ('CPU variant', 'variant'), ('CPU part', 'part')))
    numbers = ', '.join(f"{label} {fields[key]}" for key, label in labels if key in fields)
    model = (fields.get('model name') or (f'{vendor} CPU' if implementer else '')   # as records.cpu_model on x86
             or platform.processor() or platform.machine())
    kind = kind_id(vendor, flags) if flags else f"unknown-{platform.machine().lower() or 'cpu'}"
    isa = ', '.join(n for n in present if n not in ('FMA', 'AVX-512 BW', 'AVX-512 VL', 'AVX-512 DQ')) or 'no flags read'
    caps = isa_caps()
    summary = f"{model}{f' ({numbers})' if numbers else ''}: {isa}"
    if caps:
        # the CPU's kind with what was capped: 'amd-avx512-bf16+cap-avx2' runs AVX2 kernels on an AVX-512 core,
        # which is neither this kind nor an AVX2 CPU (caches, FMA units and clocks stay this CPU's)
        kind += '+cap-' + '-'.join(sorted({re.sub(r'[^a-z0-9_]+', '-', v.strip().lower())    # a folder name
                                           for v in caps.values()}))
        summary += '; kernels capped by ' + ', '.join(f"{k}={v}" for k, v in sorted(caps.items()))
    return {'kind': kind, 'vendor': vendor, 'model': model, 'family_model': numbers,
            'flags': sorted(flag for flag in {**ISA_FLAGS, **ARM_FLAGS} if flag in flags), 'isa_caps': caps,
            'bf16_native': bool(flags & {'avx512_bf16', 'amx_bf16'}) and not bf16_capped(caps),
            'fp16_native': bool(flags & {'avx512_fp16', 'amx_fp16'}) and not fp16_capped(caps),
            'amx': 'amx_tile' in flags and not amx_capped(caps), 'summary': summary}
