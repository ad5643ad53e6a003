"""Mixer-family analysis: design helpers, init spectra, CKA, the effective weights of a model's layers,
`bench mlp` and `analyze --cka` end to end."""
import argparse
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from structformer.analysis.cka import MinibatchCKA, hsic_unbiased, hsic_unbiased_reference, linear_cka, minibatch_cka
from structformer.cli import main
from structformer.models.mixer_design import fixed_omega_pairs, omega, optimal_width, sw_density, sw_width, tokens_for_omega
from structformer.analysis.mixer_spectra import (gaussian_weight, init_spectrum_sweep, largest_singular_value,
                                        sparse_masked_weight)
from structformer.models.mixer import SparseMixer


def test_fixed_omega_pairs_reproduce_the_papers_tables():
    """App. C: the (C, S) pairs at Ω = 2¹⁸ and 2²¹ (γ = 1, S-Mixer), Fig. 4's S at Ω = 2¹⁹, γ = 2, SW-MLP widths."""
    assert [(r['channels'], r['tokens']) for r in fixed_omega_pairs(2 ** 18, [16, 32, 48, 83, 113, 173])] == \
        [(16, 173), (32, 113), (48, 83), (83, 48), (113, 32), (173, 16)]
    assert [r['tokens'] for r in fixed_omega_pairs(2 ** 21, [16, 32, 64, 226, 346, 504])] == [504, 346, 226, 64, 32, 16]
    assert [r['tokens'] for r in fixed_omega_pairs(2 ** 19, [4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 64], 2.0)] \
        == [360, 252, 203, 173, 152, 136, 124, 113, 104, 96, 89, 83, 64]
    assert [round(sw_width(2 ** 18, p)) for p in (0.9, 0.7, 0.5, 0.3, 0.1)] == [540, 612, 724, 935, 1619]


def test_design_identities():
    S = tokens_for_omega(5000.0, 12, 2.0)
    assert omega(S, 12, 2.0) == pytest.approx(5000.0)
    best = optimal_width(2.0 * 40 ** 3, 2.0)
    assert best['channels'] == pytest.approx(40) and best['width'] == pytest.approx(1600)
    assert omega(40, 40, 2.0) == pytest.approx(2.0 * 40 ** 3)
    # at fixed Ω no pair is wider than C = S
    assert max(r['width'] for r in fixed_omega_pairs(2.0 * 40 ** 3, range(5, 200, 5), 2.0)) <= 1600 * 1.01
    assert sw_density(omega(64, 48, 2.0), 64 * 48, 2.0) * 2.0 * (64 * 48) ** 2 == pytest.approx(omega(64, 48, 2.0))
    with pytest.raises(ValueError, match='too narrow'):
        sw_density(1e9, 10, 1.0)
    with pytest.raises(ValueError, match='channels must be positive integers'):
        fixed_omega_pairs(1e5, [0])


def test_largest_singular_value_matches_the_dense_norm():
    rng = np.random.default_rng(0)
    dense = gaussian_weight(30, 20, rng)
    assert largest_singular_value(dense) == pytest.approx(np.linalg.norm(dense, 2), rel=1e-8)
    sparse = sparse_masked_weight(40, 25, 0.2, rng)
    assert largest_singular_value(sparse) == pytest.approx(np.linalg.norm(sparse.toarray(), 2), rel=1e-8)
    assert abs(sparse.nnz / (40 * 25) - 0.2) < 0.08


def test_init_spectra_follow_section_4_3():
    """Mixer weights sit near 1 + √γ; SW-MLP's largest singular value grows with width at fixed Ω and
    lies above the Mixer's edge (Eq. 16–18). Ω small enough that the growth is large."""
    rows = init_spectrum_sweep(omega_=2 ** 14, gamma=2.0, channels=(4, 16, 24), trials=3, seed=0)
    edge = 1 + 2 ** 0.5
    for r in rows:
        assert abs(r['mixer_token'] - edge) < 0.35 * edge
    sw = [r['sw_mlp'] for r in rows]
    assert sw[0] < sw[1] < sw[2] and sw[-1] > edge


def test_hsic_closed_form_equals_the_u_statistic():
    torch.manual_seed(0)
    x, y = torch.randn(7, 3, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    k, l = x @ x.t(), y @ y.t()
    assert float(hsic_unbiased(k, l)) == pytest.approx(hsic_unbiased_reference(k, l), rel=1e-10, abs=1e-12)


def test_cka_invariances_and_independence():
    torch.manual_seed(1)
    x = torch.randn(64, 10, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(10, 10, dtype=torch.float64))
    assert linear_cka(x, 3.0 * x @ q) == pytest.approx(1.0)
    meter = MinibatchCKA(1, 2)
    for _ in range(4):
        x = torch.randn(32, 10, dtype=torch.float64)
        meter.update([x], [5.0 * x @ q, torch.randn(32, 10, dtype=torch.float64)])
    cka = meter.compute()
    assert cka[0, 0] == pytest.approx(1.0) and abs(cka[0, 1]) < 0.1


def test_cka_where_a_summed_self_hsic_is_not_positive_is_nan():
    """A block without variance over the samples has a summed unbiased self-HSIC of rounding size, zero or below;
    CKA is 0/0 there. The accumulated sums are set as such a run leaves them (one exactly 0, one -1e-17): the
    clamped root turned the 0 row's pairs into cross·1e300 (5e137, 1e280) instead of undefined; defined pairs stay."""
    meter = MinibatchCKA(3, 2)
    meter.update([torch.randn(8, 3)] * 3, [torch.randn(8, 3)] * 2)
    meter.self_a[:] = torch.tensor([0.0, -1e-17, 4.0], dtype=torch.float64)
    meter.self_b[:] = torch.tensor([9.0, 1e-200], dtype=torch.float64)       # tiny but positive: defined
    meter.cross[:] = torch.tensor([[5e-163, 1e-20], [1e-18, -1e-17], [3.0, 1e-100]], dtype=torch.float64)
    cka = meter.compute()
    assert cka[:2].isnan().all() and not cka[2].isnan().any()
    assert cka[2, 0] == pytest.approx(0.5) and cka[2, 1] == pytest.approx(0.5)


def test_minibatch_cka_of_a_model_with_itself_is_one_on_the_diagonal():
    torch.manual_seed(2)
    model = SparseMixer(img_size=8, patch_size=2, in_chans=1, embed_dim=8, depth=3)
    result = minibatch_cka(model, model, [torch.randn(16, 1, 8, 8) for _ in range(3)])
    torch.testing.assert_close(torch.diagonal(result['cka']), torch.ones(3, dtype=torch.float64))


def test_effective_weight_of_a_model_layer_is_the_wide_sparse_mlp():
    """The S-Mixer block's token mixing, materialised from its PK layer, is I_C ⊗ W up to the J_c
    shuffles, with non-zero fraction 1/C; applying the dense matrices reproduces the block (Prop. 3.2)."""
    torch.manual_seed(3)
    model = SparseMixer(img_size=8, patch_size=2, in_chans=1, embed_dim=6, depth=1).double()
    block = model.blocks[0]
    token = block.mlp_tokens.fc1.to_dense()                       # [m, m], m = S·C = 96
    channel = block.mlp_channels.fc1.to_dense()
    assert token.shape == (96, 96) and (token != 0).double().mean().item() == pytest.approx(1 / 6)
    assert (channel != 0).double().mean().item() == pytest.approx(1 / 16)
    # the paper's Eq. 4-5 have no mixing biases; `mixing_bias=True` adds them as a vector over the m units
    assert block.mlp_tokens.fc1.dense_bias() is None and block.mlp_channels.fc1.dense_bias() is None
    X = torch.randn(2, 16, 6, dtype=torch.float64)
    u = X.reshape(2, -1) + F.gelu(block.norm1(X).reshape(2, -1) @ token.t())
    U = u.reshape(2, 16, 6)
    y = u + F.gelu(block.norm2(U).reshape(2, -1) @ channel.t())
    torch.testing.assert_close(block(X).reshape(2, -1), y)

    biased = SparseMixer(img_size=8, patch_size=2, in_chans=1, embed_dim=6, depth=1, mixing_bias=True).double()
    block = biased.blocks[0]
    token, channel = block.mlp_tokens.fc1.to_dense(), block.mlp_channels.fc1.to_dense()
    u = X.reshape(2, -1) + F.gelu(block.norm1(X).reshape(2, -1) @ token.t() + block.mlp_tokens.fc1.dense_bias())
    U = u.reshape(2, 16, 6)
    y = u + F.gelu(block.norm2(U).reshape(2, -1) @ channel.t() + block.mlp_channels.fc1.dense_bias())
    torch.testing.assert_close(block(X).reshape(2, -1), y)


def test_bench_mlp_runs_and_reports_the_goals(tmp_path, capsys, monkeypatch):
    from structformer.bench import mlp
    # in this process: the fresh-process harness has its own tests, and ten interpreters cost half a minute
    monkeypatch.setattr(mlp, '_subprocess', lambda target, *a: getattr(mlp, target.split(':')[1])(*a))
    p = argparse.ArgumentParser()
    mlp.add_arguments(p)
    args = p.parse_args(['--side', '8', '--batch-size', '16', '--model-batch-size', '4', '--repeats', '1', '--img-size', '8',
                         '--rounds', '1', '--output', str(tmp_path)])
    assert mlp.run(args) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / 'mlp.json').read_text())
    assert [r['layer'] for r in result['layers']] == list(mlp.LAYERS)
    by_name = {r['model']: r for r in result['models']}
    assert result['goals']['memory_ratio'] == pytest.approx(
        by_name['swmlp_cifar']['blocks_bytes'] / by_name['rp_mixer_cifar']['blocks_bytes'])
    assert '(a) SW-MLP / RP-Mixer block storage' in out and 'ImageNet SW-MLP is not built' in out
    goal_a = next(line for line in out.splitlines() if '(a) SW-MLP' in line)   # measured at 8 px: no verdict
    assert 'measured at 8 px' in goal_a and 'no verdict' in goal_a and 'MET' not in goal_a
    dense = next(r for r in result['layers'] if r['layer'] == 'dense')
    pk = next(r for r in result['layers'] if r['layer'] == 'pk_random')
    assert dense['macs_per_row'] == 64 * 64 and pk['macs_per_row'] == 64 * 64 / 8


def test_bench_mlp_a_failed_measurement_is_a_failed_row_not_a_traceback(tmp_path, capsys, monkeypatch):
    """A measurement subprocess that died (here SW-MLP's, as for memory) ended `bench mlp` in a traceback and lost
    the other rows; now the others are measured and listed, the failure is a FAILED row with its error line, no
    goal is judged and the exit status is 1, as `bench attention` does."""
    from structformer.bench import mlp
    from structformer.bench.harness import MeasurementFailed
    calls = []

    def fake(target, *a):
        calls.append(a[0])
        if a[0] == 'swmlp_cifar':
            raise MeasurementFailed("measurement subprocess killed by SIGKILL: ...\nRuntimeError: out of memory", -9)
        return {'step_s': 0.002, 'threads': 1}
    monkeypatch.setattr(mlp, '_subprocess', fake)
    p = argparse.ArgumentParser()
    mlp.add_arguments(p)
    args = p.parse_args(['--side', '8', '--rounds', '1', '--output', str(tmp_path)])
    assert mlp.run(args) == 1
    out = capsys.readouterr().out
    assert calls == list(mlp.LAYERS) + list(mlp.MODELS)              # measured past the failure, no paired timing
    assert 'swmlp_cifar     FAILED: RuntimeError: out of memory' in out and 'goals: not judged' in out
    assert 'rp_mixer_cifar  measured' in out and not (tmp_path / 'mlp.json').exists()


def test_analytic_table_s3_matches_the_papers_imagenet_scale():
    from structformer.bench.mlp import IMAGENET, analytic_resources
    table = analytic_resources(**IMAGENET)
    # the paper: ≈ 23.2 TB for SW-MLP (16 bytes per float32 weight: weight, gradient, two Adam moments),
    # ≈ 26.3 M for RP-Mixer at S = 256, C = 588, L = 8, γ = 4
    assert 16 * table['sw_mlp']['weights'] == pytest.approx(23.2e12, rel=0.005)
    assert table['sw_mlp']['train_bytes'] == 16 * table['sw_mlp']['weights'] + table['sw_mlp']['bytes'] - \
        4 * table['sw_mlp']['weights']
    assert table['rp_mixer']['weights'] == pytest.approx(26.3e6, rel=0.01)


def test_analyze_cka_between_two_runs(tmp_path, capsys):
    for name in ('mixer_digits', 'swmlp_digits'):
        assert main(['train', '--model', name, '--data', 'digits', '--epochs', '1', '--limit-train-batches', '1',
                     '--output', str(tmp_path / name), '--no-progress']) == 0
    out = tmp_path / 'cka'
    assert main(['analyze', '--checkpoint', str(tmp_path / 'mixer_digits'), '--cka', str(tmp_path / 'swmlp_digits'),
                 '--num-samples', '64', '--cka-batch-size', '32', '--output', str(out)]) == 0
    record = json.loads((out / 'cka.json').read_text())
    assert len(record['cka']) == 4 and len(record['cka'][0]) == 2 and record['samples'] == 64
    assert record['diagonal_mean'] is None                       # 4 × 2: no diagonal to average
    # which held-out images: the analysis seed, the split and its indices (the white-box record says them too)
    assert record['seed'] == 0 and record['data_seed'] == 0 and len(record['sample_indices']) == 64
    assert all(-0.2 < v <= 1.0 + 1e-9 for row in record['cka'] for v in row)
    assert main(['analyze', '--checkpoint', str(tmp_path / 'mixer_digits'), '--cka', str(tmp_path / 'mixer_digits'),
                 '--num-samples', '64', '--output', str(out)]) == 0
    same = json.loads((out / 'cka.json').read_text())['cka']
    assert all(abs(same[i][i] - 1) < 1e-9 for i in range(4))


def test_design_command_prints_the_fixed_omega_table(capsys):
    assert main(['design', '--omega', '2^18', '--channels', '16', '48', '173', '--json']) == 0
    record = json.loads(capsys.readouterr().out)
    assert [(r['channels'], r['tokens']) for r in record['pairs']] == [(16, 173), (48, 83), (173, 16)]
    assert record['optimal']['channels'] == pytest.approx(64)
    assert [round(r['width']) for r in record['sw_mlp']] == [540, 612, 724, 935, 1619]
    assert main(['design', '--omega', '2^19', '--gamma', '2']) == 0
    assert 'C* = S* = 64.0' in capsys.readouterr().out
    # a C this Ω cannot reach (S = 1 already spends 201 × Ω) is marked, and left out of the default list
    assert main(['design', '--omega', '100', '--channels', '4', '200', '--json']) == 0
    pairs = json.loads(capsys.readouterr().out)['pairs']
    assert [(r['channels'], r['on_curve']) for r in pairs] == [(4, True), (200, False)]
    assert main(['design', '--omega', '2^10']) == 0
    out = capsys.readouterr().out
    assert '!' not in out and '\n   173 ' not in out and '\n    16 ' in out


def test_design_rounds_an_integral_optimum_and_names_the_dropped_channels(capsys):
    """The JSON gave C* = 63.999999999999986 for Ω = 2^18 (an integer up to rounding: now 64; Ω = 2^10's 10.079...
    keeps full precision), and the default C list dropped the C this Ω cannot reach without saying so."""
    assert main(['design', '--omega', '2^18', '--json']) == 0
    record = json.loads(capsys.readouterr().out)
    assert record['optimal'] == {'channels': 64, 'tokens': 64, 'width': 4096} and record['dropped_channels'] == []
    assert main(['design', '--omega', '2^10', '--json']) == 0
    record = json.loads(capsys.readouterr().out)
    assert record['optimal']['channels'] == pytest.approx(2 ** (10 / 3), rel=1e-15) != round(2 ** (10 / 3))
    assert record['dropped_channels'] == [83, 113, 173] and 83 not in [r['channels'] for r in record['pairs']]
    assert main(['design', '--omega', '2^10']) == 0
    assert 'left out of the default C list: 83, 113, 173 (this Ω cannot reach them' in capsys.readouterr().out
    assert main(['design', '--omega', '2^10', '--channels', '16', '173', '--json']) == 0      # given: kept, marked
    record = json.loads(capsys.readouterr().out)
    assert record['dropped_channels'] == [] and [r['on_curve'] for r in record['pairs']] == [True, False]
    assert main(['design', '--omega', '2^64', '--json']) == 0      # m* = 2^(128/3) = 6981463658331.56: not an integer
    width = json.loads(capsys.readouterr().out)['optimal']['width']
    assert width == pytest.approx(2 ** (128 / 3), rel=1e-15) and not isinstance(width, int)


def test_analyze_cka_with_too_few_samples_names_the_flag(tmp_path, capsys):
    """--num-samples 3 with --cka said 'the split has 3', blaming the data for the flag's value."""
    assert main(['analyze', '--checkpoint', str(tmp_path), '--cka', str(tmp_path), '--num-samples', '3',
                 '--output', str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err
    assert err.count('error:') == 1 and "--num-samples 3: --cka's unbiased HSIC needs at least 4 samples" in err
    assert not (tmp_path / 'out').exists()


def test_minibatch_cka_leaves_the_models_mode_and_takes_float64_models():
    """Measuring put a training model into eval mode for good, and float32 images into a float64 model raised."""
    import timm

    import structformer.models  # noqa: F401  (registers the models)
    torch.manual_seed(0)
    mixer, sw = timm.create_model('mixer_digits').double(), timm.create_model('swmlp_digits')
    mixer.train()
    sw.eval()
    result = minibatch_cka(mixer, sw, [torch.randn(8, 1, 8, 8) for _ in range(2)])
    assert mixer.training and not sw.training
    assert result['cka'].shape == (4, 2) and torch.isfinite(result['cka']).all()


def test_design_counts_the_connections_of_a_pair_exactly(capsys):
    """Ω of a pair was a float: at --omega 2^64, C = 1 the table printed 18,446,744,070,963,499,008 for S(S + 1)/2 =
    18,446,744,070,963,499,500. Integer S, C, γ give the exact count; the models built at those widths have it."""
    from structformer.layers.linear import PKLinear
    assert main(['design', '--omega', '2^64', '--channels', '1', '--json']) == 0
    pair = json.loads(capsys.readouterr().out)['pairs'][0]
    S = pair['tokens']
    assert pair['omega'] == S * (S + 1) // 2 == 18_446_744_070_963_499_500
    assert main(['design', '--omega', '2^64', '--channels', '1']) == 0           # the table too (it went through float)
    assert ' 18,446,744,070,963,499,500 ' in capsys.readouterr().out
    assert omega(173, 16, 2.0) == 2 * 16 * 173 * 189 // 2 and isinstance(omega(173, 16, 2.0), int)
    for r in fixed_omega_pairs(2 ** 19, [4, 64], 2.0):           # Fig. 4's widths, built: mean nnz per mixing layer
        with torch.device('meta'):
            model = SparseMixer(num_tokens=r['tokens'], embed_dim=r['channels'], depth=2, mlp_ratio=2.0)
        layers = [m for m in model.blocks[1].modules() if isinstance(m, PKLinear)]
        assert sum(m.num_blocks * m.block_in * m.block_out for m in layers) == 4 * r['omega']


def test_bench_mlp_model_peak_leaves_out_the_flop_count(monkeypatch):
    """`measure_model`'s training peak is read before `model_flops`, which builds a second copy of the model to count
    its FLOPs (for swmlp_cifar, half a gigabyte of dense weights and masks at 32 px): that copy is no part of a
    training step. It was read after, so the SW-MLP's peak carried a second model."""
    from structformer.bench import flops, mlp
    from structformer.bench.harness import _status_mib, reset_peak_rss
    reset_peak_rss()
    if abs(_status_mib('VmHWM') - _status_mib('VmRSS')) > 8:
        pytest.skip('the peak-RSS mark cannot be reset here')

    def counting_model(name, img_size=None):                 # stands for the second model: 256 MiB, touched
        held = torch.ones(64 * 2 ** 20)
        return {'macs': float(held[0])}
    monkeypatch.setattr(flops, 'model_flops', counting_model)
    row = mlp.measure_model('mixer_cifar', 2, 1, threads=1, img_size=8)
    assert row['macs_per_image'] == 1.0 and row['step_peak_mib'] < 128, row


def _branches_by_hand(model, images):
    """The residual branches of Fig. 2 (App. C.1: the layer just before each skip connection), written out:
    Mixer blocks x + f_tok(LN1 x) then u + f_ch(LN2 u), without a skip layer; SW-MLP blocks x + f(LN x)."""
    from structformer.models.mixer import SWMLP
    out = []
    with torch.no_grad():
        x = model.stem(images)
        for block in model.blocks:
            if isinstance(model, SWMLP):
                y = block(x)
                out.append((y - x).reshape(len(x), -1))
            else:
                u = x + block.mlp_tokens(block.norm1(x).reshape(len(x), -1)).reshape(x.shape)
                y = u + block.mlp_channels(block.norm2(u).reshape(len(x), -1)).reshape(x.shape)
                out += [(u - x).reshape(len(x), -1), (y - u).reshape(len(x), -1)]
            x = y
    return out


def test_cka_branches_are_the_features_before_each_skip_connection():
    """Mixer paper Fig. 2 (App. C.1) compares the layer just before the skip connection of each block, token- and
    channel-mixing counted separately (6 for L = 3); `analyze --cka` could only compare block outputs after the
    residual add, L per Mixer. An SW-MLP block with a hidden layer calls its activation twice: the second is the branch."""
    import timm

    import structformer.models  # noqa: F401  (registers the models)
    from structformer.analysis.cka import branch_features, branch_modules
    torch.manual_seed(0)
    images = torch.randn(5, 1, 8, 8)
    mixer = timm.create_model('mixer_digits')
    sw = timm.create_model('swmlp_digits', mlp_ratio=2.0)
    sw.train()
    got = branch_features(sw, images)
    assert sw.training                                          # measuring leaves the caller's mode
    for model, count in ((mixer, 2 * len(mixer.blocks)), (sw, len(sw.blocks))):
        got, want = branch_features(model, images), _branches_by_hand(model.eval(), images)
        assert len(got) == len(want) == count
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    result = minibatch_cka(mixer, sw, [images[:4], torch.randn(4, 1, 8, 8)], features='branches')
    assert result['cka'].shape == (2 * len(mixer.blocks), len(sw.blocks)) and result['features'] == 'branches'
    with pytest.raises(ValueError, match='ViT has neither'):
        branch_modules(timm.create_model('vit_digits'))
    from timm.models.mlp_mixer import MlpMixer                  # timm's own Mixer: its MixerBlocks' two MLPs
    assert branch_modules(MlpMixer(img_size=8, patch_size=4, in_chans=1, embed_dim=8, num_blocks=2)) == [
        'blocks.0.mlp_tokens', 'blocks.0.mlp_channels', 'blocks.1.mlp_tokens', 'blocks.1.mlp_channels']


def test_analyze_cka_features_branches_end_to_end(tmp_path, capsys):
    """--cka-features branches: 2L rows for a Mixer, the record says which features and how they are numbered;
    a model without such branches is refused by name, before any output is written."""
    import timm

    import structformer.models  # noqa: F401
    from structformer.train.checkpoint import save_checkpoint
    config = {'data': 'digits', 'data_kwargs': {}, 'seed': 0, 'val_fraction': 0.2}
    for name in ('mixer_digits', 'vit_digits'):
        save_checkpoint(tmp_path / name, timm.create_model(name),
                        state={'model': name, 'model_kwargs': {}, 'epoch': 1, 'config': config}, with_rng=False)
    out = tmp_path / 'cka'
    assert main(['analyze', '--checkpoint', str(tmp_path / 'mixer_digits'), '--cka', str(tmp_path / 'mixer_digits'),
                 '--cka-features', 'branches', '--num-samples', '16', '--output', str(out)]) == 0
    record = json.loads((out / 'cka.json').read_text())
    depth = len(timm.create_model('mixer_digits').blocks)
    assert record['features'] == 'branches' and len(record['cka']) == len(record['cka'][0]) == 2 * depth
    assert all(abs(record['cka'][i][i] - 1) < 1e-9 for i in range(2 * depth))
    # Fig. 2 (a) plots the mean of this diagonal against the SW-MLP's sparsity (the recipe called it test error)
    assert record['diagonal_mean'] == pytest.approx(sum(record['cka'][i][i] for i in range(2 * depth)) / (2 * depth))
    assert f"A{2 * depth} " in capsys.readouterr().out                      # rows numbered from 1, as the paper's
    assert main(['analyze', '--checkpoint', str(tmp_path / 'mixer_digits'), '--cka', str(tmp_path / 'vit_digits'),
                 '--cka-features', 'branches', '--output', str(tmp_path / 'no')]) == 2
    err = capsys.readouterr().err
    assert err.count('error:') == 1 and "--cka-features branches: --cka" in err and "'vit_digits'" in err
    assert not (tmp_path / 'no').exists()


def test_fig2_recipe_sweeps_an_sw_mlp_with_a_block_per_mixer_branch():
    """App. C.1: the SW-MLP of Fig. 2 replaces each of the Mixer's mixing MLPs (I_C⊗W₁,₂ and W₃,₄ᵀ⊗I_S) by one
    M⊙A block, "6 blocks in total" for L = 3, the 6 branches its CKA pairs; the recipe's sweep said depth=3."""
    import re

    from structformer.train.recipes import load_recipe
    values, about = load_recipe('mixer_fig2_cifar10')
    depths = re.findall(r'--model swmlp_cifar\s+--model-kwargs depth=(\d+)', about['sweep'])
    assert depths == [str(2 * values['model_kwargs']['depth'])]
    # Fig. 2 (a) is 'the mean of the diagonal entries of the CKA' against the sparsity, not a test error
    assert 'diagonal' in about['reported'] and 'test error' not in about['reported']


def test_fig4_recipe_names_the_command_that_draws_the_init_spectra():
    """Fig. 4 (right) is σ_max at initialisation, drawn by `reproduce mixer` (init_spectrum_sweep, init_spectra.png);
    the recipe said `structformer analyze`, which has no such output (its spectra are a low-rank run's)."""
    import inspect

    from structformer.reproduce import mixer as reproduce_mixer
    from structformer.train.recipes import load_recipe
    _, about = load_recipe('mixer_fig4_cifar10')
    right = about['covers'].split('(right)', 1)[1]
    assert 'structformer reproduce mixer' in right and 'structformer analyze' not in right
    assert 'init_spectra.png' in right and "'init_spectra.png'" in inspect.getsource(reproduce_mixer)


@pytest.mark.parametrize('features', ['blocks', 'branches'])
def test_minibatch_cka_leaves_each_submodules_own_mode(features):
    """A training model with one part held in eval (a frozen stem) came back with every module in train mode:
    the mode was restored from the top module alone."""
    import timm

    import structformer.models  # noqa: F401
    torch.manual_seed(0)
    model = timm.create_model('mixer_digits').train()
    model.stem.eval()
    minibatch_cka(model, model, [torch.randn(4, 1, 8, 8)], features=features)
    assert model.training and model.blocks[0].training and not model.stem.training
