"""Sparsifiner accounting and pictures (`structformer analyze` on a Sparsifiner model; paper Eq. 2–5, Fig. 5–6)."""
import argparse
import json
import warnings

import pytest
import timm
import torch

from structformer.analysis.cli import add_analyze_arguments, run_analyze
from structformer.analysis.sparsifiner import (a_down_sparsity, attention_recall, layer_maps, mask_density,
                                               measure_sparsifiner, parse_layers, parse_query_patch,
                                               sparsifiner_layers, w_up_sparsity)
from structformer.cli import main
from structformer.errors import UsageError
from structformer.functional.sparsifiner import connectivity_scores
from structformer.hooks import capture
from structformer.models.factory import build_model
from structformer.train.checkpoint import save_checkpoint

CONFIG = {'data': 'digits', 'data_kwargs': {}, 'seed': 0, 'val_fraction': 0.2}


def _model(**kwargs):
    torch.manual_seed(0)
    model = timm.create_model('sparsifiner_digits', **kwargs).eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='.*created at the first forward')
        model(torch.zeros(1, 1, 8, 8))                                   # W_down, W_up get their n = 17 columns
    return model


def _images(b=5):
    return torch.randn(b, 1, 8, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize('keep, dense_row', [(0.25, True), (0.5, False)])
def test_mask_density_is_the_budget(keep, dense_row):
    model = _model(keep_ratio=keep, dense_cls_row=dense_row)
    result = measure_sparsifiner(model, _images(), batch_size=2)     # 3 batches: the averages are weighted
    n, keys = 17, {0.25: 5, 0.5: 9}[keep]
    assert len(result['layers']) == 4
    for row in result['layers']:
        assert row['budget'] == keys and row['budget_fraction'] == keys / n
        assert row['mask_density_sparse_rows'] == pytest.approx(keys / n, abs=1e-12)
        assert row['mask_density_per_head'] == pytest.approx([row['mask_density']] * 4, abs=1e-12)
        whole = (n + (n - 1) * keys) / n ** 2 if dense_row else keys / n
        assert row['mask_density'] == pytest.approx(whole, abs=1e-12)
        assert row['expected_mask_density'] == pytest.approx(whole)
        assert 0 < row['attention_recall'] < 1


def test_maps_reproduce_the_layer():
    """The recomputed A_down gives the layer's own scores (Eq. 1–3) and Ã·V its own output (Eq. 4–6)."""
    model = _model()
    layers = sparsifiner_layers(model)
    for attn in layers.values():
        attn.keep_scores, attn.impl = True, 'masked'
    with torch.no_grad(), capture(model, inputs=list(layers), outputs=list(layers)) as got:
        model(_images())
    for name, attn in layers.items():
        x, out = got.inputs[name][0], got.outputs[name][0]
        with torch.no_grad():
            attn(x)
            maps = layer_maps(attn, x, attn.last_mask)
            scores = connectivity_scores(maps['a_down'], attn.scoring_basis(x)[1], attn.tau, attn.up_threshold)
            torch.testing.assert_close(scores, attn.last_scores)
            torch.testing.assert_close(attn.merge(maps['sparse'] @ attn.project(x)[2]), out)
            assert not torch.allclose(maps['sparse'], maps['dense'])
            torch.testing.assert_close(maps['dense'].sum(-1), torch.ones(5, 4, 17))


def test_recall_is_one_when_every_key_is_kept():
    result = measure_sparsifiner(_model(keep_ratio=1.0), _images())
    for row in result['layers']:
        assert row['mask_density'] == 1.0
        assert row['attention_recall'] == pytest.approx(1.0, abs=1e-6)


def test_recall_by_hand():
    dense = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]).reshape(1, 1, 3, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 1]], dtype=torch.bool).reshape(1, 1, 3, 3)
    assert float(attention_recall(dense, mask, skip_rows=1)) == pytest.approx((0.1 + 0.6) / 2)
    assert float(attention_recall(dense, mask)) == pytest.approx((1.0 + 0.1 + 0.6) / 3)
    assert float(mask_density(mask, 1)) == pytest.approx(2 / 6)


def test_recall_of_a_model_by_hand():
    model = _model()
    attn = model.blocks[1].attn
    result = measure_sparsifiner(model, _images())
    attn.keep_scores, attn.impl = True, 'masked'
    with torch.no_grad(), capture(model, inputs=['blocks.1.attn']) as got:
        model(_images())
    x = got.inputs['blocks.1.attn'][0]
    maps = layer_maps(attn, x, attn.last_mask)
    dense, mask = maps['dense'], maps['mask']
    per_head = []
    for h in range(4):
        rows = [sum(float(dense[b, h, i, j].detach()) for j in range(17) if mask[b, h, i, j]) for b in range(5)
                for i in range(1, 17)]                                   # the dense cls row is not counted
        per_head.append(sum(rows) / len(rows))
    assert result['layers'][1]['attention_recall_per_head'] == pytest.approx(per_head, rel=1e-5)
    assert result['layers'][1]['attention_recall'] == pytest.approx(sum(per_head) / 4, rel=1e-5)
    assert max(per_head) < 1


def test_sparsities_are_direct_counts():
    model = _model()
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.basis.w_up[:3] = 0.005                                      # 3 of 8 rows below the 1e-2 threshold
        attn.basis.w_up[3, :4] = -0.001
    w = attn.basis.w_up.detach()
    count = sum(1 for v in w.flatten().tolist() if abs(v) < attn.up_threshold)
    assert count >= 3 * 17 + 4
    assert w_up_sparsity(w, attn.up_threshold) == count / w.numel()
    result = measure_sparsifiner(model, _images())
    assert result['layers'][0]['w_up_sparsity'] == count / w.numel()
    a_down = torch.tensor([0.01, 0.05, 0.06, 0.88]).reshape(1, 1, 1, 4)
    assert float(a_down_sparsity(a_down, 0.05)) == 0.5                   # ≤ τ is dropped (Eq. 2 keeps > τ)
    # the public code's rule (coef_topk, set by convert --from sparsifiner-official): all but each row's top k
    assert float(a_down_sparsity(a_down, 0.05, coef_topk=1)) == 0.75
    assert float(a_down_sparsity(a_down, 0.05, coef_topk=3)) == 0.25


def test_a_down_sparsity_of_a_top_k_layer_counts_the_top_k():
    model = _model(coef_topk=2)
    n_down = model.blocks[0].attn.basis.n_down
    result = measure_sparsifiner(model, _images())
    assert all(r['coef_topk'] == 2 for r in result['layers'])
    assert all(r['a_down_sparsity'] == pytest.approx(1 - 2 / n_down) for r in result['layers'])


def test_flags_parse():
    assert parse_query_patch(None, 4, 4) == (2, 2)
    assert parse_query_patch('1,3', 4, 4) == parse_query_patch('7', 4, 4) == (1, 3)
    for bad in ('4,0', '16', 'centre', '-1', '1,2,3'):
        with pytest.raises(UsageError, match=r'--query-patch .*ROW,COL with 0 <= ROW < 4'):
            parse_query_patch(bad, 4, 4)
    assert parse_layers(None, 12) == [1, 2, 3, 4, 5, 6] and parse_layers(['3', '1,3'], 4) == [3, 1]
    with pytest.raises(UsageError, match=r'--layers 5: accepted layer numbers 1\.\.4'):
        parse_layers(['5'], 4)


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_analyze_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_writes_pictures_and_numbers(tmp_path, capsys):
    model, recipe = build_model('sparsifiner_digits')              # the recipe records materialize_lazy
    ckpt = save_checkpoint(tmp_path / 'ckpt', model, with_rng=False,
                           state={'model': 'sparsifiner_digits', 'model_kwargs': {}, 'recipe': recipe.to_dict(),
                                  'epoch': 1, 'config': CONFIG})
    out = tmp_path / 'out'
    assert run_analyze(_parse('--checkpoint', str(ckpt), '--num-samples', '6', '--query-patch', '1,2',
                              '--layers', '1', '3', '--output', str(out))) == 0
    record = json.loads((out / 'sparsifiner.json').read_text())
    assert record['query_patch'] == {'row': 1, 'col': 2, 'index': 6, 'token': 7}
    assert record['grid'] == [4, 4] and record['layers_drawn'] == [1, 3] and record['num_samples'] == 6
    assert [r['layer'] for r in record['layers']] == [1, 2, 3, 4]
    assert all(r['mask_density_sparse_rows'] == pytest.approx(5 / 17) for r in record['layers'])
    names = {'sparsifiner_mask_0', 'sparsifiner_mask_1', 'sparsifiner_attention_0', 'sparsifiner_attention_1',
             'sparsifiner_wup_layer1', 'sparsifiner_wup_layer3'}
    assert set(record['figures']) == names
    assert sorted(p.stem for p in out.glob('*.png')) == sorted(names)
    assert all((out / f).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' for f in record['figures'].values())
    assert str(out / 'sparsifiner.json') in capsys.readouterr().out


def test_cli_on_a_sparsified_vit(tmp_path, capsys, monkeypatch):
    """A dense timm ViT converted by the 'sparsify' transform and trained briefly; then a bad --query-patch."""
    monkeypatch.chdir(tmp_path)
    assert main(['train', '--model', 'vit_tiny_patch16_224', '--model-kwargs', 'img_size=8', 'patch_size=2',
                 'depth=2', '--transform', 'sparsify', 'keep_ratio=0.5', '--data', 'digits', '--epochs', '1',
                 '--limit-train-batches', '2', '--no-progress', '--output', 'run']) == 0
    assert main(['analyze', '--checkpoint', 'run', '--num-samples', '4']) == 0
    record = json.loads((tmp_path / 'run' / 'analysis' / 'sparsifiner.json').read_text())
    assert [r['budget'] for r in record['layers']] == [9, 9] and record['query_patch']['index'] == 10
    assert all(r['mask_density_sparse_rows'] == pytest.approx(9 / 17) for r in record['layers'])
    capsys.readouterr()
    assert main(['analyze', '--checkpoint', 'run', '--query-patch', '9,9']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith('structformer analyze: error: --query-patch 9,9: outside the 4x4 patch grid; accepted ROW,COL')
    assert main(['analyze', '--checkpoint', 'run', '--layers', '0']) == 2
    assert '--layers 0: accepted layer numbers 1..2' in capsys.readouterr().err


def test_layers_after_token_pruning():
    """After EViT pruning a layer sees n' < n tokens: density B'/n' on its own tokens, no pictures, no Ã_down."""
    from structformer.models.token_pruning import prune_tokens
    model = prune_tokens(_model(), keep_rate=0.7, layers=(1, 2)).eval()
    result = measure_sparsifiner(model, _images())
    assert [r['num_tokens'] for r in result['layers']] == [17, 17, 14, 12]
    for r, rows in zip(result['layers'], result['rows']):
        n, keys = r['num_tokens'], r['budget']
        assert keys == -(-n // 4) and r['mask_density_sparse_rows'] == pytest.approx(keys / n, abs=1e-12)
        assert (rows is None) == (r['a_down_sparsity'] is None) == (n < 17)


def test_layers_after_pruning_that_keeps_the_token_count():
    """keep 0.9 of 16 patches: 15 kept + 1 fused = as many tokens as before, but not the same ones; the layers
    after it still get no Ã_down (bases of other tokens) and no pictures (the query index is another token)."""
    from structformer.models.token_pruning import prune_tokens
    model = prune_tokens(_model(), keep_rate=0.9, layers=(1,)).eval()
    result = measure_sparsifiner(model, _images())
    assert [r['num_tokens'] for r in result['layers']] == [17, 17, 17, 17]
    assert [rows is None for rows in result['rows']] == [False, False, True, True]
    assert [r['a_down_sparsity'] is None for r in result['layers']] == [False, False, True, True]


def test_measuring_leaves_every_module_mode_and_takes_a_float64_model():
    """measure_sparsifiner put the whole model in eval mode and left it there (a model measured between training
    steps went on without dropout, and its Sparsifiner layers out of their training-only dense stage 1), and fed
    the caller's float32 images to a float64 model (a dtype error in the first layer), unlike measure_layers and
    the CKA features."""
    model = _model()
    model.train()
    model.blocks[0].eval()                                   # a part the caller holds in eval stays so
    modes = {name: m.training for name, m in model.named_modules()}
    reference = measure_sparsifiner(model, _images(), batch_size=2)
    assert {name: m.training for name, m in model.named_modules()} == modes
    wide = measure_sparsifiner(_model().double(), _images(), batch_size=2)
    for a, b in zip(reference['layers'], wide['layers']):
        assert a['mask_density'] == pytest.approx(b['mask_density'], abs=1e-3)
        assert a['attention_recall'] == pytest.approx(b['attention_recall'], abs=1e-3)


def test_cli_refuses_data_the_model_cannot_take(tmp_path, capsys):
    """--data whose images the Sparsifiner model cannot take (16 px for an 8 px model) ended in a traceback from
    inside timm's patch embedding; now one line naming --data, exit 2, no output folder (as for CRATE)."""
    model, recipe = build_model('sparsifiner_digits')
    ckpt = save_checkpoint(tmp_path / 'ckpt', model, with_rng=False,
                           state={'model': 'sparsifiner_digits', 'model_kwargs': {}, 'recipe': recipe.to_dict(),
                                  'epoch': 1, 'config': CONFIG})
    out = tmp_path / 'out'
    status = main(['analyze', '--checkpoint', str(ckpt), '--data', 'synthetic-subspaces', '--num-samples', '4',
                   '--output', str(out)])
    err = capsys.readouterr().err
    assert status == 2 and '--data synthetic-subspaces' in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
