"""The CPU kind read from real /proc/cpuinfo text of the CPUs this project meets (`machine.cpu_kind(cpuinfo)`): the
kind's name (the docs/kinds/ folder and the choice cache's key depend on it), whether bfloat16 is native (only
AVX-512 BF16 or AMX-BF16, and not where an ISA cap keeps the kernels off them) and the hardware facts a benchmark
prints. Flag lines as the kernel prints them on each CPU (public cpuinfo dumps), shortened to one processor."""
import pytest

from structformer import machine
from structformer.bench.kinds import hardware_facts

ROME = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 49
model name\t: AMD EPYC 7742 64-Core Processor
stepping\t: 0
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid extd_apicid aperfmperf pni pclmulqdq monitor ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm extapic cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw ibs skinit wdt tce topoext perfctr_core perfctr_nb bpext perfctr_llc mwaitx cpb cat_l3 cdp_l3 hw_pstate sme ssbd mba sev ibrs ibpb stibp vmmcall fsgsbase bmi1 avx2 smep bmi2 cqm rdt_a rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local clzero irperf xsaveerptr wbnoinvd arat npt lbrv svm_lock nrip_save tsc_scale vmcb_clean flushbyasid decodeassists pausefilter pfthreshold avic v_vmsave_vmload vgif umip rdpid overflow_recov succor smca

processor\t: 1
vendor_id\t: AuthenticAMD
"""
CASCADE_LAKE = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 85
model name\t: Intel(R) Xeon(R) Silver 4210 CPU @ 2.20GHz
stepping\t: 7
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc art arch_perfmon pebs bts rep_good nopl xtopology nonstop_tsc cpuid aperfmperf pni pclmulqdq dtes64 monitor ds_cpl vmx smx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb cat_l3 cdp_l3 invpcid_single intel_ppin ssbd mba ibrs ibpb stibp ibrs_enhanced tpr_shadow vnmi flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm cqm mpx rdt_a avx512f avx512dq rdseed adx smap clflushopt clwb intel_pt avx512cd avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc cqm_mbm_total cqm_mbm_local dtherm ida arat pln pts pku ospke avx512_vnni md_clear flush_l1d arch_capabilities
"""
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc arch_perfmon rep_good nopl xtopology nonstop_tsc cpuid aperfmperf tsc_known_freq pni pclmulqdq monitor ssse3 fma cx16 pdcm pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch invpcid_single ssbd ibrs ibpb stibp ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 smep erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd ida arat avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq rdpid cldemote movdiri movdir64b md_clear serialize amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1

processor\t: 1
"""
GRAVITON2 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""


@pytest.fixture(autouse=True)
def no_caps(monkeypatch):
    for name in machine.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize('text, kind, bf16, amx, numbers, fact', [
    (ROME, 'amd-avx2', False, False, 'family 23, model 49', 'AVX2 only'),
    (CASCADE_LAKE, 'intel-avx512-vnni', False, False, 'family 6, model 85', "MKL's GEMMs"),
    (SAPPHIRE_RAPIDS, 'intel-amx', True, True, 'family 6, model 143', 'bfloat16 dot products in hardware (AMX)'),
    (GRAVITON3, 'arm-sve', False, False, 'implementer 0x41, variant 0x1, part 0xd40', 'Arm BF16 instructions'),
    (GRAVITON2, 'arm-neon', False, False, 'implementer 0x41, variant 0x3, part 0xd0c', 'not an x86-64 CPU'),
])
def test_the_kind_of_each_cpu_met(text, kind, bf16, amx, numbers, fact):
    found = machine.cpu_kind(text)
    assert (found['kind'], found['bf16_native'], found['amx'], found['family_model']) == (kind, bf16, amx, numbers)
    facts = hardware_facts(found)
    assert any(fact in f for f in facts), facts
    if not bf16:
        assert not any('can beat float32' in f for f in facts)
    if kind.startswith('arm'):                 # no x86 sentence about MKL, oneDNN's AVX-512 kernels or emulation
        assert found['vendor'] == 'Arm' and found['model'] == 'Arm CPU' and 'NEON' in found['summary']
        assert not any(x86 in f for f in facts for x86 in ('emulated', 'MKL', 'AVX-512 on', 'AVX2 only'))


def test_two_arm_cpus_are_two_machines_for_the_choice_cache():
    """The cache key holds the CPU's model and family / model numbers: on Arm the part number tells a Graviton 2 from
    a Graviton 3 (both read model 'aarch64' and no numbers before, so a shared home folder mixed their choices)."""
    g2, g3 = machine.cpu_kind(GRAVITON2), machine.cpu_kind(GRAVITON3)
    assert (g2['model'], g2['family_model'], g2['flags']) != (g3['model'], g3['family_model'], g3['flags'])


@pytest.mark.parametrize('cap, bf16, amx', [('AVX512_CORE_VNNI', False, False), ('avx512_core', False, False),
                                            ('AVX512_CORE_BF16', True, False), ('AVX512_CORE_AMX', True, True),
                                            ('ALL', True, True), ('AVX2', False, False)])
def test_a_onednn_cap_below_bf16_or_amx_turns_them_off(monkeypatch, cap, bf16, amx):
    """oneDNN runs torch's bfloat16 GEMMs: held at AVX512_CORE(_VNNI) it cannot use AVX-512 BF16, held below an AMX
    level it cannot use AMX, though the CPU (Sapphire Rapids) has both."""
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', cap)
    found = machine.cpu_kind(SAPPHIRE_RAPIDS)
    assert (found['bf16_native'], found['amx']) == (bf16, amx)
    assert found['kind'] == f'intel-amx+cap-{cap.lower()}'
    if not bf16:
        assert any('capped off' in f and 'emulated' in f for f in hardware_facts(found))


@pytest.mark.parametrize('variable, cap', [('ATEN_CPU_CAPABILITY', 'default'), ('ATEN_CPU_CAPABILITY', 'avx2'),
                                            ('MKL_ENABLE_INSTRUCTIONS', 'AVX2')])
def test_aten_and_mkl_caps_leave_the_bfloat16_gemms_native(monkeypatch, variable, cap):
    """torch's bfloat16 GEMMs are oneDNN's: ATEN_CPU_CAPABILITY (ATen's own vector kernels) and MKL's cap (float32
    GEMMs) do not keep them off AVX-512 BF16 / AMX (on a Zen 5 EPYC a bfloat16 matmul stayed ~4x float32 under each),
    so the trainer must not print "expect no speed-up" there, nor the bench call bfloat16 emulated."""
    import torch
    from structformer.train.precision import cpu_bfloat16_native
    for name in machine.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, cap)
    found = machine.cpu_kind(SAPPHIRE_RAPIDS)
    assert (found['bf16_native'], found['amx']) == (True, True)
    assert not any('emulated' in fact for fact in hardware_facts(found))
    assert cpu_bfloat16_native() == any(getattr(torch.cpu, n, lambda: False)()
                                        for n in ('_is_avx512_bf16_supported', '_is_amx_tile_supported'))


@pytest.mark.parametrize('caps, says', [
    ({'MKL_ENABLE_INSTRUCTIONS': 'AVX2'}, "MKL held below it (MKL_ENABLE_INSTRUCTIONS=AVX2): MKL's kernels run 256-bit "
     "code, oneDNN's (not capped) still use AVX-512"),
    ({'ONEDNN_MAX_CPU_ISA': 'AVX2'}, "oneDNN held below it (ONEDNN_MAX_CPU_ISA=AVX2): oneDNN's kernels run 256-bit "
     "code, MKL's (not capped) still use AVX-512"),
    ({'MKL_ENABLE_INSTRUCTIONS': 'SSE4_2'}, "MKL's kernels run 128-bit code"),
    ({'MKL_ENABLE_INSTRUCTIONS': 'AVX2', 'DNNL_MAX_CPU_ISA': 'AVX2'}, "MKL and oneDNN both held below the CPU's "
     "AVX-512: they run 256-bit kernels")])
def test_the_facts_say_which_gemm_library_a_cap_holds(monkeypatch, caps, says):
    """Each library has its own cap: under MKL_ENABLE_INSTRUCTIONS alone the facts said "AVX2 only: MKL and oneDNN
    both run 256-bit kernels", though oneDNN (torch's bfloat16 GEMMs, our linear kernel) still ran AVX-512."""
    for name in machine.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    for name, value in caps.items():
        monkeypatch.setenv(name, value)
    facts = hardware_facts(machine.cpu_kind(SAPPHIRE_RAPIDS))
    assert any(says in fact for fact in facts), facts
    assert not any('AVX2 only' in fact or 'AVX-512 on an Intel CPU' in fact for fact in facts), facts


def test_without_proc_cpuinfo_the_kind_says_it_read_nothing(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError('/proc/cpuinfo')
    monkeypatch.setattr(machine, 'open', missing, raising=False)
    found = machine.cpu_kind()
    assert found['kind'].startswith('unknown-') and found['flags'] == [] and 'no flags read' in found['summary']
    assert found['bf16_native'] is False and hardware_facts(found) == []


def test_an_unknown_arm_implementer_still_names_a_folder():
    found = machine.cpu_kind(GRAVITON2.replace('0x41', '0x6d'))
    assert found['kind'] == 'arm-implementer-0x6d-neon' and found['vendor'] == 'Arm implementer 0x6d'


def test_a_cap_value_cannot_lead_the_kind_out_of_its_folder(monkeypatch):
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', '../../x')
    assert machine.cpu_kind(ROME)['kind'] == 'amd-avx2+cap--x'


def test_the_trainers_bfloat16_verdict_follows_the_onednn_cap(monkeypatch):
    """`cpu_bfloat16_native` (the bench's bfloat16 verdict, the trainer's warning) under a oneDNN cap at an AVX-512
    level without BF16: not native, whatever this CPU has."""
    from structformer.train.precision import cpu_bfloat16_native
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX512_CORE_VNNI')
    assert cpu_bfloat16_native() is False


def test_float16_is_native_with_avx512_fp16_or_amx_fp16_unless_onednn_is_capped_below(monkeypatch):
    """torch's float16 GEMMs on a CPU run in oneDNN, whose float16 kernels take AVX-512 FP16 (Sapphire Rapids, no
    AMX-FP16) as well as AMX-FP16: float16 autocast is accepted there, refused on the CPUs without either, and under a
    oneDNN cap below AVX512_CORE_FP16; an ATen cap does not reach those GEMMs."""
    from structformer.train.precision import cpu_float16_supported
    assert [cpu_float16_supported(text) for text in (SAPPHIRE_RAPIDS, CASCADE_LAKE, ROME, GRAVITON3)] == \
        [True, False, False, False]
    assert machine.cpu_kind(SAPPHIRE_RAPIDS)['fp16_native'] is True
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', 'default')
    assert cpu_float16_supported(SAPPHIRE_RAPIDS) is True
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX512_CORE_BF16')
    assert cpu_float16_supported(SAPPHIRE_RAPIDS) is False


def test_an_aten_cap_alone_leaves_the_gemms_avx512_facts(monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 caps ATen's own vector kernels, not MKL's or oneDNN's GEMMs: the facts keep
    AVX-512 (not 'AVX2 only: MKL and oneDNN both run 256-bit kernels'); an MKL cap below AVX-512 drops it for MKL
    alone (test_the_facts_say_which_gemm_library_a_cap_holds)."""
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', 'avx2')
    facts = hardware_facts(machine.cpu_kind(CASCADE_LAKE))
    assert any(f.startswith('AVX-512 on an Intel CPU') for f in facts) and not any('AVX2 only' in f for f in facts)
    monkeypatch.setenv('MKL_ENABLE_INSTRUCTIONS', 'AVX2')
    facts = hardware_facts(machine.cpu_kind(CASCADE_LAKE))
    assert any("MKL's kernels run 256-bit code, oneDNN's (not capped) still use AVX-512" in f for f in facts)
    assert not any('AVX2 only' in f or 'AVX-512 on' in f for f in facts)


@pytest.mark.parametrize('files, expected_gib', [
    ({}, None),                                                              # no cgroup: physical memory
    ({'memory.max': 'max\n'}, None),                                         # cgroup v2, no limit
    ({'memory.max': f'{8 * 2 ** 30}\n'}, 8),                                 # a container's or a job's limit
    ({'memory/memory.limit_in_bytes': '9223372036854771712\n'}, None),       # cgroup v1's "no limit"
    ({'memory/memory.limit_in_bytes': f'{3 * 2 ** 30}\n'}, 3),
    ({'memory.max': f'{2 ** 80}\n'}, None),                                  # beyond any machine: physical memory
])
def test_memory_is_the_lower_of_the_machines_and_its_cgroups_limit(tmp_path, monkeypatch, files, expected_gib):
    """A SLURM job or a container gets a cgroup limit below the machine's memory; the OOM killer acts at the limit,
    so sizes are checked against it."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(machine, '_CGROUP_LIMITS', (str(tmp_path / 'memory.max'),
                                                    str(tmp_path / 'memory/memory.limit_in_bytes')))
    physical = machine.os.sysconf('SC_PAGE_SIZE') * machine.os.sysconf('SC_PHYS_PAGES')
    expected = physical if expected_gib is None else min(physical, expected_gib * 2 ** 30)
    assert machine.memory_bytes() == expected


def test_a_size_beyond_memory_is_one_message_naming_what_asked_and_the_remedy(monkeypatch):
    from structformer.errors import UsageError
    monkeypatch.setattr(machine, 'memory_bytes', lambda: 4 * 2 ** 30)
    machine.check_fits_memory(4 * 2 ** 30, '--batch-size 8: one batch')              # exactly what there is: fits
    with pytest.raises(UsageError, match=r"^--batch-size 9: one batch needs about 4\.5 GiB, more than this machine's "
                                         r"4 GiB of memory; lower --batch-size$"):
        machine.check_fits_memory(4.5 * 2 ** 30, '--batch-size 9: one batch', 'lower --batch-size', UsageError)
