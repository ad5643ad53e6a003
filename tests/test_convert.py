"""`structformer convert`: the public code's checkpoints into our models (issue 32).

The official layouts are written here from the public code's module structure (key names and shapes of
Ma-Lab-Berkeley/CRATE model/crate.py, fudan-zvg/SOFT models/softmax_free_*.py, lim142857/Sparsifiner
src/models/sparsifiner.py), filled with random values, and each official forward is written from the public code's
equations on those tensors; nothing of theirs is imported. The converted model's logits must equal it.
"""
import json

import pytest
import timm
import torch
import torch.nn.functional as F
from einops import rearrange
from safetensors.torch import load_file, save_file

from structformer.cli import main
from structformer.weights.cli import convert_checkpoint

F64 = torch.float64


def _fill(shapes, seed=0):
    """Random tensors for {name: shape}: LayerNorm / BatchNorm scales near 1, variances positive, the rest small."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith('num_batches_tracked'):
            out[name] = torch.tensor(7)
        elif name.endswith('running_var'):
            out[name] = torch.rand(shape, generator=gen, dtype=F64) + 0.5
        elif 'norm' in name and name.endswith('.weight') or name.endswith(('.1.weight', '.4.weight', '.7.weight')) \
                and len(shape) == 1:
            out[name] = 1 + 0.1 * torch.randn(shape, generator=gen, dtype=F64)
        else:
            out[name] = 0.1 * torch.randn(shape, generator=gen, dtype=F64)
    return out


def _as_loaded(state):
    """The tensors as a float32 model holds them (converted models are built in float32), in float64 for the
    reference: the comparison then sees only float64 rounding."""
    return {k: v.float().double() if v.is_floating_point() else v for k, v in state.items()}


def _ln(x, state, prefix, eps=1e-5):
    return F.layer_norm(x, x.shape[-1:], state[f'{prefix}.weight'], state[f'{prefix}.bias'], eps)


def _linear(x, state, prefix):
    return F.linear(x, state[f'{prefix}.weight'], state.get(f'{prefix}.bias'))


# ------------------------------------------------------------------ CRATE

def crate_official_shapes(c, p, dim, depth, heads, dim_head, patches, classes):
    """model/crate.py's CRATE: to_patch_embedding = (Rearrange, LayerNorm, Linear, LayerNorm), pos_embedding,
    cls_token, transformer.layers.i = [PreNorm(Attention), PreNorm(FeedForward)], mlp_head = (LayerNorm, Linear)."""
    pd, inner = c * p * p, heads * dim_head
    shapes = {'to_patch_embedding.1.weight': (pd,), 'to_patch_embedding.1.bias': (pd,),
              'to_patch_embedding.2.weight': (dim, pd), 'to_patch_embedding.2.bias': (dim,),
              'to_patch_embedding.3.weight': (dim,), 'to_patch_embedding.3.bias': (dim,),
              'pos_embedding': (1, patches + 1, dim), 'cls_token': (1, 1, dim)}
    for i in range(depth):
        pre = f'transformer.layers.{i}'
        shapes.update({f'{pre}.0.norm.weight': (dim,), f'{pre}.0.norm.bias': (dim,),
                       f'{pre}.0.fn.qkv.weight': (inner, dim), f'{pre}.0.fn.to_out.0.weight': (dim, inner),
                       f'{pre}.0.fn.to_out.0.bias': (dim,), f'{pre}.1.norm.weight': (dim,),
                       f'{pre}.1.norm.bias': (dim,), f'{pre}.1.fn.weight': (dim, dim)})
    shapes.update({'mlp_head.0.weight': (dim,), 'mlp_head.0.bias': (dim,), 'mlp_head.1.weight': (classes, dim),
                   'mlp_head.1.bias': (classes,)})
    return shapes


def crate_official_forward(s, x, p, depth, heads, step=0.1, lambd=0.1):
    """The public CRATE forward: LN -> Linear -> LN on (p1 p2 c) patches, cls + positions, per layer
    x = attn(LN x) + x (softmax(w wᵀ / √d_h) w with one projection w), then FeedForward(LN x) =
    ReLU(z + η(z W − z Wᵀ W) − ηλ) without a residual; cls -> LN -> Linear."""
    t = rearrange(x, 'b c (h p1) (w p2) -> b (h w) (p1 p2 c)', p1=p, p2=p)
    t = _ln(_linear(_ln(t, s, 'to_patch_embedding.1'), s, 'to_patch_embedding.2'), s, 'to_patch_embedding.3')
    t = torch.cat([s['cls_token'].expand(t.shape[0], -1, -1), t], 1) + s['pos_embedding']
    for i in range(depth):
        pre = f'transformer.layers.{i}'
        w = rearrange(F.linear(_ln(t, s, f'{pre}.0.norm'), s[f'{pre}.0.fn.qkv.weight']), 'b n (h d) -> b h n d', h=heads)
        attn = torch.softmax(w @ w.transpose(-1, -2) * w.shape[-1] ** -0.5, -1)
        t = _linear(rearrange(attn @ w, 'b h n d -> b n (h d)'), s, f'{pre}.0.fn.to_out.0') + t
        z, weight = _ln(t, s, f'{pre}.1.norm'), s[f'{pre}.1.fn.weight']
        grad_1 = F.linear(F.linear(z, weight), weight.t())
        grad_2 = F.linear(z, weight.t())
        t = F.relu(z + step * (grad_2 - grad_1) - step * lambd)
    return _linear(_ln(t[:, 0], s, 'mlp_head.0'), s, 'mlp_head.1')


def test_crate_official_converts_to_equal_logits(tmp_path):
    """crate_digits' shapes (1 channel, 8 px, patch 2, d 64, 4 layers, 4 heads of 16) in the official layout."""
    state = _fill(crate_official_shapes(1, 2, 64, 4, 4, 16, 16, 10))
    torch.save({'epoch': 3, 'arch': 'CRATE_tiny', 'state_dict': {f'module.{k}': v for k, v in state.items()}},
               tmp_path / 'crate.pth')                            # main.py's checkpoint, saved under DDP
    model, notes = convert_checkpoint('crate-official', tmp_path / 'crate.pth', 'crate_digits')
    x = torch.randn(3, 1, 8, 8, dtype=F64)
    with torch.no_grad():
        ours = model.double().eval()(x)
    torch.testing.assert_close(ours, crate_official_forward(_as_loaded(state), x, 2, 4, 4), rtol=1e-10, atol=1e-10)
    assert notes == ["num_classes=10: the checkpoint's classifier mlp_head.1.weight is [10, 64]",
                     'took state_dict, epoch 3',           # what was chosen, and why; nothing converted beyond keys
                     "removed the prefix 'module.' from 44 keys (DataParallel / DDP / torch.compile wrappers, as "
                     "timm's clean_state_dict)"]


def test_crate_official_small_patch_layout_is_the_same_flattening():
    """CRATE-S shapes (d 576, 12 heads of 48) at 32 px: the (p1 p2 c) flattening of 3 channels is where a layout error
    would show; one layer is enough."""
    from structformer.weights.convert import convert_state_dict
    state = _fill(crate_official_shapes(3, 16, 576, 1, 12, 48, 4, 7), seed=1)
    model = timm.create_model('crate_small_patch16_224', img_size=32, depth=1, num_classes=7).double().eval()
    state = _as_loaded(state)
    converted, _ = convert_state_dict('crate-official', state, model)
    model.load_state_dict(converted)
    x = torch.randn(2, 3, 32, 32, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), crate_official_forward(state, x, 16, 1, 12), rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ SOFT

def soft_official_shapes(dims, heads, depths, ratios=(8, 4, 2), convs=(9, 5, 3), classes=1000, stem=32):
    """models/softmax_free_vision_transformer.py's SoftmaxFreeVisionTransformer at 224 px (qkv_bias=True)."""
    shapes = {}

    def conv(name, cout, cin):
        shapes.update({f'{name}.weight': (cout, cin, 3, 3), f'{name}.bias': (cout,)})

    def bn(name, c):
        shapes.update({f'{name}.{k}': (c,) for k in ('weight', 'bias', 'running_mean', 'running_var')})
        shapes[f'{name}.num_batches_tracked'] = ()
    conv('patch_embed1.proj.0', stem, 3), bn('patch_embed1.proj.1', stem)
    conv('patch_embed1.proj.3', stem, stem), bn('patch_embed1.proj.4', stem)
    conv('patch_embed1.proj.6', dims[0], stem), bn('patch_embed1.proj.7', dims[0])
    for i in (1, 2, 3):
        conv(f'patch_embed{i + 1}.proj.0', dims[i], dims[i - 1]), bn(f'patch_embed{i + 1}.proj.1', dims[i])
    for i, n in enumerate((3136, 784, 196, 50)):
        shapes[f'pos_embed{i + 1}'] = (1, n, dims[i])
    for i in range(3):
        d, hd = dims[i], dims[i] // heads[i]
        for j in range(depths[i]):
            pre = f'block{i + 1}.{j}.att'
            for lin, (o, n) in {'mha.W_q': (d, d), 'mha.W_v': (d, d), 'mha.ff': (d, d), 'ff1': (4 * d, d),
                                'ff2': (d, 4 * d)}.items():
                shapes.update({f'{pre}.{lin}.weight': (o, n), f'{pre}.{lin}.bias': (o,)})
            shapes.update({f'{pre}.mha.attn.Qlandmark_op.weight': (hd, hd, ratios[i], ratios[i]),
                           f'{pre}.mha.attn.Qnorm_act.0.weight': (hd,), f'{pre}.mha.attn.Qnorm_act.0.bias': (hd,),
                           f'{pre}.mha.attn.conv.weight': (heads[i], 1, convs[i], convs[i]),
                           f'{pre}.norm1.weight': (d,), f'{pre}.norm1.bias': (d,), f'{pre}.norm2.weight': (d,),
                           f'{pre}.norm2.bias': (d,)})
    d = dims[3]
    for j in range(depths[3]):
        pre = f'block4.{j}'
        for lin, (o, n) in {'attn.q': (d, d), 'attn.kv': (2 * d, d), 'attn.proj': (d, d), 'mlp.fc1': (4 * d, d),
                            'mlp.fc2': (d, 4 * d)}.items():
            shapes.update({f'{pre}.{lin}.weight': (o, n), f'{pre}.{lin}.bias': (o,)})
        shapes.update({f'{pre}.norm1.weight': (d,), f'{pre}.norm1.bias': (d,), f'{pre}.norm2.weight': (d,),
                       f'{pre}.norm2.bias': (d,)})
    shapes.update({'norm.weight': (d,), 'norm.bias': (d,), 'cls_token': (1, 1, d), 'head.weight': (classes, d),
                   'head.bias': (classes,)})
    return shapes


def soft_official_forward(s, x, dims, heads, depths, ratios=(8, 4, 2)):
    """The public SOFT forward (eval): conv-BN-ReLU tokenisers, positions, post-LN SOFT layers in stages 1-3
    (q/d^¼ landmarks by a k×k stride-k conv, LayerNorm + GELU, Gaussian kernels, the public Newton inverse, a
    depthwise conv of V added), a pre-LN softmax stage 4 with cls (LayerNorm eps 1e-6), cls -> LN -> head."""
    from test_soft_official import public_soft_inverse

    def cbr(t, conv, norm, stride):
        t = F.conv2d(t, s[f'{conv}.weight'], s[f'{conv}.bias'], stride, 1)
        t = F.batch_norm(t, s[f'{norm}.running_mean'], s[f'{norm}.running_var'], s[f'{norm}.weight'], s[f'{norm}.bias'],
                         False, 0., 1e-5)
        return F.relu(t)

    def gaussian(a, c):
        return torch.exp(-(a[..., :, None, :] - c[..., None, :, :]).pow(2).sum(-1) / 2)

    def soft_attention(t, pre, h, height, width, ratio):
        b, n, dim = t.shape
        d = dim // h
        q = _linear(t, s, f'{pre}.W_q').reshape(b, n, h, d).transpose(1, 2) / d ** 0.25
        v = _linear(t, s, f'{pre}.W_v').reshape(b, n, h, d).transpose(1, 2)
        planes = q.reshape(b * h, height, width, d).permute(0, 3, 1, 2)
        lm = F.conv2d(planes, s[f'{pre}.attn.Qlandmark_op.weight'], stride=ratio).flatten(2).transpose(1, 2)
        lm = F.gelu(_ln(lm.reshape(b, h, -1, d), s, f'{pre}.attn.Qnorm_act.0'))
        k1 = gaussian(q, lm)
        out = (k1 @ public_soft_inverse(gaussian(lm, lm))) @ (k1.transpose(-1, -2) @ v)
        cw = s[f'{pre}.attn.conv.weight']
        vp = v.reshape(b, h, height, width, d).permute(0, 4, 1, 2, 3).reshape(b * d, h, height, width)
        out = out + F.conv2d(vp, cw, padding=cw.shape[-1] // 2, groups=h).reshape(b, d, h, height, width) \
            .flatten(3).permute(0, 2, 3, 1)
        return _linear(out.transpose(1, 2).reshape(b, n, dim), s, f'{pre}.ff')

    def approx_gelu(t):
        return 0.5 * t * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (t + 0.044715 * t ** 3)))

    t = cbr(x, 'patch_embed1.proj.0', 'patch_embed1.proj.1', 2)
    t = cbr(t, 'patch_embed1.proj.3', 'patch_embed1.proj.4', 1)
    t = cbr(t, 'patch_embed1.proj.6', 'patch_embed1.proj.7', 2)
    for stage in range(4):
        if stage:
            t = cbr(t, f'patch_embed{stage + 1}.proj.0', f'patch_embed{stage + 1}.proj.1', 2)
        b, c, height, width = t.shape
        tok = t.flatten(2).transpose(1, 2)
        if stage < 3:                          # positions at the 224-px grid: the public interpolation is the identity
            tok = tok + s[f'pos_embed{stage + 1}']
            for j in range(depths[stage]):
                pre = f'block{stage + 1}.{j}.att'
                tok = _ln(tok + soft_attention(tok, f'{pre}.mha', heads[stage], height, width, ratios[stage]), s,
                          f'{pre}.norm1')
                ff = _linear(approx_gelu(_linear(tok, s, f'{pre}.ff1')), s, f'{pre}.ff2')
                tok = _ln(tok + ff, s, f'{pre}.norm2')
            t = tok.reshape(b, height, width, c).permute(0, 3, 1, 2)
        else:
            tok = torch.cat([s['cls_token'].expand(b, -1, -1), tok], 1) + s['pos_embed4']
            h, d = heads[3], c // heads[3]
            for j in range(depths[3]):
                pre = f'block4.{j}'
                y = _ln(tok, s, f'{pre}.norm1', 1e-6)
                q = _linear(y, s, f'{pre}.attn.q').reshape(b, -1, h, d).transpose(1, 2)
                k, v = _linear(y, s, f'{pre}.attn.kv').reshape(b, -1, 2, h, d).permute(2, 0, 3, 1, 4)
                attn = torch.softmax(q @ k.transpose(-2, -1) * d ** -0.5, -1)
                tok = tok + _linear((attn @ v).transpose(1, 2).reshape(b, -1, c), s, f'{pre}.attn.proj')
                tok = tok + _linear(F.gelu(_linear(_ln(tok, s, f'{pre}.norm2', 1e-6), s, f'{pre}.mlp.fc1')), s,
                                    f'{pre}.mlp.fc2')
    return _linear(_ln(tok, s, 'norm', 1e-6)[:, 0], s, 'head')


@pytest.mark.slow
def test_soft_official_converts_to_equal_logits(tmp_path):
    """SOFT-Tiny as the public code builds it (depths 1/2/3/2), at 224 px, one image, float64."""
    dims, heads, depths = (64, 128, 320, 512), (2, 4, 10, 16), (1, 2, 3, 2)
    state = _fill(soft_official_shapes(dims, heads, depths), seed=2)
    torch.save({'state_dict': state, 'state_dict_ema': state}, tmp_path / 'soft.pth.tar')   # timm train.py's checkpoint
    model, _ = convert_checkpoint('soft-official', tmp_path / 'soft.pth.tar', 'soft_tiny_official_224')
    x = torch.randn(1, 3, 224, 224, dtype=F64)
    with torch.no_grad():
        ours = model.double().eval()(x)
        ref = soft_official_forward(_as_loaded(state), x, dims, heads, depths)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)


def test_softpp_official_keys_are_the_same_map():
    """SoftmaxFreeNormVisionTransformer (SOFT++) keeps the SOFT module names: every key maps, every tensor of
    softpp_tiny_official_224 is filled with the official value (its inverse differs, not its parameters)."""
    from structformer.weights.convert import convert_state_dict
    state = _fill(soft_official_shapes((64, 128, 320, 512), (2, 4, 10, 16), (1, 2, 3, 2)), seed=4)
    model = timm.create_model('softpp_tiny_official_224')
    converted, notes = convert_state_dict('soft-official', state, model)
    model.load_state_dict(converted)
    assert notes == []
    torch.testing.assert_close(model.stages[2].blocks[1].attn.conv.weight,
                               state['block3.1.att.mha.attn.Qlandmark_op.weight'].permute(0, 2, 3, 1).float())
    torch.testing.assert_close(model.stages[3].blocks[0].attn.qkv.bias,
                               torch.cat([state['block4.0.attn.q.bias'], state['block4.0.attn.kv.bias']]).float())


# ------------------------------------------------------------------ Sparsifiner and timm's DeiT

def sparsifiner_official_shapes(dim, depth, heads, patches, classes, c=1, p=2, reduce_n=8, reduce_c=2, hidden=4):
    """src/models/sparsifiner.py's Sparsifiner: DeiT's timm names plus blocks.i.attn.mask_predictor
    (proj_c_q, proj_c_k: Linear(head_dim, head_dim // reduce_c), proj_n, proj_back_n: [N, N // reduce_n])."""
    n, hd = patches + 1, dim // heads
    shapes = {'patch_embed.proj.weight': (dim, c, p, p), 'patch_embed.proj.bias': (dim,), 'cls_token': (1, 1, dim),
              'pos_embed': (1, n, dim), 'norm.weight': (dim,), 'norm.bias': (dim,), 'head.weight': (classes, dim),
              'head.bias': (classes,)}
    for i in range(depth):
        pre = f'blocks.{i}'
        shapes.update({f'{pre}.norm1.weight': (dim,), f'{pre}.norm1.bias': (dim,), f'{pre}.norm2.weight': (dim,),
                       f'{pre}.norm2.bias': (dim,), f'{pre}.attn.qkv.weight': (3 * dim, dim),
                       f'{pre}.attn.qkv.bias': (3 * dim,), f'{pre}.attn.proj.weight': (dim, dim),
                       f'{pre}.attn.proj.bias': (dim,), f'{pre}.mlp.fc1.weight': (hidden * dim, dim),
                       f'{pre}.mlp.fc1.bias': (hidden * dim,), f'{pre}.mlp.fc2.weight': (dim, hidden * dim),
                       f'{pre}.mlp.fc2.bias': (dim,),
                       f'{pre}.attn.mask_predictor.proj_c_q.weight': (hd // reduce_c, hd),
                       f'{pre}.attn.mask_predictor.proj_c_q.bias': (hd // reduce_c,),
                       f'{pre}.attn.mask_predictor.proj_c_k.weight': (hd // reduce_c, hd),
                       f'{pre}.attn.mask_predictor.proj_c_k.bias': (hd // reduce_c,),
                       f'{pre}.attn.mask_predictor.proj_n': (n, n // reduce_n),
                       f'{pre}.attn.mask_predictor.proj_back_n': (n, n // reduce_n)})
    return shapes


def test_sparsifiner_official_converts_the_network_and_the_predictor(tmp_path):
    """At keep 1 every key is kept: the logits are the dense DeiT's on the same weights (timm's ViT, whose names the
    public code keeps); the predictor's shapes come from the checkpoint, its bases transposed, its biases named."""
    state = _fill(sparsifiner_official_shapes(64, 4, 4, 16, 10), seed=3)
    save_file({k: v.float() for k, v in state.items()}, str(tmp_path / 'sp.safetensors'))
    model, notes = convert_checkpoint('sparsifiner-official', tmp_path / 'sp.safetensors', 'sparsifiner_digits',
                                      {'keep_ratio': 1.0})
    ours = model.state_dict()
    torch.testing.assert_close(ours['blocks.2.attn.basis.w_down'], state['blocks.2.attn.mask_predictor.proj_n'].t().float())
    torch.testing.assert_close(ours['blocks.2.attn.basis.w_up'], state['blocks.2.attn.mask_predictor.proj_back_n'].t().float())
    torch.testing.assert_close(ours['blocks.0.attn.predictor_q.weight'],
                               state['blocks.0.attn.mask_predictor.proj_c_q.weight'].float())
    for name in ('q', 'k'):                        # the reductions' biases carried over (predictor_bias, issue 34)
        torch.testing.assert_close(ours[f'blocks.1.attn.predictor_{name}.bias'],
                                   state[f'blocks.1.attn.mask_predictor.proj_c_{name}.bias'].float())
    assert not any('proj_c_q.bias' in line for line in notes), notes
    dense = timm.create_model('vit_digits').double().eval()
    dense.load_state_dict({k: v for k, v in _as_loaded(state).items() if 'mask_predictor' not in k})
    x = torch.randn(2, 1, 8, 8, dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(model.double().eval()(x), dense(x), rtol=1e-10, atol=1e-10)


def test_timm_deit_weights_into_sparsifiner_say_the_predictor_is_fresh(tmp_path):
    dense = timm.create_model('vit_digits').eval()
    save_file(dense.state_dict(), str(tmp_path / 'vit.safetensors'))
    model, notes = convert_checkpoint('timm', tmp_path / 'vit.safetensors', 'sparsifiner_digits', {'keep_ratio': 1.0})
    assert any('predictor freshly initialised' in line for line in notes), notes
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), dense(x), rtol=1.3e-6, atol=1e-5)   # float32, same products


# ------------------------------------------------------------------ the folder it writes, and who reads it

@pytest.fixture(scope='module')
def crate_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp('convert')
    state = _fill(crate_official_shapes(1, 2, 64, 4, 4, 16, 16, 10))
    save_file({k: v.float() for k, v in state.items()}, str(root / 'crate.safetensors'))
    assert main(['convert', '--from', 'crate-official', str(root / 'crate.safetensors'), '--model', 'crate_digits',
                 '--output', str(root / 'out')]) == 0
    return root / 'out', state


def test_converted_folder_loads_in_eval_timm_local_dir_and_training(crate_folder, tmp_path, capsys):
    out, state = crate_folder
    assert sorted(p.name for p in out.iterdir()) == ['config.json', 'model.safetensors', 'state.json']
    assert json.loads((out / 'config.json').read_text())['architecture'] == 'crate_digits'
    x = torch.randn(2, 1, 8, 8)
    reference = crate_official_forward({k: v.float() for k, v in state.items()}, x, 2, 4, 4)
    model = timm.create_model(f'local-dir:{out}', pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference, rtol=1e-4, atol=1e-5)      # float32 vs float32 reference
    assert main(['eval', '--checkpoint', str(out)]) == 2                 # converted weights record no data set
    assert 'error: --data:' in capsys.readouterr().err
    assert main(['eval', '--checkpoint', str(out), '--data', 'digits', '--json']) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored['top1'] >= 0 and scored['model'] == 'crate_digits'
    assert scored['weights_origin'].startswith('converted by `structformer convert` from ')   # its 'epoch 0' is none
    for flag in ('--pretrained-path', '--initial-checkpoint'):
        run = tmp_path / flag.strip('-')
        assert main(['train', '--model', 'crate_digits', '--data', 'digits', '--epochs', '1', '--limit-train-batches',
                     '1', flag, str(out), '--output', str(run), '--no-progress']) == 0
        assert f'{flag} ' in capsys.readouterr().out
    # and at another size and class count through timm's loader: the family filter adapts and says so
    adapted = timm.create_model(f'local-dir:{out}', pretrained=True, num_classes=3, img_size=16)
    assert any('grid 4x4 -> 8x8' in line for line in adapted.pretrained_adaptations)
    start = load_file(str(tmp_path / 'pretrained-path' / 'checkpoints' / 'epoch_0000' / 'model.safetensors'))
    torch.testing.assert_close(start['blocks.0.mlp.weight'], state['transformer.layers.0.1.fn.weight'].float(),
                               rtol=0, atol=0)


def test_model_kwargs_name_the_checkpoints_own_channels_and_the_folder_exports_at_them(tmp_path):
    """A checkpoint trained with another channel count than the model's default (timm's --in-chans 3 on an 8-px
    model): --model-kwargs in_chans=3 says what it is (the conversion had refused it, shapes checked against the
    default build first), and the weights folder is loaded, scored and exported at [3, 8, 8], not at the
    registry's [1, 8, 8] (export had traced the registry's input and failed inside the model)."""
    from structformer.export.graphs import example_input
    from structformer.train import load_model
    trained = timm.create_model('crate_digits', in_chans=3, num_classes=3).eval()
    save_file(trained.state_dict(), str(tmp_path / 'rgb.safetensors'))
    model, notes = convert_checkpoint('timm', tmp_path / 'rgb.safetensors', 'crate_digits', {'in_chans': 3},
                                      tmp_path / 'o')
    assert any(line.startswith("in_chans=3: as --model-kwargs asked, the checkpoint's own") for line in notes)
    assert not any('input channels' in line for line in notes)                 # nothing adapted
    loaded, _ = load_model(tmp_path / 'o')
    x = example_input(loaded)
    assert loaded.pretrained_cfg['input_size'] == (3, 8, 8) and x.shape == (2, 3, 8, 8)
    torch.testing.assert_close(loaded(x), trained(x), rtol=0, atol=0)


def test_model_kwargs_the_model_refuses_are_named_not_taken_for_a_checkpoint_mismatch(tmp_path, capsys):
    """A checkpoint of a non-default architecture (one head as wide as the model: no to_out) with --model-kwargs the
    model cannot be built with (a typo; eta with the mm step, which CRATE refuses): the kwargs are the error. Every
    reading of them failed to build, so convert blamed the checkpoint ('20 weights of the model are not in the
    checkpoint ...'), a mismatch with the default 4-head model the user never asked for."""
    shapes = crate_official_shapes(1, 2, 64, 2, 1, 64, 16, 10)
    torch.save(_fill({k: v for k, v in shapes.items() if 'to_out' not in k}), tmp_path / 'c.pth')
    base = ['convert', '--from', 'crate-official', str(tmp_path / 'c.pth'), '--model', 'crate_digits',
            '--output', str(tmp_path / 'o'), '--model-kwargs', 'num_heads=1', 'depth=2']
    for extra, named in ((['dim_hed=64'], "unexpected keyword argument 'dim_hed'"),
                         (['dim_head=64', "sparse_step='mm'", 'eta=0.2'], 'eta=0.2 is the ISTA step size')):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert named in err and 'not in the checkpoint' not in err, err
        assert not (tmp_path / 'o').exists()
    assert main(base + ['dim_head=64']) == 0                   # the same checkpoint, kwargs that build: converted


def test_model_kwargs_adapt_the_converted_weights(tmp_path):
    state = _fill(crate_official_shapes(1, 2, 64, 4, 4, 16, 16, 10))
    torch.save(state, tmp_path / 'c.pth')
    model, notes = convert_checkpoint('crate-official', tmp_path / 'c.pth', 'crate_digits',
                                      {'img_size': 16, 'num_classes': 4, 'in_chans': 3}, tmp_path / 'o')
    assert model.pos_embed.shape == (1, 65, 64) and model.head.out_features == 4
    assert any('input channels 1 -> 3' in line for line in notes)
    assert json.loads((tmp_path / 'o' / 'config.json').read_text())['model_args']['img_size'] in (16, [16, 16])


def test_converted_weights_are_scored_at_their_models_eval_geometry(tmp_path):
    """`eval --checkpoint` of a weights folder (no run, so no data options of its own) on an image form reads the held-out
    images as the model's config says its public code evaluates them (SOFT: crop 0.9 bicubic; CRATE: Resize 256 /
    CenterCrop 224 bilinear), not the forms' generic 0.875 bilinear, which it used whatever the config.json said.
    --data-kwargs still win, and a training run keeps its own options."""
    from structformer.train.scoring_data import checkpoint_data_options
    folder = {'weights_folder': True, 'model': 'soft_tiny_official_224', 'config': {},
              'recipe': {'name': 'soft_tiny_official_224', 'input_size': [3, 224, 224]}}
    options = checkpoint_data_options(folder, 'imagefolder:/data/imagenet')
    assert (options['crop_pct'], options['interpolation']) == (0.9, 'bicubic')
    crate = dict(folder, model='crate_small_patch16_224')
    assert checkpoint_data_options(crate, 'imagenet:/data/in1k')['crop_pct'] == pytest.approx(224 / 256)
    # the public Sparsifiner evaluates as DeiT's build_transform: 256 / 224 bicubic (its config said timm's 0.9)
    sparsifiner = checkpoint_data_options(dict(folder, model='sparsifiner_deit_small_patch16_224'), 'imagenet:/x')
    assert (sparsifiner['crop_pct'], sparsifiner['interpolation']) == (pytest.approx(224 / 256), 'bicubic')
    given = checkpoint_data_options(folder, 'imagefolder:/x', {'crop_pct': 1.0})
    assert (given['crop_pct'], given['interpolation']) == (1.0, 'bicubic')
    assert 'crop_pct' not in checkpoint_data_options(folder, 'digits')          # a tensor form takes no crop
    run = {'model': 'soft_tiny_official_224', 'config': {'data': 'imagefolder:/data/imagenet'}}
    assert 'crop_pct' not in checkpoint_data_options(run, 'imagefolder:/data/imagenet')
    # end to end: the folder convert writes is scored at its model's geometry
    shapes = soft_official_shapes((64, 128, 320, 512), (2, 4, 10, 16), (1, 1, 1, 1), classes=4)
    torch.save({'state_dict': _fill(shapes)}, tmp_path / 's.pth.tar')
    convert_checkpoint('soft-official', tmp_path / 's.pth.tar', 'soft_tiny_official_224', {'depths': (1, 1, 1, 1)},
                       tmp_path / 'o')
    from structformer.train import load_model
    _, state = load_model(tmp_path / 'o')
    options = checkpoint_data_options(state, 'imagefolder:/data/imagenet')
    assert (options['crop_pct'], options['interpolation'], options['img_size']) == (0.9, 'bicubic', 224)
