"""Moore–Penrose inverse by Newton–Schulz iteration (SOFT Alg. 2 / Eq. 10), implicit backward (Eq. 12).

Iteration (Eq. 10): `X_{k+1} = 2X_k − X_k A X_k`. On the range of A the error obeys
`I − A X_{k+1} = (I − A X_k)²`, so with `E_0 = I − A X_0` it is `E_0^(2^k)`: quadratic
convergence once ‖E_k‖ < 1, and null-space components stay exactly zero (X_k = Aᵀ p(A Aᵀ)).

Initialisation (our choice, not the paper's adaptive rule). SOFT's practical rule searches the
smallest n with ‖I − A·(2βⁿ/‖A‖₁²)·A‖₁ ≤ 1. For an entry-wise positive A and small α, column j
of |I − αA²| sums to 1 + α·(Σ_{i≠j}(A²)_ij − (A²)_jj), above 1 for every α > 0 unless A² is
diagonally dominant, which kernel matrices rarely are: the halving never ends (in floating point
it stops only once α is so small that X_0 ≈ 0; tested in tests/test_soft_functional.py).
We use `X_0 = α Aᵀ` with `α = 1 / (‖A‖₁ ‖A‖_∞)`:
  * σ_max(A)² ≤ ‖A‖₁‖A‖_∞, so every non-zero singular value gives 1 − ασ² ∈ [0, 1): the error
    contracts monotonically for *any* A (Ben-Israel & Cohen, 1966), with no oscillation.
  * For symmetric A this is `X_0 = A/‖A‖₁²`, half the paper's base α = 2/‖A‖₁² (Alg. 2). The
    base rule also converges for PSD A but sits on the boundary 1 − αλ² = −1 when ‖A‖₂ = ‖A‖₁
    (a kernel matrix of near-identical landmarks, A ≈ 𝟙𝟙ᵀ), where it stalls (for A = 𝟙𝟙ᵀ exactly
    it returns 0 after one step); ours costs at most one extra iteration for the small
    eigenvalues and never stalls.
  * Eigenvalue λ needs about log₂(‖A‖₁²/λ²) iterations. Directions with much smaller λ are left
    un-inverted after `num_iter` steps: a finite iteration count acts as a spectral cut-off,
    which is what keeps near-singular kernel matrices from blowing up. `ridge` adds ridge·I.
  * Non-symmetric A (Nyströmformer's softmax landmark matrix) is handled by the same rule.

Stopping. In floating point the null space of a singular A carries rounding-level eigenvalues,
and the iteration cannot tell them from small true ones: it doubles their component every step
(X_{k+1} ≈ 2X_k there). Run long enough, that noise is "inverted" and X blows up (a rank-3 8×8
matrix in float64: error 1e-12 after 20 steps, 1 after 60; in float32, NaN after ~60). So
`num_iter` is a maximum: each matrix of the batch freezes once its update
‖X_{k+1} − X_k‖_F ≤ √eps·‖X_{k+1}‖_F (eps of the compute dtype). Converged matrices then stay put for any `num_iter`; matrices still converging
(small eigenvalues still growing) are unaffected, so the spectral cut-off above is unchanged.

Backward (SOFT Eq. 12): `∇_A L = −Yᵀ (∇_Y L) Yᵀ` with Y the returned X. This is the exact
derivative of the *inverse* A⁻¹; for invertible A and converged X it is the true gradient.
For a singular A the derivative of A† has two more terms, `(I − A†A) ∇ᵀ A†A†ᵀ + A†ᵀA† ∇ᵀ (I − AA†)`
(Golub & Pereyra, 1973), which act only through the null space; they are dropped, as in SOFT.
The iterates are not stored, so memory is O(m²) whatever `num_iter` is.

Rules of the public SOFT code (github.com/fudan-zvg/SOFT), selectable with `rule=` to ablate them
(docs/soft.md has the table of differences):
* `'soft'` (its `SOFT/kernel/inverse.py`): A ← A + 0.01·I, X_0 = α(A + 0.01·I) with the fixed step
  α = 0.9·2/‖A‖_∞² (‖A‖_∞ of A without the ridge, per matrix), then exactly `num_iter` steps (no
  freeze). For PSD A, 1 − αλ² ∈ (−0.8, 1) on every eigenvalue, so it converges; the ridge floors
  the spectrum at 0.01, which bounds ‖X‖ by 100 on rank-deficient A.
* `'softpp'` (its SOFT++ `newton_inv`): α = 2/max‖A‖_∞² with the max over the *whole batch* (every
  image and head of the call), halved while max‖I − αA²‖₁ > 1.01 (again batch-wide), at most 10
  times (SPEC §2: for positive kernel matrices the test usually never passes, so α = 2⁻¹⁰·2/‖A‖_∞²
  in practice), X_0 = αA, then exactly `num_iter` steps, no ridge.
`backward='unrolled'` differentiates through the iterations (and α) with autograd instead of Eq. 12,
as the public SOFT++ does; it stores every iterate (memory O(num_iter·m²)). It is the derivative of
the finite-step map actually computed, so it differs from Eq. 12 wherever X has not converged.
"""
from typing import Tuple, Union

import torch

from . import autotune
from .precision import float32_island
from .tracing import recording_graph

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _check_num_iter(num_iter: int) -> None:
    if not isinstance(num_iter, int) or isinstance(num_iter, bool) or num_iter < 1:
        raise ValueError(f"num_iter must be an int >= 1 (Newton–Schulz steps of SOFT Eq. 10), got {num_iter!r}")


def _initial_guess(a: torch.Tensor) -> torch.Tensor:
    norm_1 = a.abs().sum(-2).amax(-1)                          # max column sum
    norm_inf = a.abs().sum(-1).amax(-1)                        # max row sum
    # tiny floor: pinv(0) = 0 (X_0 = 0 is a fixed point) instead of 0/0
    alpha = 1.0 / (norm_1 * norm_inf).clamp_min(torch.finfo(a.dtype).tiny)
    return alpha[:, None, None] * a.transpose(-2, -1)


def _newton_step(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.baddbmm(x, torch.bmm(x, a), x, beta=2.0, alpha=-1.0)     # 2X − XAX (Eq. 10), one fused op


def _converged(x_next: torch.Tensor, x: torch.Tensor, tol: float) -> torch.Tensor:
    """‖X_{k+1} − X_k‖_F ≤ tol·‖X_{k+1}‖_F per matrix (a matrix of zeros, pinv(0) = 0, counts as converged). Written
    as a product, not a quotient: five kernels a step and no copy, where the quotient took six and stacked both
    matrices into a new tensor; SOFT's eager attention is launch-bound on a GPU (docs/gpu.md), and on a CPU the 20
    steps on 16 matrices of 49×49 went from 1.68 to 1.54 ms (host loop, 2 threads, AMD EPYC Zen 5)."""
    dims = (-2, -1)
    return torch.linalg.vector_norm(x_next - x, dim=dims) <= tol * torch.linalg.vector_norm(x_next, dim=dims)


def _newton_schulz_device(a: torch.Tensor, num_iter: int) -> torch.Tensor:
    """Batched iteration with the per-matrix freeze as tensor ops only: no host sync, so a GPU never
    stalls, at the price of a masked update every step."""
    x = _initial_guess(a)
    tol = torch.finfo(a.dtype).eps ** 0.5
    frozen = torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    for _ in range(num_iter):
        x_next = _newton_step(x, a)
        converged = _converged(x_next, x, tol)
        x = torch.where(frozen[:, None, None], x, x_next)
        frozen = frozen | converged
    return x


def _newton_schulz_host(a: torch.Tensor, num_iter: int) -> torch.Tensor:
    """The same iteration and freeze rule as `_newton_schulz_device`, decided on the host: on a CPU a sync
    is free, so the loop stops once every matrix has converged and masks only while some have."""
    x = _initial_guess(a)
    tol = torch.finfo(a.dtype).eps ** 0.5
    active = torch.arange(a.shape[0])                          # matrices still iterating
    out = None
    for _ in range(num_iter):
        x_next = _newton_step(x, a)
        converged = _converged(x_next, x, tol).tolist()
        if not any(converged):
            x = x_next
            continue
        if out is None:
            out = torch.empty_like(x)
        keep = torch.tensor([not c for c in converged])
        done = ~keep
        out[active[done]] = x_next[done]                       # frozen at X_{k+1}, as the device path
        active, x, a = active[keep], x_next[keep], a[keep]
        if active.numel() == 0:
            return out
    if out is None:
        return x
    out[active] = x
    return out


LOOPS = {'host': _newton_schulz_host, 'device': _newton_schulz_device}


def _newton_schulz_batched(a: torch.Tensor, num_iter: int) -> torch.Tensor:
    """The device loop off the CPU (a host sync would stall a GPU); on a CPU the loop this machine runs faster for
    (matrix size, batch class, steps, dtype), timed once on these very matrices and cached (`autotune`, choice
    'newton_loop'; both loops give the same X up to rounding, tested). Where nothing may be timed: the host loop,
    which stops once every matrix has converged."""
    if a.device.type != 'cpu':
        return _newton_schulz_device(a, num_iter)
    shape_class = (a.shape[-1], autotune.power_class(a.shape[0]), num_iter, str(a.dtype).replace('torch.', ''))
    choice = autotune.decide('newton_loop', shape_class, 'host',
                             lambda: {name: (lambda loop=loop: loop(a, num_iter)) for name, loop in LOOPS.items()})
    return LOOPS[choice](a, num_iter)


@torch.library.custom_op('structformer::newton_schulz', mutates_args=())
def _newton_schulz_opaque(a: torch.Tensor, num_iter: int) -> torch.Tensor:
    """`_newton_schulz_batched` as one opaque operator for torch.compile. Traced, the host loop's early
    exit (a `.tolist()` and shapes that shrink as matrices freeze) breaks the graph and recompiles for
    every batch size until dynamo gives up; the device loop traces but unrolls `num_iter` steps into
    every attention layer's graph, which inductor then compiles kernel by kernel. As an operator the
    compiled model runs exactly the eager iteration, and the graph holds one node per call."""
    return _newton_schulz_batched(a, num_iter).contiguous()


@_newton_schulz_opaque.register_fake
def _(a: torch.Tensor, num_iter: int) -> torch.Tensor:
    return torch.empty_like(a, memory_format=torch.contiguous_format)


# Dtype policy of the opaque op: float32 under autocast (its inputs cast to float32, autocast off inside), as the
# eager iteration runs. `newton_pinv` already calls it with autocast off; this rule covers a direct call, which
# autocast would otherwise pass through untouched, leaving the op's bmm calls to autocast's bf16/fp16.
for _device_type in ('cpu', 'cuda'):
    torch.library.register_autocast('structformer::newton_schulz', _device_type, torch.float32)


def _newton_schulz(a: torch.Tensor, num_iter: int) -> torch.Tensor:
    """Up to `num_iter` Newton–Schulz steps on [..., m, m]; each matrix freezes once its relative
    update ‖X_{k+1} − X_k‖_F ≤ √eps·‖X_{k+1}‖_F (module docstring: past convergence the iteration
    only doubles rounding noise in the null space). Eager calls stay plain tensor code, so
    FlopCounterMode sees every step; under torch.compile the iteration is one opaque operator. While a graph is
    recorded (torch.export, ONNX, tracing: `tracing.recording_graph`) it is the device loop in plain tensor ops,
    the same rule, with no custom op an exporter cannot translate and no host decision a tracer would freeze."""
    batch_shape, m = a.shape[:-2], a.shape[-1]
    flat = a.reshape(-1, m, m)
    if recording_graph():
        run = _newton_schulz_device
    else:
        run = _newton_schulz_opaque if torch.compiler.is_compiling() else _newton_schulz_batched
    return run(flat, num_iter).reshape(*batch_shape, m, m)


def _add_ridge(a: torch.Tensor, ridge: float) -> torch.Tensor:
    if ridge == 0.0:
        return a
    return a + ridge * torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)


RULES = ('ours', 'soft', 'softpp')
BACKWARDS = ('closed_form', 'unrolled')
PUBLIC_SOFT_RIDGE = 0.01          # the public SOFT rule's A + 0.01·I
PUBLIC_SOFT_STEP = 0.9            # ... and its X_0 = 0.9·2/‖A‖_∞² · (A + 0.01·I)
PUBLIC_SOFTPP_TOL, PUBLIC_SOFTPP_HALVINGS = 1.01, 10


def _public_softpp_alpha(a: torch.Tensor) -> torch.Tensor:
    """α of the public SOFT++ rule for a flat batch [B, m, m]: 2/max_batch‖A‖_∞², halved while the
    batch-wide max column sum of |I − αA²| exceeds 1.01, at most 10 times. The halving count is chosen
    without a host sync (all 11 candidates are tested, the first that passes wins); gradients flow
    through α itself, as in the public code."""
    alpha = 2.0 / a.abs().sum(-1).amax().square().clamp_min(torch.finfo(a.dtype).tiny)
    with torch.no_grad():
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        aa = a @ a
        norms = torch.stack([(eye - alpha * 0.5 ** j * aa).abs().sum(-2).amax()
                             for j in range(PUBLIC_SOFTPP_HALVINGS + 1)])
        passes = norms <= PUBLIC_SOFTPP_TOL
        passes[-1] = True                                       # the 10th halving is kept whatever it gives
        halvings = passes.int().argmax()                        # first candidate that passes
    return alpha * torch.pow(0.5, halvings.to(a.dtype))


def _public_start(a: torch.Tensor, rule: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(matrix iterated on, X_0) of the public code's rules, for a flat batch [B, m, m]."""
    if rule == 'soft':
        # ‖A‖_∞ floored at the ridge: A = 0 then gives 100·I where the public code gives NaN (0/0);
        # a kernel matrix (unit diagonal, ‖A‖_∞ ≥ 1) never meets the floor
        alpha = PUBLIC_SOFT_STEP * 2.0 / a.abs().sum(-1).amax(-1).clamp_min(PUBLIC_SOFT_RIDGE).square()
        p = _add_ridge(a, PUBLIC_SOFT_RIDGE)                    # α from A, the iteration on A + 0.01·I
        return p, alpha[:, None, None] * p
    return a, _public_softpp_alpha(a) * a


def _iterate(a: torch.Tensor, num_iter: int, rule: str, unrolled: bool) -> torch.Tensor:
    """X for a flat batch [B, m, m] under `rule`; plain differentiable tensor code when `unrolled`."""
    if rule == 'ours':
        if unrolled:                                            # masked loop: autograd sees every step
            return _newton_schulz_device(a, num_iter)
        return _newton_schulz(a, num_iter)
    p, x = _public_start(a, rule)
    for _ in range(num_iter):                                   # fixed count, no freeze (public code)
        x = _newton_step(x, p)
    return x


class _NewtonPinv(torch.autograd.Function):
    """Forward: Newton–Schulz (Eq. 10) under no_grad. Backward: closed form (Eq. 12)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, num_iter: int, rule: str = 'ours') -> torch.Tensor:
        batch_shape, m = a.shape[:-2], a.shape[-1]
        x = _iterate(a.reshape(-1, m, m), num_iter, rule, unrolled=False).reshape(*batch_shape, m, m)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        # no once_differentiable: with create_graph=True (a second derivative) these are differentiable ops, and the
        # saved X is this function's output, so autograd differentiates Eq. 12 again through X's own backward, Eq. 12
        # (once_differentiable had dropped X's dependence on A silently when grad_x did not require grad)
        (x,) = ctx.saved_tensors
        with float32_island(x.device.type):
            xt = x.transpose(-2, -1)
            grad_a = -(xt @ grad_x.to(x.dtype) @ xt)
        return grad_a, None, None


def pinv_residual(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """‖AXA − A‖_F / ‖A‖_F per matrix (0 for A = 0): the first Moore–Penrose condition (Prop. 2)."""
    with torch.no_grad():
        num = torch.linalg.matrix_norm(a @ x @ a - a)
        den = torch.linalg.matrix_norm(a).clamp_min(torch.finfo(a.dtype).tiny)
        return num / den


def check_rule(rule: str, backward: str) -> None:
    if rule not in RULES:
        raise ValueError(f"newton rule must be one of {RULES} (ours, public SOFT, public SOFT++), got {rule!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"newton backward must be one of {BACKWARDS}, got {backward!r}")


def newton_pinv(a: torch.Tensor, num_iter: int = 20, ridge: float = 0.0, return_residual: bool = False,
                rule: str = 'ours', backward: str = 'closed_form'
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Moore–Penrose inverse of a [..., m, m] matrix (batched) by at most `num_iter` Newton–Schulz steps.

    See the module docstring for the initialisation rules (`rule='ours'`: α = 1/(‖A‖₁‖A‖_∞),
    X_0 = αAᵀ, per-matrix freeze; `'soft'` / `'softpp'`: the public code's) and the backward
    (`'closed_form'`: SOFT Eq. 12; `'unrolled'`: autograd through the iterations). Dtype policy: computes
    in float32 under any autocast context (autocast off, float16/bfloat16 inputs upcast, float32 returned),
    because the iteration squares its error each step and in bf16 it stalls at a residual of ~1e-2. With `return_residual=True`
    returns `(X, residual)` where residual = ‖AXA − A‖_F/‖A‖_F (detached, one per matrix, for
    A + ridge·I, plus 0.01·I under the 'soft' rule).
    """
    _check_num_iter(num_iter)
    check_rule(rule, backward)
    # as the layers check theirs: a negative ridge made A + ridge·I indefinite and NaN gave NaN inverses, silently
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not 0 <= ridge < float('inf'):
        raise ValueError(f"ridge={ridge!r} must be a finite number >= 0 (added as ridge·I to A before inverting)")
    if a.dim() < 2 or a.shape[-1] != a.shape[-2]:
        raise ValueError(f"newton_pinv expects square matrices [..., m, m], got shape {tuple(a.shape)}")
    with float32_island(a.device.type):
        if a.dtype in _LOW_PRECISION:
            a = a.float()
        a = _add_ridge(a, ridge)
        if backward == 'unrolled':
            m = a.shape[-1]
            x = _iterate(a.reshape(-1, m, m), num_iter, rule, unrolled=True).reshape(a.shape)
        else:
            x = _NewtonPinv.apply(a, num_iter, rule)
        if return_residual:
            target = _add_ridge(a, PUBLIC_SOFT_RIDGE) if rule == 'soft' else a
            return x, pinv_residual(target.detach(), x.detach())
    return x


def newton_pinv_reference(a: torch.Tensor, ridge: float = 0.0) -> torch.Tensor:
    """SVD-based Moore–Penrose inverse (`torch.linalg.pinv`, hermitian) of a symmetric matrix, for tests."""
    return torch.linalg.pinv(_add_ridge(a, ridge), hermitian=True)
