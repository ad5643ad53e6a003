"""Mixed precision for the training loop: autocast, a gradient scaler for float16, float32 master weights.

The parameters, the optimiser state and every checkpoint stay float32: autocast only changes the dtype the
eligible ops (matmuls, convolutions, SDPA) compute in, and each of our custom ops states its own policy
(docs/precision.md). float16 needs loss scaling against gradient underflow (torch.amp.GradScaler, whose state is
saved with the checkpoint so a resumed run scales as the uninterrupted one); bfloat16 has float32's exponent
range and needs none, as in timm's train.py.
"""
import contextlib
import re
import warnings
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

import torch

from ..errors import UsageError
from ..machine import bf16_capped, cpu_kind, fp16_capped, isa_caps

DTYPES = {'float16': torch.float16, 'bfloat16': torch.bfloat16}


def default_amp_dtype(device: torch.device) -> str:
    """timm's default (float16) on CUDA; bfloat16 on a CPU, the one low precision every CPU autocast runs."""
    return 'float16' if device.type == 'cuda' else 'bfloat16'


def cpu_float16_supported(cpuinfo: Optional[str] = None) -> bool:
    """float16 arithmetic in hardware that torch's float16 GEMMs (oneDNN) use: AVX-512 FP16 (Sapphire Rapids on) or
    AMX-FP16, as torch's own check (ideep's has_fp16_type_support, behind torch.ops.mkldnn._is_mkldnn_fp16_supported)
    accepts them; elsewhere a CPU emulates float16 through float32, slower than float32. A oneDNN cap below
    AVX512_CORE_FP16 keeps the GEMMs off it. `cpuinfo`: another CPU's /proc/cpuinfo text (tests)."""
    if cpu_kind(cpuinfo)['fp16_native']:
        return True
    if cpuinfo is not None or fp16_capped(isa_caps()):
        return False
    return bool(getattr(torch.cpu, '_is_amx_fp16_supported', lambda: False)())      # where /proc/cpuinfo is not


def cpu_bfloat16_native() -> bool:
    """bfloat16 dot products in hardware (AVX512-BF16 or AMX) that the kernels may use; without them a bfloat16
    matmul is no faster. A oneDNN cap below AVX-512 BF16 (`machine.bf16_capped`: ONEDNN_MAX_CPU_ISA=AVX2 or
    AVX512_CORE_VNNI) keeps the kernels off them: measured on an AVX-512 BF16 EPYC capped to AVX2, bfloat16 trained
    at 0.05-0.11x float32 (docs/benchmarks.md). ATEN_CPU_CAPABILITY and MKL caps leave torch's bfloat16 GEMMs (oneDNN)
    on them."""
    if bf16_capped(isa_caps()):
        return False
    return any(getattr(torch.cpu, name, lambda: False)() for name in ('_is_avx512_bf16_supported', '_is_amx_tile_supported'))


def cpu_bfloat16_note() -> str:
    """'' where bfloat16 autocast can be faster than float32 on this CPU, else why not, for the run's plan line: the
    CPU lacks AVX512-BF16 / AMX, or has them with a oneDNN cap keeping torch's bfloat16 GEMMs off them."""
    if cpu_bfloat16_native():
        return ''
    has = any(getattr(torch.cpu, name, lambda: False)() for name in ('_is_avx512_bf16_supported', '_is_amx_tile_supported'))
    caps = ', '.join(f"{k}={v}" for k, v in sorted(isa_caps().items()) if k in ('ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA'))
    if has and caps:
        return f"its bfloat16 dot products (AVX512-BF16 / AMX) are capped off by {caps}: expect no speed-up"
    return 'this CPU has no bfloat16 dot products, AVX512-BF16 or AMX: expect no speed-up'


@dataclass
class Precision:
    """One run's precision: `autocast()` around forward and loss, `backward`, `step` (unscale, clip, step)."""
    device: torch.device
    dtype: Optional[torch.dtype] = None          # None: float32 throughout
    scaler: Optional[torch.amp.GradScaler] = None

    @classmethod
    def create(cls, amp: bool, amp_dtype: Optional[str], device: torch.device) -> 'Precision':
        if not amp:
            if amp_dtype is not None:
                raise UsageError(f"--amp-dtype {amp_dtype} needs --amp")
            return cls(device)
        name = amp_dtype or default_amp_dtype(device)
        if name not in DTYPES:
            raise UsageError(f"--amp-dtype={name!r}: accepted float16 or bfloat16")
        if device.type == 'cpu' and name == 'float16' and not cpu_float16_supported():
            raise UsageError("--amp-dtype float16 on this CPU: it has no float16 arithmetic (AVX-512 FP16 or "
                             "AMX-FP16), so autocast would emulate it more slowly than float32; use --amp-dtype "
                             "bfloat16 on a CPU")
        if device.type not in ('cpu', 'cuda'):
            raise UsageError(f"--amp on device {device}: accepted on cpu or cuda")
        scaler = torch.amp.GradScaler(device.type) if name == 'float16' else None
        return cls(device, DTYPES[name], scaler)

    @property
    def name(self) -> str:
        return {torch.float16: 'float16', torch.bfloat16: 'bfloat16'}.get(self.dtype, 'float32')

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor, create_graph: bool = False) -> None:
        """`create_graph` for a second-order optimiser (timm's AdaHessian differentiates the gradients again in
        its step, as timm's train.py passes `create_graph=optimizer.is_second_order`)."""
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        with warnings.catch_warnings():
            # torch warns that create_graph ties each parameter to its .grad in a cycle: the step loop sets every
            # .grad to None after the update (zero_grad(set_to_none=True)), which breaks it
            warnings.filterwarnings('ignore', message='Using backward\\(\\) with create_graph=True')
            scaled.backward(create_graph=create_graph)

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter],
             clip_grad: Optional[float], clip_mode: str = 'norm') -> None:
        """Unscale (float16), clip the gradients if asked (timm's dispatch_clip_grad: `clip_mode` norm, value or
        agc, as timm's train.py passes --clip-mode), and step; with float16 a step whose gradients overflowed is
        skipped and the scale lowered, as GradScaler does."""
        if clip_grad:
            from timm.utils import dispatch_clip_grad
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            dispatch_clip_grad(list(params), clip_grad, mode=clip_mode)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
            return
        optimizer.step()

    def state(self) -> Dict:
        """What a checkpoint keeps: the float16 loss scale and its growth counter (JSON-safe)."""
        if self.scaler is None:
            return {}
        return {k: (v.item() if torch.is_tensor(v) else v) for k, v in self.scaler.state_dict().items()}

    def load_state(self, state: Optional[Dict]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


# torch's ways of saying an op has no kernel for a low-precision dtype: '"cholesky_cpu" not implemented for
# 'BFloat16'', 'logdet: Low precision dtypes not supported. Got BFloat16', 'linalg.pinv(BFloat16{[4, 4]}): expected
# a tensor with 2 or more dimensions of float, double, cfloat or cdouble types'
_LOW_PRECISION = (re.compile(r'"(?P<op>[\w.]+)" not implemented for \'(?P<dtype>BFloat16|Half)\''),
                  re.compile(r'(?P<op>[\w.]+): Low precision dtypes not supported\. Got (?P<dtype>BFloat16|Half)'),
                  re.compile(r'(?P<op>[\w.]+)\((?P<dtype>BFloat16|Half)\{.*expected a tensor .*of float, double'))


def low_precision_failure(error: BaseException, precision: Optional[Precision]):
    """A UsageError of one line for `error` when it is torch refusing an op in autocast's low precision (no
    bfloat16 / float16 kernel: linear algebra such as logdet, cholesky, svd, qr, eigh, inv, pinv); else None.
    The fix belongs to the op's caller: run that op in float32 (autocast off, inputs .float()), as structformer's
    own ops do (docs/precision.md), or train without --amp."""
    if precision is None or precision.dtype is None:
        return None
    text = str(error)
    for pattern in _LOW_PRECISION:
        match = pattern.search(text)
        if match:
            dtype = 'bfloat16' if match.group('dtype') == 'BFloat16' else 'float16'
            op = re.sub(r'_(cpu|cuda)$', '', match.group('op'))        # cholesky_cpu: the kernel of cholesky
            return UsageError(f"--amp: torch has no {dtype} kernel for {op} on {precision.device.type}, "
                              f"and the model runs it under autocast in {dtype}; run that op in float32 (inside "
                              f"torch.autocast('{precision.device.type}', enabled=False), inputs .float(); see "
                              "docs/precision.md) or train without --amp")
    return None


def clip_parameters(model: torch.nn.Module, clip_mode: str) -> List[torch.nn.Parameter]:
    """The parameters --clip-grad clips: all of them, but for agc not the classifier's (timm's train.py excludes
    the head from adaptive clipping, as the NFNet paper does, by taking all but the last two parameters; here the
    model's get_classifier() where it has one, the same two tensors for every structformer model and still the
    head when a low-rank head holds more than two)."""
    params = list(model.parameters())
    if clip_mode != 'agc':
        return params
    head = model.get_classifier() if hasattr(model, 'get_classifier') else None
    if not isinstance(head, torch.nn.Module):
        return params[:-2]
    exclude = {id(p) for p in head.parameters()}
    return [p for p in params if id(p) not in exclude]


@contextlib.contextmanager
def tf32_switches(device: torch.device, on: bool):
    """--tf32: TF32 matmuls and convolutions and cudnn.benchmark while a run trains on CUDA, as timm's train.py sets
    them for the whole process; restored afterwards, so that `train()` called in a process leaves torch as it found it.
    Off CUDA, or without --tf32, nothing changes (torch's defaults: float32 matmuls in float32, cuDNN's convolutions
    free to take TF32, no benchmark)."""
    if not on or device.type != 'cuda':
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.benchmark = True
    try:
        yield
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
         torch.backends.cudnn.benchmark) = saved
