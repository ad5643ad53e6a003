"""White-box analysis (CRATE §3.1, Fig. 3–7): hooks, measurements, coherence, subspace recovery, CLI."""
import argparse
import json
import re

import pytest
import timm
import torch
from safetensors.torch import load_file, save_file

import structformer  # noqa: F401  (registers the CRATE models)
from structformer.analysis import (capture_layers, map_true_bases, measure_layers, principal_angles,
                                   random_bases, subspace_coherence, subspace_recovery, token_heatmaps)
from structformer.analysis.cli import add_analyze_arguments, resolve_compare, run_analyze
from structformer.errors import UsageError
from structformer.functional.coding_rate import official_rate_per_head
from structformer.train.checkpoint import mark_latest, save_checkpoint


@pytest.fixture
def model():
    torch.manual_seed(0)
    return timm.create_model('crate_synthetic').eval()


@pytest.fixture
def images():
    return torch.randn(6, 1, 16, 16, generator=torch.Generator().manual_seed(1))


def _manual_forward(model, x):
    """CRATE Eq. 18 written out: Z^{ℓ+½} = Z + MSSA(LN(Z)), Z^{ℓ+1} = ISTA(LN(Z^{ℓ+½}))."""
    with torch.no_grad():
        z = model.patch_embed(x)
        z = torch.cat([model.cls_token.expand(len(x), -1, -1), z], 1) + model.pos_embed
        layers = []
        for blk in model.blocks:
            half = z + blk.attn(blk.norm1(z))
            out = blk.mlp(blk.norm2(half))
            layers.append({'input': z, 'half': half, 'output': out})
            z = out
    return layers


def test_hooks_capture_half_and_full_steps(model, images):
    captured = capture_layers(model, images)
    expected = _manual_forward(model, images)
    assert len(captured) == len(model.blocks) == 4
    for got, want in zip(captured, expected):
        for stage in ('input', 'half', 'output'):
            assert got[stage].shape == (6, 17, 16)
            torch.testing.assert_close(got[stage], want[stage])
    # the three stages are different tensors (a hook on the wrong module would repeat one)
    assert not torch.allclose(captured[1]['half'], captured[1]['output'])
    assert not torch.allclose(captured[1]['input'], captured[1]['half'])


def _ln(norm, z):
    with torch.no_grad():
        return torch.nn.functional.layer_norm(z, norm.normalized_shape, norm.weight, norm.bias, norm.eps).double()


def test_measurements_equal_hand_computation(model, images):
    eps = 0.7
    result = measure_layers(model, images, eps=eps, batch_size=4)      # 2 mini-batches, official estimator
    captured = capture_layers(model, images)
    assert result['num_samples'] == 6 and result['num_tokens'] == 17 and result['eps'] == eps
    assert result['estimator'] == 'official'
    for i, (row, cap) in enumerate(zip(result['layers'], captured)):
        blk = model.blocks[i]
        u = blk.attn.subspace_bases().detach().double()
        before = official_rate_per_head(_ln(blk.norm1, cap['input']), u, eps).sum(-1)
        after = official_rate_per_head(_ln(blk.norm1, cap['half']), u, eps).sum(-1)
        torch.testing.assert_close(result['samples']['R_c'][i], before)
        torch.testing.assert_close(result['samples']['R_c_after_mssa'][i], after)
        assert row['R_c']['std'] == pytest.approx(float(before.std(correction=0)))
        assert row['mssa_delta']['mean'] == pytest.approx(float((after - before).mean()))
        nonzero = (cap['output'] != 0).float().mean(dim=(1, 2))
        assert row['sparsity']['mean'] == pytest.approx(float(nonzero.mean()))
        ista_in = (_ln(blk.norm2, cap['half']) != 0).double().mean(dim=(1, 2))
        assert row['sparsity_before_ista']['mean'] == pytest.approx(float(ista_in.mean()))
        assert row['token_norm']['mean'] == pytest.approx(float(cap['input'].double().norm(dim=-1).mean()))
        assert row['token_norm_out']['mean'] == pytest.approx(float(cap['output'].double().norm(dim=-1).mean()))
        assert row['U_norm']['per_head'] == pytest.approx([float(x) for x in u.norm(dim=(1, 2))])
    # the ISTA output is ReLU'd: some but not all entries are zero
    assert 0 < result['layers'][0]['sparsity']['mean'] < 1
    lo, hi = result['R_c_bounds']
    assert all(lo <= row['R_c']['mean'] <= hi for row in result['layers'])


def test_exclude_cls_measures_patch_tokens_only(model, images):
    result = measure_layers(model, images, include_cls=False, estimator='paper')
    cap = capture_layers(model, images)[0]
    blk = model.blocks[0]
    z = _ln(blk.norm1, cap['input'])[:, 1:]
    q = torch.linalg.qr(blk.attn.subspace_bases().detach().double()).Q
    n, p = z.shape[1], q.shape[-1]
    w = torch.einsum('bnd,kdp->bknp', z, q)
    gram = torch.eye(n, dtype=torch.float64) + p / (n * 0.5 ** 2) * w @ w.transpose(-1, -2)
    want = 0.5 * torch.logdet(gram).sum(-1)
    assert result['num_tokens'] == 16 and result['eps'] == 0.5
    assert result['layers'][0]['R_c']['mean'] == pytest.approx(float(want.mean()))


def test_coherence_of_orthogonal_and_identical_heads():
    q, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64))
    orthogonal = q.reshape(16, 4, 4).permute(1, 0, 2)                       # 4 heads, mutually orthogonal
    torch.testing.assert_close(subspace_coherence(orthogonal), torch.eye(16, dtype=torch.float64))
    one = q[:, :4] * torch.tensor([1., 2., 3., 4.], dtype=torch.float64)    # column norms are divided out
    identical = one.expand(3, 16, 4)
    # every p×p block equals the diagonal block I_p: the heads see the same subspace
    expected = torch.kron(torch.ones(3, 3, dtype=torch.float64), torch.eye(4, dtype=torch.float64))
    torch.testing.assert_close(subspace_coherence(identical), expected)
    # width-1 identical heads: all ones
    torch.testing.assert_close(subspace_coherence(q[:, :1].expand(5, 16, 1)), torch.ones(5, 5, dtype=torch.float64))


def test_principal_angles_degrees():
    e = torch.eye(3, dtype=torch.float64)
    angles = principal_angles(e[:, :1], (e[:, :1] + e[:, 1:2]) / 2 ** 0.5)
    assert angles == pytest.approx([45.0])
    assert principal_angles(e[:, :2], e[:, [1, 0]]) == pytest.approx([0.0, 0.0], abs=1e-6)


def _embedded_span(model, basis):
    """Orthonormal basis of where layer 1's MSSA sees tokens of span(basis): tokens through the real patch
    embedding and block 0's norm1 (biases zeroed, so outputs lie in a subspace), then an SVD."""
    from structformer.data import tokens_to_image
    gen = torch.Generator().manual_seed(3)
    tokens = (torch.randn(4, 16, basis.shape[1], generator=gen) @ basis.T)           # [4 images, 16 tokens, D]
    with torch.no_grad():
        z = model.blocks[0].norm1(model.patch_embed(tokens_to_image(tokens))).reshape(-1, 16).double()
    u, s, _ = torch.linalg.svd(z.T, full_matrices=False)
    assert s[basis.shape[1]] < 1e-5 * s[0]                                           # exactly rank p
    return u[:, :basis.shape[1]]


def test_subspace_recovery_of_planted_bases(model):
    true = random_bases(4, 16, 3, seed=7).float()            # K=4 subspaces of R^16, p=3 (4·3 ≤ 16)
    pe = model.patch_embed
    with torch.no_grad():
        pe.norm_in.weight.uniform_(0.5, 1.5)                  # a non-trivial γ so the mapping matters
        pe.norm_out.weight.uniform_(0.5, 1.5)
        model.blocks[0].norm1.weight.uniform_(0.5, 1.5)       # layer 1's γ is part of the mapping too
        for b in (pe.norm_in.bias, pe.proj.bias, pe.norm_out.bias, model.blocks[0].norm1.bias):
            b.zero_()
        # U_k of layer 1 := the embedded span of true subspace (k+1) mod K, 4th column a repeat
        heads = []
        for k in range(4):
            span = _embedded_span(model, true[(k + 1) % 4]).float()
            heads.append(torch.cat([span, span[:, :1]], 1))                          # [d, p_model=4]
        model.blocks[0].attn.qkv.weight.copy_(torch.cat([h.T for h in heads], 0))
    rec = subspace_recovery(model, true, seed=0)
    first = rec['layers'][0]
    assert first['learned']['mean_deg'] < 0.5
    assert {(p['head'], p['true']) for p in first['learned']['pairs']} == {(k, (k + 1) % 4) for k in range(4)}
    assert all(max(p['angles_deg']) < 0.5 for p in first['learned']['pairs'])
    assert first['random']['mean_deg'] > 30
    assert len(rec['layers']) == 1                                                    # layer 1 only
    # on data drawn from those subspaces, each head holds most of its matched subspace's energy
    from structformer.analysis.subspaces import subspace_energy
    from structformer.data import sample_tokens, tokens_to_image
    gen = torch.Generator().manual_seed(5)
    labels = torch.arange(8) % 4
    tokens, subspace = sample_tokens(true, labels, 16, purity=0.5, noise=0.0, gen=gen)
    energy = subspace_energy(model, tokens_to_image(tokens), subspace, 4, permutations=50)
    assert energy['matched_share'] > energy['permutation_matched_share']['p95'] + 0.1   # uniform: 0.25
    assert energy['p_value'] < 0.05
    assert torch.tensor(energy['matrix']).argmax(1).tolist() == [(k + 1) % 4 for k in range(4)]
    assert 0 <= energy['attention_within_subspace']['chance'] <= 1
    # comparing in token space instead of feature space would not recover them
    naive = principal_angles(model.blocks[0].attn.subspace_bases()[1].detach(), true[2])
    assert naive.mean() > 5
    # the mapped bases are orthonormal
    m = map_true_bases(model, true)
    torch.testing.assert_close(m.transpose(1, 2) @ m, torch.eye(3, dtype=torch.float64).expand(4, 3, 3))


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_model_unchanged_and_hooks_removed(model, images):
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measure_layers(model, images)
    token_heatmaps(model, images[0])
    subspace_recovery(model, random_bases(4, 16, 3, seed=1))
    with pytest.raises(ValueError):                          # hooks are removed after a failing forward too
        measure_layers(model, torch.randn(2, 1, 12, 12))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert _hook_count(model) == 0
    assert all(len(b.norm2._forward_pre_hooks) == 0 and len(b.mlp._forward_hooks) == 0 for b in model.blocks)
    assert model.training and all(m.training for m in model.modules())             # mode restored


def test_token_heatmaps_subsample_50(images):
    digits = timm.create_model('crate_digits')                # 17 tokens × 64 features
    maps = token_heatmaps(digits, torch.randn(1, 1, 8, 8), size=50, seed=0)
    assert sorted(maps) == [0, 1, 3, 4]
    assert all(m.shape == (17, 50) and (m >= 0).all() for m in maps.values())
    assert (maps[4] == 0).any()                                # ISTA output is sparse
    # analyze --exclude-cls measured without the class token but drew its row in the heat maps
    without = token_heatmaps(digits, torch.randn(1, 1, 8, 8), size=50, seed=0, include_cls=False)
    assert all(without[ell].shape == (16, 50) for ell in maps)


def test_analyze_exclude_cls_draws_the_heat_maps_without_the_class_token(tmp_path, monkeypatch):
    import structformer.analysis.whitebox as whitebox
    drawn, real = [], whitebox.token_heatmaps

    def recording(model, image, **kwargs):
        maps = real(model, image, **kwargs)
        drawn.append({ell: m.shape[0] for ell, m in maps.items()})
        return maps
    monkeypatch.setattr(whitebox, 'token_heatmaps', recording)
    run = _make_run(tmp_path)
    assert run_analyze(_parse('--checkpoint', str(run), '--num-samples', '4', '--exclude-cls')) == 0
    tokens = json.loads((run / 'analysis' / 'analysis.json').read_text())['checkpoints'][0]['measure']['num_tokens']
    assert drawn and all(rows == min(tokens, 50) for maps in drawn for rows in maps.values())


def test_non_crate_model_is_rejected(images):
    vit = timm.create_model('test_vit')
    with pytest.raises(ValueError, match='CRATE'):
        measure_layers(vit, torch.randn(1, 3, 160, 160))
    with pytest.raises(ValueError, match='CRATE'):
        measure_layers(torch.nn.Linear(4, 4), images)


# ------------------------------------------------------------------ CLI

CONFIG = {'data': 'synthetic-subspaces', 'data_kwargs': {'num_samples': 48}, 'seed': 0, 'val_fraction': 0.25}


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_analyze_arguments(parser)
    return parser.parse_args(list(argv))


def _make_run(tmp_path, model_name='crate_synthetic'):
    ckpts = tmp_path / 'run' / 'checkpoints'
    torch.manual_seed(0)
    model = timm.create_model(model_name)
    save_checkpoint(ckpts / 'epoch_0000', model, state={'model': model_name, 'model_kwargs': {}, 'epoch': 0,
                                                         'config': CONFIG}, with_rng=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    last = save_checkpoint(ckpts / 'epoch_0002', model, state={'model': model_name, 'model_kwargs': {},
                                                                'epoch': 2, 'config': CONFIG}, with_rng=False)
    mark_latest(ckpts, last)
    return tmp_path / 'run'


def test_run_analyze_end_to_end(tmp_path, capsys):
    run = _make_run(tmp_path)
    args = _parse('--checkpoint', str(run), '--compare', 'init', '--num-samples', '8')
    assert run_analyze(args) == 0
    out = run / 'analysis'
    data = json.loads((out / 'analysis.json').read_text())
    assert data['num_samples'] == 8 and data['eps'] == 0.1 and data['data'] == 'synthetic-subspaces'
    assert data['estimator'] == 'official'
    assert data['data_kwargs'] == {'num_samples': 48}
    assert [c['epoch'] for c in data['checkpoints']] == [2, 0]
    for ck in data['checkpoints']:
        assert len(ck['measure']['layers']) == 4
        assert ck['subspace_recovery'] is not None                   # synthetic data: true bases known
        assert set(ck['figures']) == {'coherence', 'tokens', 'angles'}
    pngs = sorted(p.name for p in out.glob('*.png'))
    assert len(pngs) == 3 + 2 * 3                                    # + training_curves.png (2 epochs)
    assert all((out / p).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' for p in pngs)
    report = (out / 'report.md').read_text()
    assert report.count('| layer | R_c (MSSA in) |') == 2
    assert '## epoch 2' in report and '## epoch 0 (init)' in report
    for link in re.findall(r'!\[[^\]]*\]\(([^)]+)\)', report):      # relative links that resolve
        assert not link.startswith('/') and (out / link).exists()
    # the trend sentence states the measured numbers
    rows = data['checkpoints'][0]['measure']['layers']
    first, last = rows[0]['R_c']['mean'], rows[-1]['R_c']['mean']
    verb = 'falls' if last < first else 'rises'
    assert f'R_c {verb} from {first:.4g} at layer 1 to {last:.4g} at layer 4' in report
    printed = capsys.readouterr().out
    assert str(out / 'report.md') in printed and str(out / 'analysis.json') in printed


def test_resolve_compare_keywords(tmp_path):
    run = _make_run(tmp_path)
    assert resolve_compare('epoch:2', run).name == 'epoch_0002'
    assert resolve_compare('init', run).name == 'epoch_0000'
    with pytest.raises(FileNotFoundError, match='epoch_0000, epoch_0002'):
        resolve_compare('epoch:7', run)
    with pytest.raises(ValueError, match='inside a run'):
        resolve_compare('init', None)


def test_run_analyze_compare_all_epochs(tmp_path):
    run = _make_run(tmp_path)
    assert run_analyze(_parse('--checkpoint', str(run), '--compare', 'all', '--num-samples', '4',
                              '--estimator', 'paper')) == 0
    data = json.loads((run / 'analysis' / 'analysis.json').read_text())
    assert sorted(c['epoch'] for c in data['checkpoints']) == [0, 2]
    assert data['estimator'] == 'paper' and data['eps'] == 0.5
    assert (run / 'analysis' / data['figures']['training']).is_file()
    # again into the same folder, the last checkpoint only: the init's coherence_/tokens_/angles_ maps and the
    # training curves were left beside the new figures, read as this run's; another kind's figure stays
    out = run / 'analysis'
    (out / 'cka.png').write_bytes(b'another kind')
    (out / 'mine.png').write_bytes(b'a file of no kind')
    assert run_analyze(_parse('--checkpoint', str(run), '--num-samples', '4')) == 0
    data = json.loads((out / 'analysis.json').read_text())
    drawn = set(data['figures'].values()) | {f for c in data['checkpoints'] for f in c['figures'].values()}
    assert len(data['checkpoints']) == 1 and 'training' not in data['figures']
    assert {p.name for p in out.glob('*.png')} == drawn | {'cka.png', 'mine.png'}


def test_run_analyze_bad_input(tmp_path):
    run = _make_run(tmp_path)
    with pytest.raises(ValueError, match=r'--num-samples must be an integer >= 1; got 0'):
        run_analyze(_parse('--checkpoint', str(run), '--num-samples', '0'))
    with pytest.raises(ValueError, match=r'--eps must be a number in \[1e-100, 1e\+100\]'):
        run_analyze(_parse('--checkpoint', str(run), '--eps', '-1'))
    vit_dir = tmp_path / 'vit'
    save_checkpoint(vit_dir, timm.create_model('test_vit'),
                    state={'model': 'test_vit', 'model_kwargs': {}, 'epoch': 1, 'config': CONFIG}, with_rng=False)
    with pytest.raises(ValueError, match=r'not CRATE.*For other models: --cka CHECKPOINT, --interpolate CHECKPOINT'):
        run_analyze(_parse('--checkpoint', str(vit_dir)))


def test_a_figure_that_fails_mid_write_leaves_the_previous_one(tmp_path, monkeypatch):
    """analysis/plots saved straight into the target: re-running analyze into <run>/analysis (which it keeps, not
    having made it) and failing or being killed mid-savefig left half a PNG in place of the previous figure."""
    from matplotlib.figure import Figure

    from structformer.analysis.plots import plot_layer_curves
    measure = {'estimator': 'official', 'eps': 0.1, 'num_samples': 2, 'R_c_bounds': [1.0, 9.0],
               'layers': [{'R_c': {'mean': 5.0 - i, 'std': 0.1}} for i in range(3)]}
    path = tmp_path / 'compression_per_layer.png'
    plot_layer_curves({'init': measure}, 'R_c', path)
    previous = path.read_bytes()
    assert previous[:4] == b'\x89PNG'

    def torn(self, target, **kwargs):
        target.write(b'\x89PNG half')
        raise OSError(28, 'No space left on device')
    monkeypatch.setattr(Figure, 'savefig', torn)
    with pytest.raises(OSError):
        plot_layer_curves({'trained': measure}, 'R_c', path)
    assert path.read_bytes() == previous and sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize('argv, words', [
    (['--interpolate-steps', '3'], ['--interpolate-steps does not apply', 'is for --interpolate']),
    (['--cka-batch-size', '8'], ['--cka-batch-size does not apply', 'is for --cka']),
    (['--cka', '{run}', '--estimator', 'paper'], ['--estimator does not apply', 'analysed as --cka']),
    (['--interpolate', '{run}', '--cka-batch-size', '8'], ['--cka-batch-size does not apply']),
    (['--cka', '{run}', '--interpolate', '{run}'], ['--cka and --interpolate', 'give one']),
    (['--cka', ''], ['--cka: give the second checkpoint']),              # '' ran the white-box analysis
    (['--interpolate', ' '], ['--interpolate: give the second checkpoint']),
])
def test_run_analyze_refuses_options_it_would_ignore(tmp_path, argv, words):
    """These options were silently ignored: --estimator / --cka-batch-size / --interpolate-steps outside the
    analysis that reads them (their defaults were not None, so the refusal never saw them given), and --cka beside
    --interpolate (the interpolation ran, the CKA never did). No output folder is left."""
    run = _make_run(tmp_path)
    out = tmp_path / 'out'
    argv = [a.replace('{run}', str(run)) for a in argv]
    with pytest.raises(UsageError) as e:
        run_analyze(_parse('--checkpoint', str(run), '--num-samples', '8', '--output', str(out), *argv))
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not out.exists()


def test_run_analyze_defaults_are_filled_after_the_refusal(tmp_path):
    """Options left out take their documented defaults (the record says estimator official, seed 0)."""
    run = _make_run(tmp_path)
    args = _parse('--checkpoint', str(run), '--num-samples', '4')
    assert args.estimator is None and args.seed is None                  # not given: nothing to refuse
    assert run_analyze(args) == 0
    data = json.loads((run / 'analysis' / 'analysis.json').read_text())
    assert (data['estimator'], data['seed'], data['eps']) == ('official', 0, 0.1)


def test_training_curves_tick_every_layer_of_the_deepest_checkpoint(monkeypatch):
    """The layer axis took its ticks from the last line drawn: a 2-layer checkpoint after a 4-layer one left
    layers 3 and 4 without a tick."""
    from structformer.analysis import plots
    monkeypatch.setattr(plots, '_save', lambda fig, path: fig)
    row = {'R_c': {'mean': 1.0, 'std': 0.0}, 'sparsity': {'mean': 0.5, 'std': 0.0}}
    per_epoch = [{'epoch': e, 'layers': [row] * depth, 'num_samples': 2, 'estimator': 'official', 'eps': 0.1,
                  'R_c_bounds': None} for e, depth in ((0, 4), (3, 2))]
    fig = plots.plot_training_curves(per_epoch, 'unused.png', 'title')
    assert all(list(ax.get_xticks()) == [1, 2, 3, 4] for ax in fig.axes)


def test_compare_checkpoints_of_another_run_or_family(tmp_path):
    """A --compare checkpoint of another run is measured beside the others but is not a line of the run's
    'over training' figure (two runs' epoch 2 drew two lines labelled 'epoch 2'); one of another family is
    refused naming --compare (the message blamed --checkpoint)."""
    run = _make_run(tmp_path / 'a')
    other = _make_run(tmp_path / 'b')
    out = tmp_path / 'out'
    assert run_analyze(_parse('--checkpoint', str(run), '--compare', str(other), '--num-samples', '4',
                              '--output', str(out))) == 0
    data = json.loads((out / 'analysis.json').read_text())
    assert len(data['checkpoints']) == 2 and 'training' not in data['figures']
    assert run_analyze(_parse('--checkpoint', str(run), '--compare', 'init', str(other), '--num-samples', '4',
                              '--output', str(out))) == 0
    data = json.loads((out / 'analysis.json').read_text())
    assert len(data['checkpoints']) == 3 and data['figures']['training'] == 'training_curves.png'
    vit = tmp_path / 'vit'
    save_checkpoint(vit, timm.create_model('test_vit'),
                    state={'model': 'test_vit', 'model_kwargs': {}, 'epoch': 1, 'config': CONFIG}, with_rng=False)
    with pytest.raises(ValueError, match=r"^--compare .*vit.*'test_vit' is not CRATE"):
        run_analyze(_parse('--checkpoint', str(run), '--compare', str(vit), '--output', str(tmp_path / 'no')))


def test_subspace_energy_takes_a_float64_model(model, images):
    """measure_layers and capture_layers cast a caller's float32 images to the model's dtype; subspace_energy did
    not, so a float64 model raised 'mixed dtype' in its first LayerNorm. Same numbers as the float32 model."""
    from structformer.analysis.subspaces import subspace_energy
    labels = torch.randint(0, 4, (len(images), 16), generator=torch.Generator().manual_seed(0))
    want = subspace_energy(model, images, labels, 4, permutations=5)
    got = subspace_energy(model.double(), images, labels, 4, permutations=5)
    assert got['matched_share'] == pytest.approx(want['matched_share'], rel=1e-5)
    assert got['attention_within_subspace']['mean'] == pytest.approx(want['attention_within_subspace']['mean'], rel=1e-5)
    model.train()
    model.blocks[1].eval()                          # a part held in eval keeps its mode (the top one's was restored)
    subspace_energy(model, images, labels, 4, permutations=5)
    assert model.training and model.blocks[0].training and not model.blocks[1].training


def test_sigterm_mid_analysis_removes_the_folder_it_made(tmp_path, monkeypatch, capsys):
    """SIGTERM (a scheduler's stop, `kill`) during analyze ended the process on the spot: the output folder it had
    made stayed behind holding a figure's empty temporary file. It is now an interrupt (exit 143) whose clean-up
    removes that folder, as Ctrl-C's does."""
    import os
    import signal

    import structformer.analysis.cli as analyze_cli
    from structformer.cli import main
    run = _make_run(tmp_path)
    out = tmp_path / 'fresh' / 'analysis'
    ended = []

    def analysis_killed_mid_figure(args, main_path, run, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / 'coherence_epoch_2.png.tmp-1-x').write_bytes(b'')     # a figure being written
        os.kill(os.getpid(), signal.SIGTERM)
        return 0
    monkeypatch.setattr(analyze_cli, '_analyze', analysis_killed_mid_figure)
    # stands for the default action (the end of the process), which a test cannot take
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: ended.append(signum))
    try:
        status = main(['analyze', '--checkpoint', str(run), '--output', str(out)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not ended and status == 128 + signal.SIGTERM
    assert not (tmp_path / 'fresh').exists()
    err = capsys.readouterr().err
    assert 'interrupted' in err and 'checkpoints already written' not in err and str(out) in err


def test_spectra_of_an_earlier_checkpoint_stop_at_its_epoch(tmp_path):
    """analyze --checkpoint <run>/checkpoints/epoch_0001 of a low-rank run drew every epoch the run logged: its
    singular values and 'last epoch' were epoch 2's, not the chosen checkpoint's."""
    run = tmp_path / 'run'
    model = timm.create_model('test_vit')
    for epoch in (0, 1, 2):
        save_checkpoint(run / 'checkpoints' / f'epoch_{epoch:04d}', model, with_rng=False,
                        state={'model': 'test_vit', 'model_kwargs': {}, 'epoch': epoch, 'config': CONFIG})
    mark_latest(run / 'checkpoints', run / 'checkpoints' / 'epoch_0002')
    logged = [{'epoch': e, 'effective_rank': {'fc': 4.0 - e}, 'effective_rank_mean': 4.0 - e,
               'singular_values': {'fc': [2.0, 1.0 / e]}} for e in (1, 2)]
    (run / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in logged))
    out = tmp_path / 'one'
    assert run_analyze(_parse('--checkpoint', str(run / 'checkpoints' / 'epoch_0001'), '--output', str(out))) == 0
    summary = json.loads((out / 'spectra.json').read_text())
    assert summary['epochs'] == [1] and summary['last_epoch'] == 1
    assert summary['singular_values'] == {'fc': [2.0, 1.0]} and summary['effective_rank'] == {'fc': [3.0]}
    assert run_analyze(_parse('--checkpoint', str(run), '--output', str(tmp_path / 'all'))) == 0
    assert json.loads((tmp_path / 'all' / 'spectra.json').read_text())['epochs'] == [1, 2]
    with pytest.raises(ValueError, match=r'epoch 0.*from epoch 1 on'):
        run_analyze(_parse('--checkpoint', str(run / 'checkpoints' / 'epoch_0000'), '--output', str(tmp_path / 'z')))
    assert not (tmp_path / 'z').exists()


@pytest.mark.parametrize('flag', ['--cka', '--interpolate'])
def test_cka_and_interpolation_refuse_data_the_models_cannot_take(tmp_path, capsys, flag):
    """--cka / --interpolate of two 8 px ViTs on --data synthetic-subspaces (16 px images) ended in a traceback
    from inside timm's patch embedding (an AssertionError, which --cka's own catch did not take): one line naming
    --data, exit 2, no output folder."""
    from structformer.cli import main
    ckpt = save_checkpoint(tmp_path / 'vit', timm.create_model('vit_digits'), with_rng=False,
                           state={'model': 'vit_digits', 'model_kwargs': {}, 'epoch': 1,
                                  'config': dict(CONFIG, data='digits', data_kwargs={})})
    out = tmp_path / 'out'
    status = main(['analyze', '--checkpoint', str(ckpt), flag, str(ckpt), '--data', 'synthetic-subspaces',
                   '--num-samples', '4', '--output', str(out)])
    err = capsys.readouterr().err
    assert status == 2 and '--data synthetic-subspaces' in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize('flag', ['--cka', '--interpolate', '--compare'])
def test_an_unloadable_second_checkpoint_is_blamed_on_its_flag(tmp_path, capsys, flag):
    """A second checkpoint that exists but cannot be loaded (a file missing) was refused as '--checkpoint: ... is
    incomplete', naming the flag whose checkpoint was fine."""
    import shutil

    from structformer.cli import main
    run = _make_run(tmp_path)
    broken = tmp_path / 'broken'
    shutil.copytree(run / 'checkpoints' / 'epoch_0000', broken)
    (broken / 'state.json').unlink()
    status = main(['analyze', '--checkpoint', str(run), flag, str(broken), '--output', str(tmp_path / 'out')])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert f'error: {flag}' in err and '--checkpoint' not in err and 'incomplete' in err


@pytest.mark.parametrize('eps', ['1e-300', '1e300'])
def test_eps_whose_square_leaves_float64_is_refused(tmp_path, model, images, eps):
    """--eps 1e-300 (ε² underflows to 0) ended in a ZeroDivisionError traceback, --eps 1e300 (ε² overflows) in an
    OverflowError one, after the model had run: refused up front, naming --eps and its range."""
    run = _make_run(tmp_path)
    with pytest.raises(ValueError, match=r'--eps must be a number in \[1e-100, 1e\+100\]'):
        run_analyze(_parse('--checkpoint', str(run), '--eps', eps, '--num-samples', '2'))
    assert not (run / 'analysis').exists()
    with pytest.raises(ValueError, match=r'eps must be a number in \[1e-100, 1e\+100\]'):
        measure_layers(model, images[:1], eps=float(eps))
    for estimator in ('official', 'paper'):                    # the ends of the range measure
        for edge in (1e-100, 1e100):
            values = measure_layers(model, images[:2], eps=edge, estimator=estimator)['samples']['R_c']
            assert torch.isfinite(values).all()


def test_a_compare_checkpoint_that_cannot_take_the_data_is_blamed_on_compare(tmp_path, capsys):
    """--compare with a checkpoint of another image size (no --data given) was refused as '--data
    synthetic-subspaces: ... cannot take its images', naming a flag the user never gave."""
    from structformer.cli import main
    run = _make_run(tmp_path)
    small = save_checkpoint(tmp_path / 'digits', timm.create_model('crate_digits'), with_rng=False,
                            state={'model': 'crate_digits', 'model_kwargs': {}, 'epoch': 1,
                                   'config': dict(CONFIG, data='digits', data_kwargs={})})
    status = main(['analyze', '--checkpoint', str(run), '--compare', str(small), '--num-samples', '2',
                   '--output', str(tmp_path / 'out')])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1
    assert f'error: --compare {small}' in err and 'synthetic-subspaces' in err
    assert not (tmp_path / 'out').exists()


def _run_with_average(tmp_path):
    """A CRATE run whose epoch_0002 keeps a weight average (ema.safetensors, as --model-ema writes it) that differs
    from its weights, and a checkpoint holding those averaged weights as its model weights (the reference)."""
    run = _make_run(tmp_path)
    last = run / 'checkpoints' / 'epoch_0002'
    model = timm.create_model('crate_synthetic')
    model.load_state_dict(load_file(str(last / 'model.safetensors')))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=generator))
    average = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(average, str(last / 'ema.safetensors'))
    reference = save_checkpoint(tmp_path / 'average_as_weights', model, with_rng=False,
                                state={'model': 'crate_synthetic', 'model_kwargs': {}, 'epoch': 2, 'config': CONFIG})
    return run, reference


def _layers_rc(path):
    return [row['R_c']['mean'] for row in json.loads(path.read_text())['checkpoints'][0]['measure']['layers']]


def test_analyze_ema_measures_the_weight_average(tmp_path):
    """`analyze --ema` (as `eval --ema` and `export --ema`): a run trained with --model-ema was measured on its
    weights only (no such flag). The white-box measures of the average equal those of a checkpoint holding the
    averaged weights as its model, and differ from the weights' own; the record says which weights it measured."""
    run, reference = _run_with_average(tmp_path)
    assert run_analyze(_parse('--checkpoint', str(run), '--ema', '--num-samples', '4',
                              '--output', str(tmp_path / 'ema'))) == 0
    assert run_analyze(_parse('--checkpoint', str(reference), '--num-samples', '4',
                              '--output', str(tmp_path / 'ref'))) == 0
    assert run_analyze(_parse('--checkpoint', str(run), '--num-samples', '4', '--output', str(tmp_path / 'raw'))) == 0
    ema, ref, raw = (_layers_rc(tmp_path / name / 'analysis.json') for name in ('ema', 'ref', 'raw'))
    assert ema == pytest.approx(ref, rel=1e-5) and ema != pytest.approx(raw, rel=1e-3)
    assert json.loads((tmp_path / 'ema' / 'analysis.json').read_text())['weights'] == 'ema'
    assert json.loads((tmp_path / 'raw' / 'analysis.json').read_text())['weights'] == 'model'
    assert '(--ema)' in (tmp_path / 'ema' / 'report.md').read_text()
    assert '(--ema)' not in (tmp_path / 'raw' / 'report.md').read_text()


def test_analyze_ema_reads_the_second_checkpoint_average_too(tmp_path):
    """--interpolate with --ema: both ends are the weight averages (the curve equals the one between the
    checkpoints holding the averages as their weights)."""
    run, reference = _run_with_average(tmp_path)
    common = ['--interpolate-steps', '2', '--num-samples', '8']
    assert run_analyze(_parse('--checkpoint', str(run), '--interpolate', str(run), '--ema', *common,
                              '--output', str(tmp_path / 'ema'))) == 0
    assert run_analyze(_parse('--checkpoint', str(reference), '--interpolate', str(reference), *common,
                              '--output', str(tmp_path / 'ref'))) == 0
    ema, ref = (json.loads((tmp_path / n / 'interpolation.json').read_text()) for n in ('ema', 'ref'))
    assert [r['loss'] for r in ema['curve']] == pytest.approx([r['loss'] for r in ref['curve']], rel=1e-5)
    assert ema['weights'] == 'ema' and ref['weights'] == 'model'


@pytest.mark.parametrize('extra', [[], ['--cka', '{run}'], ['--interpolate', '{run}'], ['--compare', '{plain}']])
def test_analyze_ema_without_an_average_is_one_line(tmp_path, capsys, extra):
    """--ema where a checkpoint the analysis reads keeps no weight average: one line naming --ema and the
    checkpoint, exit 2, no output folder."""
    from structformer.cli import main
    run, _ = _run_with_average(tmp_path)
    plain = _make_run(tmp_path / 'plain')
    checkpoint = plain if not extra else run
    argv = [a.replace('{run}', str(plain)).replace('{plain}', str(plain / 'checkpoints' / 'epoch_0002'))
            for a in extra]
    status = main(['analyze', '--checkpoint', str(checkpoint), '--ema', '--num-samples', '4',
                   '--output', str(tmp_path / 'out'), *argv])
    err = capsys.readouterr().err.strip()
    assert status == 2 and len(err.splitlines()) == 1, err
    assert '--ema' in err and 'without --model-ema' in err and str(plain) in err
    assert not (tmp_path / 'out').exists()
