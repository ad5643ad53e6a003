"""The block path without n×n tensors (functional/sparsifiner.py) and `structformer bench sparse-attention`."""
import argparse
import itertools
import json

import pytest
import torch

from structformer.bench.sparse_attention import add_arguments, goal, run as run_bench
from structformer.bench.sparse_flops import dense_mhsa_flops
from structformer.cli import main
from structformer.functional.sparsifiner import (block_gathered_attention, block_indices_to_mask, block_sparse_attention,
                                                 budget, connectivity_scores, low_rank_attention, masked_attention,
                                                 pooled_block_scores, topk_indices)


def _qkv(n, heads=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, n, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]


@pytest.mark.parametrize('n, block_size, dense_rows',
                         [(16, 4, 0), (19, 4, 1), (23, 8, 1), (5, 8, 0), (5, 8, 1), (16, 4, 2), (2, 4, 2),
                          (6, 4, 5), (13, 4, 13), (1, 4, 0), (9, 1, 3)])   # dense rows into the partial tile / all
def test_block_gathered_attention_equals_masked_attention_with_gradients(n, block_size, dense_rows):
    q, k, v = _qkv(n)
    tiles = -(-n // block_size)
    g = torch.Generator().manual_seed(1)
    indices = torch.rand(2, 2, tiles, tiles, generator=g).topk(budget(tiles, 0.5), dim=-1).indices
    mask = block_indices_to_mask(indices, n, block_size, dense_rows)
    grad = torch.randn(2, 2, n, 8, dtype=torch.float64, generator=g)
    got = block_gathered_attention(q, k, v, indices, block_size, dense_rows=dense_rows)
    want = masked_attention(q, k, v, mask)
    # float64, softmax and sums over <= n keys in another order: ~1e-15; 1e-12 (the default 1e-7 is float32-sized)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('n, block_size, dense_rows', [(16, 4, 0), (19, 4, 1), (5, 8, 2), (7, 10 ** 12, 1)])
def test_block_indices_to_mask_is_each_tokens_tile(n, block_size, dense_rows):
    """Query i sees key j where j's tile is among i's tile's kept tiles (the first `dense_rows` rows see all): the
    obvious loop. A block size far above n (one tile) builds the n × n mask, not the padded tile square."""
    tiles = -(-n // block_size)
    g = torch.Generator().manual_seed(2)
    indices = torch.rand(2, 3, tiles, tiles, generator=g).topk(budget(tiles, 0.5), dim=-1).indices
    want = torch.zeros(2, 3, n, n, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(2), range(3), range(n), range(n)):
        want[b, h, i, j] = i < dense_rows or bool((indices[b, h, i // block_size] == j // block_size).any())
    assert torch.equal(block_indices_to_mask(indices, n, block_size, dense_rows), want)


# a head's gathered K and V here: 2 · batch 2 · 5 tiles · 2 kept · 4 tokens · d 8 · 8 bytes = 10240
@pytest.mark.parametrize('budget_bytes, chunks', [(1, 3), (2 * 10240, 2)])      # 1 head each; 2 + 1 heads
def test_block_gathered_attention_in_head_chunks_equals_masked_attention(monkeypatch, budget_bytes, chunks):
    """Heads run in chunks of `GATHER_BYTES_PER_CHUNK` (here 1 head, or 2 of 3 with a short last chunk): the
    same outputs and gradients as the masked reference."""
    from structformer.functional import sparsifiner
    monkeypatch.setattr(sparsifiner, 'GATHER_BYTES_PER_CHUNK', budget_bytes)
    calls = []
    chunk = sparsifiner._block_gathered_chunk
    monkeypatch.setattr(sparsifiner, '_block_gathered_chunk', lambda q, *a: calls.append(q.shape[1]) or chunk(q, *a))
    n, bs, dense_rows = 19, 4, 1
    q, k, v = _qkv(n, heads=3)
    tiles = -(-n // bs)
    g = torch.Generator().manual_seed(3)
    indices = torch.rand(2, 3, tiles, tiles, generator=g).topk(budget(tiles, 0.4), dim=-1).indices
    got = block_gathered_attention(q, k, v, indices, bs, dense_rows=dense_rows)
    want = masked_attention(q, k, v, block_indices_to_mask(indices, n, bs, dense_rows))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)            # float64: as the test above
    assert len(calls) == chunks and sum(calls) == 3
    grad = torch.randn(2, 3, n, 8, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_pooled_block_scores_are_the_tile_means_of_the_scores():
    """Full key tiles: the mean of S over the tile. The partial last key tile (r = 3 of 4 keys): its mean shrunk
    toward the mean over all keys of those queries, μ + √(r/bs)·(mean − μ) (`_key_tile_pooling`, issue 34)."""
    n, p, bs = 19, 5, 4                                  # 19 = 4·4 + 3: a partial last tile
    q, k, _ = _qkv(n)
    w_down, w_up = torch.randn(p, n, dtype=torch.float64), torch.randn(p, n, dtype=torch.float64)
    a_down = low_rank_attention(q, k, w_down)
    scores = connectivity_scores(a_down, w_up, 0.1, 0.3)
    tiles = pooled_block_scores(a_down, w_up, 0.1, 0.3, bs)
    edges = list(range(0, n, bs)) + [n]
    for i in range(len(edges) - 1):
        rows = scores[..., edges[i]:edges[i + 1], :]
        for j in range(len(edges) - 1):
            tile = rows[..., edges[j]:edges[j + 1]].mean(dim=(-2, -1))
            if j == len(edges) - 2:
                overall = rows.mean(dim=(-2, -1))
                tile = overall + (3 / 4) ** 0.5 * (tile - overall)
            torch.testing.assert_close(tiles[..., i, j], tile)


@pytest.mark.parametrize('head_dim', [8, 6])                 # 6: a scale that is not a power of two
def test_predictor_equals_eq_1_to_3_written_out_with_gradients(head_dim):
    """`low_rank_attention` (scale folded into the n_down keys) and `connectivity_scores` (F.threshold) against
    Eq. 1–3 as printed: softmax(Q (W_down K)ᵀ / √d), then Ã_down = A_down ⊙ 1[A_down > τ], then Ã_down · W̃_up."""
    n, p, tau, t = 13, 5, 0.15, 0.3
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 3, n, head_dim, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w_down, w_up = (torch.randn(p, n, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    a_down = low_rank_attention(q, k, w_down)
    got = connectivity_scores(a_down, w_up, tau, t)
    k_down = torch.stack([torch.stack([w_down @ k[b, h] for h in range(3)]) for b in range(2)])
    want_a = torch.softmax(q @ k_down.transpose(-2, -1) / head_dim ** 0.5, dim=-1)
    want = (want_a * (want_a > tau)) @ (w_up * (w_up.abs() >= t))
    assert (want_a > tau).any() and (want_a <= tau).any()      # both sides of τ are exercised
    torch.testing.assert_close(a_down, want_a)
    torch.testing.assert_close(got, want)
    upstream = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (q, k, w_down, w_up), upstream),
                    torch.autograd.grad(want, (q, k, w_down, w_up), upstream)):
        torch.testing.assert_close(a, b)


def test_block_sparse_attention_is_masked_attention_on_its_top_tiles():
    n, p, bs, keep = 21, 4, 4, 0.4
    q, k, v = _qkv(n)
    w_down, w_up = torch.randn(p, n, dtype=torch.float64), torch.randn(p, n, dtype=torch.float64)
    got = block_sparse_attention(q, k, v, w_down, w_up, 0.05, 1e-2, keep, bs, dense_rows=1)
    tiles = pooled_block_scores(low_rank_attention(q, k, w_down), w_up, 0.05, 1e-2, bs)
    mask = block_indices_to_mask(topk_indices(tiles, budget(tiles.shape[-1], keep)), n, bs, 1)
    torch.testing.assert_close(got, masked_attention(q, k, v, mask))
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(masked_attention(q, k, v, mask).sum(), (q, k, v))):
        torch.testing.assert_close(a, b)


def _args(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_smoke_run_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / 'sparse.json'
    args = _args('--tokens', '20', '--keep', '0.25', '--dim', '16', '--heads', '2', '--block-size', '8',
                 '--repeats', '1', '--warmup', '0', '--threads', '1', '--paths', 'masked', 'gather', 'block',
                 'block-gather', '--json', str(out))
    assert run_bench(args) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.split()[:2] == ['n', 'keep'])
    assert header.split() == ['n', 'keep', 'B', 'density', 'path', 'ms', 'vs', 'SDPA', 'FLOPs', 'vs', 'dense', 'note']
    assert 'goal: at n=577 keep 0.25, MHSA time with the predictor included ≤ 0.6× fused dense SDPA: n/a' in text
    rows = json.loads(out.read_text())['rows']
    assert [r['path'] for r in rows] == ['masked', 'gather', 'block', 'block-gather', 'dense SDPA',
                                         'block-gather core', 'dense SDPA core']
    for r in rows:
        assert r['ms'] > 0 and r['vs_dense'] > 0 and r['flops_vs_dense'] > 0
    assert rows[1]['flops_vs_dense'] == rows[0]['flops_vs_dense']          # the same sparse count
    # the attention-alone count is the module's count less the projections both modules run
    n, dim = 20, 16
    dense, projections = dense_mhsa_flops(n, dim, 2, 8), 2 * n * dim * 3 * dim + 2 * n * dim * dim
    module, core = rows[3]['flops_vs_dense'], rows[5]['flops_vs_dense']
    assert module * dense == pytest.approx(projections + core * (dense - projections))
    assert rows[6]['vs_dense'] == 1.0 and rows[6]['flops_vs_dense'] == 1.0
    # the realised key density beside the nominal keep: the token paths keep B = 5 keys per sparse row; the block
    # paths keep ⌈5 / 8⌉ = 1 tile of 8 (or the partial tile of 4) per query tile, the cls row dense
    assert rows[0]['density'] == rows[1]['density'] == pytest.approx((19 * 5 + 20) / 400)
    for r in (rows[2], rows[3], rows[5]):
        assert (19 * 4 + 20) / 400 <= r['density'] <= (19 * 8 + 20) / 400 and r['density'] == r['nnz'] / 400
    assert rows[4]['density'] == 1.0
    # the attention alone split into its two parts, each timed against SDPA in the same rounds
    core_row = rows[5]
    assert core_row['predictor_ms'] > 0 and core_row['tiles_ms'] > 0
    assert core_row['predictor_vs_dense'] > 0 and core_row['tiles_vs_dense'] > 0
    assert f"predictor {core_row['predictor_vs_dense']:.2f}× + tiles {core_row['tiles_vs_dense']:.2f}×" in core_row['note']


@pytest.mark.parametrize('impl', ['gather', 'kernel'])
def test_the_timed_parts_of_the_attention_compose_to_it(impl):
    """`core_parts`: the predictor's tiles, then the attention on them, is the core the goal times (the same function
    of q, k, v), so the two parts' times split that core."""
    from structformer.bench.sparse_attention import _block_core, _configure, core_parts
    from structformer.functional import tile_kernel
    from structformer.layers.attention.sparsifiner import SparsifinerAttention
    if impl == 'kernel' and not tile_kernel.available():
        pytest.skip(f'the tile kernel does not exist here: {tile_kernel.unavailable_reason()}')
    torch.manual_seed(0)
    layer = SparsifinerAttention(32, 2, qkv_bias=True, seq_len=37, block_size=8, basis_init='scaled').eval()
    _configure(layer, f'block-{impl}', 0.3)
    with torch.no_grad():
        q, k, v = layer.project(torch.randn(2, 37, 32))
        predict, attend = core_parts(layer, q, k, v)
        tiles = predict()
        assert tiles.shape[-1] == 2 and tiles.dtype == torch.long        # ⌈⌈0.3 · 37⌉ / 8⌉ = 2 of 5 key tiles
        torch.testing.assert_close(attend(tiles), _block_core(layer, q, k, v, layer.impl))


def test_every_module_row_is_paired_with_dense_sdpa(tmp_path, monkeypatch):
    """Each path is timed round by round against the dense module (`paired_ratios`), not against one dense median
    taken before it: the reported ratio is the pairing's, and the dense row is the median of its pairings."""
    import structformer.bench.sparse_attention as bench
    calls = []

    def fake_paired(fns, reference, rounds, warmup, device):
        (label,) = [k for k in fns if k != reference]
        calls.append((reference, label, rounds))
        for fn in fns.values():
            fn()                                       # the callables run
        dense_s = 0.010 * len(calls)                   # 10, 20, 30 ms: the dense row must be their median
        return {reference: {'median_s': dense_s, 'ratio': 1.0, 'ratio_q1': 1.0, 'ratio_q3': 1.0},
                label: {'median_s': 0.004, 'ratio': 2.5, 'ratio_q1': 2.0, 'ratio_q3': 4.0}}

    monkeypatch.setattr(bench, 'paired_ratios', fake_paired)
    out = tmp_path / 'sparse.json'
    args = _args('--tokens', '20', '--keep', '0.25', '--dim', '16', '--heads', '2', '--block-size', '8',
                 '--repeats', '3', '--warmup', '0', '--threads', '1', '--paths', 'masked', 'gather', 'block',
                 '--json', str(out))
    assert bench.run(args) == 0
    assert calls == [('dense SDPA', 'masked', 3), ('dense SDPA', 'gather', 3), ('dense SDPA', 'block', 3)]
    rows = {r['path']: r for r in json.loads(out.read_text())['rows']}
    for path in ('masked', 'gather', 'block'):
        assert rows[path]['vs_dense'] == pytest.approx(0.4)
        assert (rows[path]['vs_dense_q1'], rows[path]['vs_dense_q3']) == pytest.approx((0.25, 0.5))
        assert rows[path]['ms'] == pytest.approx(4.0)
    assert rows['dense SDPA']['ms'] == pytest.approx(20.0)


def test_goal_judges_the_attention_alone_and_the_whole_module_each_on_its_fastest_path():
    base = {'tokens': 577, 'keep': 0.25, 'keys': 145, 'note': ''}
    rows = [dict(base, path='masked', ms=30.0, vs_dense=3.0, flops_vs_dense=0.81),
            dict(base, path='block-gather', ms=10.0, vs_dense=1.0, flops_vs_dense=0.69),
            dict(base, path='dense SDPA', ms=10.0, vs_dense=1.0, flops_vs_dense=1.0),
            dict(base, path='block-kernel core', ms=3.5, vs_dense=0.7, flops_vs_dense=0.3),
            dict(base, path='dense SDPA core', ms=5.0, vs_dense=1.0, flops_vs_dense=1.0),
            dict(base, path='block-gather core', ms=2.5, vs_dense=0.5, flops_vs_dense=0.3),
            dict(base, path='dense SDPA core', ms=5.0, vs_dense=1.0, flops_vs_dense=1.0)]
    verdict = goal(rows, train=False)
    assert verdict['path'] == 'block-gather' and verdict['ratio'] == 1.0 and not verdict['met']
    assert verdict['core_path'] == 'block-gather' and verdict['core_ratio'] == 0.5 and verdict['core_met']
    lines = verdict['line'].splitlines()
    assert 'attention alone' in lines[1] and lines[1].endswith('met (0.50×, block-gather)')
    assert 'whole module' in lines[2] and lines[2].endswith('not met (1.00×, block-gather)')


@pytest.mark.parametrize('argv, message', [
    (['--keep', '0'], '--keep must be ratios in (0, 1]'), (['--keep', '1.5'], '--keep must be ratios in (0, 1]'),
    (['--tokens', '1'], '--tokens must be integers >= 2'), (['--paths', 'sideways'], '--paths: unknown'),
    (['--dtype', 'float16'], '--dtype must be one of float32, bfloat16'), (['--device', 'tpu'], '--device must be cpu or cuda')])
def test_bad_arguments_are_one_clear_line(argv, message, capsys):
    assert main(['bench', 'sparse-attention', *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('structformer bench sparse-attention: error:') and message in err and '\n' not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the message on a machine without CUDA')
def test_device_cuda_without_a_gpu_is_refused(capsys):
    assert main(['bench', 'sparse-attention', '--device', 'cuda']) == 2
    assert '--device cuda: no CUDA device is available here' in capsys.readouterr().err


def test_block_flex_rows_and_bfloat16(tmp_path, capsys):
    """block-flex (CPU eager here) times the same function as block-gather; bfloat16 rows run."""
    out = tmp_path / 'sparse.json'
    args = _args('--tokens', '20', '--keep', '0.5', '--dim', '16', '--heads', '2', '--block-size', '8',
                 '--repeats', '1', '--warmup', '0', '--threads', '1', '--paths', 'block-gather', 'block-flex',
                 '--dtype', 'bfloat16', '--json', str(out))
    assert run_bench(args) == 0
    assert 'bfloat16' in capsys.readouterr().out
    rows = {r['path']: r for r in json.loads(out.read_text())['rows']}
    assert rows['block-flex']['ms'] > 0 and 'materialises' in rows['block-flex']['note']
    assert rows['block-flex']['flops_vs_dense'] == rows['block-gather']['flops_vs_dense']


def test_goal_on_cuda_names_the_fastest_path_without_a_verdict():
    base = {'tokens': 577, 'keep': 0.25, 'keys': 145, 'note': ''}
    rows = [dict(base, path='flex', ms=3.0, vs_dense=3.0, flops_vs_dense=0.81),
            dict(base, path='block-flex', ms=2.0, vs_dense=2.0, flops_vs_dense=0.69)]
    verdict = goal(rows, train=False, device='cuda')
    assert verdict['met'] is None and verdict['path'] == 'block-flex'
    assert 'the fastest path is block-flex at 2.00× dense SDPA' in verdict['line']


def test_block_kernel_rows_in_inference_and_training(tmp_path):
    """block-kernel times the block path's function on the CPU kernel: a module row and an attention-alone row,
    with block-gather's FLOP counts; with --train the module rows (forward + backward)."""
    from structformer.functional import tile_kernel
    if not tile_kernel.available():
        pytest.skip(f'the tile kernel does not exist here: {tile_kernel.unavailable_reason()}')
    out = tmp_path / 'sparse.json'
    common = ('--tokens', '20', '--keep', '0.5', '--dim', '16', '--heads', '2', '--block-size', '8', '--repeats', '1',
              '--warmup', '0', '--threads', '1', '--paths', 'block-gather', 'block-kernel', '--json', str(out))
    assert run_bench(_args(*common)) == 0
    rows = json.loads(out.read_text())['rows']
    assert [r['path'] for r in rows] == ['block-gather', 'block-kernel', 'dense SDPA', 'block-gather core',
                                         'dense SDPA core', 'block-kernel core', 'dense SDPA core']
    assert all(r['ms'] > 0 for r in rows)
    assert rows[1]['flops_vs_dense'] == rows[0]['flops_vs_dense'] and rows[5]['flops_vs_dense'] == rows[3]['flops_vs_dense']
    assert run_bench(_args('--train', *common)) == 0
    rows = {r['path']: r for r in json.loads(out.read_text())['rows']}
    assert rows['block-gather']['ms'] > 0 and rows['block-kernel']['ms'] > 0 and rows['dense SDPA']['ms'] > 0


def test_the_docs_quote_the_committed_split_of_the_attention_time():
    """docs/sparsifiner.md's predictor / tiles split is its record's (docs/sparsifiner/cpu_577_t1_parts.json)."""
    from pathlib import Path
    docs = Path(__file__).resolve().parents[1] / 'docs'
    record = json.loads((docs / 'sparsifiner' / 'cpu_577_t1_parts.json').read_text())
    row = next(r for r in record['rows'] if r['path'] == 'block-kernel core')
    assert record['machine_load']['busy'] is False and record['environment']['threads'] == 1
    page = ' '.join((docs / 'sparsifiner.md').read_text().split())
    assert (f"predictor took {row['predictor_vs_dense']:.2f}× and the tiles {row['tiles_vs_dense']:.2f}× SDPA's time "
            f"({row['vs_dense']:.2f}× together" in page)
