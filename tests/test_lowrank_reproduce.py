"""`structformer reproduce lowrank`: its plan covers the seed's tables, the findings read the results
the right way round, bad arguments are one-line errors. (The runs themselves are the engine's, tested
in test_lowrank_train.py; a full reproduction takes minutes and is documented in docs/lowrank.md.)"""
import argparse
import json

import pytest

from structformer.cli import main
from structformer.reproduce import lowrank


def _args(**overrides):
    parser = argparse.ArgumentParser()
    lowrank.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_plan_covers_inits_decay_and_pretraining():
    runs = lowrank._plan(_args(epochs=6))
    names = {(r['part'], r['name']) for r in runs}
    for rank in (0.1, 0.2, 0.3):
        for init in ('he', 'spectral', 'spectral_ones'):
            assert ('vision', f'r{rank:g}_{init}') in names
    assert {('vision', 'r0.1_spectral_frobenius'), ('vision', 'r0.2_spectral_frobenius')} <= names
    assert [n for p, n in names if 'pretrain' in n and p == 'vision'] == ['r0.2_spectral_pretrain2']   # a third of 6
    assert {('lm', 'dense'), ('lm', 'r0.62_spectral'), ('lm', 'r0.62_spectral_pretrain2')} <= names
    config = lowrank._config(next(r for r in runs if r['name'] == 'r0.2_spectral_pretrain2'), _args(epochs=6),
                             lowrank.Path('/tmp/x'))
    assert (config.factorize_at, config.factorize_rank, config.opt, config.weight_decay) == (2, 0.2, 'sgd', 5e-4)


def _result(part, name, group, rank=None, init=None, metric=0.0, eff=None, decay=None):
    key = 'val_top1' if part == 'vision' else 'val_perplexity'
    return {'part': part, 'name': name, 'group': group, 'rank': rank, 'init': init, 'decay': decay, key: metric,
            'effective_rank_mean': eff}


def test_findings_compare_in_the_right_direction():
    results = [_result('lm', 'dense', 'baseline', metric=30),
               _result('lm', 'r0.62_he', 'init', 0.62, 'he', metric=40),
               _result('lm', 'r0.62_spectral', 'init', 0.62, 'spectral', metric=35, eff=10),
               _result('lm', 'r0.62_spectral_ones', 'init', 0.62, 'spectral_ones', metric=36),
               _result('lm', 'r0.62_spectral_frobenius', 'decay', 0.62, 'spectral', metric=34, eff=12),
               _result('lm', 'r0.62_spectral_pretrain1', 'pretrain', 0.62, 'spectral', metric=33)]
    claims = lowrank.findings(results, {})
    assert 'spectral init beats He at 1 of 1' in claims[0]                      # lower perplexity is better
    assert 'higher effective rank than L2 at 1 of 1' in claims[1] and 'better at 1 of 1' in claims[1]
    assert 'pre-training beats low-rank from the start at 1 of 1' in claims[2]


def test_vision_findings_do_not_count_a_lead_inside_the_noise():
    """'spectral init beats He at k of n' counted any lead: 11.50 % against 9.90 % (both at chance after 4 steps)
    was a win. On 2,000 held-out images two standard errors of that difference are 1.95 points."""
    results = [_result('vision', 'dense', 'baseline', metric=19.45),
               _result('vision', 'r0.1_he', 'init', 0.1, 'he', metric=9.90),
               _result('vision', 'r0.1_spectral', 'init', 0.1, 'spectral', metric=11.50, eff=11.296),
               _result('vision', 'r0.2_he', 'init', 0.2, 'he', metric=70.0),
               _result('vision', 'r0.2_spectral', 'init', 0.2, 'spectral', metric=80.0, eff=8.0),
               _result('vision', 'r0.1_spectral_frobenius', 'decay', 0.1, 'spectral', metric=11.40, eff=11.298)]
    claims = lowrank.findings(results, {})
    assert 'spectral init beats He at 1 of 2 rank(s) beyond two standard errors (0 behind beyond them, 1 within' \
        in claims[0]
    assert 'scores better at 0 of 1 rank(s) beyond two standard errors (0 behind beyond them, 1 within' in claims[1]
    assert lowrank.two_standard_errors(11.5, 9.9) == pytest.approx(1.95, abs=0.01)


@pytest.mark.parametrize('argv, message', [(['--epochs', '1'], '--epochs'), (['--ranks', '0'], '--ranks'),
                                           (['--data', '/no/such/mnist'], '--data'),
                                           (['--interpolate-steps', '1'], '--interpolate-steps'),
                                           # were named as --data-kwargs max_bytes / seq_len, flags it has not
                                           (['--parts', 'lm', '--lm-max-bytes', '-5'], '--lm-max-bytes must be'),
                                           (['--parts', 'lm', '--lm-max-bytes', '100'], '--lm-max-bytes 100: too little'),
                                           # refused only after the dense baseline had trained, pointing at a flag
                                           # (--transform) this command has not
                                           (['--parts', 'lm', '--lm-rank', '1.0'], '--lm-rank 1 (lm part'),
                                           (['--parts', 'vision', '--ranks', '0.2', '0.95'], '--ranks 0.95 (vision')])
def test_reproduce_lowrank_bad_arguments(argv, message, capsys, tmp_path):
    try:
        status = main(['reproduce', 'lowrank', *argv, '--output', str(tmp_path / 'out')])
    except SystemExit as e:             # refused by the parser (a value outside its flag's range)
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert message in err and '--data-kwargs' not in err and '--transform' not in err    # flags it has not
    assert not (tmp_path / 'out').exists()


def test_a_finished_run_is_reused_only_with_the_planned_settings(tmp_path, monkeypatch):
    """Any folder with a summary.json was reused: `--seed 1` into the output of a seed-0 reproduction reported the
    seed-0 runs under args seed 1. Now the saved config.yaml must be the planned one (data compared absolute)."""
    import yaml

    from structformer.reproduce.lowrank import reusable
    from structformer.train import TrainConfig
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'mnist').mkdir()
    folder = tmp_path / 'vision' / 'r0.2_spectral'
    folder.mkdir(parents=True)
    planned = TrainConfig(model='wrn_16_2_mnist', data='mnist:mnist', seed=0, epochs=2, factorize_rank=0.2,
                          output=str(folder))
    assert not reusable(folder, planned)                                 # nothing trained there yet
    saved = dict(planned.to_dict(), data=f'mnist:{tmp_path / "mnist"}')  # as the engine writes it: absolute
    (folder / 'config.yaml').write_text(yaml.safe_dump(json.loads(json.dumps(saved))))
    assert not reusable(folder, planned)                                 # no summary: not finished
    (folder / 'summary.json').write_text('{}')
    assert reusable(folder, planned)
    for change in ({'seed': 1}, {'epochs': 3}, {'factorize_rank': 0.3}, {'data': 'mnist:other'}, {'lr': 0.5}):
        assert not reusable(folder, TrainConfig(**dict(planned.to_dict(), **change))), change


def test_the_interpolation_scores_the_whole_held_out_split(tmp_path, monkeypatch):
    """The interpolation lines scored only the first 1,000 held-out samples, so their ends were not the runs'
    held-out losses of the tables beside them (the committed LM line starts at 3.144, its dense baseline's table
    loss is 3.037); now the whole split, and the record says how many samples a line saw."""
    import structformer.analysis.interpolate as interpolate
    import structformer.data as data
    import structformer.train.checkpoint as checkpoint
    held_out = list(range(1200))
    seen = []
    monkeypatch.setattr(data, 'build_datasets', lambda *a, **k: (None, held_out, None))
    monkeypatch.setattr(checkpoint, 'load_model', lambda folder: (folder, None))
    monkeypatch.setattr(interpolate, 'interpolation_curve',
                        lambda a, b, loader, ts: seen.append(len(loader.dataset)) or [{'t': t, 'loss': 1.0} for t in ts])
    results = [dict(_result('lm', 'dense', 'baseline'), folder='d'),
               dict(_result('lm', 'r0.62_spectral', 'init', 0.62, 'spectral'), folder='s'),
               dict(_result('lm', 'r0.62_spectral_pretrain1', 'pretrain', 0.62, 'spectral'), folder='p', at=1)]
    curves = lowrank._interpolations(results, _args(parts=['lm'], interpolate_steps=3), tmp_path)
    assert seen == [1200, 1200]
    assert (curves['lm']['samples'], curves['lm']['held_out']) == (1200, 1200)
    assert lowrank.interpolation_samples(curves['lm']) == ''
    assert 'first 1,000 of the 1,587' in lowrank.interpolation_samples({'samples': 1000, 'held_out': 1587})


def test_the_papers_numbers_are_named_in_the_record():
    """results.json's 'paper' held bare pairs ('WRN': [39.87, 16.4]): which of Table 1's columns was Frobenius decay
    and which L2 was nowhere in the record. Seed 004's Tables 1, 2, 4 and 5, by name."""
    paper = lowrank.PAPER
    assert paper['table1_effective_rank']['WRN'] == {'frobenius': 39.87, 'l2': 16.4}
    assert paper['table1_effective_rank']['LM'] == {'frobenius': 206.93, 'l2': 205.70}
    assert paper['table2'][0.1] == {'he': 77.94, 'spectral': 79.84, 'spectral_ones': 79.07}
    assert paper['table2'][0.3]['spectral_ones'] == 81.61 and paper['table2']['baseline'] == 81.08
    assert paper['table4'][0.62] == {'he': 39.6, 'spectral': 38.78, 'spectral_ones': 38.47}
    assert paper['table5'][0.1] == {'frobenius': 79.84, 'l2': 73.12}
