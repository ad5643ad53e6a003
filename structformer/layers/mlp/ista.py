"""The ISTA sparsification block of CRATE (Yu et al., 2023, §2.4).

One proximal-gradient step on min λ‖Z‖₁ + ½‖Z_½ − D Z‖² (non-negative), started at Z = Z_½.
"""
import math
from typing import Optional

import torch
from torch import nn

from ...arguments import positive_int, rate
from ...functional.crate_ops import ista_reference, mm_sparsify_reference
from ...functional.onednn_linear import linear
from ...functional.precision import autocast_dtype, float32_island
from ...functional.tracing import recording_graph


class ISTA(nn.Module):
    """ISTA block with timm's `mlp_layer` signature (`in_features`, `hidden_features`, ...).

    `step='ista'` (default): Eq. 17, Z⁺ = ReLU(Z + η Dᵀ(Z − D Z) − ηλ). The fused path uses
    that the three products collapse into one: rows x ↦ ReLU(x (I + η(D − DᵀD)) − ηλ), with the
    d×d effective matrix formed once per forward (d³ flops, independent of batch and tokens).
    `step='mm'`: the majorisation-minimisation step of Eq. 92, ReLU((1 + 4/(9(1+α))) DᵀZ − 4λ/(9α)),
    α = d/(Nε²), with no skip (App. B.4).
    `fused=False` runs the reference written term by term (`structformer.functional.ista_reference`), and so does
    `fused=True` on inputs of at most d rows, where the three products are less work (`fusing_pays`).

    In CRATE the block has no residual around it (Eq. 18); inside timm's `Block` it is used as
    `x + ISTA(LN(x))`, which is a different layer — see docs/crate.md.

    Dtype policy: under autocast every step computes its products in the autocast dtype and returns it, as a
    `nn.Linear` would (the steps are matmul-like; in Eq. 17 the skip term makes the output ≈ x, so bf16 rounding
    of the effective matrix costs ~2⁻⁸ of the output); the fused path's d×d effective matrix is formed in the weight's
    dtype with autocast off (DᵀD is not rounded before it is subtracted), and the reference path (`fused=False`),
    whose skip-connection add would promote to float32, is cast to the autocast dtype at the end.
    """

    def __init__(self, in_features: int, hidden_features: Optional[int] = None,
                 out_features: Optional[int] = None, act_layer=None, norm_layer=None,
                 bias: bool = True, drop: float = 0., *, eta: float = 0.1, lambd: float = 0.1,
                 step: str = 'ista', eps: float = 1.0, fused: bool = True,
                 device=None, dtype=None):
        super().__init__()
        positive_int('in_features', in_features, 'the width d of D')
        if out_features not in (None, in_features):
            raise ValueError(f"ISTA maps R^d to R^d: out_features={out_features} must equal "
                             f"in_features={in_features}")
        rate('drop', drop)
        if step not in ('ista', 'mm'):
            raise ValueError(f"step={step!r}: accepted 'ista' (Eq. 17) or 'mm' (Eq. 92)")
        # finite: an infinite η or λ gave NaN codes at the first step (η) or silently all-zero codes (λ)
        for name, value, ok, accepted in (('eta', eta, lambda v: v > 0, '> 0 (the ISTA step size η)'),
                                          ('lambd', lambd, lambda v: v >= 0, '>= 0 (the sparsity weight λ)'),
                                          ('eps', eps, lambda v: v > 0, '> 0 (α = d/(Nε²) of Eq. 92)')):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not ok(value):
                raise ValueError(f"{name} must be a finite number {accepted}, got {value!r}")
        self.dim = in_features
        self.eta = eta
        self.lambd = lambd
        self.step = step
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.empty(in_features, in_features, device=device, dtype=dtype))
        self.reset_parameters()
        self.drop = nn.Dropout(drop)

    def reset_parameters(self) -> None:
        """The dictionary D (d×d), kaiming-uniform as in the paper's code (also what torch's deferred initialisation
        calls after a meta-device build and `to_empty`)."""
        nn.init.kaiming_uniform_(self.weight)

    def extra_repr(self) -> str:
        eps = f', eps={self.eps}' if self.step == 'mm' else ''                  # α = d/(Nε²): the MM step's only
        return (f"in_features={self.dim}, step={self.step!r}, eta={self.eta}, lambd={self.lambd}{eps}, "
                f"fused={self.fused}")

    def effective_matrix(self) -> torch.Tensor:
        """I + η(D − DᵀD): x ↦ x @ this equals x + η(x D − x DᵀD), the row form of Eq. 17. In the weight's
        dtype, autocast or not (d³ work, independent of batch and tokens)."""
        d = self.weight
        with float32_island(d.device.type):
            eye = torch.eye(self.dim, dtype=d.dtype, device=d.device)
            return eye + self.eta * (d - d.t() @ d)

    def fusing_pays(self, x: torch.Tensor) -> bool:
        """Whether the fused product does less work than the three of Eq. 17 on `x`'s R = B·N rows. Fused: R·d² for
        the product plus d³ for the effective matrix (its backward 2R·d² + 2d³); the reference: 2R·d² (backward
        4R·d²). So fusing pays when R > d, on every machine: at a small batch (inference on one image of CRATE-B,
        197 rows against d = 768; a training step on 2 images of 17 tokens) the d³ would cost more than the product
        it saves. While a graph is recorded (export) the fused path stays: R is the free batch there, and a branch
        on it would constrain the exported batch range."""
        rows = x.numel() // self.dim
        return recording_graph() or rows > self.dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step == 'mm':
            alpha = self.dim / (x.shape[-2] * self.eps ** 2)
            return self.drop(mm_sparsify_reference(x, self.weight, self.lambd, alpha))
        if not self.fused or not self.fusing_pays(x):
            out = ista_reference(x, self.weight, self.eta, self.lambd)
            return self.drop(out.to(autocast_dtype(x.device.type, out.dtype)))
        # one GEMM with the threshold folded in as its bias (addmm: x M + b = F.linear(x, Mᵀ, b)), then an in-place
        # ReLU: no pass over the B×N×d activations besides the product itself. The ReLU runs on the
        # product's own 2-D result, not on a view of it: an in-place op on a view makes autograd
        # copy the whole gradient three times in the backward (CopySlices). The GEMM runs on the kernels this
        # machine chose for its shape (`functional.onednn_linear.linear`: oneDNN's or torch's, float32 on a CPU).
        threshold = x.new_full((self.dim,), -self.eta * self.lambd)
        codes = linear(x.reshape(-1, self.dim), self.effective_matrix().t(), threshold).relu_()
        return self.drop(codes.view(x.shape))
