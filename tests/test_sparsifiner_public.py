"""Sparsifiner at the public code's sparsity (issue 45): a checkpoint in the public layout, converted with
`structformer convert --from sparsifiner-official`, keeps exactly the keys the public code keeps at its defaults.

The public forward is written here from lim142857/Sparsifiner src/models/sparsifiner.py's equations (MaskPredictor
and Attention in inference) and its default config (experiments/sparsifiner_default_config.yaml: BASIS_THRESHOLD
2e-2, BASIS_COEF.USE_TOPK with TOPK 8, ATTN_SCORE.USE_TOPK at ATTN_KEEP_RATE 0.25), in float64; nothing of theirs
is imported. The three choices it makes that are options of ours (coef_topk, predictor_scale, up_threshold) are
checked on every execution path that computes the predictor: the token paths (masked, gathered, FlexAttention
share `predict`), the block paths (tile-mean scores in torch; the CPU kernel's predictor, which the top-k
coefficients route to torch) and the pruned-sequence bases."""
import json
import math

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from structformer.functional import tile_kernel
from structformer.functional.sparsifiner import (block_indices_to_mask, block_mask_from_scores, connectivity_scores,
                                                 low_rank_attention, predicted_tiles, sparse_coefficients)
from structformer.layers import SparsifinerAttention
from structformer.weights.cli import convert_checkpoint
from test_convert import _as_loaded, _fill, sparsifiner_official_shapes

# torch warns (once per process, at whichever test comes first) that eager FlexAttention on the CPU is its unfused
# reference: that path is the one compared here
pytestmark = pytest.mark.filterwarnings('ignore:flex_attention called without torch.compile')

F64 = torch.float64
DIM, DEPTH, HEADS, PATCHES, CLASSES = 64, 4, 4, 16, 10      # sparsifiner_digits: 17 tokens, head_dim 16


def public_forward(s, x, keep=0.25, coef_topk=8, basis_threshold=2e-2):
    """The public Sparsifiner (DeiT with MaskPredictor) in eval mode; returns (logits, masks per layer)."""
    b = x.shape[0]
    t = F.conv2d(x, s['patch_embed.proj.weight'], s['patch_embed.proj.bias'], stride=2).flatten(2).transpose(1, 2)
    t = torch.cat([s['cls_token'].expand(b, -1, -1), t], 1) + s['pos_embed']
    n, masks = t.shape[1], []
    for i in range(DEPTH):
        pre = f'blocks.{i}'
        y = F.layer_norm(t, (DIM,), s[f'{pre}.norm1.weight'], s[f'{pre}.norm1.bias'], 1e-6)
        q, k, v = F.linear(y, s[f'{pre}.attn.qkv.weight'], s[f'{pre}.attn.qkv.bias']) \
            .reshape(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        mp = f'{pre}.attn.mask_predictor'
        qc = F.linear(q, s[f'{mp}.proj_c_q.weight'], s[f'{mp}.proj_c_q.bias'])
        kc = F.linear(k, s[f'{mp}.proj_c_k.weight'], s[f'{mp}.proj_c_k.bias'])
        k_down = kc.transpose(-1, -2) @ s[f'{mp}.proj_n']                       # [B, H, c, K]
        basis = s[f'{mp}.proj_back_n'].t().abs()
        basis = torch.where(basis > basis_threshold, basis, torch.zeros_like(basis))   # nn.Threshold(th, 0)(|W|)
        coef = ((qc @ k_down) * HEADS ** -0.5)[..., 1:, :].softmax(-1)           # the cls row is not predicted
        values, indices = coef.topk(coef_topk, sorted=False)
        coef = torch.zeros_like(coef).scatter(-1, indices, values)
        approx = coef @ basis                                                   # [B, H, N-1, N]
        chosen = approx.topk(math.ceil(keep * n), sorted=False).indices
        mask = torch.zeros_like(approx).scatter(-1, chosen, 1.0)
        mask = torch.cat([torch.ones(b, HEADS, 1, n, dtype=mask.dtype), mask], 2).bool()
        masks.append(mask)
        attn = ((q @ k.transpose(-2, -1)) * (DIM // HEADS) ** -0.5).masked_fill(~mask, float('-inf')).softmax(-1)
        out = F.linear((attn @ v).transpose(1, 2).reshape(b, n, DIM), s[f'{pre}.attn.proj.weight'],
                       s[f'{pre}.attn.proj.bias'])
        t = t + out
        y = F.layer_norm(t, (DIM,), s[f'{pre}.norm2.weight'], s[f'{pre}.norm2.bias'], 1e-6)
        t = t + F.linear(F.gelu(F.linear(y, s[f'{pre}.mlp.fc1.weight'], s[f'{pre}.mlp.fc1.bias'])),
                         s[f'{pre}.mlp.fc2.weight'], s[f'{pre}.mlp.fc2.bias'])
    t = F.layer_norm(t, (DIM,), s['norm.weight'], s['norm.bias'], 1e-6)
    return F.linear(t[:, 0], s['head.weight'], s['head.bias']), masks


@pytest.fixture(scope='module')
def public(tmp_path_factory):
    """A public-layout checkpoint (n_down = N: top 8 of 17 coefficients matters), its file and the input."""
    state = _fill(sparsifiner_official_shapes(DIM, DEPTH, HEADS, PATCHES, CLASSES, reduce_n=1), seed=11)
    path = tmp_path_factory.mktemp('public') / 'sparsifiner.safetensors'
    save_file({k: v.float() for k, v in state.items()}, str(path))
    x = torch.randn(3, 1, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(12))
    return _as_loaded(state), path, x


def _masks_of(model, x):
    layers = [m for m in model.modules() if isinstance(m, SparsifinerAttention)]
    for layer in layers:
        layer.keep_scores = True
    with torch.no_grad():
        logits = model.double().eval()(x)
    return logits, [layer.last_mask for layer in layers]


@pytest.mark.parametrize('impl', ['masked', 'gather', 'flex'])
def test_converted_public_checkpoint_keeps_the_public_keys(impl, public):
    state, path, x = public
    model, notes = convert_checkpoint('sparsifiner-official', path, 'sparsifiner_digits', {'impl': impl})
    for setting in ('coef_topk=8: ', "predictor_scale='heads': ", 'up_threshold=0.02: ', 'keep_ratio=0.25: ',
                    'n_down=17: ', 'predictor_dim=8: '):
        assert any(line.startswith(setting) for line in notes), (setting, notes)
    logits, masks = _masks_of(model, x)
    want_logits, want_masks = public_forward(state, x)
    for ours, theirs in zip(masks, want_masks):
        assert torch.equal(ours, theirs) if impl != 'gather' else ours is None    # gather forms no mask
    torch.testing.assert_close(logits, want_logits, rtol=1e-10, atol=1e-10)


def test_our_defaults_keep_other_keys_so_the_options_matter(public):
    """The same weights with coef_topk, predictor_scale and up_threshold at our defaults: other keys (the reason
    they are options), and each of the three alone changes the masks."""
    state, path, x = public
    _, want = public_forward(state, x)
    defaults = dict(coef_topk=None, predictor_scale='dim', up_threshold=1e-2, tau=0.05)
    model, notes = convert_checkpoint('sparsifiner-official', path, 'sparsifiner_digits', defaults)
    assert model.blocks[0].attn.coef_topk is None          # KEY=None: the model's default, not the public 8
    assert any(n.startswith("coef_topk: the model's default, as --model-kwargs coef_topk=None asked") for n in notes)
    _, masks = _masks_of(model, x)
    assert sum(int((a != b).sum()) for a, b in zip(masks, want)) > 0
    for one in ('coef_topk', 'predictor_scale', 'up_threshold'):
        model, _ = convert_checkpoint('sparsifiner-official', path, 'sparsifiner_digits', {one: defaults[one]})
        _, masks = _masks_of(model, x)
        assert any(not torch.equal(a, b) for a, b in zip(masks, want)), one


def test_the_converted_folder_reproduces_the_settings_through_local_dir(public, tmp_path):
    state, path, x = public
    out = tmp_path / 'converted'
    convert_checkpoint('sparsifiner-official', path, 'sparsifiner_digits', output=out)
    args = json.loads((out / 'config.json').read_text())['model_args']
    assert (args['coef_topk'], args['predictor_scale'], args['up_threshold']) == (8, 'heads', 0.02)
    model = timm.create_model(f'local-dir:{out}', pretrained=True)
    _, masks = _masks_of(model, x)
    for ours, theirs in zip(masks, public_forward(state, x)[1]):
        assert torch.equal(ours, theirs)


def test_top_k_coefficients_keep_k_per_row_and_their_gradient():
    a = torch.rand(2, 3, 5, 9, dtype=F64, requires_grad=True).softmax(-1)
    kept = sparse_coefficients(a, 0.5, coef_topk=4)
    assert ((kept != 0).sum(-1) == 4).all()
    torch.testing.assert_close(kept, torch.zeros_like(a).scatter(-1, a.topk(4).indices, a.topk(4).values))
    assert torch.equal(sparse_coefficients(a, 0.5, coef_topk=20), a)           # k >= n_down keeps them all
    (grad,) = torch.autograd.grad(kept.sum(), a)
    assert grad.abs().sum() > 0


def _predictor_case(n=37, seed=4):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 3, n, 8, generator=g), torch.randn(1, 3, n, 8, generator=g)
    return q, k, 0.3 * torch.randn(12, n, generator=g), 0.05 * torch.randn(12, n, generator=g)


@pytest.mark.parametrize('kernel', [False, True])
def test_block_predictor_honours_top_k_coefficients_and_the_scale(kernel):
    """The tile-mean predictor (torch, and 'kernel', which routes top-k coefficients to torch) keeps the tiles that
    the masked block path keeps from the full scores, with coef_topk and the heads scale."""
    if kernel and not tile_kernel.available():
        pytest.skip('no C++ compiler for the tile kernel')
    q, k, w_down, w_up = _predictor_case(n=97)
    scale, t = 3 ** -0.5, 0.02
    indices = predicted_tiles(q, k, w_down, w_up, 0.05, t, 0.3, 8, kernel=kernel, coef_topk=2, scale=scale)
    scores = connectivity_scores(low_rank_attention(q, k, w_down, scale), w_up, 0.05, t, coef_topk=2)
    assert torch.equal(block_indices_to_mask(indices, q.shape[-2], 8), block_mask_from_scores(scores, 8, 0.3))
    for other in (dict(scale=scale), dict(coef_topk=2)):                     # each option changes the tiles here
        assert not torch.equal(predicted_tiles(q, k, w_down, w_up, 0.05, t, 0.3, 8, kernel=kernel, **other)
                               .sort(-1).values, indices.sort(-1).values), other


@pytest.mark.parametrize('impl', ['gather', 'kernel', 'flex'])
def test_block_paths_follow_the_masked_block_path_with_the_public_options(impl):
    if impl == 'kernel' and not tile_kernel.available():
        pytest.skip('no C++ compiler for the tile kernel')
    torch.manual_seed(0)
    options = dict(keep_ratio=0.3, connectivity='block', block_size=4, seq_len=21, n_down=10, coef_topk=3,
                   predictor_scale='heads', up_threshold=0.02, predictor_dim=4)
    masked = SparsifinerAttention(32, 2, impl='masked', **options).eval()
    other = SparsifinerAttention(32, 2, impl=impl, **options).eval()
    other.load_state_dict(masked.state_dict())
    x = torch.randn(2, 21, 32)
    with torch.no_grad():
        torch.testing.assert_close(other(x), masked(x), rtol=1e-5, atol=1e-6)     # float32: the same kept tiles


def test_pruned_sequence_bases_use_the_heads_scale():
    """token_sources (EViT pruning) with one-hot rows is the unpruned layer: the per-sample bases take the scale."""
    torch.manual_seed(1)
    layer = SparsifinerAttention(32, 4, seq_len=9, n_down=6, keep_ratio=0.5, coef_topk=2, predictor_scale='heads',
                                 keep_scores=True).double().eval()
    x = torch.randn(2, 9, 32, dtype=F64)
    with torch.no_grad():
        plain = layer(x)
        scores = layer.last_scores
        pruned = layer(x, token_sources=torch.eye(9, dtype=F64).expand(2, 9, 9))
    torch.testing.assert_close(pruned, plain)
    torch.testing.assert_close(layer.last_scores, scores)
