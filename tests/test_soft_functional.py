"""gaussian_kernel (SOFT Eq. 4–5), newton_pinv (Eq. 10, backward Eq. 12) and SOFT's spectral props 3–6."""
import pytest
import torch

from structformer.functional import gaussian_kernel, gaussian_kernel_reference, newton_pinv, newton_pinv_reference
from structformer.layers.attention.softmax import softmax_attention_reference

F64 = torch.float64


def _spd(m, seed, rank=None, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(m, rank or m, generator=g, dtype=F64)
    return b @ b.T + shift * torch.eye(m, dtype=F64)


# ---------------------------------------------------------------- gaussian kernel

def test_gaussian_kernel_matches_reference_values_and_grads():
    torch.manual_seed(0)
    q = torch.randn(2, 3, 7, 5, dtype=F64, requires_grad=True)
    k = torch.randn(2, 3, 4, 5, dtype=F64, requires_grad=True)
    w = torch.randn(2, 3, 7, 4, dtype=F64)
    fast, ref = gaussian_kernel(q, k), gaussian_kernel_reference(q, k)
    assert fast.shape == (2, 3, 7, 4)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    g_fast = torch.autograd.grad((fast * w).sum(), (q, k))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k))
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # explicit scale
    torch.testing.assert_close(gaussian_kernel(q, k, scale=0.3), gaussian_kernel_reference(q, k, scale=0.3))


@pytest.mark.parametrize('q_shape, k_shape', [((2, 3, 7, 5), (4, 5)), ((7, 5), (2, 3, 4, 5)),
                                              ((2, 1, 7, 5), (1, 3, 4, 5)), ((7, 5), (4, 5)), ((1, 1, 1, 5), (1, 1, 1, 5)),
                                              ('self', (2, 6, 5))])
def test_gaussian_kernel_every_branch_matches_the_reference_with_gradients(q_shape, k_shape):
    """The in-place baddbmm branch (same leading dims, 2-D inputs, one token) and the broadcasting branch (leading
    dims that differ), and q and k one tensor (SOFT's A = exp(Q̃ ⊖ Q̃), where both gradient paths add up and the
    clamp sits on the diagonal): outputs and both gradients against the pairwise differences, float64. The
    expansion ‖q‖² + ‖k‖² − 2qkᵀ cancels to ~eps·‖q‖², so 1e-12 of the largest entry; the test above takes only
    the first branch."""
    g = torch.Generator().manual_seed(3)
    if q_shape == 'self':
        k = torch.randn(*k_shape, dtype=F64, generator=g, requires_grad=True)
        inputs, fn = (k,), lambda f: (lambda t: f(t, t, 0.3))
    else:
        inputs = (torch.randn(*q_shape, dtype=F64, generator=g, requires_grad=True),
                  torch.randn(*k_shape, dtype=F64, generator=g, requires_grad=True))
        fn = lambda f: (lambda q, k: f(q, k, 0.3))                                      # noqa: E731
    results = []
    for f in (gaussian_kernel, gaussian_kernel_reference):
        out = fn(f)(*inputs)
        probe = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(4))
        results.append((out.detach(), *torch.autograd.grad((out * probe).sum(), inputs)))
    assert results[0][0].shape == results[1][0].shape
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item())


def test_gaussian_kernel_bounded_and_finite():
    torch.manual_seed(0)
    far = gaussian_kernel(1e4 * torch.randn(6, 4), -1e4 * torch.randn(5, 4))
    assert torch.isfinite(far).all() and (far >= 0).all() and far.max() < 1e-30
    # large, nearly equal points: ‖q‖²+‖k‖²−2qkᵀ cancels; the clamp keeps every value <= 1
    base = 1e3 + 1e-3 * torch.randn(8, 16)
    near = gaussian_kernel(base, base)
    assert torch.isfinite(near).all() and near.max() <= 1.0 and near.min() >= 0.0


def test_gaussian_kernel_self_attention_properties():
    """SOFT §3.1: S = exp(Q ⊖ Q) is symmetric, in [0, 1], with unit diagonal."""
    torch.manual_seed(1)
    q = torch.randn(2, 12, 8, dtype=F64)
    s = gaussian_kernel(q, q)
    torch.testing.assert_close(s, s.transpose(-2, -1), rtol=0, atol=1e-14)
    assert s.min() >= 0 and s.max() <= 1
    torch.testing.assert_close(torch.diagonal(s, dim1=-2, dim2=-1), torch.ones(2, 12, dtype=F64))


def test_gaussian_kernel_autocast_runs_in_float32():
    torch.manual_seed(0)
    q, k = torch.randn(9, 16), torch.randn(5, 16)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = gaussian_kernel(q.bfloat16(), k.bfloat16())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, gaussian_kernel_reference(q.bfloat16().double(), k.bfloat16().double()).float(),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- newton pinv

def test_newton_pinv_well_conditioned_matches_pinv():
    a = torch.stack([_spd(8, s, shift=1.0) for s in range(3)])
    x = newton_pinv(a, num_iter=30)
    torch.testing.assert_close(x, newton_pinv_reference(a), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(x @ a, torch.eye(8, dtype=F64).expand(3, 8, 8), rtol=1e-9, atol=1e-9)


def test_newton_pinv_rank_deficient_moore_penrose():
    a = _spd(8, 3, rank=3)                                    # PSD, rank 3 of 8
    x, residual = newton_pinv(a, num_iter=40, return_residual=True)
    ref = newton_pinv_reference(a)
    torch.testing.assert_close(x, ref, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(a @ x @ a, a, rtol=1e-9, atol=1e-9)        # AXA = A
    torch.testing.assert_close(x @ a @ x, x, rtol=1e-9, atol=1e-9)        # XAX = X
    torch.testing.assert_close(a @ x, (a @ x).T, rtol=1e-9, atol=1e-9)    # AX symmetric
    assert residual < 1e-10
    assert torch.linalg.matrix_rank(x, rtol=1e-10) == 3


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_newton_pinv_stays_put_past_convergence(dtype):
    """Unchecked, Newton doubles null-space rounding each step (X blows up on a singular A after ~60
    steps); each matrix freezes once converged, so any num_iter gives the same answer."""
    a64 = torch.stack([_spd(8, 3, rank=3), _spd(8, 4, shift=1.0)])
    a, ref = a64.to(dtype), newton_pinv_reference(a64)     # rounding a to float32 makes it full rank
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for num_iter in (30, 200):
        x = newton_pinv(a, num_iter=num_iter)
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_newton_pinv_host_loop_equals_sync_free_loop(dtype):
    """The CPU path (early exit, host-side freeze) and the GPU path (masked updates, no sync) are the
    same iteration: a batch mixing fast, slow and never-converging matrices gives the same X."""
    from structformer.functional.newton_pinv import _newton_schulz_device, _newton_schulz_host
    torch.manual_seed(4)
    lm = 0.3 * torch.randn(3, 10, 6, dtype=F64)
    a = torch.cat([torch.stack([_spd(10, 1, shift=5.0), _spd(10, 2, rank=4), torch.zeros(10, 10, dtype=F64)]),
                   gaussian_kernel(lm, lm)]).to(dtype)
    # Different BLAS kernels round the two loops differently, so a matrix may freeze one step earlier on
    # one path. The freeze rule only stops once ‖X_{k+1} − X_k‖_F ≤ √eps·‖X_{k+1}‖_F, so such a
    # disagreement moves X by at most √eps relative (and later steps by far less: Newton converges
    # quadratically). That bound, per matrix, is the tolerance; no bitwise comparison across paths.
    bound = torch.finfo(dtype).eps ** 0.5
    for num_iter in (1, 7, 25, 80):
        host, device = _newton_schulz_host(a, num_iter), _newton_schulz_device(a, num_iter)
        assert torch.isfinite(host).all() and torch.isfinite(device).all()
        gap, size = (host - device).flatten(1).norm(dim=1), host.flatten(1).norm(dim=1)
        assert (gap <= bound * size).all(), (num_iter, (gap / size).tolist())
        assert host[2].abs().max() == 0 and device[2].abs().max() == 0      # A = 0 gives X = 0 on both paths


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_newton_schulz_custom_op_passes_torch_library_opcheck(dtype):
    """`structformer::newton_schulz` (what torch.compile runs in place of the iteration) has a fake kernel and a
    schema of its own: torch's opcheck checks them (shapes and strides of the fake output against the real one, no
    mutation of the input, no autograd formula needed where none is registered), on a batch and on a transposed
    input, whose output the fake says is contiguous. shared_qkv_attention's ops had this check; this op had none."""
    import importlib
    newton = importlib.import_module('structformer.functional.newton_pinv')
    base = torch.randn(3, 5, 5, dtype=F64, generator=torch.Generator().manual_seed(2))
    a = (base @ base.transpose(-2, -1) / 5 + torch.eye(5, dtype=F64)).to(dtype)
    for matrices in (a, a[:1].transpose(-2, -1)):
        torch.library.opcheck(newton._newton_schulz_opaque, (matrices, 20))


def test_newton_pinv_residual_decreases_with_iterations():
    torch.manual_seed(2)
    lm = 0.6 * torch.randn(16, 8, dtype=F64)
    a = gaussian_kernel(lm, lm)                                # entry-wise positive kernel matrix
    residuals = [newton_pinv(a, n, return_residual=True)[1].item() for n in (1, 2, 4, 8, 16, 32, 64)]
    assert all(r1 <= r0 * (1 + 1e-9) for r0, r1 in zip(residuals, residuals[1:])), residuals
    assert residuals[0] > 0.1 and residuals[-1] < 1e-8, residuals


def test_paper_adaptive_alpha_rule_fails_where_ours_converges():
    """SPEC §2 'Careful': ‖I − A·(2βⁿ/‖A‖₁²)·A‖₁ ≤ 1 is never met for a positive kernel matrix."""
    torch.manual_seed(3)
    lm = 0.5 * torch.randn(12, 8, dtype=F64)
    a = gaussian_kernel(lm, lm)
    eye = torch.eye(12, dtype=F64)
    norm_1 = torch.linalg.matrix_norm(a, ord=1)
    for n in range(30):
        alpha = 2 * 0.5 ** n / norm_1 ** 2
        assert torch.linalg.matrix_norm(eye - alpha * a @ a, ord=1) > 1
    x, residual = newton_pinv(a, num_iter=40, return_residual=True)
    assert residual < 1e-8
    torch.testing.assert_close(x, newton_pinv_reference(a), rtol=1e-6, atol=1e-6)


def test_newton_pinv_all_ones_matrix():
    """‖A‖₂ = ‖A‖₁ for A = 𝟙𝟙ᵀ: Alg. 2's α = 2/‖A‖₁² maps it to X = 0 for ever; α = 1/‖A‖₁² is exact."""
    a = torch.ones(5, 5, dtype=F64)
    x = 2 / 25 * a
    for _ in range(10):
        x = 2 * x - x @ a @ x
    assert x.abs().max() == 0
    torch.testing.assert_close(newton_pinv(a, num_iter=10), a / 25)


def test_newton_pinv_gradcheck():
    """One matrix at float64's gradcheck tolerances (see the batched test below for why atol 1e-8 / rtol 1e-6: the
    old atol 1e-5 passed an Eq. 12 gradient off by 1e-5 relative)."""
    a = (_spd(5, 4) / 5 + torch.eye(5, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda m: newton_pinv(m, num_iter=40), (a,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize('rule', ['ours', 'soft', 'softpp'])
def test_newton_pinv_gradcheck_batched_at_float64_tolerances(rule):
    """The custom backward (Eq. 12) of every rule on a batch whose matrices freeze at different steps, at float64's
    tolerances. Once X has converged (to ~eps·cond), gradcheck's central difference with step 1e-6 is good to
    ~1e-10 (truncation ~1e-12 times the third derivative, cancellation ~1e-16 / 1e-6 times ‖X‖²), so atol 1e-8 and
    rtol 1e-6 fail any wrong term, where the default atol 1e-5 of the single-matrix test above could not tell a
    gradient off by 1e-6. The public rules' X_0 steps need more iterations than ours: num_iter 80."""
    a = torch.stack([_spd(5, 11) / 5 + torch.eye(5, dtype=F64),
                     _spd(5, 12, shift=0.1) / 5 + 0.2 * torch.eye(5, dtype=F64),
                     3.0 * torch.eye(5, dtype=F64) + _spd(5, 13) / 50]).requires_grad_()
    assert torch.autograd.gradcheck(lambda m: newton_pinv(m, num_iter=80, rule=rule), (a,), eps=1e-6, atol=1e-8,
                                    rtol=1e-6)


def test_newton_pinv_gradcheck_non_symmetric():
    """Nyströmformer inverts a row-stochastic, non-symmetric Ã: Eq. 12 with its transposes, −Yᵀ G Yᵀ, is the
    derivative of A⁻¹ for any invertible A; a backward that dropped a transpose would pass on symmetric A only."""
    g = torch.Generator().manual_seed(14)
    a = (torch.softmax(torch.randn(2, 6, 6, generator=g, dtype=F64), -1) + torch.eye(6, dtype=F64)).requires_grad_()
    assert not torch.allclose(a, a.transpose(-2, -1))
    assert torch.autograd.gradcheck(lambda m: newton_pinv(m, num_iter=80), (a,), eps=1e-6, atol=1e-8, rtol=1e-6)



def test_newton_pinv_inverts_non_symmetric_matrices_from_its_transposed_start():
    """X₀ = αAᵀ makes every error eigenvalue 1 − ασ² lie in [0, 1) for any A (module docstring), so the iteration
    inverts non-symmetric matrices too: an orthogonal Q (pinv Qᵀ; Q² has eigenvalues on the unit circle, so a
    start X₀ = αA diverges) and a random invertible matrix. Symmetric kernel matrices cannot tell the two starts
    apart."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(3, 6, 6, generator=g, dtype=F64))
    torch.testing.assert_close(newton_pinv(q, num_iter=30), q.mT, rtol=1e-12, atol=1e-12)
    a = torch.randn(3, 6, 6, generator=g, dtype=F64) + 3 * torch.eye(6, dtype=F64)
    torch.testing.assert_close(newton_pinv(a, num_iter=60), torch.linalg.inv(a), rtol=1e-10, atol=1e-10)

def test_newton_pinv_backward_is_eq12():
    a = (_spd(6, 5) / 6 + torch.eye(6, dtype=F64)).requires_grad_()
    g = torch.randn(6, 6, dtype=F64)
    (grad,) = torch.autograd.grad((newton_pinv(a, 40) * g).sum(), a)
    y = torch.linalg.inv(a.detach())
    torch.testing.assert_close(grad, -y.T @ g @ y.T, rtol=1e-8, atol=1e-8)


def test_newton_pinv_near_singular_is_finite():
    torch.manual_seed(4)
    lm = torch.randn(1, 8).expand(10, 8) + 1e-6 * torch.randn(10, 8)   # ten almost identical landmarks
    a = gaussian_kernel(lm, lm)                                          # ≈ 𝟙𝟙ᵀ, float32
    x, residual = newton_pinv(a, num_iter=20, return_residual=True)
    assert torch.isfinite(x).all() and torch.isfinite(residual).all()
    assert residual < 1e-2                                               # the rank-1 part is inverted
    zero_x, zero_res = newton_pinv(torch.zeros(2, 4, 4), return_residual=True)
    assert (zero_x == 0).all() and (zero_res == 0).all()


def test_newton_pinv_ridge():
    a = _spd(6, 6, rank=2)
    x = newton_pinv(a, num_iter=60, ridge=0.1)
    torch.testing.assert_close(x, torch.linalg.inv(a + 0.1 * torch.eye(6, dtype=F64)), rtol=1e-8, atol=1e-8)


def test_newton_pinv_autocast_returns_float32():
    a = (_spd(8, 7, shift=8.0) / 8).float().bfloat16().requires_grad_()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        x, residual = newton_pinv(a, num_iter=30, return_residual=True)
    assert x.dtype == torch.float32 and residual < 1e-5
    torch.testing.assert_close(x, newton_pinv_reference(a.detach().float()), rtol=1e-4, atol=1e-4)
    x.sum().backward()
    assert a.grad.dtype == torch.bfloat16 and torch.isfinite(a.grad.float()).all()


@pytest.mark.parametrize('num_iter', [0, -3, 2.5])
def test_newton_pinv_rejects_bad_num_iter(num_iter):
    with pytest.raises(ValueError, match='num_iter'):
        newton_pinv(torch.eye(3), num_iter=num_iter)


@pytest.mark.parametrize('ridge', [-1.0, float('nan'), float('inf'), None, 'x', True])
def test_newton_pinv_names_a_bad_ridge(ridge):
    """The layers check their ridge, the public function did not: -1 made A + ridge·I indefinite and NaN gave NaN
    inverses, silently; 'x' failed as "only integer tensors of a single element can be converted to an index"."""
    with pytest.raises(ValueError, match=r'^ridge=\S+ must be a finite number >= 0'):
        newton_pinv(torch.eye(3), ridge=ridge)


def test_newton_pinv_names_an_input_that_is_not_matrices():
    """A vector failed with "IndexError: tuple index out of range"."""
    with pytest.raises(ValueError, match=r'newton_pinv expects square matrices \[\.\.\., m, m\], got shape \(3,\)'):
        newton_pinv(torch.ones(3))


# ---------------------------------------------------------------- spectral properties (SOFT Props 3–6)

@pytest.mark.parametrize('seed', range(4))
def test_softmax_attention_spectral_radius_at_most_one(seed):
    """Prop 3: softmax attention D⁻¹A is row-stochastic, so every eigenvalue has |λ| ≤ 1."""
    g = torch.Generator().manual_seed(seed)
    q, k = (2 * torch.randn(20, 8, generator=g, dtype=F64) for _ in range(2))
    attn = softmax_attention_reference(q, k, torch.eye(20, dtype=F64))    # the matrix itself
    assert torch.linalg.eigvals(attn).abs().max() <= 1 + 1e-10
    sym = softmax_attention_reference(q, q, torch.eye(20, dtype=F64))     # Q = K: real spectrum, λ₁ = 1
    torch.testing.assert_close(torch.linalg.eigvals(sym).real.max(), torch.tensor(1.0, dtype=F64))


@pytest.mark.parametrize('seed', range(4))
def test_gaussian_attention_eigenvalues_at_most_n(seed):
    """Prop 4: S is PSD with trace n, so 0 ≤ λ ≤ n; near-identical tokens push λ₁ towards n."""
    g = torch.Generator().manual_seed(seed)
    n = 20
    for spread in (0.01, 1.0):
        q = spread * torch.randn(n, 8, generator=g, dtype=F64)
        lam = torch.linalg.eigvalsh(gaussian_kernel(q, q))
        assert lam.min() > -1e-10 and lam.max() <= n + 1e-9
        torch.testing.assert_close(lam.sum(), torch.tensor(float(n), dtype=F64))
    assert lam.max() < n / 2 and torch.linalg.eigvalsh(
        gaussian_kernel(0.01 * q, 0.01 * q)).max() > 0.99 * n


@pytest.mark.parametrize('seed', range(6))
def test_softpp_normalisation_shrinks_bottleneck_norm(seed):
    """Props 5–6: ‖D^-½ A† D^-½‖₂ < ‖A†‖₂ (D = diag(A1) ≥ 1 because A has a unit diagonal)."""
    g = torch.Generator().manual_seed(seed)
    lm = 0.7 * torch.randn(16, 8, generator=g, dtype=F64)
    a = gaussian_kernel(lm, lm)
    a_pinv = newton_pinv_reference(a)
    d = torch.diag(a.sum(-1).rsqrt())
    assert torch.linalg.matrix_norm(d @ a_pinv @ d, ord=2) < torch.linalg.matrix_norm(a_pinv, ord=2)
