"""`structformer reproduce mixer`: its plan follows the fixed-Ω design, its verdicts follow the numbers, and a
tiny run goes end to end on the real MNIST."""
import argparse
import json
from pathlib import Path

import pytest

from structformer.cli import main
from structformer.models.mixer_design import omega
from structformer.reproduce import mixer

MNIST = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'mnist'


def _args(*argv):
    p = argparse.ArgumentParser()
    mixer.add_arguments(p)
    return p.parse_args(list(argv))


def test_parse_omega():
    assert mixer.parse_omega('2^15') == mixer.parse_omega('2**15') == mixer.parse_omega('32768') == 32768
    with pytest.raises(argparse.ArgumentTypeError):
        mixer.parse_omega('lots')


def test_plan_keeps_omega_fixed_and_matches_sw_mlp():
    runs = mixer.plan(_args('--seeds', '1'))
    width = [r for r in runs if r['group'] == 'width' and r['kind'] != 'SW-MLP']
    assert {r['channels'] for r in width} == {8, 16, 32, 64, 128}
    for r in width:       # integer S: within one token of the curve
        assert abs(omega(r['tokens'], r['channels']) - 2 ** 15) <= omega(r['tokens'] + 1, r['channels']) - \
            omega(r['tokens'], r['channels'])
        assert r['kwargs']['skip_layer'] is True
    sw = [r for r in runs if r['kind'] == 'SW-MLP']
    for r in sw:
        assert r['width'] % 49 == 0 and r['density'] * r['width'] ** 2 == pytest.approx(2 ** 15)
    depth = [r for r in runs if r['group'] == 'depth']
    assert {(r['kind'], r['depth']) for r in depth} == {(k, d) for k in ('S-Mixer', 'RP S-Mixer') for d in (2, 4, 8)}
    assert all(r['channels'] == r['tokens'] == 32 for r in depth)


def _row(group, kind, error, **kw):
    return dict(group=group, kind=kind, val_top1=100 - error, **kw)


def _seeds(group, kind, error, spread=0.1, **kw):
    """Two seeds at error ± spread: mean `error`, standard error `spread`."""
    return [_row(group, kind, error - spread, **kw), _row(group, kind, error + spread, **kw)]


def test_verdicts_follow_the_numbers():
    rows = [r for c, m, e in ((8, 700, 5.0), (32, 1024, 3.0), (128, 512, 6.0))
            for r in _seeds('width', 'S-Mixer', e, channels=c, width=m)]
    rows += [r for d, e in ((2, 4.0), (8, 3.0)) for r in _seeds('depth', 'S-Mixer', e, depth=d)]
    rows += [r for d, e in ((2, 6.0), (8, 3.2)) for r in _seeds('depth', 'RP S-Mixer', e, depth=d)]
    found = mixer.verdicts(rows, 2 ** 15)
    assert "'Best near C = S' HOLDS" in found['best_near_c_equals_s_S-Mixer']
    assert 'C = 32' in found['best_near_c_equals_s_S-Mixer']
    assert 'HOLDS here: the gap shrinks' in found['rp_catches_up_with_depth']
    assert "'Error falls as the width grows at fixed Ω' HOLDS" in found['wider_is_better_S-Mixer']
    for r in rows[2:4]:
        r['val_top1'] -= 6.0                 # C = 32 now at 9 %: best at C = 8
    for r in rows[-2:]:
        r['val_top1'] -= 5.8                 # RP falls further behind at L = 8
    found = mixer.verdicts(rows, 2 ** 15)
    assert 'DOES NOT HOLD (C = 8, C = 128 lower' in found['best_near_c_equals_s_S-Mixer']
    # ρ = +0.48 over 6 runs (exact one-sided p = 0.87 for a fall, 0.2 for a rise): no trend either way
    assert "grows at fixed Ω' CANNOT TELL at this scale (no trend either way" in found['wider_is_better_S-Mixer']
    assert 'DOES NOT HOLD here: the gap grows' in found['rp_catches_up_with_depth']


def test_the_width_trend_is_neither_vacuous_nor_read_from_no_evidence():
    """'Error falls as the width grows' read scipy's t-approximate Spearman p: three SW-MLP runs (--seeds 1, the
    default three densities) in perfect order got p = 0 and HOLDS, where chance alone orders them so one time in 6;
    no significant fall was read as DOES NOT HOLD (the committed record's SW-MLP, p = 0.32), and every run at one
    error gave ρ = nan and DOES NOT HOLD."""
    def found(errors, widths):
        rows = [_row('width', 'SW-MLP', e, width=m, channels=m // 49) for e, m in zip(errors, widths)]
        return mixer.verdicts(rows, 2 ** 15)['wider_is_better_SW-MLP']
    three = found([3.0, 2.0, 1.0], [245, 490, 1029])
    assert 'p = 0.17, exact' in three and "CANNOT TELL at this scale (3 runs cannot show a trend" in three
    assert "HOLDS" not in three
    four = found([4.0, 3.0, 2.0, 1.0], [245, 490, 735, 1029])        # chance 1/24 < 5 %: a perfect order counts
    assert "p = 0.042, exact" in four and "fixed Ω' HOLDS here" in four
    assert "CANNOT TELL at this scale (every run has the same error" in found([2.0] * 4, [245, 490, 735, 1029])
    assert "CANNOT TELL at this scale (no trend either way" in found([2.25, 1.95, 2.0, 1.85, 2.25, 1.65],
                                                                    [245, 245, 490, 490, 1029, 1029])
    rises = found([1.0, 1.1, 2.0, 2.1, 3.0, 3.1], [245, 245, 490, 490, 1029, 1029])
    assert "DOES NOT HOLD (error rises with m" in rises
    assert mixer.rank_trend([1, 2, 3], [3, 2, 1], 'less')[1] == pytest.approx(1 / 6)


def test_verdicts_do_not_read_noise_or_one_seed_as_a_result():
    """The committed record's S-Mixer: C = 32 at 3.12 % against 3.27 % at C = 16, seeds 0.45 points apart, was read
    'HOLDS'; a 0.15-point lead inside two standard errors (±0.64) cannot tell. One seed has no standard error."""
    rows = [_row('width', 'S-Mixer', e, channels=c, width=m) for c, m, e in
            ((8, 696, 3.7), (8, 696, 3.9), (16, 896, 3.05), (16, 896, 3.5), (32, 1024, 2.9), (32, 1024, 3.35))]
    rows += [r for d, e in ((2, 4.0), (8, 3.0)) for r in _seeds('depth', 'S-Mixer', e, spread=0.3, depth=d)]
    rows += [r for d, e in ((2, 4.8), (8, 3.4)) for r in _seeds('depth', 'RP S-Mixer', e, spread=0.3, depth=d)]
    found = mixer.verdicts(rows, 2 ** 15)
    assert "'Best near C = S' CANNOT TELL at this scale (C = 16 within two standard errors" in \
        found['best_near_c_equals_s_S-Mixer']
    # RP behind by 0.8 ± 0.42 (2 SE 0.85): not behind beyond the noise, no gap to close
    assert 'DOES NOT APPLY here' in found['rp_catches_up_with_depth']
    for r in rows:
        if r['group'] == 'depth' and r['kind'] == 'RP S-Mixer' and r['depth'] == 2:
            r['val_top1'] -= 1.0             # behind by 1.8 at L = 2, 0.4 at L = 8: shrinks by 1.4 > 2 SE (±1.2)
    found = mixer.verdicts(rows, 2 ** 15)
    assert 'HOLDS here: the gap shrinks' in found['rp_catches_up_with_depth']
    for r in rows:
        if r['group'] == 'depth' and r['kind'] == 'RP S-Mixer' and r['depth'] == 8:
            r['val_top1'] -= 1.0             # behind by 1.8 at L = 2 and 1.4 at L = 8: within 2 SE (±1.2)
    found = mixer.verdicts(rows, 2 ** 15)
    assert 'CANNOT TELL at this scale: the gap at L=8' in found['rp_catches_up_with_depth']
    single = [r for r in rows if r['val_top1'] == max(q['val_top1'] for q in rows if q['group'] == r['group']
                                                       and q['kind'] == r['kind'] and q.get('channels') ==
                                                       r.get('channels') and q.get('depth') == r.get('depth'))]
    found = mixer.verdicts(single, 2 ** 15)
    assert 'one seed gives no standard error' in found['best_near_c_equals_s_S-Mixer']
    assert 'one seed gives no standard error' in found['rp_catches_up_with_depth']


@pytest.mark.skipif(not MNIST.is_dir(), reason='needs ../shared/data/mnist')
def test_tiny_reproduction_end_to_end(tmp_path):
    out = tmp_path / 'mixer'
    assert main(['reproduce', 'mixer', '--data', str(MNIST), '--epochs', '1', '--seeds', '1', '--channels', '32',
                 '--depths', '2', '--sw-densities', '0.25', '--depth', '2', '--limit-train-batches', '2',
                 '--spectra-trials', '0', '--output', str(out)]) == 0
    result = json.loads((out / 'results.json').read_text())
    assert result['command'].startswith('structformer reproduce mixer --data ')
    assert '--channels 32 ' in result['command']
    assert len(result['rows']) == 5 and {r['kind'] for r in result['rows']} == {'S-Mixer', 'RP S-Mixer', 'SW-MLP'}
    for r in result['rows']:      # each row is its run's own final number
        summary = json.loads((Path(r['run']) / 'summary.json').read_text())
        assert r['val_top1'] == summary['final_val_top1'] and summary['model'] == r['model']
    report = (out / 'report.md').read_text()
    assert '## Verdicts' in report and "'Best near C = S'" not in report      # one C only: no width verdict
    assert "'RP catches up with depth'" not in report                         # one depth only: no depth verdict


def test_spectra_verdict_follows_the_trend():
    def rows(sw):
        return [dict(channels=c, width=100 * (i + 1), density=0.1, mixer_token=2.41 + (0.01 if i % 2 else -0.01),
                     mixer_channel=2.4, sw_mlp=v, marchenko_pastur_edge=1 + 2 ** 0.5)
                for i, (c, v) in enumerate(zip(range(4, 40, 4), sw))]
    rising = mixer.spectra_verdict(rows([2.40 + 0.01 * i for i in range(9)]))['spectra']
    assert "does not' HOLDS" in rising
    flat = mixer.spectra_verdict(rows([2.45, 2.40, 2.46, 2.41, 2.44, 2.42, 2.43, 2.41, 2.44]))['spectra']
    assert 'DOES NOT HOLD' in flat
    assert mixer.predicted_sw_sigma({'density': 1.0, 'width': 50}) == pytest.approx(1 + 2 ** 0.5)


def test_report_only_rebuilds_from_results(tmp_path):
    rows = [_row('width', 'S-Mixer', e, channels=c, tokens=64 // c, width=64 * c, omega=2 ** 15)
            for c, e in ((8, 5.0), (32, 3.0))]
    (tmp_path / 'results.json').write_text(json.dumps({'recipe': {'epochs': 1}, 'omega': 2 ** 15, 'rows': rows,
                                                       'spectra': [], 'environment': {'cpu': 'then'}}))
    assert main(['reproduce', 'mixer', '--report-only', '--output', str(tmp_path)]) == 0
    saved = json.loads((tmp_path / 'results.json').read_text())
    assert saved['environment'] == {'cpu': 'then'}
    assert 'one seed gives no standard error' in saved['verdicts']['best_near_c_equals_s_S-Mixer']   # refreshed
    assert '| S-Mixer | 32 |' in (tmp_path / 'report.md').read_text()


def test_report_only_refuses_another_commands_results_in_one_line(tmp_path, capsys):
    (tmp_path / 'results.json').write_text(json.dumps({'recipe': {}, 'curves': {}, 'verdict': {}}))   # crate's
    assert main(['reproduce', 'mixer', '--report-only', '--output', str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert 'Traceback' not in err and err.count('error:') == 1
    assert "results.json: should be the results.json of `reproduce mixer`, but it has no 'omega'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ['results.json']


def test_pairs_off_the_fixed_omega_curve_are_refused_before_training(tmp_path, capsys):
    """--omega 16 with the default C = 8 … 128 planned S = 1 for every C (Ω of the pairs 36 … 8,256) and trained
    them as points of a 'fixed-Ω' sweep; `design` flags such pairs, the reproduction now refuses them by name."""
    out = tmp_path / 'out'
    assert main(['reproduce', 'mixer', '--data', str(tmp_path), '--omega', '2^10', '--channels', '8', '64',
                 '--output', str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count('error:') == 1 and 'Traceback' not in err
    assert '--channels 64: off the fixed-Ω curve at --omega 1024' in err and 'accepted C up to 54' in err
    assert not out.exists()
    assert [r['channels'] for r in omega_pairs(2 ** 10, range(50, 60)) if not r['on_curve']] == [55, 56, 57, 58, 59]


def omega_pairs(omega_, channels):
    from structformer.models.mixer_design import fixed_omega_pairs
    return fixed_omega_pairs(omega_, list(channels), 1.0)


@pytest.mark.skipif(not MNIST.is_dir(), reason='needs ../shared/data/mnist')
def test_a_model_that_cannot_be_built_is_refused_before_anything_trains(tmp_path, capsys, monkeypatch):
    """--sw-densities 1e-9 asks for a width-5.7M SW-MLP (131 TB of dense weights): refused in one line before the
    first run trains (it failed after the S-Mixer rows had trained), and no output folder is left. Before the
    init-spectra sweep too (a minute of SVDs with the default --spectra-trials 3: it ran first)."""
    import structformer.analysis.mixer_spectra as spectra
    swept = []
    monkeypatch.setattr(spectra, 'init_spectrum_sweep', lambda **kw: swept.append(kw) or [])
    out = tmp_path / 'out'
    assert main(['reproduce', 'mixer', '--data', str(MNIST), '--channels', '32', '--depths', '2', '--seeds', '1',
                 '--sw-densities', '1e-9', '--epochs', '1', '--limit-train-batches', '1', '--output', str(out)]) == 2
    assert swept == []
    err = capsys.readouterr().err
    assert err.count('error:') == 1 and 'Traceback' not in err
    assert '--sw-densities: density 1e-09 at --omega 32768 is a width-5724327 SW-MLP' in err
    assert '--model-kwargs' not in err                      # this command has no such flag
    assert not out.exists()



def _stamps(out):
    """{run folder name: summary.json's (inode, mtime)}: a run trained again writes a new summary."""
    return {p.parent.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / 'runs').glob('*/summary.json')}


@pytest.mark.skipif(not MNIST.is_dir(), reason='needs ../shared/data/mnist')
def test_an_interrupted_study_reuses_its_finished_runs(tmp_path, capsys):
    """Run again into its --output, the study trained every run anew (an interrupted one started over). A finished
    run of the planned settings made by this code is reused now; one that did not finish, one of another setting
    and one stamped by other code (records.source_digest in its checkpoints' state.json) train anew."""
    import yaml
    out = tmp_path / 'mixer'
    argv = ['reproduce', 'mixer', '--data', str(MNIST), '--epochs', '1', '--seeds', '1', '--channels', '32',
            '--depths', '2', '--sw-densities', '0.25', '--depth', '1', '--limit-train-batches', '1',
            '--spectra-trials', '0', '--output', str(out)]
    assert main(argv) == 0
    first = {r['run']: r for r in json.loads((out / 'results.json').read_text())['rows']}
    before = _stamps(out)
    assert len(before) == 5
    unfinished, other_setting, other_code, *kept = sorted(before)
    (out / 'runs' / unfinished / 'summary.json').unlink()                 # interrupted before its summary
    config = out / 'runs' / other_setting / 'config.yaml'
    config.write_text(yaml.safe_dump(dict(yaml.safe_load(config.read_text()), lr=0.5)))
    for state in (out / 'runs' / other_code / 'checkpoints').glob('*/state.json'):
        record = json.loads(state.read_text())
        record['environment']['source'] = '0123456789abcdef'
        state.write_text(json.dumps(record))
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    after = _stamps(out)
    assert sorted(name for name in before if after[name] != before[name]) == [unfinished, other_setting, other_code]
    for name in kept:
        assert f"reusing the finished run in {out / 'runs' / name}" in printed
    again = {r['run']: r for r in json.loads((out / 'results.json').read_text())['rows']}
    assert set(again) == set(first)
    for run in again:                  # a reused row is its run's numbers, as the first pass recorded them
        if Path(run).name in kept:
            assert again[run] == first[run]


@pytest.mark.skipif(not MNIST.is_dir(), reason='needs ../shared/data/mnist')
@pytest.mark.parametrize('argv, blamed', [(['--depths', '1000000000'], '--depths 1000000000: C = S = 32'),
                                          (['--depth', '1000000000'], '--channels 32 at --depth 1000000000')])
def test_a_depth_the_machine_cannot_build_is_blamed_on_its_flag(tmp_path, capsys, argv, blamed):
    """--depths 10**9 (the depth sweep) was refused as '--channels 32: C = 32, S = 32, which this machine cannot
    build', naming a flag the user had not given (the sweep's C = S = C* happened to be 32)."""
    out = tmp_path / 'out'
    assert main(['reproduce', 'mixer', '--data', str(MNIST), '--channels', '32', '--depths', '2', '--seeds', '1',
                 '--sw-densities', '0.25', '--spectra-trials', '0', *argv, '--output', str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count('error:') == 1 and 'Traceback' not in err
    assert f'error: {blamed}' in err and 'which this machine cannot build' in err, err
    assert not out.exists()
