"""`structformer compare` (issue 46): the quick set end to end at tiny size, grid resumption after a kill, the
statistics against hand examples, the parameter matching, the dependencies inside the grid, the timing phase,
the in1k plan, and the leaderboard page against its record."""
import importlib
import json
import math
from pathlib import Path

import pytest

from structformer.cli import main
from structformer.compare.catalogue import SETS, TOLERANCE, match_rows, within
from structformer.compare.record import mean_se, pareto_front

from forking import Forked, run_forked

pytestmark = pytest.mark.usefixtures('one_torch_thread')     # two tests fork a grid

ROOT = Path(__file__).resolve().parents[1]
TINY = ['--epochs', '2', '--limit-train-batches', '1', '--threads', '1']


def _one_error(argv, capsys, *needles):
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if 'error:' in line]
    assert rc == 2 and 'Traceback' not in err, err
    assert len(errors) == 1 and errors[0].startswith('structformer compare: error: '), err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def _record(folder):
    return json.loads((Path(folder) / 'compare.json').read_text())


def _accuracies(record):
    return {r['key']: [(c['seed'], c.get('top1'), c.get('best_top1')) for c in r['cells']] for r in record['rows']}


# ---- statistics -------------------------------------------------------------------------------------------------
def test_mean_and_standard_error_against_a_hand_example():
    # 97.0, 98.0, 99.5: mean 98.1667; deviations -1.1667, -0.1667, 1.3333; s^2 = (1.3611 + 0.0278 + 1.7778) / 2
    # = 1.58333; SE = sqrt(1.58333 / 3) = 0.72648
    mean, se = mean_se([97.0, 98.0, 99.5])
    assert mean == pytest.approx(98.16667, abs=1e-5)
    assert se == pytest.approx(0.72648, abs=1e-5)
    assert mean_se([93.5]) == (93.5, None)               # one seed: no error bar
    assert mean_se([]) == (None, None)


def _hand_row(key, label, top1s):
    mean, se = mean_se(top1s)
    return dict(key=key, label=label, family='ViT', top1_mean=mean, top1_se=se,
                cells=[{'seed': i, 'top1': t} for i, t in enumerate(top1s)])


def test_a_difference_is_read_against_two_standard_errors_and_an_under_trained_vit_is_said():
    from structformer.compare.leaderboard import difference, readings
    # 94, 92, 93 and 97, 96, 98: means 93 and 97, each SE 1/√3; the difference's SE √(2/3) = 0.8165, 4 > 2 SE
    vit, linformer = _hand_row('vit', 'ViT', [94.0, 92.0, 93.0]), _hand_row('vit_linformer', 'Lin', [97.0, 96.0, 98.0])
    d = difference(linformer, vit, 2000)
    assert d['delta'] == pytest.approx(4.0) and d['se'] == pytest.approx(math.sqrt(2 / 3)) and d['reading'] == 'higher'
    said = readings({'data': {'val_images': 2000}, 'rows': [vit, linformer]})
    assert len(said) == 1 and 'Lin 97.00 % vs ViT 93.00 %' in said[0] and '94.00, 92.00, 93.00' in said[0]
    close = _hand_row('vit_linformer', 'Lin', [93.5, 92.5, 94.5])          # +0.5 ± 1.0: nothing to say
    assert readings({'data': {'val_images': 2000}, 'rows': [vit, close]}) == []
    # one seed each: the binomial SE on the held-out images, √((.91·.09 + .90·.10) / 1000) = 1.3115 points
    d = difference(_hand_row('b', 'B', [91.0]), _hand_row('a', 'A', [90.0]), 1000)
    assert d['se'] == pytest.approx(100 * math.sqrt((0.91 * 0.09 + 0.90 * 0.10) / 1000))
    assert d['reading'] == 'no clear difference'
    # a row left with one finished seed beside one with three: the three seeds' spread is kept (94, 90, 92 -> SE
    # 2/√3), the single seed's binomial SE added (2 SE = 2.54); binomial SEs alone (2 SE = 1.61) read +2.0 as 'higher'
    d = difference(_hand_row('one', 'One', [94.0]), _hand_row('wide', 'Wide', [94.0, 90.0, 92.0]), 2000)
    assert d['delta'] == pytest.approx(2.0)
    assert d['se'] == pytest.approx(math.sqrt(4 / 3 + 100 ** 2 * 0.94 * 0.06 / 2000))
    assert d['reading'] == 'no clear difference' and d['basis'] == 'seeds and binomial, 2000 images'


def test_crate_close_to_vit_is_read_against_the_papers_gap_and_the_noise():
    """'CRATE close to ViT' (the paper's CRATE-B is 1.6 points below ViT-S): one seed on 50 images (2 SE ≈ 14 points)
    said 'agrees' for a 12-point deficit, because only a significant deficit could disagree; and three tight seeds
    1.0 point below read 'disagrees' though the paper's own CRATE is further below."""
    from structformer.compare.leaderboard import claims
    def verdict(crate, vit, held_out):
        record = {'data': {'val_images': held_out}, 'rows': [
            dict(_hand_row('vit', 'ViT', vit), family='ViT'), dict(_hand_row('crate', 'CRATE', crate), family='CRATE')]}
        return next(c['verdict'] for c in claims(record) if c['claim'] == 'CRATE vs ViT at equal parameters')
    assert verdict([80.0], [92.0], 50) == 'cannot tell at this scale'
    assert verdict([96.9, 97.0, 97.1], [97.9, 98.0, 98.1], 2000) == 'agrees'          # 1.0 below, ± 0.16
    assert verdict([94.9, 95.0, 95.1], [97.9, 98.0, 98.1], 2000) == 'disagrees'       # 3.0 below, ± 0.16
    assert verdict([98.0, 98.1, 97.9], [92.0, 93.0, 94.0], 2000) == 'agrees'          # above: closer than the paper


def test_a_tie_with_the_mixer_is_no_evidence_that_rp_mixer_keeps_up():
    """'RP-Mixer keeps the Mixer's accuracy' read a difference inside two standard errors as met, so one seed on 50
    images (2 SE ≈ 13 points) 'agreed' with RP-Mixer 10 points below the Mixer: now it cannot tell."""
    from structformer.compare.leaderboard import claims
    def verdict(rp, sw, held_out=2000):
        rows = [dict(_hand_row('mixer', 'Mixer', [90.0, 90.1, 89.9]), family='Mixer')]
        rows += [dict(_hand_row(k, k, t), family='Mixer') for k, t in (('rp_mixer', rp), ('swmlp', sw)) if t]
        record = {'data': {'val_images': held_out}, 'rows': rows}
        return next(c['verdict'] for c in claims(record) if c['claim'].startswith('RP-Mixer and SW-MLP'))
    assert verdict([80.0], None, 50) == 'cannot tell at this scale'                 # -10 ± 6.5: no evidence
    assert verdict([91.0, 91.1, 90.9], [92.0, 92.1, 91.9]) == 'agrees'             # both above, ± 0.12
    assert verdict([91.0, 91.1, 90.9], [90.0, 90.2, 89.8]) == 'partly agrees'      # SW-MLP a tie
    assert verdict([88.0, 88.1, 87.9], [90.0, 90.2, 89.8]) == 'disagrees'          # RP-Mixer 2 below, ± 0.12


def test_plot_labels_do_not_overlap_a_hand_example():
    from structformer.compare.record import label_offsets
    # a and b 2 points apart, labels 40 wide and 8 high: a keeps right-above (4, 3); b's right-above box would
    # overlap a's, so b takes right-below (4, -11); c far to the right keeps its place
    points, widths = [(100.0, 200.0), (110.0, 198.0), (300.0, 199.0)], [40.0, 40.0, 40.0]
    assert label_offsets(points, widths) == [(4.0, 3.0), (4.0, -11.0), (4.0, 3.0)]
    # four on one spot: right-above, right-below, left-above, left-below; the fifth a line further down, where
    # right-above (4, -5) still meets the second's box (-11..-3) and right-below (4, -19) is the first free place
    spots = label_offsets([(0.0, 0.0)] * 5, [20.0] * 5)
    assert spots == [(4.0, 3.0), (4.0, -11.0), (-24.0, 3.0), (-24.0, -11.0), (4.0, -19.0)]


def test_the_recipes_factorisation_goes_to_the_low_rank_rows_alone(tmp_path):
    """--init / --factorize-include / --factor-decay / --factorize-lr-scale say how --rank factorises: the low-rank
    row takes them, its dense baseline row (which train would refuse them for: nothing to factorise) does not."""
    from structformer.compare.catalogue import resolve_keys
    from structformer.compare.grid import plan_cells
    rows = match_rows(resolve_keys(None, ['wrn_lowrank_0.25']), 'digits', SETS['quick']['budget'])
    assert {r.key for r in rows} == {'wrn', 'wrn_lowrank_0.25'}      # the baseline it follows comes along
    shared = {'epochs': 1, 'factorize_init': 'spectral_ones', 'factorize_include': ['stages.*'],
              'factor_decay': 'frobenius', 'factorize_lr_scale': 0.5}
    cells = {c.row.key: c.config for c in plan_cells(rows, [0], shared, 'digits', tmp_path)}
    low, dense = cells['wrn_lowrank_0.25'], cells['wrn']
    assert (low.factorize_rank, low.factorize_init, list(low.factorize_include), low.factor_decay,
            low.factorize_lr_scale) == (0.25, 'spectral_ones', ['stages.*'], 'frobenius', 0.5)
    assert dense.factorize_rank is None and not dense.factorize_include and dense.factorize_init == 'spectral'
    assert (dense.factor_decay, dense.factorize_lr_scale) == ('l2', 1)


def test_clip_mode_reaches_every_cell_and_the_timed_step(tmp_path):
    """--clip-mode (timm's norm / value / agc, which train takes) was not among compare's shared flags: a recipe
    clipping by value was planned and timed as clipping the norm."""
    import argparse

    import torch

    from structformer.compare.catalogue import resolve_keys
    from structformer.compare.cli import _train_flags, add_arguments
    from structformer.compare.grid import plan_cells
    from structformer.compare.speed import step_functions
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = _train_flags(parser.parse_args(['--clip-grad', '1e-6', '--clip-mode', 'value']))
    rows = match_rows(resolve_keys(None, ['wrn']), 'digits', SETS['quick']['budget'])
    cells = plan_cells(rows, [0], dict(flags, epochs=1), 'digits', tmp_path)
    assert cells and all((c.config.clip_grad, c.config.clip_mode) == (1e-6, 'value') for c in cells)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 10).double()          # float64: the 1e-6 steps stand clear of the weights' rounding
    before = [p.detach().clone() for p in model.parameters()]
    recipe = dict(opt='momentum', lr=1.0, weight_decay=0.0, momentum=0.9, **flags)
    train_step, _ = step_functions(model, torch.randn(32, 64, dtype=torch.float64), torch.randint(0, 10, (32,)), recipe, 'cpu')
    train_step()
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    # value clipping: every gradient entry at most 1e-6, most of them at it (norm clipping: the whole norm 1e-6)
    assert moved.abs().max() <= 1e-6 * (1 + 1e-9) and moved.norm() > 10e-6


def test_the_timed_batch_and_the_counted_image_are_not_augmented(shared_mnist):
    """MNIST trains with a random one-pixel shift by default: the timing batch and the image whose FLOPs the record
    counts (SOFT's depend on it) are the images as they are, whatever the random state."""
    import torch

    from structformer.compare.speed import data_batch
    from structformer.data import build_datasets
    spec = f'mnist:{shared_mnist}'
    _, _, info = build_datasets(spec)
    assert info.extra['augment']                          # the default this guards against
    plain, _, _ = build_datasets(spec, augment=False)
    want = torch.stack([plain[i][0] for i in range(4)])
    for seed in (1, 2):
        torch.manual_seed(seed)
        images, targets, _ = data_batch(spec, 4)
        assert torch.equal(images, want) and targets.tolist() == [plain[i][1] for i in range(4)]


def test_the_speed_ratio_names_the_row_it_is_to():
    """Without a ViT in the grid the ratios are to its first timed row: the table said '× ViT' all the same."""
    from structformer.compare.leaderboard import render
    from structformer.compare.record import markdown_table
    timing = {'img_per_s': 100.0, 'ratio': 1.0, 'ratio_q1': 1.0, 'ratio_q3': 1.0}
    rows = [dict(_hand_row(key, label, [90.0]), budget=None, params=1000, role='registry size', flops_per_image=1e6,
                 train_img_per_s=100.0, infer_img_per_s=100.0, train_ms_per_image=10.0, train_ratio=timing)
            for key, label in (('wrn', 'Wide-ResNet'), ('swmlp', 'SW-MLP'))]
    for row in rows:
        row['cells'][0]['state'] = 'finished'
    record = {'rows': rows, 'speed': {'reference': 'wrn', 'batch_size': 8, 'rounds': 2}, 'recipe': {}, 'seeds': [0],
              'data': {'kind': 'digits'}, 'environment': {}, 'record_command': 'x', 'command': 'x', 'set': None}
    assert '| × Wide-ResNet train (IQR) |' in markdown_table(record) and '× ViT' not in markdown_table(record)
    assert 'ratio to the Wide-ResNet with its interquartile range' in render(record)
    record['speed']['reference'] = 'vit'
    assert '| × ViT train (IQR) |' in markdown_table(record)


def test_pareto_front_against_a_hand_example():
    # (cost, accuracy): b is cheaper and better than a; c costs more but is the most accurate; d is dominated by b
    # (equal accuracy, higher cost); e has no timing
    points = [(2.0, 90.0), (1.0, 95.0), (3.0, 97.0), (1.5, 95.0), (None, 99.0)]
    assert pareto_front(points) == [False, True, True, False, False]


# ---- matching ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('set_name, kind', [('quick', 'digits'), ('mnist', 'mnist')])
def test_matched_rows_are_within_15_percent_of_the_budget(set_name, kind):
    import torch

    from structformer.models.factory import build_model
    from structformer.models.inventory import effective_parameter_count
    budget = SETS[set_name]['budget']
    rows = match_rows(SETS[set_name]['entries'], kind, budget)
    assert {e for e in ('vit', 'vit_linformer', 'vit_performer', 'vit_nystrom', 'mixer', 'wrn')} <= \
        {r.key for r in rows if r.entry.baseline}          # the dense baselines of every set
    for row in rows:
        transforms = row.transforms + ([{'name': 'factorize', 'kwargs': {'rank': row.entry.rank}}] if row.entry.rank
                                       else [])
        with torch.random.fork_rng(devices=[]):
            model, _ = build_model(row.model, row.kwargs_for(0), None, transforms)
        count = effective_parameter_count(model)
        if row.entry.rank:                                 # the matched dense row, factorised: fewer on purpose
            assert row.role == f"factorised {row.entry.follows}" and count < 0.8 * budget, (row.key, count)
        else:
            assert within(count, budget), (row.key, count, budget)
            assert abs(count / budget - 1) <= TOLERANCE


def test_a_row_at_the_vits_width_is_held_to_the_budget_too():
    """Sparsifiner's predictor is added to the ViT's width: at --budget 30000 on MNIST the ViT is -13 % (within) but
    Sparsifiner +19 %, which the page would have printed under "matched within ±15 % per row"."""
    from structformer.errors import UsageError
    rows = match_rows(['vit', 'vit_linformer'], 'mnist', 30_000)           # +13 %: within
    assert [r.role for r in rows] == ['matched', 'width of vit']
    with pytest.raises(UsageError, match=r'--budget 30000: Sparsifiner .* 35,782 parameters \(\+19%'):
        match_rows(['vit', 'sparsifiner'], 'mnist', 30_000)
    assert [r.role for r in match_rows(['vit', 'sparsifiner'], 'mnist', 30_000, match=False)] == ['registry size'] * 2


def test_a_masked_layer_counts_the_weights_its_mask_keeps():
    from torch import nn

    from structformer.layers.linear import MaskedLinear
    from structformer.models.inventory import effective_parameter_count
    model = nn.Sequential(MaskedLinear(40, 30, density=0.25, seed=3), nn.Linear(30, 2))
    kept = int(model[0].mask.sum())
    assert 0 < kept < 1200
    assert effective_parameter_count(model) == kept + 30 + 30 * 2 + 2


# ---- the quick set, end to end at tiny size -----------------------------------------------------------------------
@pytest.fixture(scope='module')
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp('compare') / 'quick'
    assert main(['compare', '--set', 'quick', '--output', str(out), '--skip-speed', *TINY]) == 0
    return out


@pytest.mark.slow
def test_quick_set_trains_every_family_and_writes_the_record(quick):
    record = _record(quick)
    assert [r['key'] for r in record['rows']] == SETS['quick']['entries']
    assert {r['family'] for r in record['rows']} == {'ViT', 'CRATE', 'SOFT', 'Sparsifiner', 'Mixer', 'low-rank', 'WRN'}
    for row in record['rows']:
        assert row['finished'] == 1 and row['cells'][0]['state'] == 'finished', row['key']
        assert 0 <= row['top1_mean'] <= 100 and row['top1_se'] is None          # one seed: no error bar
        assert row['params'] > 0 and row['flops_per_image'] > 0
    assert (quick / 'leaderboard.md').read_text().startswith('# Leaderboard')
    for name in record['figures']:
        assert (quick / name).stat().st_size > 1000


@pytest.mark.slow
def test_the_pages_regenerate_command_makes_this_record(quick):
    """The page's "Regenerate the record" line is this record's own flags (it was the set's defaults: a quick run at
    --epochs 2 said to regenerate it at 8 epochs; a --models grid, `--set custom`, which is no set)."""
    import argparse
    import shlex

    from structformer.compare.cli import add_arguments
    record = _record(quick)
    words = shlex.split(record['record_command'])
    assert words[:2] == ['structformer', 'compare'] and words[-4:] == ['--output', 'outputs/compare_quick',
                                                                         '--publish', 'docs']
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(words[2:])
    assert (args.set, args.data, args.epochs, args.limit_train_batches, args.threads) == ('quick', 'digits', 2, 1, 1)
    assert record['command'] == shlex.join(words[:-4] + ['--output', 'DIR'])


@pytest.mark.slow
def test_trained_on_is_the_cells_environment_not_the_writers(quick, tmp_path):
    """The record's "trained on" line comes from the cells' checkpoints: rewritten by a process at another
    --threads (nothing to train), it still says the cells' 1 thread."""
    import shutil

    import torch
    grid = tmp_path / 'quick'
    shutil.copytree(quick, grid)
    for path in grid.glob('cells/*/seed_0/config.yaml'):       # the copy's own teacher
        path.write_text(path.read_text().replace(str(quick), str(grid)))
    threads = torch.get_num_threads()
    try:
        argv = TINY[:TINY.index('--threads')] + ['--threads', '2']
        assert main(['compare', '--set', 'quick', '--output', str(grid), '--skip-speed', *argv]) == 0
    finally:
        torch.set_num_threads(threads)
    environment = _record(grid)['environment']
    assert environment['threads'] == 1 and 'others' not in environment
    assert '- trained on: ' in (grid / 'leaderboard.md').read_text() and ', 1 thread(s), torch' in \
        (grid / 'leaderboard.md').read_text()


def test_a_models_grid_is_regenerated_by_its_own_command():
    import argparse
    import shlex

    from structformer.compare.cli import _this_command, _train_flags, add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(['--models', 'vit', 'swmlp', '--seeds', '2', '--epochs', '1', '--speed-rounds', '3'])
    args.train_flags = _train_flags(args)
    line = _this_command(args, None, 'digits', 'outputs/compare_custom', 'docs')
    again = parser.parse_args(shlex.split(line)[2:])
    assert again.set is None and again.models == ['vit', 'swmlp'] and again.seeds == 2 and again.epochs == 1
    assert again.speed_rounds == 3 and (again.output, again.publish) == ('outputs/compare_custom', 'docs')


@pytest.mark.slow
def test_sparsifiner_distils_from_the_dense_cell_of_its_seed(quick):
    record = _record(quick)
    cell = next(r for r in record['rows'] if r['key'] == 'sparsifiner')['cells'][0]
    assert cell['teacher'].startswith('cells/vit/seed_0/checkpoints/epoch_')
    import yaml
    config = yaml.safe_load((quick / 'cells' / 'sparsifiner' / 'seed_0' / 'config.yaml').read_text())
    assert Path(config['teacher']).resolve().is_relative_to((quick / 'cells' / 'vit' / 'seed_0').resolve())


@pytest.mark.slow
def test_pretrained_low_rank_cell_starts_from_the_dense_cell(quick):
    """Its dense epochs are the dense cell's (copied, not retrained), and the whole run equals `--factorize-at`
    from scratch, bit for bit."""
    from structformer.train import TrainConfig, load_model, train
    from structformer.train.engine import parameter_digest
    from structformer.train.run_dir import read_metrics
    cell = quick / 'cells' / 'vit_lowrank_0.5_pretrained' / 'seed_0'
    dense = read_metrics(quick / 'cells' / 'vit' / 'seed_0' / 'metrics.jsonl')
    mine = read_metrics(cell / 'metrics.jsonl')
    assert mine[0] == dense[0] and len(mine) == 2 and 'factorized_val_top1' in mine[1]
    import yaml
    values = yaml.safe_load((cell / 'config.yaml').read_text())
    values.update(output=str(quick.parent / 'scratch'), save_every=0)
    train(TrainConfig.from_dict(values), progress=False)
    grid_model, _ = load_model(cell)
    scratch_model, _ = load_model(quick.parent / 'scratch')
    assert parameter_digest(grid_model) == parameter_digest(scratch_model)


@pytest.mark.slow
def test_running_again_trains_nothing(quick, capsys):
    stamps = {p: p.stat().st_mtime_ns for p in quick.rglob('model.safetensors')}
    capsys.readouterr()
    assert main(['compare', '--set', 'quick', '--output', str(quick), '--skip-speed', *TINY]) == 0
    assert '== ' not in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in quick.rglob('model.safetensors')} == stamps


@pytest.mark.slow
def test_overwrite_retrains_a_diverged_cell(tmp_path, capsys):
    """--overwrite retrains a cell recorded as diverged (the grid's own rule); the engine was asked to train into
    the folder of the diverged run without overwrite, refused with 'already holds a run', and the cell's
    diverged.json was gone."""
    out = tmp_path / 'grid'
    argv = ['compare', '--models', 'wrn', '--output', str(out), '--skip-speed', '--epochs', '1',
            '--limit-train-batches', '1', '--threads', '1']
    assert main(argv) == 0
    cell = out / 'cells' / 'wrn' / 'seed_0'
    (cell / 'diverged.json').write_text('{"message": "loss is nan at epoch 1"}')
    assert main(argv) == 0 and _record(out)['rows'][0]['cells'][0]['state'] == 'diverged'     # kept without it
    capsys.readouterr()
    assert main(argv + ['--overwrite']) == 0, capsys.readouterr().err
    assert 'wrn/seed_0: training' in capsys.readouterr().out
    assert not (cell / 'diverged.json').exists() and _record(out)['rows'][0]['cells'][0]['state'] == 'finished'


@pytest.mark.slow
def test_another_recipe_into_the_same_output_is_refused(quick, capsys):
    before = sorted(p.name for p in quick.rglob('*'))
    _one_error(['compare', '--set', 'quick', '--output', str(quick), '--skip-speed', *TINY, '--lr', '0.01'], capsys,
               '--output', 'another recipe', 'lr', '--overwrite')
    assert sorted(p.name for p in quick.rglob('*')) == before


@pytest.mark.slow
def test_a_grid_begun_on_an_older_release_goes_on(quick, tmp_path, capsys):
    """Cells whose config.yaml lacks options a later release added (it trained with their defaults, as `train
    --resume` reads the file) are finished cells, not 'another configuration'; a missing key whose default is not
    the plan's value is still a change."""
    import shutil

    import yaml
    grid = tmp_path / 'quick'
    shutil.copytree(quick, grid)
    added = ('avg_last', 'bce_loss', 'allow_other_model', 'keep_best', 'recovery_interval')
    for path in grid.glob('cells/*/seed_0/config.yaml'):
        values = yaml.safe_load(path.read_text().replace(str(quick), str(grid)))     # the copy's own teacher
        assert all(key in values for key in added)
        path.write_text(yaml.safe_dump({k: v for k, v in values.items() if k not in added}))
    stamps = {p: p.stat().st_mtime_ns for p in grid.rglob('model.safetensors')}
    capsys.readouterr()
    assert main(['compare', '--set', 'quick', '--output', str(grid), '--skip-speed', *TINY]) == 0
    assert '== ' not in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in grid.rglob('model.safetensors')} == stamps
    # a missing key is read as its default, not skipped: without `lr` the cell ran at TrainConfig's 1e-3, not 2e-3
    path = grid / 'cells' / 'vit' / 'seed_0' / 'config.yaml'
    path.write_text(yaml.safe_dump({k: v for k, v in yaml.safe_load(path.read_text()).items() if k != 'lr'}))
    _one_error(['compare', '--set', 'quick', '--output', str(grid), '--skip-speed', *TINY], capsys,
               'cell vit/seed_0', 'lr: 0.001 -> 0.002', '--overwrite')


def test_a_record_read_back_is_refused_by_name_when_torn_or_foreign(tmp_path):
    from structformer.errors import UsageError
    from structformer.records import read_record
    path = tmp_path / 'grid.json'
    for text, reason in (('{"recipe": {"lr"', 'not valid JSON'), ('[1, 2]', 'a JSON list, not an object'),
                         ('{"set": "quick"}', "has no 'recipe'"), (b'\xff\xfe', 'not valid JSON')):
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(UsageError) as e:
            read_record(path, 'a grid', ('recipe',), 'delete it')
        assert str(e.value).startswith(f'{path}: should be a grid') and reason in str(e.value), str(e.value)
        assert str(e.value).endswith('; delete it')
    path.write_text('{"recipe": {}}')
    assert read_record(path, 'a grid', ('recipe',)) == {'recipe': {}}


@pytest.mark.slow
def test_a_torn_or_foreign_file_in_the_grid_is_one_line(quick, tmp_path, capsys):
    """A grid.json, a cell's summary.json or speed.json that is not the record it should be: one line naming the file
    and what to do (was: a JSONDecodeError traceback), and no file in the folder changes."""
    import shutil
    grid = tmp_path / 'quick'
    shutil.copytree(quick, grid)
    for path in grid.glob('cells/*/seed_0/config.yaml'):       # the copy's own teacher
        path.write_text(path.read_text().replace(str(quick), str(grid)))
    argv = ['compare', '--set', 'quick', '--output', str(grid), *TINY]
    for name, text, needles in (
            ('grid.json', '{"recipe": ', ('grid.json: should be', 'not valid JSON', 'delete it')),
            ('cells/vit/seed_0/summary.json', '', ('vit/seed_0/summary.json', 'delete the cell folder')),
            ('speed.json', '[]', ('speed.json', 'not an object', 'time the rows again'))):
        original = (grid / name).read_text() if (grid / name).is_file() else None
        (grid / name).write_text(text)
        before = {p: p.read_bytes() for p in grid.rglob('*') if p.is_file()}
        _one_error(argv, capsys, *needles)
        assert {p: p.read_bytes() for p in grid.rglob('*') if p.is_file()} == before
        if original is None:
            (grid / name).unlink()
        else:
            (grid / name).write_text(original)


@pytest.mark.slow
def test_dry_run_prints_the_grid_and_its_time_and_writes_nothing(quick, tmp_path, capsys):
    out = tmp_path / 'never'
    capsys.readouterr()
    assert main(['compare', '--models', 'vit', 'swmlp', '--output', str(out), '--dry-run', *TINY]) == 0
    text = capsys.readouterr().out
    assert 'estimated training time' in text and 'machine:' in text and 'swmlp' in text
    assert not out.exists()
    assert main(['compare', '--set', 'quick', '--output', str(quick), '--dry-run', *TINY]) == 0
    assert ' 0  f' in capsys.readouterr().out          # finished cells: nothing to go


# ---- resumption and seeds -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_grid_resumes_to_the_same_record(tmp_path):
    """Two rows (Sparsifiner and the ViT teacher it adds) × two seeds. One grid runs in this process, cell after
    cell; another runs two cells at a time in worker processes (--jobs 2), which are killed in the middle of their
    second epoch (as kill -9 would); run again, it ends with every cell's accuracy equal to the first grid's."""
    argv = ['--models', 'sparsifiner', '--seeds', '2', '--skip-speed', '--epochs', '2', '--limit-train-batches', '2',
            '--threads', '1']
    assert main(['compare', '--output', str(tmp_path / 'straight'), *argv]) == 0
    killed = tmp_path / 'killed'
    # the grid in a process of its own (forked: tests/forking.py), whose workers inherit the test hook
    done = run_forked(main, ['compare', '--output', str(killed), *argv, '--jobs', '2'],
                      env={'STRUCTFORMER_TEST_KILL_AT': 'epoch 2:step 1', 'PYTHONPATH': str(ROOT)})
    assert done.returncode == 1 and 'vit/seed_0 (exit status 137' in done.stderr, done.stderr[-2000:]
    assert 'run the command again' in done.stderr
    assert not (killed / 'compare.json').exists()
    assert (killed / 'cells' / 'vit' / 'seed_0' / 'checkpoints' / 'epoch_0001').is_dir()
    assert main(['compare', '--output', str(killed), *argv]) == 0
    straight, resumed = _record(tmp_path / 'straight'), _record(killed)
    assert _accuracies(resumed) == _accuracies(straight)
    assert resumed['seeds'] == [0, 1]
    for row in resumed['rows']:                    # seeds distinct, recorded in the record and in each cell
        assert [c['seed'] for c in row['cells']] == [0, 1]
        for c in row['cells']:
            import yaml
            assert yaml.safe_load((killed / c['run'] / 'config.yaml').read_text())['seed'] == c['seed']


@pytest.mark.slow
def test_timing_phase_remeasures_without_training(tmp_path, capsys, monkeypatch):
    out = tmp_path / 'grid'
    argv = ['compare', '--models', 'vit', 'swmlp', '--output', str(out), '--epochs', '1', '--limit-train-batches', '1',
            '--threads', '1', '--skip-speed']
    assert main(argv) == 0
    assert _record(out)['rows'][0]['train_img_per_s'] is None and not (out / 'speed.json').exists()
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob('model.safetensors')}
    argv = [a for a in argv if a != '--skip-speed'] + ['--measure-only', '--speed-rounds', '2']
    assert main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob('model.safetensors')} == stamps     # nothing trained
    speed, record = json.loads((out / 'speed.json').read_text()), _record(out)
    assert set(speed['train']) == set(speed['infer']) == {'vit', 'swmlp'} and speed['reference'] == 'vit'
    assert speed['environment']['cpu'] and speed['environment']['device'] == 'cpu'
    assert isinstance(speed['machine_load']['busy'], bool)
    for row in record['rows']:
        assert row['train_img_per_s'] > 0 and row['infer_img_per_s'] > 0 and row['peak_train_mib'] is not None
        assert row['train_ms_per_image'] == pytest.approx(1e3 / row['train_img_per_s'])
    assert record['rows'][0]['train_ratio']['ratio'] == 1.0                # the ViT against itself
    assert 'machine' in (out / 'leaderboard.md').read_text()
    # nothing to train, but another --speed-rounds: timed again at it (the old timings were kept, and the record's
    # command named rounds its timings did not have). The fresh processes were tested above; here the same calls
    # run in this process (three fresh interpreters fewer: ~22 s on a 2-core Zen 1), their JSON round trip kept
    def in_this_process(target, *args, **kwargs):
        module, _, function = target.partition(':')
        args, kwargs = json.loads(json.dumps([args, kwargs]))
        return json.loads(json.dumps(getattr(importlib.import_module(module), function)(*args, **kwargs)))

    monkeypatch.setattr('structformer.bench.harness.measure_in_subprocess', in_this_process)
    assert main([a for a in argv if a != '--measure-only'][:-1] + ['3']) == 0
    assert _record(out)['speed']['rounds'] == 3 and '--speed-rounds 3' in _record(out)['command']
    assert {p: p.stat().st_mtime_ns for p in out.rglob('model.safetensors')} == stamps
    # a timed model that is not the cell's model any more (retrained since, e.g. --overwrite --skip-speed after its
    # configuration changed): its old timings are not the record's
    from safetensors.torch import load_file, save_file
    weights = sorted(out.glob('cells/swmlp/seed_0/checkpoints/epoch_*/model.safetensors'))[-1]
    tensors = load_file(weights)
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, weights)
    assert main([a for a in argv if a != '--measure-only'][:-2] + ['--skip-speed']) == 0
    assert all(row['train_img_per_s'] is None for row in _record(out)['rows']) and _record(out)['speed'] is None


# ---- in1k and the page --------------------------------------------------------------------------------------------
def test_in1k_dry_run_prints_torchrun_commands_and_gpu_hours(capsys):
    capsys.readouterr()
    assert main(['compare', '--set', 'in1k', '--models', 'sparsifiner_deit_small', '--dry-run', '--output', 'grid',
                 '--data', 'imagefolder:/data/imagenet']) == 0
    out = capsys.readouterr().out
    commands = [line for line in out.splitlines() if line.startswith('torchrun')]
    assert len(commands) == 2 and 'deit_small_in1k' in commands[0]
    assert '--recipe sparsifiner_deit_small_in1k' in commands[1]
    assert '--teacher grid/cells/deit_small/seed_0' in commands[1]
    assert '--nproc_per_node 8' in commands[0] and 'GPU-hours' in out
    row = next(line.split() for line in out.splitlines() if line.startswith('deit_small '))
    gflops, epochs, hours = float(row[2]), int(row[3]), float(row[5])
    assert 4 < gflops / 2 < 5                # DeiT-S: 4.6 GMACs per 224-px image
    expected = (3 * 1_281_167 + 50_000) * epochs * gflops * 1e9 / 30e12 / 3600     # at the default 30 TFLOP/s
    assert hours == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize('extra', [['--publish', 'docs'], ['--no-match'], ['--skip-speed'], ['--jobs', '2', '--threads', '1'],
                                   ['--device', 'cpu'], ['--speed-rounds', '3']])
def test_in1k_refuses_what_it_would_ignore(extra, capsys):
    _one_error(['compare', '--set', 'in1k', '--dry-run', *extra], capsys, extra[0], '--set in1k', 'leave it out')


def test_in1k_data_is_an_imagenet_form_and_its_paths_are_quoted(capsys):
    import shlex
    _one_error(['compare', '--set', 'in1k', '--dry-run', '--data', 'digits'], capsys, '--data digits',
               'imagefolder:PATH')
    capsys.readouterr()
    assert main(['compare', '--set', 'in1k', '--models', 'sparsifiner_deit_small', '--dry-run',
                 '--data', 'imagefolder:/data/image net', '--output', 'my grid']) == 0
    command = [line for line in capsys.readouterr().out.splitlines() if line.startswith('torchrun')][1]
    words = shlex.split(command)
    assert words[words.index('--data') + 1] == 'imagefolder:/data/image net'
    assert words[words.index('--teacher') + 1] == 'my grid/cells/deit_small/seed_0'


def test_in1k_low_rank_rows_are_costed_as_the_factorised_model_they_train(capsys):
    """The factorised ResNet-50 runs two thin convolutions per layer: its GFLOPs and GPU-hours are its own, not the
    dense ResNet-50's; the pre-trained row is dense up to its switch (epoch 45 of 90), factorised after it."""
    capsys.readouterr()
    assert main(['compare', '--set', 'in1k', '--models', 'resnet50', 'resnet50_lowrank', 'resnet50_lowrank_pretrain',
                 '--dry-run']) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith('resnet50')}
    dense, lowrank, pretrain = (float(rows[k][2]) for k in ('resnet50', 'resnet50_lowrank', 'resnet50_lowrank_pretrain'))
    assert 4 < dense / 2 < 4.2                  # ResNet-50: 4.1 GMACs per 224-px image
    assert lowrank < 0.75 * dense and pretrain == lowrank          # rank 0.5: about 5.1 GFLOPs
    hours = {k: float(rows[k][5]) for k in rows}

    def cost(gflops, epochs):
        return (3 * 1_281_167 + 50_000) * epochs * gflops * 1e9 / 30e12 / 3600
    assert hours['resnet50_lowrank'] == pytest.approx(cost(lowrank, 90), rel=0.01)
    assert hours['resnet50_lowrank_pretrain'] == pytest.approx(cost(dense, 45) + cost(lowrank, 45), rel=0.01)


def test_the_pages_placeholders_are_said_where_its_commands_use_them():
    """The page's commands name `mnist:PATH` and `DIR` (a record keeps no user's paths): said what they are, and
    only where a command uses them."""
    from structformer.compare.leaderboard import _placeholders
    said = _placeholders({'record_command': 'structformer compare --set mnist --data mnist:PATH --publish docs',
                          'command': 'structformer compare --set mnist --data mnist:PATH --output DIR'})
    assert "`mnist:PATH`: a folder of MNIST's four IDX files" in said and '`DIR`: the grid folder' in said
    assert _placeholders({'record_command': 'structformer compare --set quick --data digits', 'command': None}) == ''


def test_leaderboard_page_is_the_render_of_its_record():
    from structformer.compare.leaderboard import render
    record = json.loads((ROOT / 'docs' / 'leaderboard' / 'record.json').read_text())
    assert (ROOT / 'docs' / 'leaderboard.md').read_text() == render(record, figures='leaderboard')
    for name in record['figures']:
        assert (ROOT / 'docs' / 'leaderboard' / name).is_file()
    assert record['record_command'] in (ROOT / 'docs' / 'leaderboard.md').read_text()


@pytest.mark.slow
def test_sigterm_to_the_grid_stops_its_workers(tmp_path):
    """`kill` of `compare --jobs 2` (a scheduler's stop): the workers are stopped with it, their checkpoints intact,
    and none is left training as an orphan that holds its cell's run lock; exit status 143 and one line."""
    import signal
    import time
    out = tmp_path / 'grid'
    argv = ['--models', 'vit', 'swmlp', '--seeds', '1', '--skip-speed', '--epochs', '40', '--limit-train-batches', '2',
            '--threads', '1', '--jobs', '2', '--output', str(out)]
    grid = Forked(main, ['compare', *argv], env={'PYTHONPATH': str(ROOT)})     # tests/forking.py

    def workers():
        found = []
        for entry in Path('/proc').iterdir():
            try:
                line = (entry / 'cmdline').read_bytes().decode(errors='replace')
            except OSError:
                continue
            if entry.name.isdigit() and 'train_planned' in line and str(out) in line:
                found.append(int(entry.name))
        return found

    deadline = time.monotonic() + 120
    # a cell's first epoch is committed once its metrics line is written (a stop between its checkpoint and that
    # line still counts as a new run stopped before its first epoch, and leaves nothing behind)
    while not any(p.stat().st_size for p in (out / 'cells').glob('*/seed_0/metrics.jsonl')):
        assert grid.poll() is None and time.monotonic() < deadline, grid.stderr[-2000:]
        time.sleep(0.2)
    assert workers()
    grid.send_signal(signal.SIGTERM)
    status = grid.wait(timeout=120)
    stderr = grid.stderr
    grid.close()
    assert status == 143 and stderr.strip().endswith('interrupted; checkpoints already written are intact'), stderr
    assert workers() == []
    assert any((out / 'cells').glob('*/seed_0/checkpoints/epoch_*/model.safetensors')), \
        sorted(str(p.relative_to(out)) for p in (out / 'cells').rglob('*'))   # kept (keep_last 1)


def test_the_readme_quotes_the_committed_leaderboard():
    """README's leaderboard summary is the committed record's (a new record: update the README), and its plot is
    the one published beside the page."""
    record = json.loads((ROOT / 'docs' / 'leaderboard' / 'record.json').read_text())
    rows = {r['key']: r for r in record['rows']}
    readme = ' '.join((ROOT / 'README.md').read_text().replace('**', '').split())
    assert record['set'] == 'mnist' and record['seeds'] == [0, 1, 2] and f"{record['budget'] // 1000}K" in readme
    for key in ('softpp', 'wrn', 'wrn_lowrank_0.25', 'rp_mixer', 'swmlp', 'mixer', 'crate', 'vit_linformer',
                'sparsifiner', 'vit'):
        text = f"{rows[key]['top1_mean']:.2f} ± {rows[key]['top1_se']:.2f} %"
        assert text in readme, (key, text)
    assert f"{rows['wrn_lowrank_0.25']['params'] / rows['wrn']['params']:.2f}× its parameters" in readme
    assert f"{rows['swmlp']['train_ratio']['ratio']:.2f}× the ViT's speed" in readme
    assert 'docs/leaderboard/accuracy_vs_time.png' in readme and 'accuracy_vs_time.png' in record['figures']


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob('*')) if p.is_file()}


@pytest.mark.parametrize('failure', [None, 'missing-plot', 'interrupted'])
def test_publish_is_all_or_nothing(tmp_path, monkeypatch, failure):
    """`compare --publish DOCS`: the page, its record and its plots change together or not at all. A plot that
    cannot be copied or a Ctrl-C while the page renders leaves DOCS byte for byte as it was, with no temporaries;
    a publish that succeeds replaces the folder whole (a plot the new record lacks does not stay)."""
    from structformer.compare import leaderboard, report
    docs, output = tmp_path / 'docs', tmp_path / 'out'
    (docs / 'leaderboard').mkdir(parents=True)
    output.mkdir()
    (docs / 'leaderboard.md').write_text('old page')
    (docs / 'leaderboard' / 'record.json').write_text('{"old": 1}')
    for name in ('accuracy_vs_time.png', 'dropped.png'):
        (docs / 'leaderboard' / name).write_bytes(b'old plot')
    (output / 'accuracy_vs_time.png').write_bytes(b'new plot')
    if failure != 'missing-plot':
        (output / 'accuracy_vs_params.png').write_bytes(b'new plot 2')
    record = {'figures': ['accuracy_vs_time.png', 'accuracy_vs_params.png'], 'rows': []}

    def render(record, figures):
        if failure == 'interrupted':
            raise KeyboardInterrupt
        return f'new page, plots in {figures}/'

    monkeypatch.setattr(leaderboard, 'render', render)
    before = _tree(docs)
    if failure is None:
        assert report.publish(record, output, docs) == docs / 'leaderboard.md'
        assert _tree(docs) == {'leaderboard.md': b'new page, plots in leaderboard/',
                               'leaderboard/accuracy_vs_params.png': b'new plot 2',
                               'leaderboard/accuracy_vs_time.png': b'new plot',
                               'leaderboard/record.json': json.dumps(record, indent=1).encode()}
        return
    with pytest.raises(KeyboardInterrupt if failure == 'interrupted' else FileNotFoundError):
        report.publish(record, output, docs)
    assert _tree(docs) == before and sorted(p.name for p in docs.iterdir()) == ['leaderboard', 'leaderboard.md']


# ---- reuse keyed on the code that made a result ---------------------------------------------------------------
def test_a_cell_trained_by_other_code_is_marked_then_retrained_with_overwrite(tmp_path, monkeypatch, capsys):
    """A finished cell was reused on its configuration alone: one trained by older code (another model definition
    or training loop) went into the record as current. Now each cell keeps the stamps of the code that trained it
    (code.json): under other code the cell is kept but marked stale (its row †, named on the page), and --overwrite
    trains it anew under this code's stamp."""
    from structformer import records
    from structformer.compare.report import current_timings
    out = tmp_path / 'grid'
    argv = ['compare', '--models', 'swmlp', '--seeds', '1', '--output', str(out), '--skip-speed', '--epochs', '1',
            '--limit-train-batches', '1', '--threads', '1']
    assert main(argv) == 0
    first = records.source_digest()
    cell = out / 'cells' / 'swmlp' / 'seed_0'
    assert json.loads((cell / 'code.json').read_text()) == {'source': [first]}
    record = _record(out)
    assert record['code'] == {'source': first} and 'stale' not in record['rows'][0]['cells'][0]
    written = {p: p.stat().st_mtime_ns for p in cell.rglob('model.safetensors')}

    monkeypatch.setitem(records._DIGEST, 'source', 'f' * 16)             # the code changed since
    capsys.readouterr()
    assert main(argv) == 0
    assert 'were trained by other code than this (swmlp/seed_0)' in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in cell.rglob('model.safetensors')} == written     # kept, not retrained
    row = _record(out)['rows'][0]
    assert row['stale'] == 1 and first in row['cells'][0]['stale'] and 'f' * 16 in row['cells'][0]['stale']
    page = (out / 'leaderboard.md').read_text()
    assert '| SW-MLP † |' in page and f"swmlp/seed_0 (trained by other code (source {first};" in page
    # timings taken by the other code are not this code's either
    assert current_timings({'environment': {'source': first}, 'train': {}}, []) is None

    assert main(argv + ['--overwrite']) == 0
    assert json.loads((cell / 'code.json').read_text()) == {'source': ['f' * 16]}
    retrained = {p: p.stat().st_mtime_ns for p in cell.rglob('model.safetensors')}
    assert retrained and all(retrained.get(p) != t for p, t in written.items())        # trained anew
    row = _record(out)['rows'][0]
    assert row['stale'] == 0 and 'stale' not in row['cells'][0] and '| SW-MLP |' in (out / 'leaderboard.md').read_text()

    (cell / 'code.json').unlink()                                   # a cell from before the stamps were kept
    assert main(argv) == 0
    assert _record(out)['rows'][0]['cells'][0]['stale'] == 'trained before compare kept code stamps'


def test_the_source_stamp_changes_with_the_model_code_only(tmp_path):
    """records.source_digest hashes the packages that build, feed and train a model: an edit there changes it, an
    edit elsewhere (the CLI, the docs) does not."""
    import shutil

    from structformer import records
    package = Path(records.__file__).resolve().parent
    copy = tmp_path / 'structformer'
    for name in ('models', 'train'):
        shutil.copytree(package / name, copy / name, ignore=shutil.ignore_patterns('__pycache__'))
    (copy / 'cli.py').write_text('# the command line\n')
    before = records.source_digest(copy)
    (copy / 'cli.py').write_text('# the command line, edited\n')
    assert records.source_digest(copy) == before
    engine = copy / 'train' / 'engine.py'
    engine.write_text(engine.read_text() + '\n# a change to the training loop\n')
    assert records.source_digest(copy) != before


def test_a_pretrained_low_rank_cell_inherits_the_dense_cells_code(tmp_path, monkeypatch):
    """The pre-trained low-rank cell's dense epochs are the dense cell's, copied in: a dense cell trained by other
    code makes it stale too, though its own epochs ran under this code."""
    from structformer import records
    out = tmp_path / 'grid'
    argv = ['--seeds', '1', '--output', str(out), '--skip-speed', '--epochs', '2', '--limit-train-batches', '1',
            '--threads', '1']
    import shutil
    monkeypatch.setitem(records._DIGEST, 'source', 'a' * 16)
    assert main(['compare', '--models', 'vit_lowrank_0.5_pretrained', *argv]) == 0
    cell = out / 'cells' / 'vit_lowrank_0.5_pretrained' / 'seed_0'
    shutil.rmtree(cell)                           # the dense cell keeps its checkpoint at the switch for it
    monkeypatch.setitem(records._DIGEST, 'source', 'b' * 16)
    assert main(['compare', '--models', 'vit_lowrank_0.5_pretrained', *argv]) == 0
    assert json.loads((cell / 'code.json').read_text()) == {'source': ['a' * 16, 'b' * 16]}
    rows = {r['key']: r for r in _record(out)['rows']}
    assert rows['vit']['stale'] == rows['vit_lowrank_0.5_pretrained']['stale'] == 1
    assert 'a' * 16 in rows['vit_lowrank_0.5_pretrained']['cells'][0]['stale']
