"""`structformer reproduce sparsifiner`: its rows, its verdict rule, and a smoke run on a small MNIST subset."""
import argparse
import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from structformer.cli import main
from structformer.data.mnist import read_idx
from structformer.reproduce import sparsifiner as repro

MNIST = Path(__file__).resolve().parents[1] / '..' / 'shared' / 'data' / 'mnist'


def _args(**overrides):
    parser = argparse.ArgumentParser()
    repro.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_rows_pair_each_keep_with_linformer_at_the_budget(tmp_path):
    rows = repro._rows(_args(keep=[0.1, 0.25, 0.5]), tmp_path / 'teacher')
    kinds = [(r['kind'], r['keep']) for r in rows]
    assert kinds[0] == ('dense', 1.0)
    budgets = {r['keep']: r['config']['transforms'][0]['kwargs']['num_landmarks'] for r in rows if r['kind'] == 'linformer'}
    assert budgets == {0.1: 5, 0.25: 13, 0.5: 25}                       # ⌈keep · 50⌉
    sparse = [r for r in rows if r['kind'] == 'sparsifiner']
    assert [r['config']['model_kwargs']['keep_ratio'] for r in sparse] == [0.1, 0.25, 0.5]
    assert all(r['config']['teacher'] == str(tmp_path / 'teacher') for r in rows)
    # the same recipe for every student: only the model, its attention and the stage-1 length differ
    recipe = lambda r: {k: v for k, v in r['config'].items() if k not in ('model', 'model_kwargs', 'transforms',
                                                                          'predictor_epochs')}
    assert all(recipe(r) == recipe(rows[0]) for r in rows)


def _row(kind, keep, top1):
    return {'kind': kind, 'keep': keep, 'top1': top1}


def test_verdict_rule():
    rows = [_row('dense', 1.0, 98.0), _row('sparsifiner', 0.25, 97.7), _row('linformer', 0.25, 97.0),
            _row('sparsifiner', 0.5, 97.9), _row('linformer', 0.5, 98.1)]
    v = repro._verdicts(rows, 2000)
    two_se = 200 * ((0.98 * 0.02 + 0.977 * 0.023) / 2000) ** 0.5        # 0.91 points
    assert v['small_drop_at_0.25']['two_standard_errors'] == pytest.approx(two_se)
    assert abs(v['small_drop_at_0.25']['drop_points'] - 0.3) < 1e-9
    assert v['small_drop_at_0.25']['holds'] is None                      # 0.3 ± 0.91 straddles the 0.5 bar
    assert v['beats_linformer']['margins_points'][0.25] == pytest.approx(0.7)
    assert v['beats_linformer']['holds'] is None                         # +0.7 ± 0.99 and -0.2 ± 0.87: noise
    v = repro._verdicts(rows, 200_000)                                   # 100× the images: 2 SE 0.09 points
    assert v['small_drop_at_0.25']['holds'] is True and v['small_drop_at_0.25']['text'].startswith('holds')
    assert v['beats_linformer']['holds'] is False                        # keep 0.5: -0.2 beyond ± 0.09
    rows[1]['top1'] = 96.0                                               # 2 points below: beyond 0.5 + 2 SE
    rows[4]['top1'] = 97.0
    v = repro._verdicts(rows, 2000)
    assert v['small_drop_at_0.25']['holds'] is False
    assert v['small_drop_at_0.25']['text'].startswith('does not hold')
    assert v['beats_linformer']['holds'] is None                         # keep 0.25: -1.0 ± 1.16, keep 0.5: -0.2
    rows[2]['top1'] = 94.0
    rows[4]['top1'] = 95.0
    assert repro._verdicts(rows, 2000)['beats_linformer']['holds'] is True    # +2.0 and +2.9, both beyond 2 SE


def test_verdicts_do_not_read_noise_as_a_result():
    """On 100 held-out images a drop of 8 points sat inside the old widened bar max(0.5, 2 SE = 9.8) and read
    'holds: small drop'; a lead of 0.1 points over Linformer read 'holds'. Both are noise: cannot tell."""
    rows = [_row('dense', 1.0, 90.0), _row('sparsifiner', 0.25, 82.0), _row('linformer', 0.25, 81.9)]
    v = repro._verdicts(rows, 100)
    assert v['small_drop_at_0.25']['holds'] is None and 'cannot tell' in v['small_drop_at_0.25']['text']
    assert v['beats_linformer']['holds'] is None and 'cannot tell' in v['beats_linformer']['text']


def test_a_run_without_keep_025_says_the_small_drop_claim_is_untested():
    """`--keep 0.1 0.5` left the small-drop verdict out of the report without a word."""
    rows = [_row('dense', 1.0, 98.0), _row('sparsifiner', 0.5, 97.7), _row('linformer', 0.5, 97.0)]
    v = repro._verdicts(rows, 2000)
    assert v['small_drop_at_0.25']['holds'] is None
    assert v['small_drop_at_0.25']['text'].startswith('not tested: --keep has no 0.25')
    assert 'beats_linformer' in v


def _subset(src: Path, dst: Path, count: int) -> None:
    dst.mkdir()
    for name, magic in (('t10k-images-idx3-ubyte', 2051), ('t10k-labels-idx1-ubyte', 2049)):
        array = read_idx(str(src / f'{name}.gz'))
        array = np.ascontiguousarray(np.concatenate([array[:count // 2], array[-count // 2:]]))
        with gzip.open(dst / f'{name}.gz', 'wb') as f:
            f.write(struct.pack('>I', magic) + struct.pack(f'>{array.ndim}I', *array.shape) + array.tobytes())


@pytest.mark.skipif(not MNIST.is_dir(), reason='needs the MNIST test set in ../shared/data/mnist')
def test_smoke_run_and_reuse(tmp_path, capsys):
    data = tmp_path / 'mnist'
    _subset(MNIST, data, 300)
    argv = ['reproduce', 'sparsifiner', '--data', str(data), '--teacher-epochs', '1', '--epochs', '2', '--keep', '0.25',
            '--limit-train-batches', '1', '--batch-size', '32', '--threads', '1', '--output', str(tmp_path / 'out')]
    assert main(argv) == 0
    results = json.loads((tmp_path / 'out' / 'results.json').read_text())
    assert results['command'].startswith('structformer reproduce sparsifiner --data ')
    assert '--keep 0.25 ' in results['command']
    assert all(isinstance(r['load']['busy'], bool) for r in results['rows'])      # the timed layer's machine load
    assert [r['kind'] for r in results['rows']] == ['dense', 'sparsifiner', 'linformer']
    dense, sparse, linformer = results['rows']
    assert sparse['mhsa_mflops'] < dense['mhsa_mflops'] and linformer['mhsa_mflops'] < dense['mhsa_mflops']
    assert set(results['verdicts']) == {'small_drop_at_0.25', 'beats_linformer'}
    report = (tmp_path / 'out' / 'report.md').read_text()
    assert 'Sparsifiner keep 0.25 (B = 13)' in report and 'Linformer k = 13' in report
    capsys.readouterr()
    assert main(argv) == 0                                   # every run is reused
    assert capsys.readouterr().out.count('reusing the finished run') == 4


def test_a_finished_run_on_other_data_is_not_reused(tmp_path):
    """A finished run was reused whatever --data said: its recipe was compared, its data never."""
    import yaml
    run = tmp_path / 'dense_1'
    run.mkdir()
    config = {'model': 'vit_mnist', 'epochs': 2}
    (run / 'summary.json').write_text(json.dumps({'epochs': 2}))
    (run / 'config.yaml').write_text(yaml.safe_dump(dict(config, data=f'mnist:{tmp_path / "a"}')))
    assert repro._finished(run, config, f'mnist:{tmp_path / "a"}')
    assert not repro._finished(run, config, f'mnist:{tmp_path / "b"}')


def test_bad_keep_is_refused(tmp_path, capsys):
    assert main(['reproduce', 'sparsifiner', '--keep', '0', '--output', str(tmp_path / 'o')]) == 2
    assert '--keep' in capsys.readouterr().err
    assert not (tmp_path / 'o').exists()


def test_a_student_of_a_retrained_teacher_is_not_reused(tmp_path):
    """--teacher-epochs or --lr into the same --output retrains the teacher at the same path; the students' configs
    name only that path, so they were reused although distilled from the old teacher."""
    import yaml
    teacher = tmp_path / 'teacher'
    teacher.mkdir()
    (teacher / 'summary.json').write_text(json.dumps({'epochs': 1, 'final_val_top1': 90.0}))
    run = tmp_path / 'sparsifiner_0.25'
    run.mkdir()
    config = {'model': 'sparsifiner_mnist', 'epochs': 2, 'teacher': str(teacher)}
    (run / 'summary.json').write_text(json.dumps({'epochs': 2}))
    (run / 'config.yaml').write_text(yaml.safe_dump(dict(config, data=f'mnist:{tmp_path / "a"}')))
    spec = f'mnist:{tmp_path / "a"}'
    assert not repro._finished(run, config, spec)          # no stamp: which teacher it learnt from is unknown
    (run / repro.TEACHER_STAMP).write_text(repro._teacher_stamp(config) + '\n')
    assert repro._finished(run, config, spec)
    (teacher / 'summary.json').write_text(json.dumps({'epochs': 2, 'final_val_top1': 95.0}))   # retrained
    assert not repro._finished(run, config, spec)


def test_a_teacher_that_did_not_learn_gives_no_verdict():
    """A smoke run whose teacher stayed at chance (9.90 % on held-out digits whose most frequent class is 11.5 %)
    read 'does not hold' for both claims: students converted from an untrained teacher are no test of a method that
    converts a trained one. As `reproduce crate` and `soft`: cannot tell, said so."""
    rows = [_row('dense', 1.0, 18.05), _row('sparsifiner', 0.25, 9.90), _row('linformer', 0.25, 13.30)]
    labels = [1] * 230 + [i % 10 for i in range(1770)]                  # class 1: 11.5 % + its share of the rest
    teacher = repro.learned(9.90, labels)
    assert not teacher['learned']
    v = repro._verdicts(rows, 2000, teacher)
    for claim in ('small_drop_at_0.25', 'beats_linformer'):
        assert v[claim]['holds'] is None
        assert v[claim]['text'].startswith('cannot tell at this scale: the teacher did not learn')
    learnt = repro.learned(96.4, labels)
    assert repro._verdicts(rows, 2000, learnt)['small_drop_at_0.25']['holds'] is False     # a trained teacher: read


def test_keep_ratios_that_name_one_run_folder_are_refused(tmp_path, capsys):
    """--keep 0.25 0.2500001 passed the distinct check (two floats) but both rows trained in sparsifiner_0.25 (the
    folder names keep with :g): the second overwrote the first, and each rerun retrained both in turn."""
    out = tmp_path / 'out'
    assert main(['reproduce', 'sparsifiner', '--data', str(tmp_path), '--keep', '0.25', '0.2500001',
                 '--output', str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count('error:') == 1 and 'Traceback' not in err and '--keep names 0.25 more than once' in err
    assert not out.exists()
