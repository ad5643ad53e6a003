"""The CPU tile kernel of Sparsifiner's block connectivity (csrc/) against its slow, obvious references:
masked_attention on block_indices_to_mask (outputs, and gradients through autograd), gradcheck in float64,
and pooled_block_scores + top_tiles for its predictor."""
import math
from pathlib import Path

import pytest
import torch

from structformer.functional import tile_kernel
from structformer.functional.sparsifiner import (block_gathered_attention, block_indices_to_mask, budget,
                                                 down_projected_keys, low_rank_attention, masked_attention,
                                                 pooled_basis, pooled_block_scores, predicted_tiles, tile_attention,
                                                 top_tiles)
from structformer.layers.attention.sparsifiner import SparsifinerAttention


@pytest.fixture(scope='module')
def kernel():
    """The kernel where it is meant to build (Linux x86-64 with torch's MKL and OpenMP and a compiler): a failed
    build there fails the test instead of skipping it."""
    reason = tile_kernel._platform_reason() or (None if tile_kernel._compiler() else 'no C++ compiler')
    if reason:
        pytest.skip(f'the tile kernel does not exist here: {reason}')
    assert tile_kernel.unavailable_reason() is None, tile_kernel.unavailable_reason()
    return tile_kernel.block_tile_attention


def _case(batch, heads, n, d, block_size, kept, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, d, generator=g, dtype=dtype) for _ in range(3))
    tiles = -(-n // block_size)
    rows = [torch.randperm(tiles, generator=g)[:kept] for _ in range(batch * heads * tiles)]
    return q, k, v, torch.stack(rows).reshape(batch, heads, tiles, kept)


CASES = [  # batch, heads, n, d, block_size, kept, dense_rows
    (1, 6, 577, 64, 64, 3, 1),          # DeiT-S at 384 px, keep 0.25: a one-token last tile, the cls row dense
    (2, 3, 130, 16, 32, 2, 0),          # two images, partial last tiles, no dense row
    (1, 2, 20, 8, 64, 1, 1),            # fewer tokens than one tile
    (1, 2, 70, 8, 8, 9, 9),             # every tile kept; dense rows past the first tile
    (1, 1, 64, 4, 16, 2, 64),           # every row dense
]


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('batch, heads, n, d, block_size, kept, dense_rows', CASES)
def test_kernel_equals_masked_attention_on_the_tile_mask(kernel, dtype, batch, heads, n, d, block_size, kept,
                                                         dense_rows):
    q, k, v, chosen = _case(batch, heads, n, d, block_size, kept, dtype)
    expected = masked_attention(q, k, v, block_indices_to_mask(chosen, n, block_size, dense_rows))
    got = kernel(q, k, v, chosen, block_size, dense_rows=dense_rows)
    tolerance = {} if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, expected, **tolerance)


def test_kernel_takes_the_strided_heads_of_a_projection_and_returns_token_major_heads(kernel):
    """q, k, v as the layer has them (views of one [B, n, 3, H, d] projection, no copies), an explicit scale, and
    an output whose heads merge into [B, n, H·d] as a view."""
    torch.manual_seed(0)
    b, n, h, d, bs = 2, 50, 3, 8, 16
    qkv = torch.randn(b, n, 3, h, d, dtype=torch.float64).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    assert not q.is_contiguous()
    _, _, _, chosen = _case(b, h, n, d, bs, 2, torch.float64)
    got = kernel(q, k, v, chosen, bs, scale=0.3, dense_rows=1)
    expected = masked_attention(q, k, v, block_indices_to_mask(chosen, n, bs, 1), scale=0.3)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert got.transpose(1, 2).is_contiguous()
    # an expanded key (every token the same row: stride 0) and channels two apart are copied first
    same_key = k[:, :, :1].expand(-1, -1, n, -1)
    spaced = torch.randn(b, h, n, 2 * d, dtype=torch.float64)[..., ::2]
    got = kernel(q, same_key, spaced, chosen, bs)
    expected = masked_attention(q, same_key, spaced, block_indices_to_mask(chosen, n, bs, 0))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_kernel_equals_the_gathered_path_at_every_thread_count(kernel):
    """Outputs and gradients (the backward's tasks write dK, dV per key tile in parallel: the suite's
    OMP_NUM_THREADS=1 alone would never run two at once)."""
    q, k, v, chosen = _case(1, 4, 200, 16, 32, 3, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    upstream = torch.randn_like(q)
    reference = block_gathered_attention(q, k, v, chosen, 32, dense_rows=1)
    reference_grads = torch.autograd.grad(reference, (q, k, v), upstream)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            out = tile_attention(q, k, v, chosen, 32, dense_rows=1, impl='kernel')
            torch.testing.assert_close(out, reference)
            for got, expected in zip(torch.autograd.grad(out, (q, k, v), upstream), reference_grads):
                torch.testing.assert_close(got, expected)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize('dtype, predictor_dim', [(torch.float64, None), (torch.float32, None), (torch.float64, 4)])
def test_layer_infers_on_the_kernel_by_default_and_matches_gather(kernel, dtype, predictor_dim):
    """impl='auto' with block connectivity runs the kernel on a CPU (predictor and attention in inference, the
    attention in training) and gathers under attention dropout; it gives the outputs of impl='gather'."""
    torch.manual_seed(0)
    options = dict(keep_ratio=0.3, connectivity='block', block_size=8, seq_len=41, n_down=6,
                   predictor_dim=predictor_dim)
    auto = SparsifinerAttention(32, 4, **options).to(dtype).eval()
    gathered = SparsifinerAttention(32, 4, impl='gather', **options).to(dtype).eval()
    gathered.load_state_dict(auto.state_dict())
    x = torch.randn(3, 41, 32, dtype=dtype)
    with torch.no_grad():
        q = auto.project(x)[0]
        assert auto._resolve_impl(q, 0.0) == 'kernel'
        got, expected = auto(x), gathered(x)
    # float64: sums over <= 41 keys in another order, 1e-12 of the largest entry; float32: its default tolerance
    tolerance = dict(rtol=1e-12, atol=1e-12 * expected.abs().max().item()) if dtype == torch.float64 else {}
    torch.testing.assert_close(got, expected, **tolerance)
    assert auto._resolve_impl(auto.project(x)[0], 0.0) == 'kernel'          # gradients wanted: its backward
    assert auto._resolve_impl(q, 0.1) == 'gather'                            # attention dropout
    assert SparsifinerAttention(32, 4, keep_ratio=0.3)._resolve_impl(q, 0.0) == 'masked'   # token connectivity


def test_bad_input_is_one_clear_error(kernel):
    q, k, v, chosen = _case(1, 2, 40, 8, 16, 2, torch.float32)
    cases = [
        ((q, k, v, chosen.clamp(max=0) + 3, 16), r'block index 3 out of range; accepted 0\.\.2'),
        ((q, k, v, torch.zeros_like(chosen), 16), 'key tile 0 kept twice in one row'),
        ((q, k, v, chosen[:, :, :2], 16), r'block_indices must be contiguous int64 \[B, H, 3 query tiles, 1\.\.3'),
        ((q.bfloat16(), k.bfloat16(), v.bfloat16(), chosen, 16), 'takes float32 or float64 CPU tensors'),
        ((q, k[..., :4], v[..., :4], chosen, 16), r'q \[B, H, n, d\], k and v \[B, H, m, d\] expected'),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            kernel(*args)
    with pytest.raises(ValueError, match=r'dense_rows must be in 0\.\.40, got 41'):
        kernel(q, k, v, chosen, 16, dense_rows=41)
    with pytest.raises(ValueError, match="impl='kernel' has no attention dropout"):
        tile_attention(q, k, v, chosen, 16, dropout_p=0.1, impl='kernel')


def test_layer_refuses_the_kernel_where_it_does_not_apply():
    with pytest.raises(ValueError, match="impl='kernel' .* runs connectivity='block' only"):
        SparsifinerAttention(32, 4, impl='kernel')
    with pytest.raises(ValueError, match="impl='kernel' has no attention dropout"):
        SparsifinerAttention(32, 4, impl='kernel', connectivity='block', attn_drop=0.1)


def test_without_the_kernel_auto_gathers_and_says_why(monkeypatch):
    monkeypatch.setenv('STRUCTFORMER_NO_KERNEL', '1')
    assert tile_kernel._platform_reason() == 'STRUCTFORMER_NO_KERNEL is set'
    monkeypatch.setattr(tile_kernel, 'unavailable_reason', lambda: 'no C++ compiler found ($CXX, c++ or g++)')
    layer = SparsifinerAttention(32, 4, connectivity='block', block_size=8, seq_len=20).eval()
    x = torch.randn(1, 20, 32)
    with torch.no_grad():
        assert layer._resolve_impl(layer.project(x)[0], 0.0) == 'gather'
        assert layer(x).shape == x.shape
    q, k, v, chosen = _case(1, 2, 20, 8, 8, 2, torch.float32)
    with pytest.raises(RuntimeError, match=r'tile kernel is unavailable: no C\+\+ compiler found'):
        tile_kernel.block_tile_attention(q, k, v, chosen, 8)


def test_build_is_cached_and_a_failed_build_leaves_nothing(kernel, tmp_path, monkeypatch):
    """The library is compiled under a temporary name and renamed into place, once; a compile error names the
    compiler and the first error line and leaves no library behind.

    The real compiler runs `_build`'s real commands (side-by-side compiles against torch's headers, the link
    against torch's libraries) on two small sources and a header: what is tested is the build and its cache, and
    the kernel's own sources are built by the `kernel` fixture (in the cache, keyed by their contents: once per
    change of sources, torch or compiler) -- compiling them a second time here cost half a minute of the suite."""
    (tmp_path / 'src').mkdir()
    header = tmp_path / 'src' / 'probe.h'
    header.write_text('inline int probe_value() { return 42; }\n')
    sources = (tmp_path / 'src' / 'probe.cpp', tmp_path / 'src' / 'probe_torch.cpp')
    sources[0].write_text('#include "probe.h"\nextern "C" int structformer_probe() { return probe_value(); }\n')
    sources[1].write_text('#include <c10/core/ScalarType.h>\n'
                          'extern "C" int structformer_probe_dtype() { return int(c10::ScalarType::Double); }\n')
    monkeypatch.setattr(tile_kernel, 'SOURCES', sources)
    monkeypatch.setattr(tile_kernel, 'HEADERS', (header,))
    monkeypatch.setenv('STRUCTFORMER_KERNEL_DIR', str(tmp_path / 'cache'))
    compiler = tile_kernel._compiler()
    library = tile_kernel._build(compiler)
    assert library.exists() and library.parent.parent == tmp_path / 'cache'
    assert [p.name for p in library.parent.iterdir()] == [tile_kernel.LIBRARY]      # no scratch left over
    import ctypes
    loaded = ctypes.CDLL(str(library))                                                # a linked, loadable library
    assert loaded.structformer_probe() == 42 and loaded.structformer_probe_dtype() == 7      # c10's kDouble
    stamp = library.stat().st_mtime_ns
    assert tile_kernel._build(compiler) == library and library.stat().st_mtime_ns == stamp
    broken = tmp_path / 'broken.cpp'
    broken.write_text('this is not C++;\n')
    monkeypatch.setattr(tile_kernel, 'SOURCES', (broken,))
    with pytest.raises(RuntimeError, match=r'compiling broken\.cpp with .* failed: .*error'):
        tile_kernel._build(compiler)
    assert list((tmp_path / 'cache').rglob('*.so')) == [library]                  # only the good build
    assert not list((tmp_path / 'cache').rglob('.build-*'))


def dyadic(*shape, generator, levels=8, exponent=-4, dtype=torch.float32):
    """Integers in [−levels, levels] times 2^exponent: float32 holds their products and sums of a few thousand exactly."""
    return torch.randint(-levels, levels + 1, shape, generator=generator).to(dtype) * 2.0 ** exponent


def is_dyadic(t, exponent_floor=-12):
    """Whether every entry of t is an integer multiple of 2^exponent_floor of magnitude below 2^12."""
    scaled = t.double() * 2.0 ** -exponent_floor
    return bool((scaled == scaled.round()).all() and t.abs().max() < 2 ** 12)


def _exact_tile_scores(q, k_down, basis, tau, block_size, pooled_after=0, bases=None):
    """The tile scores both predictors compute, in float64 from the same inputs (q, the down-projected keys and the
    pooled basis they share), and the bound on either path's rounding error in its own dtype, entry by entry.

    Either path: logits q·k_down (d terms, abs. error ≤ γ_d Σ|q||k_down| =: E), softmax over p (relative error
    ≤ 2E + (p + 2)u), the mean of a query tile's thresholded rows (≤ bs·u), the product with the basis (p terms:
    γ_p Σ|c̄||b̄|). So |score − exact| ≤ (2E + (2p + bs + 4)u)·(|c̄| @ |b̄|), u the dtype's unit roundoff. Returns
    (exact scores, bound) and refuses inputs with a coefficient within its rounding of τ (there Eq. 2's threshold
    itself may fall either way, and the scores jump). `pooled_after`: the length of one more mean of non-negative
    weights taken after the product (the masked block path's key-tile mean over the n × n scores).

    `bases` = (k, w_down, w_up, up_threshold): the paths do not share k_down and the basis but each computes its
    own from these (the CPU kernel does both inside its op), so they must be dyadic: small integers times powers of
    two (`dyadic`), whose products and n-term sums float32 holds exactly in any order, as it does the scale 1/√d for
    d a power of 4 and the tile means over bs a power of 2. The exact k_down and basis are computed from them in
    float64; what remains of either path's rounding is the partial key tile's shrink, μ + √(r/bs)·(mean_r − μ): a
    division by n, a product and a sum, error ≤ γ_3 |W̃_up| P_kᵀ (added through c̄). (Worst-case bounds on general
    inputs, γ_n of n-term sums, were 12× wider than the gaps between tile scores at n = 577 in float32.)"""
    from structformer.functional.sparsifiner import _key_tile_pooling, _tile_pooling
    u = torch.finfo(q.dtype).eps / 2
    d, p = q.shape[-1], k_down.shape[-2]

    def gamma(terms):
        return terms * u / (1 - terms * u)
    q64 = q.double()
    basis_error = 0
    if bases is None:
        kd64, basis64 = k_down.double(), basis.double()
    else:
        k, w_down, w_up, up_threshold = bases
        assert all(is_dyadic(t) for t in (k, w_down, w_up)) and math.log2(d) % 2 == 0      # d a power of 4
        kd64 = down_projected_keys(k.double(), w_down.double(), d ** -0.5)
        kept = w_up.double() * (w_up.abs() >= up_threshold)          # the threshold: the same decision on both
        pooling = _key_tile_pooling(k.shape[-2], block_size, kept)
        basis64 = kept @ pooling.transpose(-2, -1)
        basis_error = gamma(3) * (kept.abs() @ pooling.transpose(-2, -1))
    logit_error = (gamma(d) * (q64.abs() @ kd64.abs().transpose(-2, -1))).amax(-1, keepdim=True)  # E per row
    a_down = torch.softmax(q64 @ kd64.transpose(-2, -1), dim=-1)
    relative = 2 * logit_error + (2 * p + block_size + pooled_after + 4) * u
    assert not ((a_down - tau).abs() <= 2 * relative * a_down).any(), 'a coefficient within rounding of tau'
    pooling = _tile_pooling(q.shape[-2], block_size, q64)
    coefficients = pooling @ (a_down * (a_down > tau))
    bound = (pooling @ (relative * (a_down * (a_down > tau)))) @ basis64.abs() + coefficients @ basis_error
    return coefficients @ basis64, bound + (p * u / (1 - p * u)) * (coefficients @ basis64.abs())


def _assert_same_tiles_up_to_rounding(got, expected, exact, bound):
    """The kernel's picks equal the torch ops' wherever the exact scores separate the candidates by more than both
    paths' rounding (`_exact_tile_scores`): a row may differ only in tiles whose exact scores lie within 2·bound of
    the row's kept-th score, and in the order of tiles whose exact scores lie within 2·bound of each other. Never a
    bitwise comparison of two float paths' decisions (each rounds its near ties its own way), and a wrong kernel,
    which picks tiles off by more than rounding, still fails."""
    kept = expected.shape[-1]
    kth = exact.sort(-1, descending=True).values[..., kept - 1:kept]
    for picks in (got, expected):
        chosen = exact.gather(-1, picks)
        slack = 2 * bound.gather(-1, picks)
        assert (chosen >= kth - slack).all(), 'a tile kept below the budget by more than rounding'
        assert (chosen[..., :-1] >= chosen[..., 1:] - slack[..., :-1] - slack[..., 1:]).all(), 'not in descending order'
    assert_allowance_is_small(exact, bound)


def assert_allowance_is_small(exact, bound):
    """The rounding allowance is below a hundredth of the median gap between a row's neighbouring exact tile scores:
    it can excuse true near ties only, and tiles separated by more must be kept or dropped alike on every path."""
    ordered = exact.sort(-1, descending=True).values
    gaps = ordered[..., :-1] - ordered[..., 1:]
    if gaps.numel():                                   # one key tile: nothing to choose
        assert (2 * bound).amax() <= 0.01 * gaps.median(), (float((2 * bound).amax()), float(gaps.median()))


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('n, block_size, keep, tau', [(577, 64, 0.25, 0.05), (41, 8, 0.5, 0.05), (30, 8, 1.0, 0.0),
                                                      (12, 16, 0.3, 0.2)])
def test_kernel_predictor_picks_the_tiles_of_the_torch_ops(kernel, dtype, n, block_size, keep, tau):
    """block_connectivity = pooled_block_scores + top_tiles (Eq. 1–3 on tile means, then the top tiles, in
    descending order); with a threshold that zeroes coefficients and an up-threshold that zeroes part of W_up. The
    two compute the scores in another order, so their picks are compared up to the rounding of near ties."""
    g = torch.Generator().manual_seed(1)
    b, h, d, p = 2, 3, 16, 8
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    k = dyadic(b, h, n, d, generator=g, exponent=-3, dtype=dtype)           # the kernel makes its own k_down: exact
    w_down, w_up = (dyadic(p, n, generator=g, levels=4, exponent=-6, dtype=dtype) for _ in range(2))
    tiles = pooled_block_scores(low_rank_attention(q, k, w_down), w_up, tau, 0.03, block_size)
    expected = top_tiles(tiles, budget(tiles.shape[-1], keep))
    k_down, basis = down_projected_keys(k, w_down), pooled_basis(w_up, 0.03, block_size)
    got = tile_kernel.block_connectivity(q, k, w_down, w_up, d ** -0.5, tau, 0.03, block_size, expected.shape[-1])
    assert got.dtype == torch.int64 and got.shape == expected.shape
    exact, bound = _exact_tile_scores(q, k_down, basis, tau, block_size, bases=(k, w_down, w_up, 0.03))
    _assert_same_tiles_up_to_rounding(got, expected, exact, bound)
    _assert_same_tiles_up_to_rounding(predicted_tiles(q, k, w_down, w_up, tau, 0.03, keep, block_size, kernel=True),
                                      expected, exact, bound)


def test_exact_ties_keep_the_same_tiles_on_every_path(kernel):
    """Where Eq. 3's threshold zeroes W_up (all |w| < t) every tile score is 0: the kernel, the torch ops and the
    masked block path all keep tiles 0..kept-1, so the layer's outputs agree across paths."""
    torch.manual_seed(0)
    options = dict(keep_ratio=0.5, connectivity='block', block_size=4, seq_len=17, n_down=6, up_threshold=1.0)
    layers = {impl: SparsifinerAttention(32, 2, impl=impl, **options).double().eval()
              for impl in ('kernel', 'gather', 'masked')}
    for layer in layers.values():
        layer.load_state_dict(layers['kernel'].state_dict())
    x = torch.randn(3, 17, 32, dtype=torch.float64)
    with torch.no_grad():
        outputs = {impl: layer(x) for impl, layer in layers.items()}
        q, k, _ = layers['kernel'].project(x)
        tiles = predicted_tiles(q, k, layers['kernel'].basis.w_down, layers['kernel'].basis.w_up, 0.05, 1.0, 0.5, 4)
    assert torch.equal(tiles, torch.tensor([0, 1, 2]).expand(3, 2, 5, 3))
    torch.testing.assert_close(outputs['kernel'], outputs['gather'], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outputs['kernel'], outputs['masked'], rtol=1e-12, atol=1e-12)


def test_kernel_predictor_breaks_ties_to_the_lower_tile_and_refuses_bad_input(kernel):
    """All-equal scores (zero W_up) keep tiles 0..kept-1; a budget outside 1..tiles is named."""
    q, k, w_down = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(4, 40)
    got = tile_kernel.block_connectivity(q, k, w_down, torch.zeros(4, 40), 0.5, 0.05, 0.0, 16, 2)
    assert torch.equal(got, torch.tensor([0, 1]).expand(1, 2, 3, 2))
    with pytest.raises(ValueError, match=r'kept must be in 1\.\.3, got 4'):
        tile_kernel.block_connectivity(q, k, w_down, torch.zeros(4, 40), 0.5, 0.05, 0.0, 16, 4)
    with pytest.raises(ValueError, match='float32 or float64'):
        tile_kernel.block_connectivity(q.double(), k, w_down, torch.zeros(4, 40), 0.5, 0.05, 0.0, 16, 2)
    with pytest.raises(ValueError, match='do not fit'):
        tile_kernel.block_connectivity(q, k, w_down, torch.zeros(4, 39), 0.5, 0.05, 0.0, 16, 2)


def test_an_unwritable_cache_falls_back_to_the_temp_dir(tmp_path, monkeypatch):
    """(The compiler is replaced by a stand-in that writes the linked file: this is about where it goes.)"""
    import os
    import tempfile

    def stand_in(commands, compiler):
        for command in commands:
            if '-shared' in command:
                Path(command[command.index('-o') + 1]).write_bytes(b'library')
    monkeypatch.setattr(tile_kernel, '_run_all', stand_in)
    blocked = tmp_path / 'file'
    blocked.write_text('')                      # a file where the cache folder should be: mkdir fails
    monkeypatch.setenv('STRUCTFORMER_KERNEL_DIR', str(blocked / 'cache'))
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path / 'tmp'))
    (tmp_path / 'tmp').mkdir()
    library = tile_kernel._build('c++')
    assert library.exists() and library.parent.parent == tmp_path / 'tmp' / f'structformer-kernels-{os.getuid()}'


def test_the_temp_dir_fallback_loads_nothing_another_user_could_have_planted(tmp_path, monkeypatch):
    """The fallback folder's name is predictable (/tmp/structformer-kernels-UID): a folder there that others can
    write in (or that another user owns) is refused with one reason, and its library is neither loaded nor
    built over."""
    import os
    import tempfile

    built = []
    monkeypatch.setattr(tile_kernel, '_run_all', lambda commands, compiler: built.append(commands))
    blocked = tmp_path / 'file'
    blocked.write_text('')
    monkeypatch.setenv('STRUCTFORMER_KERNEL_DIR', str(blocked / 'cache'))
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path / 'tmp'))
    shared = tmp_path / 'tmp' / f'structformer-kernels-{os.getuid()}'
    planted = shared / tile_kernel._cache_key('c++') / tile_kernel.LIBRARY
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b'not ours')
    shared.chmod(0o777)                          # as another user's `mkdir -m 777` would leave it
    with pytest.raises(OSError, match='only this user can write .* no library is loaded from it'):
        tile_kernel._build('c++')
    if os.getuid() == 0:                         # (only root can hand a folder to another user)
        shared.chmod(0o755)
        os.chown(shared, 4321, 4321)
        with pytest.raises(OSError, match='owner uid 4321'):
            tile_kernel._build('c++')
    assert not built and planted.read_bytes() == b'not ours'


def test_the_cache_key_follows_the_compiler_file_and_the_flags(tmp_path, monkeypatch):
    """A compiler replaced at the same path (upgraded in place, or another node's on a shared home: its library
    would need that node's libstdc++) and a change of flags each get their own cache folder."""
    compiler = tmp_path / 'c++'
    compiler.write_text('#!/bin/sh\nexec g++ "$@"\n')
    before = tile_kernel._cache_key(str(compiler))
    assert tile_kernel._cache_key(str(compiler)) == before
    compiler.write_text('#!/bin/sh\nexec g++-14 "$@"\n')
    upgraded = tile_kernel._cache_key(str(compiler))
    assert upgraded != before
    monkeypatch.setattr(tile_kernel, 'COMPILE_FLAGS', (*tile_kernel.COMPILE_FLAGS, '-DANOTHER_FLAG'))
    assert tile_kernel._cache_key(str(compiler)) not in (before, upgraded)


def _vector_instructions(library: Path) -> list:
    import shutil
    import subprocess
    if not shutil.which('objdump'):
        pytest.skip('objdump is not installed')
    listing = subprocess.run(['objdump', '-d', '--no-show-raw-insn', str(library)], capture_output=True, text=True,
                             check=True).stdout
    return [line for line in listing.splitlines() if '%ymm' in line or '%zmm' in line]


def _stand_in_build(tmp_path, monkeypatch, compiler_script: str, source_text: str = 'int probe;\n'):
    """The kernel's build pointed at one small source (probe.cpp) and a cache in tmp_path; `compiler_script` the
    body of a stand-in compiler (a sh script), whose path is returned."""
    compiler = tmp_path / 'cxx'
    compiler.write_text(compiler_script)
    compiler.chmod(0o755)
    source = tmp_path / 'probe.cpp'
    source.write_text(source_text)
    monkeypatch.setattr(tile_kernel, 'SOURCES', (source,))
    monkeypatch.setattr(tile_kernel, 'HEADERS', ())
    monkeypatch.setenv('STRUCTFORMER_KERNEL_DIR', str(tmp_path / 'cache'))
    return compiler


def test_the_library_runs_on_any_x86_64_whatever_the_compilers_default(kernel, tmp_path, monkeypatch):
    """A compiler whose default target is AVX-512 (as RHEL 10's GCC defaults to AVX2) still builds a library of
    x86-64's baseline instructions: the cache may be shared with CPUs without them. Checked on a vectorisable
    probe built with such a compiler (a wrapper adding -march=x86-64-v4), and on the kernel's own library."""
    assert not _vector_instructions(tile_kernel._build(tile_kernel._compiler()))
    wrapper = _stand_in_build(tmp_path, monkeypatch,
                              f'#!/bin/sh\nexec {tile_kernel._compiler()} -march=x86-64-v4 "$@"\n',
                              'extern "C" void structformer_axpy(float* y, const float* x, float a, int n) {\n'
                              '  for (int i = 0; i < n; ++i) y[i] += a * x[i];\n}\n')
    assert not _vector_instructions(tile_kernel._build(str(wrapper)))


@pytest.mark.parametrize('says, remembered', [
    ("probe.cpp:1:1: error: 'this' does not name a type", True),               # the source: not retried
    ('c++: fatal error: Killed signal terminated program cc1plus', False),    # the OOM killer: tried again
    ('/usr/bin/ld: final link failed: No space left on device', False),       # a full disk: tried again
])
def test_a_failed_build_is_remembered_only_when_the_source_or_compiler_is_at_fault(tmp_path, monkeypatch, says,
                                                                                   remembered):
    """A compiler (a stand-in script that counts its runs) failing with what g++ says in each case, twice."""
    runs = tmp_path / 'runs'
    compiler = _stand_in_build(tmp_path, monkeypatch, f'#!/bin/sh\necho run >> {runs}\necho "{says}" >&2\nexit 1\n')
    with pytest.raises(RuntimeError, match='compiling probe.cpp with .* failed: '):
        tile_kernel._build(str(compiler))
    with pytest.raises(RuntimeError, match='earlier build with this compiler failed' if remembered else '^compiling'):
        tile_kernel._build(str(compiler))
    assert len(runs.read_text().split()) == (1 if remembered else 2)


def test_a_killed_builds_scratch_is_removed_by_the_next_build_and_a_running_ones_is_not(tmp_path, monkeypatch):
    """A build killed by SIGTERM or kill -9 runs no cleanup: its scratch folder (partial objects) is named for its
    process and removed by the next build once that process is gone; a live builder's (here our parent's) stays."""
    import os
    import subprocess
    import sys

    from structformer import atomic

    monkeypatch.setattr(tile_kernel, '_run_all', lambda commands, compiler: [
        Path(c[c.index('-o') + 1]).write_bytes(b'library') for c in commands if '-shared' in c])
    monkeypatch.setenv('STRUCTFORMER_KERNEL_DIR', str(tmp_path / 'cache'))
    folder = tmp_path / 'cache' / tile_kernel._cache_key('c++')
    folder.mkdir(parents=True)
    gone = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True,
                          text=True).stdout.strip()
    killed, running = (folder / f'{tile_kernel.LIBRARY}.tmp-{pid}-{atomic._HOST}-abcd1234'
                       for pid in (gone, os.getppid()))
    for scratch in (killed, running):
        scratch.mkdir()
        (scratch / 'block_tile_attention.o').write_bytes(b'partial')
    library = tile_kernel._build('c++')
    assert sorted(p.name for p in folder.iterdir()) == sorted([library.name, running.name])


def test_the_compiler_is_the_one_cxx_names_and_none_found_is_said_once(tmp_path, monkeypatch):
    """$CXX as build tools read it (a wrapper and its compiler: `ccache g++`); a $CXX naming no program is not
    swapped for another compiler; without a compiler the kernel is unavailable with one warning that says why."""
    fake = tmp_path / 'bin'
    fake.mkdir()
    for name in ('ccache', 'g++'):
        (fake / name).write_text('#!/bin/sh\nexit 1\n')
        (fake / name).chmod(0o755)
    monkeypatch.setenv('PATH', str(fake))
    monkeypatch.setenv('CXX', 'ccache g++ -Wall')
    assert tile_kernel._compiler() == f'{fake}/ccache g++ -Wall'
    compiles, link = tile_kernel._compile_commands(tile_kernel._compiler(), tmp_path, tmp_path / 'out.so')
    assert all(c[:3] == [f'{fake}/ccache', 'g++', '-Wall'] for c in (*compiles, link))
    monkeypatch.setenv('CXX', 'clang++')                      # not installed: not replaced by g++
    assert tile_kernel._compiler() is None
    monkeypatch.setattr(tile_kernel, '_platform_reason', lambda: None)
    tile_kernel.unavailable_reason.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"unavailable \(OSError: CXX='clang\+\+' names no program found"):
            assert 'clang++' in tile_kernel.unavailable_reason()
        monkeypatch.delenv('CXX')
        (fake / 'g++').unlink()
        tile_kernel.unavailable_reason.cache_clear()
        with pytest.warns(RuntimeWarning, match='no C\\+\\+ compiler found .* runs the gathered path'):
            tile_kernel.unavailable_reason()
    finally:
        tile_kernel.unavailable_reason.cache_clear()          # the next caller loads the real kernel again


def test_a_cache_folder_that_exists_but_cannot_be_written_falls_back_to_the_temp_dir(tmp_path, monkeypatch):
    """A cache on a read-only mount (or another user's folder): mkdir succeeds (it exists), writing in it fails
    (EROFS, simulated: this suite may run as root, whom no permission bit stops) -- the build goes to the temp dir."""
    import errno
    import os
    import tempfile

    from structformer import atomic

    def read_only_cache(target, **kwargs):
        if str(target).startswith(str(tmp_path / 'cache')):
            raise OSError(errno.EROFS, 'Read-only file system', str(target))
        return atomic.temporary_sibling(target, **kwargs)
    monkeypatch.setattr(tile_kernel, 'temporary_sibling', read_only_cache)
    monkeypatch.setattr(tile_kernel, '_run_all', lambda commands, compiler: [
        Path(c[c.index('-o') + 1]).write_bytes(b'library') for c in commands if '-shared' in c])
    (tmp_path / 'cache' / tile_kernel._cache_key('c++')).mkdir(parents=True)
    monkeypatch.setenv('STRUCTFORMER_KERNEL_DIR', str(tmp_path / 'cache'))
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path / 'tmp'))
    (tmp_path / 'tmp').mkdir()
    library = tile_kernel._build('c++')
    assert library.read_bytes() == b'library'
    assert library.parent.parent == tmp_path / 'tmp' / f'structformer-kernels-{os.getuid()}'


def test_processes_that_build_at_once_compile_once(tmp_path, monkeypatch, capfd):
    """DDP ranks or xdist workers starting together: while one process builds (holds the folder's flock, here an
    open descriptor of this test), another waits and then takes the library it built instead of compiling again;
    a builder stuck past BUILD_WAIT_S is not waited for forever."""
    import fcntl
    import os
    import threading

    builds = []

    def stand_in(commands, compiler):
        builds.append(commands)
        for c in commands:
            if '-shared' in c:
                Path(c[c.index('-o') + 1]).write_bytes(b'ours')
    monkeypatch.setattr(tile_kernel, '_run_all', stand_in)
    monkeypatch.setenv('STRUCTFORMER_KERNEL_DIR', str(tmp_path / 'cache'))
    folder = tmp_path / 'cache' / tile_kernel._cache_key('c++')
    folder.mkdir(parents=True)
    other_builder = os.open(folder, os.O_RDONLY)
    fcntl.flock(other_builder, fcntl.LOCK_EX)
    result = []
    waiting = threading.Thread(target=lambda: result.append(tile_kernel._build('c++')))
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive() and not builds                  # waits for the other build
    (folder / tile_kernel.LIBRARY).write_bytes(b'theirs')      # which finishes
    os.close(other_builder)
    waiting.join(10)
    assert result[0].read_bytes() == b'theirs' and not builds
    assert 'waiting for another process' in capfd.readouterr().err
    (folder / tile_kernel.LIBRARY).unlink()
    stuck = os.open(folder, os.O_RDONLY)
    fcntl.flock(stuck, fcntl.LOCK_EX)
    monkeypatch.setattr(tile_kernel, 'BUILD_WAIT_S', 0.3)
    try:
        assert tile_kernel._build('c++').read_bytes() == b'ours' and len(builds) == 2    # compiles, links
    finally:
        os.close(stuck)


def test_without_a_home_the_build_goes_to_the_temp_dir(tmp_path, monkeypatch):
    """A container run under a user id with no passwd entry and no HOME: Path.home() raises; the kernel still
    builds, in the private temp folder."""
    import os
    import tempfile

    def no_home():
        raise RuntimeError('Could not determine home directory.')
    monkeypatch.setattr(Path, 'home', staticmethod(no_home))
    for name in ('STRUCTFORMER_KERNEL_DIR', 'XDG_CACHE_HOME'):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tile_kernel, '_run_all', lambda commands, compiler: [
        Path(c[c.index('-o') + 1]).write_bytes(b'library') for c in commands if '-shared' in c])
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
    library = tile_kernel._build('c++')
    assert library.parent.parent == tmp_path / f'structformer-kernels-{os.getuid()}' and library.exists()


def test_a_cached_library_cut_short_is_built_again(tmp_path, monkeypatch):
    """A library in the cache that is a stub (empty: a crash after its rename, before its data reached the disk)
    is built again instead of leaving the kernel unavailable on every run until someone deletes it. (Loading is a
    stand-in that refuses what is not ELF, as the loader does: the real library is loaded once per process.)"""
    loaded = []

    def load_library(path):
        if Path(path).read_bytes()[:4] != b'\x7fELF':
            raise OSError(f'{path}: file too short')
        loaded.append(path)
    monkeypatch.setattr(torch.ops, 'load_library', load_library)
    monkeypatch.setattr(tile_kernel, 'register_flop_formulas', lambda formulas: None)
    monkeypatch.setattr(tile_kernel, '_platform_reason', lambda: None)
    monkeypatch.setattr(tile_kernel, '_compiler', lambda: 'c++')
    monkeypatch.setattr(tile_kernel, '_run_all', lambda commands, compiler: [
        Path(c[c.index('-o') + 1]).write_bytes(b'\x7fELF library') for c in commands if '-shared' in c])
    monkeypatch.setattr(tile_kernel, '_flush_to_disk', lambda path: None, raising=False)
    monkeypatch.setenv('STRUCTFORMER_KERNEL_DIR', str(tmp_path))
    stub = tmp_path / tile_kernel._cache_key('c++') / tile_kernel.LIBRARY
    stub.parent.mkdir()
    stub.write_bytes(b'')
    tile_kernel.unavailable_reason.cache_clear()
    try:
        assert tile_kernel.unavailable_reason() is None
    finally:
        tile_kernel.unavailable_reason.cache_clear()
    assert loaded == [str(stub)] and stub.read_bytes() == b'\x7fELF library'


def test_a_compiler_that_hangs_is_killed_and_tried_again_next_run(tmp_path, monkeypatch):
    """A compiler wrapper stuck (on a license server, a remote cache) does not hang the process, nor the
    processes waiting for its build: it is killed after COMPILE_TIMEOUT_S, and the failure is not remembered."""
    import time

    compiler = _stand_in_build(tmp_path, monkeypatch, f'#!/bin/sh\necho $$ > {tmp_path}/pid\nexec sleep 30\n')
    monkeypatch.setattr(tile_kernel, 'COMPILE_TIMEOUT_S', 1.0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r'with .*cxx did not finish in 1 s'):
        tile_kernel._build(str(compiler))
    assert time.monotonic() - started < 20
    assert not list((tmp_path / 'cache').rglob(tile_kernel.FAILED))              # tried again next run
    assert not Path(f"/proc/{(tmp_path / 'pid').read_text().strip()}").exists()  # no compiler left running


GRADIENT_CASES = [  # batch, heads, n, d, block_size, kept, dense_rows
    (1, 2, 19, 4, 4, 2, 1),             # partial last tiles, the cls row dense
    (2, 2, 20, 3, 8, 2, 0),             # a key tile no query keeps gets a zero gradient (some draws)
    (1, 1, 10, 2, 16, 1, 1),            # fewer tokens than one tile
    (1, 2, 13, 3, 4, 4, 5),             # every tile kept, dense rows past the first tile
]


@pytest.mark.parametrize('batch, heads, n, d, block_size, kept, dense_rows', GRADIENT_CASES)
def test_kernel_backward_passes_gradcheck(kernel, batch, heads, n, d, block_size, kept, dense_rows):
    q, k, v, chosen = _case(batch, heads, n, d, block_size, kept, torch.float64, seed=3)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: kernel(q, k, v, chosen, block_size, dense_rows=dense_rows), inputs)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_kernel_gradients_equal_autograd_through_masked_attention(kernel, dtype):
    """At DeiT-S's 577 tokens, keep 0.25, with the cls row dense and q, k, v strided views of one projection."""
    torch.manual_seed(0)
    b, h, n, d, bs = 1, 6, 577, 64, 64
    qkv = torch.randn(b, n, 3, h, d, dtype=dtype, requires_grad=True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    _, _, _, chosen = _case(b, h, n, d, bs, 3, dtype)
    upstream = torch.randn(b, h, n, d, dtype=dtype)
    expected = torch.autograd.grad(masked_attention(q, k, v, block_indices_to_mask(chosen, n, bs, 1)), qkv, upstream)
    got = torch.autograd.grad(kernel(q, k, v, chosen, bs, dense_rows=1), qkv, upstream)
    tolerance = {} if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[0], expected[0], **tolerance)


def test_layer_trains_on_the_kernel_as_on_the_gathered_path(kernel):
    """A training step's outputs and gradients (input, qkv and output weights) on impl='kernel'
    equal impl='gather''s on the same weights."""
    torch.manual_seed(0)
    options = dict(keep_ratio=0.4, connectivity='block', block_size=4, seq_len=19, n_down=6)
    layers = {impl: SparsifinerAttention(32, 2, impl=impl, **options).double().train() for impl in ('kernel', 'gather')}
    layers['gather'].load_state_dict(layers['kernel'].state_dict())
    x = torch.randn(3, 19, 32, dtype=torch.float64, requires_grad=True)
    results = {}
    for impl, layer in layers.items():
        out = layer(x)
        results[impl] = (out, *torch.autograd.grad(out.square().sum(), [x, layer.qkv.weight, layer.proj.weight]))
    for a, b in zip(results['kernel'], results['gather']):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _tile_mask(chosen, n_q, n_k, block_size, dense_rows):
    """The [B, H, n_q, n_k] mask of kept key tiles written out tile by tile (block_indices_to_mask is square)."""
    b, h, tiles, _ = chosen.shape
    mask = torch.zeros(b, h, n_q, n_k, dtype=torch.bool)
    for i in range(b):
        for j in range(h):
            for t in range(tiles):
                for key_tile in chosen[i, j, t].tolist():
                    mask[i, j, t * block_size:(t + 1) * block_size, key_tile * block_size:(key_tile + 1) * block_size] = True
    mask[:, :, :dense_rows] = True
    return mask


@pytest.mark.parametrize('n_q, n_k, block_size, kept, dense_rows', [
    (13, 22, 4, 2, 1),                  # more keys than queries, partial last tiles on both sides
    (22, 13, 4, 3, 2),                  # fewer keys than queries, every key tile kept
    (5, 9, 8, 1, 0),                    # one query tile, two key tiles
])
def test_kernel_with_an_explicit_scale_and_another_key_count(kernel, n_q, n_k, block_size, kept, dense_rows):
    """The ops take k, v of m ≠ n tokens and any scale (the backward multiplies dQ and dK by it): gradcheck in float64,
    and outputs and q, k, v gradients against autograd through masked_attention on the tile mask written out and
    against the gathered tiles. Every other test runs m = n, where a swapped n_q / n_k or a missing scale in the
    backward would not show."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, n_q, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, n_k, 3, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    key_tiles = -(-n_k // block_size)
    chosen = torch.stack([torch.randperm(key_tiles, generator=g)[:kept] for _ in range(2 * 2 * -(-n_q // block_size))])
    chosen = chosen.reshape(2, 2, -1, kept)
    run = lambda q, k, v: kernel(q, k, v, chosen, block_size, scale=0.3, dense_rows=dense_rows)   # noqa: E731
    assert torch.autograd.gradcheck(run, (q, k, v))
    mask = _tile_mask(chosen, n_q, n_k, block_size, dense_rows)
    upstream = torch.randn(2, 2, n_q, 3, dtype=torch.float64, generator=g)
    got = (run(q, k, v), *torch.autograd.grad(run(q, k, v), (q, k, v), upstream))
    for reference in (lambda q, k, v: masked_attention(q, k, v, mask, scale=0.3),
                      lambda q, k, v: block_gathered_attention(q, k, v, chosen, block_size, scale=0.3,
                                                               dense_rows=dense_rows)):
        want = (reference(q, k, v), *torch.autograd.grad(reference(q, k, v), (q, k, v), upstream))
        for a, b in zip(got, want):       # float64, softmax and sums over <= 22 keys: ~1e-15
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('n, d', [(1, 4), (6, 1)], ids=['one-token', 'one-channel'])
def test_kernel_takes_size_one_dims_with_any_stride(kernel, n, d):
    """torch counts a tensor whose size-1 dims carry any stride as contiguous (`contiguous()` returns it unchanged):
    one token, or one channel, read from transposed storage has a token stride 1 < d, or a channel stride != 1. The
    ops need BLAS rows (lda >= d), so the wrapper copies such inputs into row-major strides; they were refused
    ("need contiguous channels and a token stride >= d"), and so was such an upstream gradient in the backward.
    Outputs and q, k, v gradients against masked_attention, float64."""
    g = torch.Generator().manual_seed(9)
    odd = lambda: torch.randn(1, 2, d, n, dtype=torch.float64, generator=g).transpose(-1, -2)  # noqa: E731
    q, k, v = (odd().requires_grad_() for _ in range(3))
    assert q.is_contiguous() and (q.stride(-2) < d or q.stride(-1) != 1)
    chosen = torch.zeros(1, 2, -(-n // 4), 1, dtype=torch.int64)
    upstream = odd()
    got = kernel(q, k, v, chosen, 4, dense_rows=0)
    want = masked_attention(q, k, v, block_indices_to_mask(chosen, n, 4, 0))
    for a, b in zip((got, *torch.autograd.grad(got, (q, k, v), upstream)),
                    (want, *torch.autograd.grad(want, (q, k, v), upstream))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
