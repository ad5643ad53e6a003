"""model_flops (`structformer models --flops`): counted multiply-adds against closed forms, per component."""
import pytest
import torch
import structformer  # noqa: F401  (registers the models)

from structformer.bench.flops import COMPONENTS, model_flops
from structformer.cli import main


def _conv_macs(side_out, k, c_in, c_out):
    return side_out * side_out * k * k * c_in * c_out


def test_soft_digits_components_match_closed_forms():
    """soft_digits: grids 8², 4², 2², 1² (+ cls), dims 32/64/96/128, depths 1/1/2/1, FFN ratio 4."""
    out = model_flops('soft_digits')
    parts = out['breakdown_macs']
    tokens, dims, depths = (64, 16, 4, 2), (32, 64, 96, 128), (1, 1, 2, 1)
    assert parts['mlp'] == sum(n * d * 2 * c * 4 * c for n, c, d in zip(tokens, dims, depths))
    stem = _conv_macs(8, 3, 1, 16) + _conv_macs(8, 3, 16, 16) + _conv_macs(8, 3, 16, 32)   # inner width dims[0]/2
    assert parts['stem'] == stem
    assert parts['downsampling'] == _conv_macs(4, 3, 32, 64) + _conv_macs(2, 3, 64, 96) + _conv_macs(1, 3, 96, 128)
    assert parts['head'] == 128 * 10
    assert parts['attention'] > 0 and abs(parts['other']) < 1e-6 * out['macs']
    assert out['macs'] == out['flops'] / 2 == sum(parts.values())


def test_fused_softmax_attention_is_counted():
    """timm's ViT uses SDPA; model_flops counts it on its explicit path (its `fused_attn` switch)."""
    out = model_flops('vit_tiny_patch16_224', img_size=32, patch_size=16, depth=2)
    n, c = 1 + 4, 192
    assert out['breakdown_macs']['attention'] == 2 * (4 * n * c * c + 2 * n * n * c)   # qkv + proj, QKᵀ and AV


def test_crate_attention_products_are_counted():
    """CRATE's MSSA (Eq. 5–6) calls SDPA with q = k = v = U x and has no `fused` switch: its QKᵀ and AV products
    count through the formula given for SDPA's CPU kernel (before it they counted 0, and CRATE-T was 1.45 GMACs
    instead of 1.81)."""
    out = model_flops('crate_tiny_patch16_224', img_size=32, depth=2)
    n, c = 1 + 4, 384                                   # heads 6 × head width 64 = 384
    assert out['breakdown_macs']['attention'] == 2 * (2 * n * c * c + 2 * n * n * c)   # U and output, QKᵀ and AV


@pytest.mark.parametrize('causal', [False, True])
def test_the_counter_sees_sdpa_on_the_cpu_forward_and_backward(causal):
    """The fused CPU kernel counts as its explicit products do (torch's convention: a causal mask in full), and
    its backward as torch counts SDPA's backward on CUDA: five products of that size against the forward's two."""
    import torch
    import torch.nn.functional as F

    from structformer.bench.flops import flop_counter
    b, h, n, m, d = 2, 3, 7, 5, 8
    q = torch.randn(b, h, n, d, requires_grad=True)
    k, v = torch.randn(b, h, m, d, requires_grad=True), torch.randn(b, h, m, d, requires_grad=True)
    with flop_counter() as forward:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal and n == m)
    assert forward.get_total_flops() == 2 * (b * h * n * m * d) * 2          # QKᵀ and AV, 2 FLOPs a multiply-add
    with flop_counter() as backward:
        out.sum().backward()
    assert 2 * backward.get_total_flops() == 5 * forward.get_total_flops()


def test_crate_shared_qkv_attention_counts_its_products_forward_and_backward():
    """The shared-QKV custom ops are opaque to FlopCounterMode; their registered formulas count what they run: two
    N×N×p products forward (S, O) and three backward (G Wᵀ, Pᵀ G, (dS + dSᵀ) W: module docstring); the explicit
    reference differentiated by autograd runs four backward (dS W and dSᵀ W apart: W enters the scores twice)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from structformer.functional.shared_qkv_attention import shared_qkv_attention, shared_qkv_attention_reference
    images, heads, n, p = 2, 3, 10, 4
    product = 2 * images * heads * n * n * p
    counts = {}
    for name, fn in (('shared', shared_qkv_attention), ('reference', shared_qkv_attention_reference)):
        w = torch.randn(images, heads, n, p, requires_grad=True)
        with FlopCounterMode(display=False) as forward:
            out = fn(w, 0.5)
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
        counts[name] = forward.get_total_flops(), backward.get_total_flops()
    assert counts['shared'] == (2 * product, 3 * product)
    assert counts['reference'] == (2 * product, 4 * product)


def test_the_tile_kernel_counts_what_the_gathered_tiles_count():
    """Sparsifiner's CPU tile kernel is opaque to FlopCounterMode; its formulas count the products it runs: with
    whole tiles and no dense row, the gathered path's count (SDPA over the kept tiles), a backward of five such
    products, and the predictor's Q K_downᵀ plus the tile means' product."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from structformer.functional import tile_kernel
    from structformer.functional.sparsifiner import block_gathered_attention
    from structformer.bench.flops import flop_counter
    if not tile_kernel.available():
        pytest.skip(f"no tile kernel here: {tile_kernel.unavailable_reason()}")
    b, h, n, d, bs, kept = 1, 2, 16, 8, 4, 2
    q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
    indices = torch.stack([torch.randperm(n // bs)[:kept] for _ in range(b * h * (n // bs))]).view(b, h, n // bs, kept)
    with flop_counter() as gathered:
        block_gathered_attention(q, k, v, indices, bs)
    with FlopCounterMode(display=False) as forward:
        out = tile_kernel.block_tile_attention(q, k, v, indices, bs)
    assert forward.get_total_flops() == gathered.get_total_flops() == 2 * 2 * b * h * n * kept * bs * d
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    assert 2 * backward.get_total_flops() == 5 * forward.get_total_flops()
    p = 3
    with FlopCounterMode(display=False) as predictor:
        tile_kernel.block_connectivity(q.detach(), k.detach(), torch.randn(p, n), torch.randn(p, n), 0.5, 0.0, 0.0,
                                       bs, kept)
    assert predictor.get_total_flops() == 2 * b * h * (2 * n * p * d + (n // bs) * p * (n // bs))


@pytest.mark.parametrize('name, kwargs', [
    ('crate_digits', {}), ('soft_digits', {}), ('softpp_digits', {}), ('sparsifiner_digits', {}),
    ('sparsifiner_digits', {'connectivity': 'block'}), ('vit_digits', {}), ('mixer_digits', {}),
    ('rp_mixer_digits', {}), ('swmlp_digits', {}), ('wrn_10_2_digits', {}), ('soft_tiny_linformer_mnist', {}),
    ('soft_tiny_nystrom_mnist', {}), ('soft_tiny_performer_mnist', {})])
def test_every_family_counts_its_products(name, kwargs):
    """Forward and training step of each family under a dispatch spy: every product-like op (matmul, convolution,
    attention) and every op outside aten has a FLOP formula, so no count silently drops work (SDPA's CPU kernel,
    the shared-QKV ops and the tile kernel each did)."""
    import timm
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    from structformer.bench.flops import CPU_SDPA_FORMULAS

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func)
            return func(*args, **(kwargs or {}))

    products = ('mm', 'conv', 'linear', 'attention', 'einsum', 'matmul', 'dot')
    model = timm.create_model(name, **kwargs)
    x = torch.randn(2, *model.pretrained_cfg['input_size'])
    for train in (False, True):
        model.train(train)
        with Ops() as ops, torch.set_grad_enabled(train):
            out = model(x)
            if train:
                out.sum().backward()
        missing = sorted(str(op) for op in ops.seen
                         if op.overloadpacket not in flop_registry and op.overloadpacket not in CPU_SDPA_FORMULAS
                         and (op.namespace != 'aten' or any(word in op.__name__ for word in products)))
        assert not missing, (train, missing)


_SCALES = {'G': 1e9, 'M': 1e6, 'K': 1e3}


def _printed_count(text: str):
    """'2.964G' -> (2.964e9, 1e9): a count as `models --flops` prints it, and the scale of its unit."""
    if text[-1] in _SCALES:
        return float(text[:-1]) * _SCALES[text[-1]], _SCALES[text[-1]]
    return float(text), 1.0


@pytest.mark.parametrize('name, size', [('softpp_tiny_mnist', '1x28x28'), ('mixer_digits', '1x8x8'),
                                        ('crate_digits', '1x8x8')])
def test_models_cli_prints_macs(capsys, name, size):
    """Each count with its own unit (G, M, K, or none), three decimals: the digits models printed 0.000 in a GMACs
    column (mixer_digits' 0.2 M multiply-adds, every component of them)."""
    torch.manual_seed(0)        # SOFT++'s attention count moves by a few hundred MACs with the drawn weights
    assert main(['models', '--filter', name, '--flops']) == 0
    lines = capsys.readouterr().out.splitlines()
    header, row = lines[0].split(), lines[1].split()
    columns = list(COMPONENTS) + ['other']
    assert header == ['model', 'params', 'input', 'MACs'] + columns       # every component named in full
    torch.manual_seed(0)
    expected = model_flops(name)
    assert row[0] == name and row[2] == size
    for key, text in [('total', row[3])] + list(zip(columns, row[4:])):
        want = expected['macs'] if key == 'total' else expected['breakdown_macs'][key]
        value, scale = _printed_count(text)
        assert value == pytest.approx(want, abs=5e-4 * scale), (key, text)      # printed with 3 decimals
        assert want == 0 or want < 1000 or 1 <= value / scale < 1000, (key, text)     # the unit that shows it
    assert expected['macs'] > 0 and _printed_count(row[3])[0] > 0


def test_models_cli_rejects_bad_img_size(capsys):
    with pytest.raises(SystemExit) as exc:
        main(['models', '--flops', '--img-size', '0'])
    assert exc.value.code == 2 and '--img-size must be an integer >= 1' in capsys.readouterr().err


def test_mixer_and_sw_mlp_multiply_adds_are_counted_as_mlp():
    """mixer_digits (S = 16, C = 32, C0 = 4, L = 4, gamma = 2) and swmlp_digits (m = 128, L = 2): the token and channel
    MLPs, and SW-MLP's sparse-weight blocks, are the 'mlp' column (they were all 'other' before), by closed form."""
    S, C, C0, L, gamma = 16, 32, 4, 4, 2
    parts = model_flops('mixer_digits')['breakdown_macs']
    token, channel = 2 * C * S * gamma * S, 2 * S * C * gamma * C           # fc1 + fc2 of each, per block
    assert parts == {'stem': S * C0 * C, 'downsampling': 0, 'attention': 0, 'mlp': L * (token + channel),
                     'head': C * 10, 'other': 0}
    m, depth = 16 * 8, 2
    parts = model_flops('swmlp_digits')['breakdown_macs']
    assert parts == {'stem': 16 * 4 * 8, 'downsampling': 0, 'attention': 0, 'mlp': depth * m * m, 'head': m * 10,
                     'other': 0}
