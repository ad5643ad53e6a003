"""What the GPU suite checks with, kept apart from the tests so the default suite can test it on a CPU
(tests/test_gpu_suite.py): the loss tolerance of a half-precision run, the loss-parity harness, and the dtype /
device log of every op and module under autocast.

## The loss tolerance of a half-precision run (`forward_band`, `step_tolerance`, `loss_tolerance`)

u is the dtype's unit roundoff, half the spacing of its numbers above 1: 2⁻⁸ for bfloat16 (8 significant bits),
2⁻¹¹ for float16 (11 significant bits). Under autocast the weights stay float32 and each low-precision matrix
product (a linear layer, a convolution, an attention product: counted op by op, `OpLog.products`) rounds its two
operands and its result: 3 roundings of relative size at most u. A forward with P such products puts R = 3P
roundings on the way to the logits z (the custom ops' float32 islands, docs/precision.md, add none). Modelled as
independent errors of size u each (a bound on each; their spread is u/√3), they move z by a relative √R·u (the
worst case with no cancellation, R·u, exceeds 1 for a depth-12 network and bounds nothing; the CPU tests measure
1–2 u per product, as the model says, and CUDA's tensor cores accumulate in float32 as the CPU does).

The loss of a batch is a mean over its B samples of the cross-entropy, whose gradient in sample b's logits is
p_b − y_b. So a logit error δz moves the loss by (1/B) Σ_b (p_b − y_b)·δz_b: independent over samples, of size
√R·u·s/√B, with s = rms(z)·rms_b‖p_b − y_b‖ the loss's sensitivity (`loss_sensitivity`, measured on float32's
model; hard labels, which make it larger than Mixup's soft targets do). At three standard deviations:
`forward_band` = 3·√(3P)·u·s/√B, the band of the same batch through the same weights. The cross-entropy itself
adds one rounding where autocast computes its log-softmax in the low dtype (the CPU's autocast does; CUDA's keeps it
in float32): u·|L| at most, added by `step_tolerance` and the evaluation check (a zero-initialised head, whose
logits are 0 and s = 0, shows it: ln 4 in bfloat16 is 1.3828, 0.0035 from float32's 1.3863).

After k optimiser steps the weights differ too. The gradients round as the forward does, through the backward's
products (about 2P), so the updates differ by a relative √(6P)·u of what they did, and what they did to the loss
is at most what float32's run shows between its first step and step k, |L_k − L_1| (batch-to-batch variation
included, which only widens the band). float16's GradScaler skips a step whose gradients overflowed (its first
steps, while the scale comes down from 2¹⁶): then the updates differ by whole steps, and the band takes all of
|L_k − L_1|. `step_tolerance` = `forward_band` + u·|L_k| + (3·√(6P)·u, or 1 after a skipped step)·|L_k − L_1|.

`loss_tolerance` = 3·√(3P)·u is the relative band without the sensitivity and the batch (a loss of any size
through any logits): for checks that have no model at hand. CRATE-T (P ≈ 62) gets 16 % in bfloat16, 2 % in float16.

What these catch: a lost float32 island, a layer in the wrong dtype or scale moves the loss by far more than
the rounding does (tests/test_gpu_suite.py breaks an attention layer by 25 % under autocast and the first step
leaves the band); an overflow that GradScaler does not catch gives inf or nan. The op log below names the op.
"""
import contextlib
import math
from typing import Dict, List, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
BAND = 3.0              # standard deviations
PRODUCT_OPS = {'aten.mm.default', 'aten.bmm.default', 'aten.addmm.default', 'aten.baddbmm.default',
               'aten.convolution.default', 'aten.cudnn_convolution.default', 'aten.mkldnn_convolution.default',
               'aten._convolution.default', 'aten._scaled_dot_product_flash_attention.default',
               'aten._scaled_dot_product_efficient_attention.default',
               'aten._scaled_dot_product_cudnn_attention.default',
               'aten._scaled_dot_product_flash_attention_for_cpu.default', 'aten._flash_attention_forward.default',
               'aten._efficient_attention_forward.default'}
ATTENTION_OPS = {name for name in PRODUCT_OPS if 'attention' in name}


def unit_roundoff(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF[dtype]


def loss_tolerance(dtype: torch.dtype, products: int) -> float:
    """Relative band of a loss computed through `products` low-precision matrix products: 3·√(3·products)·u."""
    if products < 1:
        raise ValueError(f"products must be >= 1, got {products}")
    return BAND * math.sqrt(3 * products) * unit_roundoff(dtype)


def loss_sensitivity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """s = rms(z) · rms over the batch of ‖softmax(z_b) − onehot(y_b)‖: how much a relative logit error moves the
    cross-entropy (module docstring), from float32 logits and hard labels."""
    z = logits.detach().double()
    p = z.softmax(-1) - torch.nn.functional.one_hot(targets, z.shape[-1]).double()
    return float(z.square().mean().sqrt() * p.square().sum(-1).mean().sqrt())


def forward_band(dtype: torch.dtype, products: int, sensitivity: float, batch: int) -> float:
    """Absolute band of a batch-mean loss through the same weights: 3·√(3P)·u·s/√B."""
    return loss_tolerance(dtype, products) * sensitivity / math.sqrt(batch)


def step_tolerance(dtype: torch.dtype, products: int, sensitivity: float, batch: int, reference: List[float],
                   step: int, skipped: bool = False) -> float:
    """Absolute band of the half-precision loss at optimiser step `step` (0-based) around float32's `reference`
    losses of the same steps; `skipped`: a float16 step was skipped before this one (GradScaler)."""
    drift = 1.0 if skipped else BAND * math.sqrt(6 * products) * unit_roundoff(dtype)
    return (forward_band(dtype, products, sensitivity, batch) + unit_roundoff(dtype) * abs(reference[step])
            + drift * abs(reference[step] - reference[0]))


def parity_failures(reference: List[float], half: List[float], dtype: torch.dtype, products: int,
                    sensitivity: float, batch: int, skipped_steps: int = 0) -> List[str]:
    """Every step where `half` (the half-precision run's per-step losses) leaves its band around `reference`
    (float32's): one line each, empty when the runs agree. Runs of different lengths or a non-finite loss fail.
    `skipped_steps`: how many steps float16's GradScaler skipped (which ones is not known: the band widens from
    the second step on when there were any)."""
    if len(reference) != len(half) or not reference:
        return [f"float32 logged {len(reference)} steps, {dtype} {len(half)}"]
    out = []
    for k, (want, got) in enumerate(zip(reference, half)):
        tolerance = step_tolerance(dtype, products, sensitivity, batch, reference, k, skipped=skipped_steps > 0)
        if not math.isfinite(got) or abs(got - want) > tolerance:
            out.append(f"step {k + 1}: {dtype} loss {got:.5f}, float32 {want:.5f}, allowed ±{tolerance:.5f}")
    return out


def skipped_steps(scale: float, init_scale: float = 2.0 ** 16) -> int:
    """Steps float16's GradScaler skipped, from its final scale (each skip halves it; it grows only every 2000
    steps, more than these runs take)."""
    return max(0, round(math.log2(init_scale / scale)))


@contextlib.contextmanager
def recorded_step_losses():
    """The loss of every optimiser step of the `structformer train` runs inside the block, as the engine reports it
    to its step log (train/steplog.py): a list, appended to as the steps run."""
    from structformer.train.steplog import StepLog
    losses: List[float] = []
    original = StepLog.step

    def step(self, epoch, batch, batches, global_step, loss, lr, images):
        losses.append(float(loss))
        return original(self, epoch, batch, batches, global_step, loss, lr, images)
    StepLog.step = step
    try:
        yield losses
    finally:
        StepLog.step = original


# ---- what every op and module computed in, and where ----------------------------------------------------------

class OpLog(TorchDispatchMode):
    """Each op the dispatcher runs (after autocast's casts): its name, the dtypes of its tensor inputs and the
    (device, dtype, numel) of its tensor outputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t.dtype for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [(t.device.type, t.dtype, t.numel()) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.calls.append((str(func), inputs, outputs))
        return out

    def products(self, dtype: torch.dtype) -> int:
        """Matrix products that ran in `dtype` (an attention op counts as two: QKᵀ and PV)."""
        return sum((2 if name in ATTENTION_OPS else 1) for name, inputs, _ in self.calls
                   if name in PRODUCT_OPS and dtype in inputs)

    def off_device(self, device: str) -> List[str]:
        """Ops that produced a tensor of more than one element somewhere other than `device`: a computation that
        left the GPU (a 0-dim CPU tensor, a Python number's wrapper, is not one)."""
        return sorted({name for name, _, outputs in self.calls
                       if any(d != device and numel > 1 for d, _, numel in outputs)})

    def custom_ops(self) -> Dict[str, set]:
        """{structformer custom op: the dtypes of its outputs}."""
        found: Dict[str, set] = {}
        for name, _, outputs in self.calls:
            if name.startswith('structformer.'):
                found.setdefault(name, set()).update(dtype for _, dtype, _ in outputs)
        return found


# the policy of docs/precision.md for what runs under autocast on any device: 'autocast' = the autocast dtype
CUSTOM_OP_POLICY = {'structformer.newton_schulz.default': 'float32',
                    'structformer.shared_qkv_attention_forward.default': 'autocast',
                    'structformer.shared_qkv_attention_backward.default': 'autocast'}


def custom_op_violations(log: OpLog, dtype: torch.dtype) -> List[str]:
    out = []
    for name, dtypes in log.custom_ops().items():
        policy = CUSTOM_OP_POLICY.get(name)
        if policy is None:
            out.append(f"{name}: no policy in docs/precision.md for it on this device")
            continue
        want = {dtype if policy == 'autocast' else torch.float32}
        if dtypes != want:
            out.append(f"{name}: computed in {sorted(map(str, dtypes))}, the policy says {policy} ({want.pop()})")
    return out


def _policy_classes():
    from structformer.layers import ISTA, MSSA
    from structformer.layers.attention.softmax import AttentionBase
    from structformer.layers.linear import FactorizedConv2d, StructuredLinear
    return (torch.nn.Linear, torch.nn.Conv2d, StructuredLinear, FactorizedConv2d, MSSA, ISTA, AttentionBase)


def module_dtype_violations(model: torch.nn.Module, images: torch.Tensor, dtype: torch.dtype,
                            device_type: str, backward: bool = False) -> tuple:
    """One forward of `model` under autocast(`dtype`) with every module's output and every op logged (`backward`:
    with gradients, and the backward of the logits' sum logged too): the modules whose policy is 'the autocast
    dtype out' (linear and convolution layers, the structured linears, every attention layer, ISTA) that returned
    something else; the ops that computed off the device; the custom ops out of policy. Returns (violations,
    OpLog)."""
    classes = _policy_classes()
    wrong, handles = [], []

    def hook(name):
        def check(module, args, output):
            if isinstance(output, torch.Tensor) and output.is_floating_point() and output.dtype != dtype:
                wrong.append(f"{name} ({type(module).__name__}) returned {output.dtype} under {dtype} autocast")
        return check
    for name, module in model.named_modules():
        if isinstance(module, classes):
            handles.append(module.register_forward_hook(hook(name)))
    log = OpLog()
    try:
        with torch.set_grad_enabled(backward), log:
            with torch.autocast(device_type, dtype=dtype):
                logits = model(images)
            if backward:
                logits.float().sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    if logits.dtype != dtype:
        wrong.append(f"the logits are {logits.dtype} under {dtype} autocast")
    wrong += [f"{name} computed off {device_type}" for name in log.off_device(device_type)]
    wrong += custom_op_violations(log, dtype)
    return wrong, log


def first_failure(lines: List[str], limit: int = 8) -> Optional[str]:
    return None if not lines else '\n'.join(lines[:limit]) + (f"\n... {len(lines) - limit} more" if len(lines) > limit
                                                               else '')


# ---- a CUDA device faked on a CPU -------------------------------------------------------------------------------

@contextlib.contextmanager
def fake_cuda():
    """Inside: tensors made on 'cuda' (`model.to('cuda')`, `torch.randn(..., device='cuda')`) are FakeTensors, shapes
    and devices without data, so a forward runs on a machine with no GPU as it would dispatch on one: CUDA's autocast
    (its float16 and bfloat16 op lists, not the CPU's), and an op that mixes a CPU tensor of more than one element
    with CUDA ones raises (FakeTensorDeviceMismatchError), as CUDA does. What it cannot run: anything that reads data
    (`.item()`, `.tolist()`), FlexAttention, and a backward (the autograd engine asks the CUDA driver for a device).
    CUDA's autocast is let on here (torch switches it off where no GPU is found) and for the block only."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    amp = torch.cuda.amp.common
    saved = amp.amp_definitely_not_available, torch.cuda.is_bf16_supported
    amp.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda *args, **kwargs: True
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        amp.amp_definitely_not_available, torch.cuda.is_bf16_supported = saved


# ---- the suite's own deadline ------------------------------------------------------------------------------------

DEADLINE_ENV = 'STRUCTFORMER_GPU_SUITE_DEADLINE'   # Unix time after which no test starts (tools/gpu_check.sh sets it)


def deadline_skip_reason(value: Optional[str], now: float) -> Optional[str]:
    """Why a test must not start at `now` under the deadline `value` (the environment's string; None or '' for no
    deadline), or None. The prepared GPU check stops the suite with SIGINT at its hard limit, and under xdist an
    interrupt can end in an INTERNALERROR that loses the junit file and the summary: with a deadline a little before
    that limit, the tests not yet started are skipped instead, so the run ends by itself and reports every test."""
    if value is None or value.strip() == '':
        return None
    try:
        deadline = float(value)
    except ValueError:
        raise ValueError(f"{DEADLINE_ENV} must be a Unix time in seconds, got {value!r}") from None
    if not math.isfinite(deadline):
        raise ValueError(f"{DEADLINE_ENV} must be a finite Unix time in seconds, got {value!r}")
    if now < deadline:
        return None
    return f"the suite's time budget was spent ({DEADLINE_ENV} passed {now - deadline:.0f} s before this test)"

