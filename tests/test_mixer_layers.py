"""Structured linear layers of the Mixer family against materialised matrices (Mixer paper Eq. 6–10,
Prop. 3.2, Def. 5.1; Monarch), in float64 where two code paths are compared."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from structformer.layers.linear import KroneckerLinear, MaskedLinear, MonarchLinear, PKLinear
from structformer.layers.linear.permutation import (check_permutation, permute_features, permute_features_reference,
                                                    random_permutation, transpose_permutation)

D = torch.float64


def permutation_matrix(perm: torch.Tensor) -> torch.Tensor:
    """The m×m matrix J with (Jx)[i] = x[perm[i]] -- only the tests ever build one."""
    m = perm.numel()
    J = torch.zeros(m, m, dtype=D)
    J[torch.arange(m), perm] = 1
    return J


def vec(X: torch.Tensor) -> torch.Tensor:
    """The paper's column-major vec."""
    return X.t().reshape(-1)


def test_vec_kronecker_identity_and_mixing_forms():
    """vec(WXV) = (Vᵀ⊗W) vec X (Eq. 6); token mixing I_C⊗W, channel mixing Vᵀ⊗I_S = J_cᵀ(I_S⊗Vᵀ)J_c (Eq. 9–10)."""
    torch.manual_seed(0)
    S, C = 5, 3
    X, W, V = torch.randn(S, C, dtype=D), torch.randn(S, S, dtype=D), torch.randn(C, C, dtype=D)
    torch.testing.assert_close(vec(W @ X @ V), torch.kron(V.t().contiguous(), W) @ vec(X))
    torch.testing.assert_close(vec(W @ X), torch.kron(torch.eye(C, dtype=D), W) @ vec(X))
    Jc = permutation_matrix(transpose_permutation(C, S))     # vec(X) = [C, S] row-major -> vec(Xᵀ)
    torch.testing.assert_close(Jc @ vec(X), vec(X.t()))
    torch.testing.assert_close(torch.kron(V.t().contiguous(), torch.eye(S, dtype=D)),
                               Jc.t() @ torch.kron(torch.eye(S, dtype=D), V.t().contiguous()) @ Jc)


def test_proposition_3_2_s_mixer_is_a_sparse_wide_mlp():
    """vec(φ(φ(WX)V)) = φ(J_cᵀ(I_S⊗Vᵀ)J_c φ((I_C⊗W) vec X)), every matrix materialised."""
    torch.manual_seed(1)
    S, C = 4, 6
    X, W, V = torch.randn(S, C, dtype=D), torch.randn(S, S, dtype=D), torch.randn(C, C, dtype=D)
    phi = F.gelu
    Jc = permutation_matrix(transpose_permutation(C, S))
    wide = phi(Jc.t() @ torch.kron(torch.eye(S, dtype=D), V.t().contiguous()) @ Jc
               @ phi(torch.kron(torch.eye(C, dtype=D), W) @ vec(X)))
    torch.testing.assert_close(wide, vec(phi(phi(W @ X) @ V)))
    # the non-zero fractions of §4.1: 1/C for token mixing, 1/S for channel mixing
    assert (torch.kron(torch.eye(C, dtype=D), W) != 0).double().mean().item() == pytest.approx(1 / C)
    assert (torch.kron(torch.eye(S, dtype=D), V.t().contiguous()) != 0).double().mean().item() == pytest.approx(1 / S)


def test_pk_layer_with_transpose_is_token_mixing():
    """PK_W(x; J_c, J_cᵀ) on the row-major table x = X.flatten() is (W X).flatten() (Eq. S.10–S.11)."""
    torch.manual_seed(2)
    S, C, S_out = 5, 3, 7
    layer = PKLinear(C, S, S_out, 'transpose', 'transpose', bias=False).double()
    X = torch.randn(2, S, C, dtype=D)
    torch.testing.assert_close(layer(X.reshape(2, -1)), (layer.weight @ X).reshape(2, -1))
    channel = PKLinear(S, C, C, 'identity', 'identity', bias=True).double()
    torch.testing.assert_close(channel(X.reshape(2, -1)), F.linear(X, channel.weight, channel.bias).reshape(2, -1))


def test_pk_dense_matches_definition_5_1():
    torch.manual_seed(3)
    layer = PKLinear(4, 3, 5, 'random', 'random', seed=7).double()
    J1, J2 = permutation_matrix(layer.input_permutation()), permutation_matrix(layer.output_permutation())
    expected = J2 @ torch.kron(torch.eye(4, dtype=D), layer.weight.detach()) @ J1
    torch.testing.assert_close(layer.to_dense(), expected)


def _layers():
    return [
        ('pk-identity', lambda: PKLinear(3, 4, 5)),
        ('pk-transpose', lambda: PKLinear(3, 4, 4, 'transpose', 'transpose')),
        ('pk-random', lambda: PKLinear(3, 4, 6, 'random', 'random', seed=1)),
        ('pk-explicit', lambda: PKLinear(2, 3, 3, torch.tensor([5, 0, 3, 1, 4, 2]), 'transpose')),
        ('kronecker', lambda: KroneckerLinear((3, 4), (5, 2))),
        ('monarch-square', lambda: MonarchLinear(16, 16, nblocks=4)),
        ('monarch-rect', lambda: MonarchLinear(12, 18, nblocks=3)),
        ('monarch-wide-blocks', lambda: MonarchLinear(24, 8, nblocks=2)),
        ('masked', lambda: MaskedLinear(10, 7, density=0.3, seed=2)),
    ]


@pytest.mark.parametrize('name,make', _layers(), ids=[n for n, _ in _layers()])
def test_fast_path_equals_dense_reference_outputs_and_gradients(name, make):
    torch.manual_seed(4)
    layer = make().double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)        # non-zero biases too
    x = torch.randn(2, 3, layer.in_features, dtype=D, requires_grad=True)
    grad_out = torch.randn(2, 3, layer.out_features, dtype=D)
    results = []
    for forward in (layer.forward, layer.forward_reference):
        layer.zero_grad()
        x.grad = None
        y = forward(x)
        y.backward(grad_out)
        results.append((y.detach(), x.grad.clone(), [p.grad.clone() for p in layer.parameters()]))
    (y1, gx1, gp1), (y2, gx2, gp2) = results
    # float64, sums of <= 24 products in another order: 1e-12 of the largest entry (the default 1e-7 is float32's)
    for a, b in zip([y1, gx1, *gp1], [y2, gx2, *gp2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item())
    assert y1.shape == (2, 3, layer.out_features)


@pytest.mark.parametrize('shape', [(16, 16, 4), (12, 18, 3), (24, 8, 2)], ids=['square', 'rect', 'wide-blocks'])
def test_monarch_gradcheck_float64(shape):
    """The forward's `_ContiguousGrad` (identity forward, contiguous gradient) is custom autograd: gradcheck
    through the whole layer, input and both factors."""
    torch.manual_seed(6)
    layer = MonarchLinear(shape[0], shape[1], nblocks=shape[2]).double()
    x = torch.randn(3, shape[0], dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t, r, l: torch.func.functional_call(
        layer, {'weight_right': r, 'weight_left': l, 'bias': layer.bias}, (t,)),
        (x, layer.weight_right.detach().clone().requires_grad_(), layer.weight_left.detach().clone().requires_grad_()))


def test_monarch_bmm_operands_are_blas_layouts_forward_and_backward():
    """Every bmm of a Monarch training step gets matrices with a unit stride in one of their two dims: a CPU bmm
    whose matrices have none (the batch innermost, as the permuted middle and the gradients coming back through the
    permutations had) copies them one batch entry at a time (12 % of the step at n 4096, b 64)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class BmmLayouts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bad = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.bmm.out):
                for t in args[:2]:
                    if t.stride(-1) != 1 and t.stride(-2) != 1:
                        self.bad.append((tuple(t.shape), t.stride()))
            return func(*args, **(kwargs or {}))

    layer = MonarchLinear(64, 64, nblocks=8)                  # square: p = q = s = b, where the reshape is a view
    x = torch.randn(5, 64, requires_grad=True)
    with BmmLayouts() as spy:
        layer(x).square().sum().backward()
    assert spy.bad == []


def test_permute_features_gradcheck_and_reference():
    torch.manual_seed(5)
    perm = random_permutation(7, seed=3)
    x = torch.randn(3, 7, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: permute_features(t, perm), (x,))
    g = torch.randn(3, 7, dtype=D)
    a, = torch.autograd.grad(permute_features(x, perm), x, g)
    b, = torch.autograd.grad(permute_features_reference(x, perm), x, g)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(permute_features(x, perm), x[:, perm])


def test_permutation_and_monarch_backwards_pass_gradgradcheck():
    """The two custom autograd Functions of the Mixer layers (`_PermuteFeatures`' gather backward, Monarch's
    `_ContiguousGrad`) differentiated twice, float64: a second-order method (a Hessian-vector product, a gradient
    penalty) goes through them."""
    torch.manual_seed(9)
    perm = random_permutation(7, seed=4)
    x = torch.randn(3, 7, dtype=D, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: permute_features(t, perm).square(), (x,))
    layer = MonarchLinear(12, 18, nblocks=3).double()
    inputs = (torch.randn(2, 12, dtype=D, requires_grad=True), layer.weight_right.detach().clone().requires_grad_(),
              layer.weight_left.detach().clone().requires_grad_())
    assert torch.autograd.gradgradcheck(lambda t, r, l: torch.func.functional_call(
        layer, {'weight_right': r, 'weight_left': l, 'bias': layer.bias}, (t,)).square(), inputs)


def test_monarch_projection_recovers_a_monarch_and_is_locally_optimal():
    torch.manual_seed(6)
    source = MonarchLinear(16, 16, nblocks=4, bias=False).double()
    projected = MonarchLinear.from_dense(source.to_dense())
    torch.testing.assert_close(projected.to_dense(), source.to_dense())
    dense = torch.randn(16, 16, dtype=D)
    best = MonarchLinear.from_dense(dense)
    error = (best.to_dense() - dense).norm()
    assert error < dense.norm()
    for _ in range(10):                               # no nearby Monarch is closer
        other = MonarchLinear.from_dense(dense)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(torch.randn_like(p) * 1e-2)
        assert (other.to_dense() - dense).norm() >= error - 1e-12


def test_masked_linear_masked_entries_never_change_in_training():
    torch.manual_seed(7)
    layer = MaskedLinear(20, 12, density=0.25, seed=3)
    off = ~layer.mask
    assert 0.1 < layer.mask.float().mean().item() < 0.4
    assert (layer.weight[off] == 0).all()
    # init scaled to the kept fan-in: kept entries have variance 1/(p·in)
    kept = layer.weight[layer.mask]
    assert kept.std().item() == pytest.approx(1 / math.sqrt(0.25 * 20), rel=0.35)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.5)
    for _ in range(5):
        opt.zero_grad()
        layer(torch.randn(8, 20)).square().sum().backward()
        assert (layer.weight.grad[off] == 0).all()
        opt.step()
    assert (layer.weight[off] == 0).all()
    assert (layer.weight[layer.mask] != kept).any()          # the kept ones did train


def test_masked_linear_warns_with_the_byte_count():
    with pytest.warns(ResourceWarning, match=r'4,000 bytes'):
        MaskedLinear(20, 40, density=0.5, warn_bytes=1000)    # 800 weights × (4 + 1) bytes
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        MaskedLinear(20, 40, density=0.5)


def test_seeded_layers_rebuild_exactly():
    a, b = PKLinear(3, 4, 4, 'random', 'random', seed=9), PKLinear(3, 4, 4, 'random', 'random', seed=9)
    assert torch.equal(a.perm_in, b.perm_in) and torch.equal(a.perm_out, b.perm_out)
    assert a.perm_in.dtype == torch.int64 and set(a.state_dict()) == {'weight', 'bias', 'perm_in', 'perm_out'}
    assert not torch.equal(a.perm_in, PKLinear(3, 4, 4, 'random', 'random', seed=10).perm_in)
    # J₁ from the seed, J₂ from seed + 1: two independent draws (one seed for both made J₂ = J₁ whenever the sizes
    # agree, a correlated pair instead of the paper's two random permutations)
    assert torch.equal(a.perm_in, random_permutation(12, 9)) and torch.equal(a.perm_out, random_permutation(12, 10))
    assert not torch.equal(a.perm_in, a.perm_out)
    assert torch.equal(MaskedLinear(9, 9, 0.3, seed=1).mask, MaskedLinear(9, 9, 0.3, seed=1).mask)



@pytest.mark.parametrize('make, factors', [
    (lambda: KroneckerLinear((64, 48), (64, 48)), lambda m: [(m.weight_rows, 64), (m.weight_cols, 48)]),
    (lambda: MonarchLinear(2304, 2304, nblocks=48), lambda m: [(m.weight_right, 48), (m.weight_left, 48)])],
    ids=['kronecker', 'monarch'])
def test_structured_factors_start_at_the_dense_init_scale(make, factors):
    """Each factor starts N(0, 1/fan_in of its own blocks), so the product's entries have the variance 1/in_features of
    a dense N(0, 1/fan_in) init (one path per entry: a product of one entry of each factor). Checked on the factors'
    sample second moments, within four standard errors of a mean of N squared normals (relative √(2/N))."""
    torch.manual_seed(0)
    layer = make()
    for weight, fan_in in factors(layer):
        moment = weight.detach().double().pow(2).mean().item() * fan_in
        assert abs(moment - 1) <= 4 * math.sqrt(2 / weight.numel()), (tuple(weight.shape), moment)
        assert abs(weight.detach().double().mean().item()) * math.sqrt(fan_in) <= 4 / math.sqrt(weight.numel())


GIVEN_PERMUTATION = torch.tensor([3, 1, 0, 2, 11, 4, 5, 6, 7, 8, 9, 10])


@pytest.mark.parametrize('make', [
    lambda **dd: PKLinear(3, 4, 5, 'random', 'random', seed=4, **dd),
    lambda **dd: PKLinear(3, 4, 4, GIVEN_PERMUTATION, 'transpose', **dd),      # made outside torch.device('meta')
    lambda **dd: MaskedLinear(12, 8, density=0.3, seed=5, **dd),
])
@pytest.mark.parametrize('context', [False, True])
def test_a_meta_built_layer_materialised_by_to_empty_and_reset_parameters_is_the_seeded_layer(make, context):
    """torch's deferred initialisation: build on the meta device (the `device='meta'` argument, or under
    `torch.device('meta')`), `to_empty(device=...)`, then `reset_parameters()` on every module. The layers' index and
    mask buffers are part of their construction, so reset_parameters regenerates them (from the seed, or the vector
    given), as BatchNorm's resets its running statistics. Before, they kept `to_empty`'s uninitialised memory: a
    PKLinear's gather read indices such as 94421330960164 (IndexError, or other rows silently where the garbage was
    in range), a MaskedLinear kept a random mask instead of its seed's."""
    torch.manual_seed(0)
    reference = make()
    from deferred_init import deferred_init
    layer = deferred_init(make, context)
    buffers, expected = dict(layer.named_buffers()), dict(reference.named_buffers())
    assert set(buffers) == set(expected) and buffers
    for name, buffer in buffers.items():
        assert buffer.device.type == 'cpu' and torch.equal(buffer, expected[name]), name
    layer.load_state_dict({k: v for k, v in reference.state_dict().items() if k not in buffers}, strict=False)
    x = torch.randn(2, 12)
    torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=0)       # the same ops on the same values


def test_loaded_permutations_win_and_bad_ones_are_refused():
    torch.manual_seed(8)
    source, target = PKLinear(3, 4, 4, 'random', 'random', seed=1), PKLinear(3, 4, 4, 'random', 'random', seed=2)
    target.load_state_dict(source.state_dict())
    x = torch.randn(2, 12)
    torch.testing.assert_close(target(x), source(x))
    state = dict(source.state_dict(), perm_in=torch.zeros(12, dtype=torch.int64))
    with pytest.raises(RuntimeError, match='not a permutation'):
        target.load_state_dict(state)
    torch.testing.assert_close(target(x), source(x))                         # the failed load changed nothing
    identity = PKLinear(3, 4, 4)                                               # structure: stores no indices
    assert set(identity.state_dict()) == {'weight', 'bias'}
    with pytest.raises(RuntimeError, match='Unexpected key.*perm_in'):
        identity.load_state_dict(source.state_dict())


@pytest.mark.parametrize('make,match', [
    (lambda: PKLinear(2, 3, 3, torch.arange(5)), 'length 6'),
    (lambda: PKLinear(2, 3, 3, torch.tensor([0, 1, 2, 3, 4, 4])), r'not a permutation: index\(es\) \[4\] repeat'),
    (lambda: PKLinear(2, 3, 3, torch.tensor([0, 1, 2, 3, 4, 6])), r'indices in \[0, 5\]'),
    (lambda: PKLinear(2, 3, 3, torch.rand(6)), 'integer index vector'),
    (lambda: PKLinear(2, 3, 3, 'shuffle'), "'identity', 'transpose', 'random'"),
    (lambda: PKLinear(0, 3, 3), '^PKLinear num_blocks=0 must be a positive integer$'),
    (lambda: MaskedLinear(4, 4, density=0.0), r'density must be in \(0, 1\]'),
    (lambda: MaskedLinear(4, 4, density=1.5), r'density must be in \(0, 1\]'),
    (lambda: MonarchLinear(12, 16, nblocks=5), 'nblocks=5 must divide in_features=12'),
    (lambda: MonarchLinear(12, 10, nblocks=4), 'nblocks=4 must divide out_features=10'),
    (lambda: MonarchLinear.from_dense(torch.randn(12, 12)), 'perfect square'),
    (lambda: KroneckerLinear((3,), (2, 2)), 'in_shape must be two positive integers'),
])
def test_bad_arguments_give_one_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_wrong_input_width_is_named():
    with pytest.raises(ValueError, match=r'inputs \[\.\.\., 12\] \(num_blocks 3 × block_in 4\)'):
        PKLinear(3, 4, 4)(torch.randn(2, 10))
    with pytest.raises(ValueError, match=r'MonarchLinear expects inputs \[\.\.\., 16\]'):
        MonarchLinear(16, 16, nblocks=4)(torch.randn(2, 15))


def test_check_permutation_accepts_lists():
    assert check_permutation([2, 0, 1], 3).tolist() == [2, 0, 1]


def _edge_layers():
    return [
        ('pk-transpose-rect', lambda: PKLinear(3, 4, 5, 'transpose', 'transpose')),     # [4, 3] in, [3, 5] out grids
        ('pk-transpose-in-only', lambda: PKLinear(3, 4, 5, 'transpose', 'identity')),
        ('pk-transpose-out-no-bias', lambda: PKLinear(3, 4, 5, 'identity', 'transpose', bias=False)),
        ('pk-random-rect', lambda: PKLinear(5, 2, 3, 'random', 'transpose', seed=3)),
        ('kronecker-no-bias-unit-dims', lambda: KroneckerLinear((1, 4), (3, 1), bias=False)),
        ('monarch-one-block', lambda: MonarchLinear(6, 10, nblocks=1)),
        ('monarch-no-bias-narrow', lambda: MonarchLinear(12, 6, nblocks=6, bias=False)),
        ('masked-no-bias', lambda: MaskedLinear(9, 4, density=0.5, seed=1, bias=False)),
    ]


@pytest.mark.parametrize('lead', [(), (1,), (1, 1), (2, 3, 4)], ids=['vector', 'batch-1', 'batch-1x1', 'batch-2x3x4'])
@pytest.mark.parametrize('name,make', _edge_layers(), ids=[n for n, _ in _edge_layers()])
def test_fast_path_equals_dense_reference_on_edge_shapes(name, make, lead):
    """The shapes the test above does not take: rectangular grids under the transpose shuffle (in and out grids
    differ), no bias, unit factor dimensions, one Monarch block, and inputs that are one vector, one row, or four
    leading dims. Outputs and the input and parameter gradients in float64; sums of <= 12 products in another
    order, so 1e-12 of each tensor's largest entry (the default float64 tolerance, 1e-7, would pass a wrong term
    of that size)."""
    torch.manual_seed(7)
    layer = make().double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(*lead, layer.in_features, dtype=D)
    grad_out = torch.randn(*lead, layer.out_features, dtype=D)
    results = []
    for forward in (layer.forward, layer.forward_reference):
        xs = x.clone().requires_grad_()
        y = forward(xs)
        assert y.shape == (*lead, layer.out_features)
        results.append((y.detach(), *torch.autograd.grad(y, [xs, *layer.parameters()], grad_out)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item())


@pytest.mark.parametrize('layout', ['feature-major', 'strided-features'])
@pytest.mark.parametrize('name,make', _layers() + _edge_layers(), ids=[n for n, _ in _layers() + _edge_layers()])
def test_fast_path_equals_dense_reference_on_non_contiguous_inputs(name, make, layout):
    """x as a view that is not row-major (a permuted [in, 5, 3] tensor: the features are the slowest axis; or every
    other feature of a wider tensor): the fast paths reshape and permute x, and a view where a copy is needed
    would raise or read the wrong features. Outputs and the input and parameter gradients against the dense
    reference, float64, 1e-12 of each tensor's largest entry (the tests above take contiguous x only)."""
    torch.manual_seed(8)
    layer = make().double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    if layout == 'feature-major':
        base = torch.randn(layer.in_features, 5, 3, dtype=D)
        view = lambda t: t.permute(2, 1, 0)                                          # noqa: E731
    else:
        base = torch.randn(3, 5, 2 * layer.in_features, dtype=D)
        view = lambda t: t[..., ::2]                                                 # noqa: E731
    assert not view(base).is_contiguous()
    grad_out = torch.randn(3, 5, layer.out_features, dtype=D)
    results = []
    for forward in (layer.forward, layer.forward_reference):
        leaf = base.clone().requires_grad_()
        y = forward(view(leaf))
        results.append((y.detach(), *torch.autograd.grad(y, [leaf, *layer.parameters()], grad_out)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item())


def _reshape_transpose(rows: int, cols: int) -> torch.Tensor:
    """P of Dao et al. (2022) as a matrix: x viewed as [rows, cols], transposed, flattened."""
    return permutation_matrix(torch.arange(rows * cols).view(rows, cols).t().reshape(-1))


def test_square_monarch_is_dao_et_al_and_corollary_3_4():
    """Independent of `to_dense`: the square Monarch (b = √n) is P L Pᵀ R with Dao et al.'s P, every factor
    materialised; and with weight-shared blocks R = I_C ⊗ W, L = I_S ⊗ Vᵀ (S = C = b) it is the linear S-Mixer of
    Cor. 3.4, vec(W X V) in the paper's column-major vec."""
    torch.manual_seed(8)
    b = 4
    layer = MonarchLinear(b * b, b * b, nblocks=b, bias=False).double()
    P = _reshape_transpose(b, b)
    R, L = torch.block_diag(*layer.weight_right.detach()), torch.block_diag(*layer.weight_left.detach())
    x = torch.randn(3, b * b, dtype=D)
    torch.testing.assert_close(layer(x), x @ (P @ L @ P.t() @ R).t(), rtol=1e-12, atol=1e-12)
    W, V, X = torch.randn(b, b, dtype=D), torch.randn(b, b, dtype=D), torch.randn(b, b, dtype=D)
    with torch.no_grad():
        layer.weight_right.copy_(W.expand(b, b, b))
        layer.weight_left.copy_(V.t().expand(b, b, b))
    torch.testing.assert_close(layer(vec(X)), vec(W @ X @ V), rtol=1e-12, atol=1e-12)


def test_rectangular_monarch_shuffles_its_middle_as_documented():
    """b ≠ q: the middle is read as [b, q] and transposed (P L P R, the module docstring), the inverse of the
    shuffle in Dao et al.'s code (P L Pᵀ R); both connect each output block to the same number of input blocks."""
    torch.manual_seed(9)
    layer = MonarchLinear(12, 18, nblocks=3, bias=False).double()          # p = 4, q = 4, s = 6
    b, (p, q, s) = layer.nblocks, layer.block_sizes
    R, L = torch.block_diag(*layer.weight_right.detach()), torch.block_diag(*layer.weight_left.detach())
    ours = _reshape_transpose(b, s) @ L @ _reshape_transpose(b, q) @ R
    torch.testing.assert_close(layer.to_dense(), ours, rtol=1e-12, atol=1e-12)
    x = torch.randn(2, 12, dtype=D)
    torch.testing.assert_close(layer(x), x @ ours.t(), rtol=1e-12, atol=1e-12)
    daos = _reshape_transpose(b, s) @ L @ _reshape_transpose(b, q).t() @ R
    assert not torch.allclose(ours, daos)
