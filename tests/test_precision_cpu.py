"""Mixed precision on the CPU as a laptop user runs it (docs/precision.md): which dtype a resumed run trains in."""
import argparse

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from structformer.errors import UsageError


def _saved_run(monkeypatch, precision: str, amp_dtype=None):
    """A checkpoint of a run trained with --amp (amp_dtype as given; None: the device's default), whose state
    records the dtype it trained in."""
    from structformer.train import checkpoint
    from structformer.train.config import TrainConfig
    config = TrainConfig(model='crate_digits', data='digits', epochs=2, amp=True, amp_dtype=amp_dtype).to_dict()
    state = {'config': config, 'epoch': 1, 'precision': precision, 'path': 'run/checkpoints/epoch_0001'}
    monkeypatch.setattr(checkpoint, 'load_checkpoint', lambda source, **kwargs: ({}, state, {}))


@pytest.mark.parametrize('recorded', ['bfloat16', 'float16'])
def test_a_resumed_amp_run_keeps_the_dtype_it_trained_in(monkeypatch, recorded):
    """`--amp` alone resolves to the device's default (bfloat16 on a CPU, float16 on CUDA): resumed on another
    device, the run must go on in the dtype its checkpoint records, not silently switch (a CUDA float16 run,
    resumed on a CPU, trained on in bfloat16 without a word and dropped its loss scale)."""
    from structformer.commands.train import _resume_config
    _saved_run(monkeypatch, recorded)
    args = argparse.Namespace(resume='run')
    assert _resume_config(args, {}, {}, None)['amp_dtype'] == recorded
    # where the recorded dtype cannot run (float16 on a CPU without AMX-FP16) the refusal tells the user to give
    # --amp-dtype bfloat16: a resume must accept it, not call it a change of the saved configuration
    assert _resume_config(args, {'amp_dtype': 'bfloat16', 'device': 'cpu'}, {}, None)['amp_dtype'] == 'bfloat16'


def test_a_resumed_float32_run_still_refuses_amp(monkeypatch):
    from structformer.commands.train import _resume_config
    from structformer.train import checkpoint
    from structformer.train.config import TrainConfig
    state = {'config': TrainConfig(model='crate_digits', data='digits', epochs=2).to_dict(), 'epoch': 1,
             'precision': 'float32', 'path': 'run/checkpoints/epoch_0001'}
    monkeypatch.setattr(checkpoint, 'load_checkpoint', lambda source, **kwargs: ({}, state, {}))
    values = _resume_config(argparse.Namespace(resume='run'), {}, {}, None)
    assert not values['amp'] and values.get('amp_dtype') is None
    with pytest.raises(UsageError, match='--amp cannot change on --resume'):
        _resume_config(argparse.Namespace(resume='run'), {'amp': True}, {}, None)


def test_the_model_card_names_the_autocast_dtype_a_run_trained_in(tmp_path):
    """`--amp` alone records no dtype in the configuration: the exported model card must say the one the run
    trained in (the checkpoint's record), not a bare 'amp: True'."""
    import timm

    from structformer.export.hf import model_card
    from structformer.train.config import TrainConfig
    model = timm.create_model('crate_digits')
    state = {'path': str(tmp_path / 'epoch_0001'), 'model': 'crate_digits', 'epoch': 1, 'precision': 'bfloat16',
             'config': TrainConfig(model='crate_digits', data='digits', epochs=1, amp=True).to_dict()}
    card = model_card(model, state, 'crate_digits')
    assert 'amp: bfloat16 autocast, float32 weights' in card
    state['config']['amp'] = False
    assert 'autocast' not in model_card(model, dict(state, precision='float32'), 'crate_digits')


class _CustomOpDtypes(TorchDispatchMode):
    """The floating dtypes each structformer custom op is called with (after autocast's casts)."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith('structformer.'):
            dtypes = {t.dtype for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()}
            self.seen.setdefault(name.split('.')[1], set()).update(dtypes)
        return func(*args, **kwargs)


def _float16_layers():
    from structformer.functional import tile_kernel
    from structformer.layers.attention.mssa import MSSA
    from structformer.layers.attention.sparsifiner import SparsifinerAttention
    layers = {'mssa': (MSSA(16, num_heads=2, ssa_impl='shared'), (2, 9, 16),
                       {'shared_qkv_attention_forward': torch.float16, 'shared_qkv_attention_backward': torch.float16})}
    if tile_kernel.unavailable_reason() is None:
        torch.manual_seed(3)
        layer = SparsifinerAttention(32, num_heads=2, qkv_bias=True, basis_init='scaled', seq_len=65,
                                     connectivity='block', block_size=16, impl='kernel')
        layers['sparsifiner_kernel'] = (layer, (2, 65, 32), {op: torch.float32 for op in (
            'block_connectivity', 'block_tile_attention', 'block_tile_attention_backward')})
    return layers


@pytest.mark.parametrize('name', ['mssa', 'sparsifiner_kernel'])
def test_custom_ops_keep_their_dtype_under_cpu_float16_autocast(name):
    """docs/precision.md's table under CPU float16 autocast (what `--amp-dtype float16` runs on a CPU with AMX-FP16):
    the shared-QKV ops in the autocast dtype, the tile kernel in float32 (cast in, float16 out), the layer's output
    float16 and the parameters' gradients float32 and finite; output within S·u of float32 (u = 2⁻¹¹, float16's unit
    roundoff; S = 11 roundings as counted for MSSA and 8 for the kernel path in tests/test_autocast_policy.py)."""
    layers = _float16_layers()
    if name not in layers:
        pytest.skip('the CPU tile kernel is unavailable here')
    layer, shape, policy = layers[name]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    want = layer(x).detach()
    log = _CustomOpDtypes()
    with log:
        with torch.autocast('cpu', dtype=torch.float16):
            got = layer(x)
        got.float().square().sum().backward()
    assert got.dtype == torch.float16
    assert {op: log.seen.get(op) for op in policy} == {op: {dtype} for op, dtype in policy.items()}
    grads = [p.grad for p in layer.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    rounds = 11 if name == 'mssa' else 8
    assert float((got.detach().double() - want.double()).norm() / want.double().norm()) <= rounds * 2.0 ** -11


def _bf16_logits(shape, gap=None, seed=0):
    """bf16 logits as a head's Linear returns them under CPU autocast; with `gap`, (teacher, student) that close."""
    gen = torch.Generator().manual_seed(seed)
    teacher = 3 * torch.randn(*shape, generator=gen)
    if gap is None:
        return teacher.bfloat16()
    return teacher.bfloat16(), (teacher + gap * torch.randn(*shape, generator=gen)).bfloat16()


def test_the_losses_take_float32_logits_under_cpu_autocast():
    """CPU autocast runs log_softmax in bfloat16 (CUDA's in float32); timm's SoftTargetCrossEntropy (the Mixup
    loss) takes log_softmax of the logits: under `--amp` on a CPU it must see them in float32, as on CUDA, so the
    loss is exactly the float32 loss of the same (bf16-valued) logits."""
    from timm.loss import SoftTargetCrossEntropy

    from structformer.train.phases import LossContext, cross_entropy_term
    logits = _bf16_logits((8, 100)).requires_grad_()
    targets = torch.softmax(torch.randn(8, 100, generator=torch.Generator().manual_seed(1)), -1)
    want = SoftTargetCrossEntropy()(logits.detach().float(), targets)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        got = cross_entropy_term(LossContext(None, None, targets, logits))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    got.backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad).all()


def test_the_distillation_kl_is_float32_under_cpu_autocast():
    """Eq. 9's KL(p_teach ‖ p_student) near convergence (student logits within 0.02 of the teacher's): in bfloat16
    log-probabilities (8 bits) it came out negative; in float32 it must match float64 on the same bf16-valued
    logits to float32 rounding: each term p_t·(log p_t − log p_s) carries ~8 float32 roundings of numbers up to
    max|log p|, and the p_t sum to 1 per row, so |error| ≤ 8·2⁻²⁴·max|log p|."""
    import torch.nn.functional as F

    from structformer.train.distill import logit_distillation_term
    from structformer.train.phases import LossContext
    teacher, student = _bf16_logits((16, 1000), gap=0.02)

    class Teacher:
        def teacher(self):
            return {'logits': teacher}
    log_t, log_s = F.log_softmax(teacher.double(), -1), F.log_softmax(student.double(), -1)
    want = float((log_t.exp() * (log_t - log_s)).sum(-1).mean())
    with torch.autocast('cpu', dtype=torch.bfloat16):
        got = logit_distillation_term(LossContext(None, None, None, student, extras={'distiller': Teacher()}))
    bound = 8 * 2.0 ** -24 * float(torch.maximum(log_t.abs().max(), log_s.abs().max()))
    assert got.dtype == torch.float32 and want > 0
    assert abs(float(got) - want) <= bound, (float(got), want, bound)


def test_the_plan_line_says_why_bfloat16_will_not_be_faster(monkeypatch):
    """The trainer's plan line: nothing where bfloat16 dot products run natively; on a CPU that has them but a
    oneDNN cap keeps torch's GEMMs off them, the cap by name (not "this CPU has no ... AVX512-BF16 or AMX", which
    tells the owner of such a CPU something false); on a CPU without them, that."""
    from structformer import machine
    from structformer.train import precision
    for name in machine.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cpu, '_is_avx512_bf16_supported', lambda: True)
    assert precision.cpu_bfloat16_note() == ''
    monkeypatch.setenv('ATEN_CPU_CAPABILITY', 'default')                 # ATen's cap leaves the GEMMs native
    assert precision.cpu_bfloat16_note() == ''
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX2')
    note = precision.cpu_bfloat16_note()
    assert 'capped off by ONEDNN_MAX_CPU_ISA=AVX2' in note and 'has no' not in note
    monkeypatch.setattr(torch.cpu, '_is_avx512_bf16_supported', lambda: False)
    monkeypatch.setattr(torch.cpu, '_is_amx_tile_supported', lambda: False)
    assert 'this CPU has no bfloat16 dot products' in precision.cpu_bfloat16_note()


def test_the_bench_verdict_names_the_cap_too(monkeypatch):
    from structformer import machine
    from structformer.bench.model_goals import cpu_capability
    for name in machine.ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cpu, '_is_avx512_bf16_supported', lambda: True)
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX512_CORE_VNNI')
    verdict = cpu_capability('bfloat16')
    assert not verdict['native'] and 'capped off by ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI' in verdict['text']
    assert 'emulated' in verdict['text'] and 'has no' not in verdict['text']
