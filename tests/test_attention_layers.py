"""SOFT / SOFT++ layers and the softmax, Linformer, Performer and Nyströmformer baselines."""
import math
import re
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from einops import rearrange

from structformer.layers.attention.linformer import (LinformerAttention, linformer_attention,
                                                     linformer_attention_reference)
from structformer.layers.attention.nystrom import NystromAttention, nystrom_attention, nystrom_attention_reference
from structformer.layers.attention.performer import (PerformerAttention, orthogonal_random_features,
                                                     performer_attention, performer_attention_reference)
from structformer.layers.attention.registry import ATTENTION_LAYERS, get_attention, select_options
from structformer.layers.attention.soft import (SoftAttention, SoftPlusPlusAttention, exact_gaussian_attention,
                                                soft_attention, soft_attention_reference)
from structformer.layers.attention.softmax import (NaiveSoftmaxAttention, SoftmaxAttention,
                                                   softmax_attention_reference)

F64 = torch.float64
NAMES = ['soft', 'softpp', 'softmax', 'softmax_naive', 'linformer', 'performer', 'nystrom']


def _randn(*shape, scale=1.0, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=F64)).requires_grad_(grad)


# ---------------------------------------------------------------- SOFT / SOFT++

@pytest.mark.parametrize('sampler,kwargs', [('avgpool', {}), ('conv', {'sampling_ratio': 1}), ('random', {})])
@pytest.mark.parametrize('tokens', [16, 17])          # 4×4 grid, without / with a cls token
def test_soft_with_every_token_a_landmark_is_exact(sampler, kwargs, tokens):
    """m = n: Nyström reproduces S exactly, so Ŝ V = S V (Eq. 9 with A = S)."""
    torch.manual_seed(0)
    layer = SoftAttention(16, num_heads=2, num_landmarks=16, sampler=sampler, newton_iter=60, **kwargs).double().eval()
    q, _, v = layer.project(_randn(2, tokens, 16, scale=3.0))
    landmarks = layer.landmarks(q)
    assert landmarks.shape[-2] == tokens
    torch.testing.assert_close(soft_attention(q, v, landmarks, newton_iter=60, scale=layer.scale),
                               exact_gaussian_attention(q, v, scale=layer.scale), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('normalize', [False, True])
@pytest.mark.parametrize('shape, m', [((2, 2, 20, 4), 6), ((1, 1, 9, 3), 1), ((1, 3, 5, 4), 5)])   # batch 1, m = 1, m = n
def test_soft_fast_matches_reference(normalize, shape, m):
    """Right-to-left Pᵀ(A†(PV)) (SOFT Eq. 9 / SOFT++ Eq. 17) = the explicit n×n Ŝ V, values and grads. Float64 with
    Newton–Schulz converged: A† is off by ~eps·cond(A) and its Eq. 12 derivative by ~eps·cond(A)², so the tolerance
    is 10·eps·cond(A)² of each tensor's largest entry (about 1e-12 here; it was 1e-9 / 1e-7, where the error is 1e-15)."""
    q, v = _randn(*shape, seed=1, grad=True), _randn(*shape[:-1], 3, seed=2, grad=True)
    landmarks = _randn(*shape[:-2], m, shape[-1], scale=1.5, seed=3, grad=True)
    from structformer.functional import gaussian_kernel
    cond = torch.linalg.cond(gaussian_kernel(landmarks, landmarks).detach()).max().item()
    tol = max(1e-13, 10 * torch.finfo(F64).eps * cond ** 2)
    assert tol < 1e-9, cond
    fast = soft_attention(q, v, landmarks, normalize=normalize, newton_iter=60)
    ref = soft_attention_reference(q, v, landmarks, normalize=normalize)
    torch.testing.assert_close(fast, ref, rtol=tol, atol=tol * ref.abs().max().item())
    w = _randn(*fast.shape, seed=4)
    for a, b in zip(torch.autograd.grad((fast * w).sum(), (q, v, landmarks)),
                    torch.autograd.grad((ref * w).sum(), (q, v, landmarks))):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


def test_soft_approximation_is_symmetric_psd():
    q = _randn(24, 4, seed=5)
    landmarks = q[::4] + 0.1 * _randn(6, 4, seed=6)
    for normalize in (False, True):
        _, s_hat = soft_attention_reference(q, torch.eye(24, dtype=F64), landmarks, normalize=normalize,
                                            return_attn=True)
        torch.testing.assert_close(s_hat, s_hat.T, rtol=1e-10, atol=1e-10)
        assert torch.linalg.eigvalsh(s_hat).min() > -1e-8


def test_softpp_layer_is_soft_with_normalisation():
    torch.manual_seed(0)
    soft = SoftAttention(16, num_heads=2, num_landmarks=4, sampler='avgpool').double()
    softpp = SoftPlusPlusAttention(16, num_heads=2, num_landmarks=4, sampler='avgpool').double()
    softpp.load_state_dict(soft.state_dict())
    assert softpp.normalize and not soft.normalize
    x = _randn(2, 17, 16, seed=7)
    q, _, v = soft.project(x)
    lm = soft.landmarks(q)
    torch.testing.assert_close(softpp(x), softpp.merge(soft_attention(q, v, lm, normalize=True, scale=soft.scale)))
    assert not torch.allclose(soft(x), softpp(x))


def test_soft_grid_inference_and_samplers():
    torch.manual_seed(0)
    layer = SoftAttention(8, num_heads=2, num_landmarks=4, sampler='avgpool')
    assert layer.resolve_grid(16) == (0, (4, 4))
    assert layer.resolve_grid(17) == (1, (4, 4))
    assert layer.resolve_grid(21, grid_size=(4, 5)) == (1, (4, 5))
    q = torch.randn(1, 2, 21, 4)
    # 4×5 grid, k = ⌈√(20/4)⌉ = 3, ceil-mode -> 2×2 landmarks + the cls token
    assert layer.landmarks(q, grid_size=(4, 5)).shape == (1, 2, 5, 4)
    conv = SoftAttention(8, num_heads=2, num_landmarks=4, grid_size=(4, 5))
    assert conv.conv.kernel_size == 3 and conv.landmarks(q, grid_size=(4, 5)).shape == (1, 2, 5, 4)
    assert conv.landmarks(q).shape == (1, 2, 5, 4)            # the constructor's grid_size is the default
    # the conv starts as average pooling (replicate-padded borders)
    inner = q[..., 1:, :].reshape(1, 2, 4, 5, 4)[:, :, :3, :3].mean((2, 3))
    torch.testing.assert_close(conv.landmarks(q, grid_size=(4, 5))[:, :, 1], inner)
    # random sampler: fresh subset in training, one fixed subset at eval
    rnd = SoftAttention(8, num_heads=2, num_landmarks=5, sampler='random', num_prefix_tokens=1)
    x = torch.randn(2, 17, 8)
    rnd.eval()
    torch.testing.assert_close(rnd(x), rnd(x))
    rnd.train()
    outs = [rnd(x) for _ in range(3)]
    assert not (torch.allclose(outs[0], outs[1]) and torch.allclose(outs[1], outs[2]))


def test_soft_lazy_conv_is_built_at_first_forward_and_trains():
    torch.manual_seed(0)
    layer = SoftAttention(16, num_heads=2, num_landmarks=4)
    assert layer.conv.kernel_size is None
    with pytest.warns(UserWarning, match='first forward'):
        out = layer(torch.randn(2, 17, 16))
    assert layer.conv.kernel_size == 2 and layer.conv.weight.shape == (8, 2, 2, 8)   # head_dim × head_dim, shared by heads
    out.square().mean().backward()
    assert layer.conv.weight.grad.abs().sum() > 0
    reloaded = SoftAttention(16, num_heads=2, num_landmarks=4)            # lazy weights load from a checkpoint
    reloaded.load_state_dict(layer.state_dict())
    assert reloaded.conv.kernel_size == 2


@pytest.mark.parametrize('name', sorted(ATTENTION_LAYERS))
@pytest.mark.parametrize('sizes, bad', [(dict(dim=0, num_heads=2), 'dim'), (dict(dim=8, num_heads=0), 'num_heads'),
                                        (dict(dim=8, num_heads=-2), 'num_heads'),
                                        (dict(dim=8, num_heads=2, attn_head_dim=-1), 'attn_head_dim'),
                                        (dict(dim=8, num_heads=2, attn_head_dim=0), 'attn_head_dim')])
def test_every_attention_names_a_bad_size(name, sizes, bad):
    """Not a ZeroDivisionError, math domain error or torch shape error, and not a layer that builds and
    fails at its first forward."""
    with pytest.raises(ValueError, match=rf'^{bad}={sizes[bad]} must be (None or )?a positive integer$'):
        get_attention(name)(**sizes)


def test_soft_bad_inputs():
    with pytest.raises(ValueError, match=r'num_landmarks=49.*n=16'):
        SoftAttention(8, num_heads=2, sampler='avgpool')(torch.randn(1, 16, 8))
    with pytest.raises(ValueError, match=r'num_landmarks=49.*n=16'):
        SoftAttention(8, num_heads=2)(torch.randn(1, 17, 8))
    with pytest.raises(ValueError, match=r'num_landmarks=20.*n=16'):
        SoftAttention(8, num_heads=2, sampler='random', num_landmarks=20)(torch.randn(1, 16, 8))
    with pytest.raises(ValueError, match='grid_size'):
        SoftAttention(8, num_heads=2, num_landmarks=4, sampler='avgpool')(torch.randn(1, 20, 8))
    with pytest.raises(ValueError, match='grid_size'):
        SoftAttention(8, num_heads=2, num_landmarks=4)(torch.randn(1, 17, 8), grid_size=(5, 5))
    for bad in (0, -1):
        with pytest.raises(ValueError, match='newton_iter'):
            SoftAttention(8, num_heads=2, newton_iter=bad)
    with pytest.raises(ValueError, match='sampler'):
        SoftAttention(8, num_heads=2, sampler='strided')
    for bad in (-0.1, float('nan'), float('inf')):              # NaN gave NaN outputs, silently
        with pytest.raises(ValueError, match=r'^ridge=\S+ must be a finite number >= 0'):
            SoftAttention(8, num_heads=2, ridge=bad)
    with pytest.raises(NotImplementedError, match='attn_mask'):
        SoftAttention(8, num_heads=2, num_landmarks=4)(torch.randn(1, 16, 8), is_causal=True)


@pytest.mark.parametrize('sampler', ['conv', 'avgpool', 'random'])
@pytest.mark.parametrize('grid', [(4,), (2.5, 4), (-4, -4), (0, 4), 4.0, 'ab'])
def test_soft_names_a_bad_grid_size(sampler, grid):
    """grid_size, at construction or in forward: (4,) failed with an IndexError or "not enough values to unpack",
    (2.5, 4) with "slice indices must be integers", (-4, -4) with torch's "invalid shape dimension -2" at the first
    forward (or was taken by the random sampler), 4.0 with "'float' object is not iterable", naming nothing."""
    with pytest.raises(ValueError, match=rf'^grid_size={re.escape(repr(grid))} must be a positive integer or an '
                                         r'\(H, W\) pair of them'):
        SoftAttention(8, num_heads=2, num_landmarks=1, sampler=sampler, grid_size=grid)
    layer = SoftAttention(8, num_heads=2, num_landmarks=1, sampler=sampler, sampling_ratio=2)
    with pytest.raises(ValueError, match=rf'^grid_size={re.escape(repr(grid))} must be a positive integer or an '):
        layer(torch.randn(1, 17, 8), grid_size=grid)


@pytest.mark.parametrize('options', [dict(), dict(sampling_ratio=2), dict(grid_size=(3, 5)), dict(normalize=True),
                                     dict(official=True, grid_size=(3, 5)),
                                     dict(landmark_border='drop', grid_size=(3, 5))])
def test_soft_takes_an_empty_batch(options):
    """A batch of 0 images (as nn.Linear, SDPA and the other attentions take): the conv sampler's reshape(..., -1, C)
    of 0 elements raised "cannot reshape tensor of 0 elements ... ambiguous", the public V conv's rearrange a
    ZeroDivisionError. The sampler's reference takes it too."""
    layer = SoftAttention(8, num_heads=2, num_landmarks=4, **{'sampling_ratio': 2, **options})
    x = torch.randn(0, 16, 8, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, 16, 8) and x.grad.shape == x.shape
    tokens, k = torch.randn(0, 2, 15, 4), layer.conv.kernel_size       # a 3×5 grid: 2·3 windows padded, 1·2 whole
    landmarks = math.ceil(3 / k) * math.ceil(5 / k) if layer.conv.border == 'replicate' else (3 // k) * (5 // k)
    assert layer.conv(tokens, (3, 5)).shape == layer.conv.forward_reference(tokens, (3, 5)).shape == \
        (0, 2, landmarks, 4)


def test_an_exported_random_sampler_keeps_the_seeded_evaluation_subset():
    """In evaluation the random sampler uses one subset per (n, m), drawn from `seed`, so evaluation is deterministic.
    Exported before any eager forward, the draw (torch.randperm with the layer's generator) was recorded as a graph
    op without its generator: the exported (or TorchScript-traced) program drew a new subset on every call (two calls
    on one input differed by 0.5), not the eager layer's. The subset is now drawn eagerly while a graph is recorded."""
    torch.manual_seed(0)
    layer = SoftAttention(12, num_heads=3, num_landmarks=4, sampler='random', seed=3).eval()
    x, other = torch.randn(2, 17, 12), torch.randn(2, 17, 12)
    program = torch.export.export(layer, (x,))
    assert not [n for n in program.graph.nodes if 'randperm' in str(n.target)]
    exported = program.module()
    fresh = SoftAttention(12, num_heads=3, num_landmarks=4, sampler='random', seed=3).eval()
    fresh.load_state_dict(layer.state_dict())                  # an eager twin that never saw the export
    for inputs in (x, other, x):
        torch.testing.assert_close(exported(inputs), fresh(inputs))      # float32, the same ops in one order
    layer = SoftAttention(12, num_heads=3, num_landmarks=4, sampler='random', seed=3).eval()
    layer.load_state_dict(fresh.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')                  # torch.jit.trace's deprecation, tracer warnings
        traced = torch.jit.trace(layer, (x,), check_trace=False)    # the ONNX exporter's dynamo=False path
    assert 'randperm' not in str(traced.graph)
    torch.testing.assert_close(traced(other), fresh(other))


def test_soft_takes_the_grid_sizes_a_graph_recorder_hands_over():
    """A model passes grid_size=(H, W) read from an image's shape: TorchScript's tracer (the ONNX dynamo=False path)
    hands those over as 0-dim tensors, torch.export / torch.compile as SymInts; the grid_size check took them for bad
    values ("grid_size=(tensor(4), tensor(4)) must be ...", the legacy ONNX export of soft_digits failed)."""
    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = SoftAttention(8, num_heads=2, num_landmarks=4, sampler='avgpool')

        def forward(self, image):
            h, w = image.shape[-2:]
            return self.attn(image.flatten(2).transpose(1, 2), grid_size=(h, w))
    torch.manual_seed(0)
    stage, image = Stage().eval(), torch.randn(2, 8, 4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')                  # torch.jit.trace's deprecation, tracer warnings
        traced = torch.jit.trace(stage, (image,), check_trace=False)
    torch.testing.assert_close(traced(image), stage(image))
    exported = torch.export.export(stage, (image,), dynamic_shapes=({0: torch.export.Dim('batch', max=8)},))
    torch.testing.assert_close(exported.module()(image[:1]), stage(image[:1]))


@pytest.mark.parametrize('bad', [None, '0.1', True])
def test_soft_names_a_ridge_that_is_not_a_number(bad):
    """None / '0.1' failed inside a comparison ("'<=' not supported between instances of 'int' and 'NoneType'");
    True was taken as a ridge of 1."""
    with pytest.raises(ValueError, match=rf'^ridge={re.escape(repr(bad))} must be a finite number >= 0'):
        SoftAttention(8, num_heads=2, ridge=bad)


@pytest.mark.parametrize('border', ['replicate', 'drop'])          # ours, and the public unpadded conv (official)
@pytest.mark.parametrize('grid', [(8, 8), (7, 10), (9, 7)])          # divisible by k = 2, and padded / cut
def test_conv_sampler_matmul_matches_conv2d_reference(grid, border):
    """Outputs and the token and weight gradients for both borders; 'drop' was compared on outputs only, at the
    official layer's weights."""
    from structformer.layers.attention.soft import ConvLandmarkSampler
    sampler = ConvLandmarkSampler(4, kernel_size=2, dtype=F64, border=border)
    with torch.no_grad():
        sampler.weight.normal_()                                  # not the average-pool initialisation
    tokens = _randn(3, 2, grid[0] * grid[1], 4, grad=True)
    out = sampler(tokens, grid)
    ref = sampler.forward_reference(tokens, grid)
    windows = (lambda size: -(-size // 2)) if border == 'replicate' else (lambda size: size // 2)
    assert out.shape == (3, 2, windows(grid[0]) * windows(grid[1]), 4)
    # float64, sums of k²·C = 16 products (weight gradient: over the windows) in another order: 1e-12 of the largest
    # entry (the default float64 tolerance, 1e-7, is far above what two orders of one sum can differ by)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())
    cot = _randn(*out.shape, seed=1)
    g_fast = torch.autograd.grad((out * cot).sum(), (tokens, sampler.weight))
    g_ref = torch.autograd.grad((ref * cot).sum(), (tokens, sampler.weight))
    for a, b in zip(g_fast, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item())


def test_conv_sampler_weight_layout_and_average_pool_init():
    """Weight [C_out, ky, kx, C_in]: landmark (0, 0) is Σ W[o, ky, kx, c]·token[ky·W + kx, c], written out;
    the initial weight is average pooling over each k×k window."""
    from structformer.layers.attention.soft import ConvLandmarkSampler
    sampler = ConvLandmarkSampler(3, kernel_size=2, dtype=F64)
    tokens = _randn(1, 6 * 4, 3)                                  # a 6×4 grid, row-major
    pooled = F.avg_pool2d(rearrange(tokens, 'b (y x) c -> b c y x', y=6, x=4), 2)
    torch.testing.assert_close(sampler(tokens, (6, 4)), rearrange(pooled, 'b c y x -> b (y x) c'))
    with torch.no_grad():
        sampler.weight.normal_()
    by_hand = sum(sampler.weight[:, ky, kx, :] @ tokens[0, ky * 4 + kx] for ky in range(2) for kx in range(2))
    torch.testing.assert_close(sampler(tokens, (6, 4))[0, 0], by_hand)


@pytest.mark.parametrize('normalize,qkv_bias,proj_bias,prefix,head_dim,qk_norm', [
    (False, False, True, 0, None, False),
    (True, True, True, 1, None, False),
    (False, True, False, 1, 3, True),                             # attn_head_dim ≠ dim / heads, LayerNorm on q
])
def test_soft_folded_projections_match_unfolded(normalize, qkv_bias, proj_bias, prefix, head_dim, qk_norm):
    torch.manual_seed(0)
    kwargs = dict(num_heads=2, num_landmarks=4, qkv_bias=qkv_bias, proj_bias=proj_bias, normalize=normalize,
                  attn_head_dim=head_dim, qk_norm=qk_norm, norm_layer=torch.nn.LayerNorm, sampling_ratio=2,
                  num_prefix_tokens=prefix, dtype=F64)
    folded = SoftAttention(8, fold_projections=True, **kwargs)
    with torch.no_grad():                                         # random, not zero, biases and a non-pooling conv
        for p in folded.parameters():
            p.normal_(0, 0.5)
    plain = SoftAttention(8, fold_projections=False, **kwargs)
    plain.load_state_dict(folded.state_dict())
    x = _randn(2, prefix + 30, 8, grad=True)                      # 5×6 grid, k = 2 pads it
    out, ref = folded(x, grid_size=(5, 6)), plain(x, grid_size=(5, 6))
    # both orders invert the same A (one landmark path), so they differ only by re-associated products: float64
    # rounding, 1e-11 of each tensor's largest entry (measured ≤ 2e-14; the default 1e-7 would pass a wrong term)
    close = lambda a, b, **kw: torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11 * b.abs().max().item(), **kw)  # noqa: E731
    close(out, ref)
    cot = _randn(*out.shape, seed=1)
    grads = torch.autograd.grad((out * cot).sum(), [x, *folded.parameters()])
    grads_ref = torch.autograd.grad((ref * cot).sum(), [x, *plain.parameters()])
    for (name, _), a, b in zip(folded.named_parameters(), grads[1:], grads_ref[1:]):
        close(a, b, msg=lambda m: f"{name}: {m}")
    close(grads[0], grads_ref[0])


def test_soft_folds_projections_only_where_it_saves_work():
    stage1 = SoftAttention(64, num_heads=2, num_landmarks=49)     # SOFT-Tiny stage 1: h·m = 98 vs C = 64
    stage3 = SoftAttention(320, num_heads=10, num_landmarks=49)   # stage 3: h·m = 490 vs C = 320
    # per token: folded 98·128 = 12,544 < textbook 64·128 + 2·98·32 = 14,464; stage 3: 313,600 > 236,160
    assert stage1.folding_pays(49) and not stage3.folding_pays(49)
    assert SoftAttention(64, num_heads=2, fold_projections=False).folding_pays(49) is False
    assert SoftAttention(320, num_heads=10, fold_projections=True).folding_pays(49) is True
    scaled = SoftAttention(64, num_heads=2, fold_projections=True, scale_norm=True, norm_layer=torch.nn.LayerNorm)
    assert not scaled.folding_pays(49)


def test_soft_scale_norm_uses_the_unfolded_order():
    # Two evaluation orders through a pseudo-inverse and a LayerNorm: in float32 they differ by rounding
    # that depends on the CPU's kernels, so compare the orders in float64 where rounding is negligible.
    torch.manual_seed(0)
    layer = SoftAttention(8, num_heads=2, num_landmarks=4, sampling_ratio=2, scale_norm=True, norm_layer=torch.nn.LayerNorm).double()
    x = torch.randn(1, 16, 8, dtype=torch.float64)
    q, _, v = layer.project(x)                                    # norm sits between merge and proj: cannot fold
    heads = soft_attention(q, v, layer.landmarks(q), scale=layer.scale)
    expected = layer.proj(layer.norm(heads.transpose(1, 2).reshape(1, 16, 8)))
    torch.testing.assert_close(layer(x), expected)


# ---------------------------------------------------------------- baselines

def test_softmax_fused_equals_naive_and_reference():
    torch.manual_seed(0)
    fused = SoftmaxAttention(16, num_heads=2).double()
    naive = NaiveSoftmaxAttention(16, num_heads=2).double()
    naive.load_state_dict(fused.state_dict())
    x = _randn(2, 9, 16, seed=8)
    q, k, v = fused.project(x)
    torch.testing.assert_close(fused(x), fused.merge(softmax_attention_reference(q, k, v)))
    torch.testing.assert_close(naive(x), fused(x))
    torch.testing.assert_close(naive(x, is_causal=True), fused(x, is_causal=True))
    mask = torch.rand(9, 9, generator=torch.Generator().manual_seed(0)) > 0.3
    mask.fill_diagonal_(True)
    torch.testing.assert_close(naive(x, attn_mask=mask), fused(x, attn_mask=mask))


def test_linformer_matches_reference_and_checks_length():
    q, k, v = (_randn(2, 3, 12, 4, seed=s) for s in range(3))
    e, f = _randn(5, 12, scale=0.3, seed=4), _randn(5, 12, scale=0.3, seed=5)
    torch.testing.assert_close(linformer_attention(q, k, v, e, f), linformer_attention_reference(q, k, v, e, f))
    torch.manual_seed(0)
    layer = LinformerAttention(16, num_heads=2, num_landmarks=5, seq_len=12).double()
    x = _randn(2, 12, 16, seed=6)
    q, k, v = layer.project(x)
    torch.testing.assert_close(layer(x), layer.merge(
        linformer_attention_reference(q, k, v, layer.seq_proj.e, layer.seq_proj.f)))
    with pytest.raises(ValueError, match='seq_len=12'):
        layer(_randn(2, 13, 16))
    with pytest.raises(ValueError, match=r'num_landmarks=20.*n=12'):
        LinformerAttention(16, num_heads=2, num_landmarks=20, seq_len=12)
    lazy = LinformerAttention(16, num_heads=2, num_landmarks=5, share_kv=True)
    with pytest.warns(UserWarning, match='first forward'):
        lazy(torch.randn(1, 12, 16))
    assert lazy.seq_proj.seq_len == 12 and lazy.seq_proj.f is None


def test_performer_matches_reference_and_converges_to_softmax():
    q, k, v = (_randn(2, 3, 16, 8, scale=0.5, seed=s) for s in range(3))
    omega = orthogonal_random_features(64, 8, torch.Generator().manual_seed(0), dtype=F64)
    torch.testing.assert_close(performer_attention(q, k, v, omega), performer_attention_reference(q, k, v, omega))
    exact = softmax_attention_reference(q, k, v)

    def error(num_features):
        errs = [(performer_attention(q, k, v, orthogonal_random_features(
            num_features, 8, torch.Generator().manual_seed(s), dtype=F64)) - exact).abs().mean() for s in range(3)]
        return sum(errs) / 3

    e64, e4096 = error(64), error(4096)
    assert e4096 < e64 / 3, (e64, e4096)          # Monte Carlo: ~1/√m, so ~8× in expectation
    # the features are orthogonal within blocks of d
    block = omega[:8] / omega[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(8, dtype=F64))


def test_performer_features_change_only_when_redrawn():
    torch.manual_seed(0)
    layer = PerformerAttention(16, num_heads=2, num_features=32)
    x = torch.randn(2, 10, 16)
    first = layer(x)
    torch.testing.assert_close(layer(x), first)
    layer.train()
    torch.testing.assert_close(layer(x), first)
    layer.redraw_features()
    assert not torch.allclose(layer(x), first)


def test_nystrom_matches_reference_and_is_exact_with_all_landmarks():
    q, k, v = (_randn(2, 2, 14, 4, seed=s) for s in range(3))
    for m in (3, 5, 7):                            # 5 does not divide 14: uneven segments
        torch.testing.assert_close(nystrom_attention(q, k, v, m, newton_iter=60),
                                   nystrom_attention_reference(q, k, v, m), rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(nystrom_attention(q, k, v, 14, newton_iter=60), softmax_attention_reference(q, k, v),
                               rtol=1e-8, atol=1e-8)
    torch.manual_seed(0)
    layer = NystromAttention(16, num_heads=2, num_landmarks=17, newton_iter=60).double()
    x = _randn(2, 17, 16, scale=3.0, seed=9)
    q, k, v = layer.project(x)
    torch.testing.assert_close(layer(x), layer.merge(softmax_attention_reference(q, k, v)), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r'num_landmarks=17.*n=16'):
        layer(_randn(2, 16, 16))
    skip = NystromAttention(16, num_heads=2, num_landmarks=4, conv_kernel_size=3)    # depthwise skip on V
    assert skip(torch.randn(2, 17, 16)).shape == (2, 17, 16)
    with pytest.raises(ValueError, match='conv_kernel_size'):
        NystromAttention(16, num_heads=2, conv_kernel_size=4)


# ---------------------------------------------------------------- timm drop-in

def _small(cls):
    """The same class with settings that fit a 4×4 grid + cls token (17 tokens); each class takes the
    ones it accepts (an option it does not take is a TypeError)."""
    extra = select_options(cls, {'num_landmarks': 4, 'sampling_ratio': 2, 'num_features': 32})

    class Small(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**extra, **kwargs})
    return Small


@pytest.mark.parametrize('name', NAMES)
def test_timm_vit_drop_in(name):
    torch.manual_seed(0)
    cls = get_attention(name)
    model = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, num_classes=10,
                              attn_layer=_small(cls), qkv_bias=True, drop_path_rate=0.1)
    assert all(isinstance(b.attn, cls) for b in model.blocks)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')                     # Linformer's lazy E, F
        logits = model(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 10) and torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    grads = [p.grad for p in model.blocks[0].attn.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize('fold', [True, False])
def test_soft_attention_runs_after_its_projections_are_factorised(fold):
    """`factorize(soft_model, include='transformer')` replaced qkv by a FactorizedLinear, which has no `.weight`;
    SOFT's forward sliced `qkv.weight` and the first forward raised AttributeError. At full rank the factorised
    layer computes what the dense one did, on the folded and the textbook path alike (float64)."""
    from structformer.models.factorize import factorize
    torch.manual_seed(0)
    layer = SoftAttention(16, num_heads=2, num_landmarks=4, sampler='avgpool', fold_projections=fold).double().eval()
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    before, kernel = layer(x), layer.landmark_kernel(x)
    factorize(torch.nn.ModuleDict({'attn': layer}), rank=1.0, include=['*qkv', '*proj'], skip_no_saving=False,
              verbose=False)
    assert not isinstance(layer.qkv, torch.nn.Linear) and not layer.folding_pays(4)
    torch.testing.assert_close(layer(x), before, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(layer.landmark_kernel(x), kernel, rtol=1e-9, atol=1e-9)
    layer(x).sum().backward()
    assert all(p.grad is not None for p in layer.qkv.parameters())


# ---------------------------------------------------------------- baselines: gradients of the fast paths

def _values_and_grads(fn, inputs, probe):
    """fn(*inputs) and the gradients of <fn(*inputs), probe> with respect to every input."""
    out = fn(*inputs)
    return (out.detach(), *torch.autograd.grad((out * probe).sum(), inputs))


def _assert_same_values_and_grads(fast, reference, inputs, rtol):
    """Every output and gradient entry within rtol of the reference's largest entry of that tensor (some gradient
    entries are exactly 0 in one path and ~1e-17 in the other, so an entry-wise relative test would be noise). A
    gradient that is exactly zero in the reference (q's, where one projected key makes the softmax constant: its
    terms cancel) is held to rtol of the largest entry of any output or gradient, the scale of the terms that
    cancel in it: the fast path's cancellation leaves ~1e-16 there (AVX-512 Xeon, family 6 model 207), not 0."""
    probe = _randn(*reference(*inputs).shape, seed=99)
    got, want = _values_and_grads(fast, inputs, probe), _values_and_grads(reference, inputs, probe)
    largest = max(b.abs().max().item() for b in want)
    for name, a, b in zip(('output',) + tuple(f'grad[{i}]' for i in range(len(inputs))), got, want):
        scale = b.abs().max().item() or largest
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize('shape, proj_len', [((2, 3, 12, 4), 5), ((1, 1, 13, 3), 1), ((1, 2, 9, 4), 9)])
def test_linformer_fast_path_gradients_equal_the_reference(shape, proj_len):
    """SDPA on the projected keys and values against Eq. 7 head by head: outputs and the gradients of q, k, v, E
    and F, float64, batch 1 and k = 1 (one projected key: the softmax is constant) and k = n included. A few
    products of length ≤ n in another order: ~1e-15 relative; 1e-12 leaves room and still fails any wrong term."""
    inputs = tuple(_randn(*shape, seed=s, grad=True) for s in range(3)) + tuple(
        _randn(proj_len, shape[-2], scale=0.3, seed=s, grad=True) for s in (4, 5))
    _assert_same_values_and_grads(linformer_attention, linformer_attention_reference, inputs, rtol=1e-12)


@pytest.mark.parametrize('scale', [0.5, 2.0])                        # 2.0: the stabilisers shift exp by ~10
@pytest.mark.parametrize('shape', [(2, 3, 16, 8), (1, 1, 5, 8)])
def test_performer_fast_path_gradients_equal_the_reference(shape, scale):
    """FAVOR+ in linear order, with its row / head maxima detached, against the n×n Â written out: the stabilisers
    cancel in D̂⁻¹Â, so the detached maxima must not change the gradients either (q, k, v; float64)."""
    omega = orthogonal_random_features(64, shape[-1], torch.Generator().manual_seed(0), dtype=F64)
    inputs = tuple(_randn(*shape, scale=scale, seed=s, grad=True) for s in range(3))
    _assert_same_values_and_grads(lambda q, k, v: performer_attention(q, k, v, omega),
                                  lambda q, k, v: performer_attention_reference(q, k, v, omega), inputs, rtol=1e-12)


@pytest.mark.parametrize('shape, landmarks', [((2, 2, 14, 4), 1), ((2, 2, 14, 4), 5), ((1, 1, 11, 3), 4),
                                              ((2, 2, 14, 4), 14)])
def test_nystrom_fast_path_gradients_equal_the_reference(shape, landmarks):
    """F̃ (Ã⁺ (B̃ V)) with Newton–Schulz and its Eq. 12 backward (Ã row-stochastic, not symmetric) against the n×n
    product with an SVD pseudo-inverse differentiated by autograd: outputs and the gradients of q, k, v, float64,
    at m = 1, m not dividing n (uneven segments), batch 1, and m = n. Ã is invertible here, so Eq. 12 is its exact
    derivative; the error is eps·cond(Ã)² at most (the inverse and its derivative), and the tolerance is that bound."""
    inputs = tuple(_randn(*shape, seed=s, grad=True) for s in range(3))
    q, k = inputs[0].detach(), inputs[1].detach()
    from structformer.layers.attention.nystrom import segment_means
    kernel_a = torch.softmax(segment_means(q, landmarks) @ segment_means(k, landmarks).transpose(-2, -1)
                             * shape[-1] ** -0.5, dim=-1)
    cond = torch.linalg.cond(kernel_a).max().item()
    rtol = max(1e-12, 10 * torch.finfo(F64).eps * cond ** 2)
    assert rtol < 1e-6, cond                                       # the case tests something
    _assert_same_values_and_grads(lambda q, k, v: nystrom_attention(q, k, v, landmarks, newton_iter=80),
                                  lambda q, k, v: nystrom_attention_reference(q, k, v, landmarks), inputs, rtol=rtol)


@pytest.mark.parametrize('mask', ['none', 'causal', 'bool', 'float'])
@pytest.mark.parametrize('tokens', [1, 9])
def test_softmax_fused_gradients_equal_the_naive_layer(mask, tokens):
    """SoftmaxAttention (SDPA) against NaiveSoftmaxAttention (the softmax written out) on the same weights: the
    output and the gradients of the input and every parameter, float64, with each kind of mask and one token."""
    torch.manual_seed(0)
    fused = SoftmaxAttention(16, num_heads=2, qkv_bias=True).double()
    naive = NaiveSoftmaxAttention(16, num_heads=2, qkv_bias=True).double()
    naive.load_state_dict(fused.state_dict())
    x = _randn(2, tokens, 16, seed=8, grad=True)
    kwargs = {}
    if mask == 'causal':
        kwargs['is_causal'] = True
    elif mask != 'none':
        keep = torch.rand(tokens, tokens, generator=torch.Generator().manual_seed(1)) > 0.3
        keep.fill_diagonal_(True)
        kwargs['attn_mask'] = keep if mask == 'bool' else torch.zeros(tokens, tokens, dtype=F64).masked_fill(~keep, -3.0)
    probe = _randn(2, tokens, 16, seed=9)
    results = []
    for layer in (fused, naive):
        out = layer(x, **kwargs)
        results.append((out.detach(), *torch.autograd.grad((out * probe).sum(), [x, *layer.parameters()])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12 * b.abs().max().item())


@pytest.mark.parametrize('name', ['nystrom', 'linformer', 'soft'])
def test_landmarks_above_the_token_count_are_refused_when_the_model_is_built(name):
    """vit_digits has 17 tokens; with attn_layer='nystrom' (49 landmarks by default) it built and every
    forward failed. Now timm.create_model, build_model, swap_attention and SoftNet refuse it by name, and
    a count that fits builds and trains."""
    from structformer import build_model
    from structformer.models.attention_swap import swap_attention
    cls = get_attention(name)
    with pytest.raises(ValueError, match=r'num_landmarks=49 .*exceeds.* n=1[67]'):
        timm.create_model('vit_digits', attn_layer=cls)
    with pytest.raises(ValueError, match=r'num_landmarks=49 .*exceeds'):
        build_model('vit_digits', {'attn_layer': name})
    if name != 'soft':                                                  # shared Q = K: not swappable into a ViT
        dense = timm.create_model('vit_digits')
        with pytest.raises(ValueError, match=r'num_landmarks=49 .*exceeds'):
            swap_attention(dense, name)
        assert not any(isinstance(m, cls) for m in dense.modules())    # refused before any layer was replaced
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        model, _ = build_model('vit_digits', {'attn_layer': name, 'attn_kwargs': {'num_landmarks': 4}})
    model(torch.randn(1, 1, 8, 8)).sum().backward()
    if name != 'soft':                                                  # SoftNet's stages give SOFT its grid
        with pytest.raises(ValueError, match=r'num_landmarks=100 .*exceeds.* n=64'):
            timm.create_model('soft_digits', attn=name, attn_kwargs={'num_landmarks': 100})


@pytest.mark.parametrize('cls', [PerformerAttention, NystromAttention])
def test_attention_dropout_is_refused_where_no_attention_weights_exist(cls):
    """FAVOR+ and Nyström never form attention weights: attn_drop=0.5 was accepted and silently did nothing
    (two training forwards gave the same output). Refused by name at build; 0 builds."""
    with pytest.raises(ValueError, match=r'attn_drop=0\.5: .*nothing to drop'):
        cls(16, num_heads=2, attn_drop=0.5)
    with pytest.raises(ValueError, match=r'attn_drop=0\.1'):
        timm.create_model('vit_digits', attn_layer=_small(cls), attn_drop_rate=0.1)
    cls(16, num_heads=2, attn_drop=0.0, **select_options(cls, {'num_landmarks': 4}))


def test_model_kwargs_attn_layer_typos_and_block_options_are_named():
    """--model-kwargs attn_layer=nystrm reached timm, whose refusal read "Unknown attn_layer: None"; attn_kwargs
    proj_drop=0.3 was overridden by timm's Block (which passes proj_drop to every attention) and silently became
    0.0; attn_kwargs next to timm's own attention was a TypeError from VisionTransformer's constructor."""
    from structformer.layers.attention.registry import resolve_layer_kwargs
    with pytest.raises(ValueError, match=r"unknown attn_layer 'nystrm' \(did you mean 'nystrom'\?\); accepted: .*"
                                         r"nystrom.*'diff'"):
        resolve_layer_kwargs({'attn_layer': 'nystrm'})
    with pytest.raises(ValueError, match=r'attn_kwargs: dim, proj_drop set by the model'):
        resolve_layer_kwargs({'attn_layer': 'nystrom', 'attn_kwargs': {'num_landmarks': 4, 'dim': 8, 'proj_drop': .3}})
    with pytest.raises(ValueError, match=r"attn_kwargs is taken only with .* got attn_layer='attn'"):
        resolve_layer_kwargs({'attn_layer': 'attn', 'attn_kwargs': {'num_landmarks': 4}})
    assert resolve_layer_kwargs({'attn_layer': 'diff'}) == {'attn_layer': 'diff'}           # timm's names pass
    # SoftNet's own attn_kwargs (no attn_layer) pass through
    assert resolve_layer_kwargs({'attn': 'soft', 'attn_kwargs': {'seed': 1}})['attn_kwargs'] == {'seed': 1}
    preset = resolve_layer_kwargs({'attn_layer': 'nystrom', 'attn_kwargs': {'num_landmarks': 4}})['attn_layer']
    assert preset(16, num_heads=2).num_landmarks == 4


def test_softnet_refuses_num_landmarks_its_sampling_ratios_override():
    """soft_digits(attn_kwargs={'num_landmarks': 100}) built and ran: each stage passes SOFT its sampling ratio,
    which decides m, so the user's num_landmarks was silently unused. Refused by name; the random sampler (which
    takes m from num_landmarks) keeps it, and a count above a stage's tokens is refused at build."""
    with pytest.raises(ValueError, match=r'attn_kwargs num_landmarks=100: .*sampling_ratios'):
        timm.create_model('soft_digits', attn_kwargs={'num_landmarks': 100})
    model = timm.create_model('soft_digits', attn_kwargs={'num_landmarks': 1, 'sampler': 'random'}).eval()
    assert all(b.attn.num_landmarks == 1 for s in model.stages for b in s.blocks)
    model(torch.randn(2, 1, 8, 8))
    with pytest.raises(ValueError, match=r'stage 3 .*num_landmarks=2 exceeds'):
        timm.create_model('soft_digits', attn_kwargs={'num_landmarks': 2, 'sampler': 'random'})


@pytest.mark.parametrize('context', [False, True])
def test_performer_built_on_meta_is_filled_in_by_to_empty_and_reset_parameters(context):
    """torch's deferred initialisation (build on the meta device, `to_empty`, `reset_parameters()` on every module):
    ω and the redraw count are the layer's own state, so its reset_parameters draws ω afresh (as the constructor does,
    from the global generator) and zeroes the count. Before, the layer had no reset_parameters and both kept
    `to_empty`'s uninitialised memory: features of arbitrary size (NaN or garbage attention, silently) and a redraw
    schedule counted from garbage."""
    def build(**dd):
        return PerformerAttention(16, num_heads=2, num_features=12, redraw_interval=3, **dd)
    from deferred_init import deferred_init
    layer = deferred_init(build, context, seed=5)
    torch.manual_seed(5)
    features = orthogonal_random_features(12, 8)     # what the reset drew: modules() yields the layer before its maps
    assert torch.equal(layer.projection, features) and int(layer.training_forwards) == 0
    assert torch.isfinite(layer(torch.randn(2, 6, 16))).all()


def test_performer_redraw_keeps_float64_orthogonality():
    """redraw_features drew ω in float32 and copied it into a float64 buffer: rows orthogonal to ~3e-7 only."""
    layer = PerformerAttention(64, num_heads=2, num_features=32, dtype=F64)
    layer.redraw_features(torch.Generator().manual_seed(0))
    rows = layer.projection / layer.projection.norm(dim=1, keepdim=True)
    torch.testing.assert_close(rows @ rows.T, torch.eye(32, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize('cast', [lambda m: m.to(torch.bfloat16), lambda m: m.half(),
                                  lambda m: PerformerAttention(64, num_heads=2, num_features=32, dtype=torch.bfloat16)])
def test_performer_features_stay_float32_in_a_half_precision_layer(cast):
    """`model.to(torch.bfloat16)` rounded ω to 8 mantissa bits (rows orthogonal to ~4e-3, where the float32 draw is
    to ~3e-7), though the forward computes the features in float32: ω now stays the float32 draw (bf16 / fp16 casts,
    or a layer built in bf16), the rest of the layer is cast, and a redraw stays float32 too."""
    torch.manual_seed(0)
    layer = PerformerAttention(64, num_heads=2, num_features=32)
    drawn = layer.projection.clone()
    torch.manual_seed(0)
    cast_layer = cast(layer)
    assert cast_layer.qkv.weight.dtype in (torch.bfloat16, torch.float16)
    assert cast_layer.projection.dtype == torch.float32
    torch.testing.assert_close(cast_layer.projection, drawn, rtol=0, atol=0)     # the same draw, not its rounding
    cast_layer.redraw_features(torch.Generator().manual_seed(0))
    rows = cast_layer.projection / cast_layer.projection.norm(dim=1, keepdim=True)
    torch.testing.assert_close(rows @ rows.T, torch.eye(32), rtol=0, atol=1e-5)
    x = torch.randn(2, 10, 64).to(cast_layer.qkv.weight.dtype)
    assert cast_layer(x).dtype == x.dtype


def test_softmax_honours_timms_fused_attn_switch():
    """timm's `attn.fused_attn = False` (to read attention maps off `attn_drop`) set an unused attribute on the
    'softmax' layer, which stayed on SDPA; and its explicit path replaced an attn_mask by the causal one silently."""
    torch.manual_seed(0)
    layer = SoftmaxAttention(16, num_heads=2).double()
    assert layer.fused_attn and not NaiveSoftmaxAttention(16, num_heads=2).fused_attn
    x = _randn(2, 5, 16, seed=3)
    fused = layer(x)
    seen = []
    layer.attn_drop.register_forward_hook(lambda m, i, o: seen.append(o))
    layer.fused_attn = False
    torch.testing.assert_close(layer(x), fused)
    assert len(seen) == 1 and seen[0].shape == (2, 2, 5, 5)
    torch.testing.assert_close(seen[0].sum(-1), torch.ones(2, 2, 5, dtype=F64))
    with pytest.raises(ValueError, match='attn_mask and is_causal'):
        layer(x, attn_mask=torch.ones(5, 5, dtype=torch.bool), is_causal=True)


def test_vit_set_input_size_refuses_a_token_count_its_attention_cannot_take():
    """timm's set_input_size on vit_digits with Linformer (E, F shaped for 17 tokens) or 10 Nyström landmarks
    went through, and the next forward failed; now refused with the model unchanged, and a fitting change works."""
    from structformer import build_model
    for name, options in (('linformer', {'num_landmarks': 4}), ('nystrom', {'num_landmarks': 10})):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            model, _ = build_model('vit_digits', {'attn_layer': name, 'attn_kwargs': options})
        with pytest.raises(ValueError, match=r'set_input_size\(img_size=4.*5 tokens.*blocks\.0\.attn'):
            model.set_input_size(img_size=4)
        assert model.patch_embed.img_size == (8, 8)
    model, _ = build_model('vit_digits', {'attn_layer': 'nystrom', 'attn_kwargs': {'num_landmarks': 4}})
    model.set_input_size(img_size=4)
    assert model(torch.randn(2, 1, 4, 4)).shape == (2, 10)


def test_soft_drop_border_on_a_grid_smaller_than_k_is_refused_at_build():
    """official SOFT (landmark_border='drop') with k = 8 on vit_digits' 4×4 grid built, and every forward failed."""
    from structformer.layers.attention.registry import with_defaults
    with pytest.raises(ValueError, match=r"landmark_border='drop' needs .* 8×8, got 4×4"):
        timm.create_model('vit_digits', attn_layer=with_defaults(SoftAttention, official=True, sampling_ratio=8))
    model = timm.create_model('vit_digits', attn_layer=with_defaults(SoftAttention, official=True, sampling_ratio=2))
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize('cls, option', [(NystromAttention, 'num_landmarks'), (NystromAttention, 'conv_kernel_size'),
                                         (LinformerAttention, 'num_landmarks'), (LinformerAttention, 'seq_len'),
                                         (PerformerAttention, 'num_features'), (SoftAttention, 'num_landmarks'),
                                         (SoftAttention, 'sampling_ratio'), (SoftAttention, 'newton_iter'),
                                         (NystromAttention, 'newton_iter')])
@pytest.mark.parametrize('bad', [3.0, '3', True, 0])
def test_integer_options_are_checked_when_the_layer_is_built(cls, option, bad):
    """num_landmarks=3.0 (a float from a config) built Nyström and Linformer, and the first forward failed with
    "'float' object cannot be interpreted as an integer" / a torch.empty size error."""
    with pytest.raises(ValueError, match=rf'^{option}={re.escape(repr(bad))} must be a positive integer$'):
        cls(16, num_heads=2, **{option: bad})


def test_performer_redraws_features_on_its_interval_and_keeps_the_schedule_on_reload():
    """FAVOR+ as trained by the public code redraws ω periodically; the layer had no way to (ω fixed forever)."""
    torch.manual_seed(0)
    layer = PerformerAttention(16, num_heads=2, num_features=32, redraw_interval=2)
    first = layer.projection.clone()
    x = torch.randn(2, 6, 16)
    layer.eval()
    for _ in range(3):
        layer(x)                                                # evaluation never redraws or counts
    assert torch.equal(layer.projection, first) and int(layer.training_forwards) == 0
    layer.train()
    layer(x), layer(x)
    assert torch.equal(layer.projection, first)
    layer(x)                                                    # the third training forward: a new ω
    second = layer.projection.clone()
    assert not torch.allclose(second, first)
    reloaded = PerformerAttention(16, num_heads=2, num_features=32, redraw_interval=2)
    reloaded.load_state_dict(layer.state_dict())
    assert torch.equal(reloaded.projection, second) and int(reloaded.training_forwards) == 3
    reloaded(x)
    assert torch.equal(reloaded.projection, second)             # the 4th forward keeps it, the 5th redraws
    reloaded(x)
    assert not torch.equal(reloaded.projection, second)
    assert set(PerformerAttention(16, num_heads=2).state_dict()) == {'qkv.weight', 'proj.weight', 'proj.bias',
                                                                      'projection'}


def test_soft_in_a_vit_whose_grid_it_would_misread_names_the_layout():
    """Without grid_size / num_prefix_tokens SOFT infers a square grid from N: in a ViT of a non-square input, 1 cls +
    3×5 patch tokens = 16 were read as a 4×4 grid without a prefix (at 224×256 px: 1 + 14×16 = 225 as 15×15), and
    the landmarks pooled windows of a scrambled grid, silently. A model of a fixed size now refuses it when built,
    naming the options that give the layer its layout, which then work."""
    from structformer import build_model
    with pytest.raises(ValueError, match=r'blocks\.0\.attn \(SoftAttention\) in a model of 16 tokens: .*1 prefix '
                                         r'token\(s\) and a 3×5 grid.*0 prefix token\(s\) and a 4×4 grid.*'
                                         r'grid_size=\(3, 5\), num_prefix_tokens=1'):
        build_model('vit_digits', {'attn_layer': 'soft', 'img_size': (6, 10), 'attn_kwargs': {'num_landmarks': 4}})
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        model, _ = build_model('vit_digits', {'attn_layer': 'soft', 'img_size': (6, 10), 'attn_kwargs': {
            'num_landmarks': 4, 'grid_size': (3, 5), 'num_prefix_tokens': 1}})
        square, _ = build_model('vit_digits', {'attn_layer': 'soft', 'attn_kwargs': {'num_landmarks': 4}})
    assert model(torch.randn(2, 1, 6, 10)).shape == square(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_soft_in_a_vit_with_register_tokens_names_num_prefix_tokens():
    """SOFT cannot infer the grid of 1 + 4 register + 16 patch tokens; the refusal told a timm user to pass
    grid_size to forward, which timm's Block never does. It names the build option now, which then works."""
    from structformer import build_model
    with pytest.raises(ValueError, match=r'blocks\.0\.attn .*21 tokens.*attn_kwargs num_prefix_tokens'):
        build_model('vit_digits', {'attn_layer': 'soft', 'reg_tokens': 4, 'attn_kwargs': {'num_landmarks': 4}})
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        model, _ = build_model('vit_digits', {'attn_layer': 'soft', 'reg_tokens': 4,
                                              'attn_kwargs': {'num_landmarks': 4, 'num_prefix_tokens': 5}})
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
