"""Goals judged per kind of CPU (`bench/kinds.py`, `bench/kind_tables.py`): every benchmark JSON carries the CPU
kind and the kernel choices, a busy run's record stays out of docs/, and each kind's table in docs/benchmarks.md
equals the render of its committed record, which equals the benchmark records it was collected from."""
import json
from pathlib import Path

import pytest

from structformer.bench import kind_tables, kinds
from structformer.cli import main
from structformer.records import cpu_kind

DOCS = Path(__file__).resolve().parents[1] / 'docs'
# kinds whose record was transcribed by hand (no folder of benchmark records measured on that kind yet): once
# `make bench-records` runs on one, its folder appears and the tests of measured kinds take it over
TRANSCRIBED = sorted(p.stem for p in (DOCS / 'kinds').glob('*.json') if not (DOCS / 'kinds' / p.stem).is_dir())
# the kind the records-run tests measure: a transcribed one while one is left (its transcription replaced), else new
UNMEASURED = TRANSCRIBED[0] if TRANSCRIBED else 'amd-zen-never-met'


@pytest.mark.parametrize('kind', sorted(p.stem for p in (DOCS / 'kinds').glob('*.json')))
def test_each_kind_table_in_the_docs_is_its_records_render(kind):
    record = json.loads((DOCS / 'kinds' / f'{kind}.json').read_text())
    assert record['kind'] == kind and [g['goal'] for g in record['goals']] == list(kinds.GOALS)
    assert kind_tables.table_in_docs((DOCS / 'benchmarks.md').read_text(), kind) == kind_tables.render(record)


@pytest.mark.parametrize('kind', sorted(p.name for p in (DOCS / 'kinds').iterdir() if p.is_dir()))
def test_a_measured_kinds_record_is_what_its_benchmarks_wrote(kind):
    """The kind record equals `collect` over its folder: no number retyped, none left from an older run."""
    record = json.loads((DOCS / 'kinds' / f'{kind}.json').read_text())
    assert record == json.loads(json.dumps(kind_tables.collect(kind, DOCS / 'kinds' / kind)))
    for entry in record['goals']:
        if entry.get('record'):
            source = json.loads((DOCS.parent / entry['record']).read_text())
            assert source['environment']['cpu_kind']['kind'] == kind
            assert 'choices' in source['environment']


def test_collect_refuses_a_record_of_another_kind(tmp_path):
    (tmp_path / 'lowrank.json').write_text(json.dumps({'environment': {'cpu_kind': {'kind': 'intel-amx'}},
                                                       'kind_goals': []}))
    with pytest.raises(ValueError, match="measured on a 'intel-amx' CPU, not 'amd-avx2'"):
        kind_tables.collect('amd-avx2', tmp_path)


def test_update_docs_replaces_only_the_marked_tables():
    record = json.loads((DOCS / 'kinds' / 'intel-avx512-vnni.json').read_text())
    text = "before\n<!-- kind-table intel-avx512-vnni -->\nstale\n<!-- /kind-table -->\nafter\n"
    updated = kind_tables.update_docs(text, {'intel-avx512-vnni': record})
    assert updated.startswith('before\n') and updated.endswith('after\n') and 'stale' not in updated
    assert kind_tables.table_in_docs(updated, 'intel-avx512-vnni') == kind_tables.render(record)


def test_a_goal_that_cannot_hold_says_why_and_verdicts_read_the_target():
    entry = kinds.goal_entry('lowrank_layer', 2.2, [2.1, 2.3], 1, 'rank 0.25', bound='the GEMM is already the fastest')
    assert entry['met'] is False and entry['target'] == '>= 3'
    line = kinds.verdict_line(entry)
    assert 'not met (2.200×, quartiles 2.100–2.300, 1 thread; rank 0.25)' in line
    assert line.endswith('on this kind: the GEMM is already the fastest')
    assert kinds.goal_entry('sparsifiner_sdpa', 0.59)['met'] is True
    assert kinds.goal_entry('rp_mixer_step', 1.2)['met'] is False
    facts = kinds.hardware_facts({'kind': 'intel-avx512-vnni', 'flags': ['avx2', 'avx512f', 'avx512_vnni'],
                                  'bf16_native': False})
    assert any('no bfloat16 speed-up is possible' in f for f in facts)
    assert any('MKL' in f and 'FLOP ratio' in f for f in facts)


def _load(busy: bool) -> dict:
    return {'busy': busy, 'other_cores': 1.4 if busy else 0.0, 'wall_s': 90.0}


def test_a_busy_run_is_not_written_into_docs_unless_allowed(tmp_path, monkeypatch, capsys):
    docs = tmp_path / 'docs'
    monkeypatch.setattr(kinds, 'DOCS_DIR', docs)
    monkeypatch.setattr(kinds.tempfile, 'gettempdir', lambda: str(tmp_path / 'tmp'))
    target = docs / 'kinds' / 'x' / 'lowrank.json'
    written = kinds.write_record(target, {'machine_load': _load(True)})
    assert not target.exists() and Path(written) == tmp_path / 'tmp' / 'structformer-busy-records' / 'lowrank.json'
    message = capsys.readouterr().err
    assert 'BUSY' in message and '--allow-busy' in message and 'this run took 1.5 min' in message
    assert kinds.RECORDS_COMMAND in message
    assert kinds.write_record(target, {'machine_load': _load(True)}, allow_busy=True) == str(target)
    target.unlink()
    assert kinds.write_record(target, {'machine_load': _load(False)}) == str(target)       # quiet: written
    outside = tmp_path / 'outputs' / 'lowrank.json'
    assert kinds.write_record(outside, {'machine_load': _load(True)}) == str(outside)       # not docs/: written


def test_a_bench_json_carries_the_cpu_kind_and_the_choices(tmp_path, capsys):
    out = tmp_path / 'sparse.json'
    assert main(['bench', 'sparse-attention', '--tokens', '65', '--keep', '0.5', '--paths', 'block-gather',
                 '--repeats', '1', '--warmup', '0', '--threads', '1', '--json', str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    env = record['environment']
    assert env['cpu_kind'] == cpu_kind() and env['aten_cpu_capability']
    assert set(env['choices']) >= {'timing', 'overrides', 'decisions', 'cached'}
    assert record['kind_goals'] == []                        # the goal is stated at n 577, keep 0.25
    assert f"CPU kind {cpu_kind()['kind']}" in printed


def test_a_bench_json_lists_the_choices_its_measurements_made(tmp_path, monkeypatch):
    """The record's `environment.choices.decisions` are the kernel choices the benchmark's own measurements made
    (timed here, on a fresh cache): read after measuring, not before (it was empty in every committed record), and
    from the measuring subprocesses too, through the run's shared log, which is gone after the run."""
    import tempfile
    from structformer.functional import autotune
    monkeypatch.setenv('STRUCTFORMER_AUTOTUNE', 'on')
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tmp_path / 'cache'))
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
    autotune.forget()
    out = tmp_path / 'lowrank.json'
    with autotune.use_timer(lambda calls: {label: [1.0] * 3 for label in calls}):      # no real timing needed
        assert main(['bench', 'lowrank', '--tokens', '256', '--in-features', '512', '--out-features', '512', '--ranks',
                     '0.25', '--depth', '0', '--steps', '1', '--rounds', '1', '--threads', '1', '--output', str(out)]) == 0
    decisions = json.loads(out.read_text())['environment']['choices']['decisions']
    assert {(d['name'], d['class'], d['source']) for d in decisions} >= {
        ('linear_kernel', '256,512,128,transposed,nobias,train', 'timed'), ('linear_kernel', '256,128,512,rows,bias,train', 'timed')}
    assert not list(tmp_path.glob('structformer-choices-*')) and autotune.ENV_LOG not in __import__('os').environ
    autotune.forget()
    from structformer.bench.harness import measure_in_subprocess
    monkeypatch.setenv(autotune.ENV_LOG, str(tmp_path / 'log.jsonl'))
    assert measure_in_subprocess('structformer.functional.autotune:decide', 'ssa_impl', [5, 16, 'float32'], 'shared',
                                 None, 'sdpa') == 'sdpa'                     # decided in a child process
    assert [(d['name'], d['class'], d['choice'], d['source']) for d in autotune.report()['decisions']] == [
        ('ssa_impl', '5,16,float32', 'sdpa', 'isa')]
    autotune.forget()


def test_the_header_counts_the_cached_choices_instead_of_listing_every_class():
    """A machine's cache holds every shape class any process met (the test suite leaves hundreds): the header says
    per choice how many classes took each candidate, the most taken first; the record keeps each class."""
    cached = {'linear_kernel': {f'[{i},64,64]': 'onednn' for i in range(78)} | {'[1,2,3]': 'torch', '[4,5,6]': 'torch'},
              'ssa_impl': {'[16,16]': 'sdpa', '[181,64]': 'shared'}, 'newton_loop': {}}
    assert kinds.cache_summary(cached) == 'linear_kernel 78 onednn, 2 torch; ssa_impl 1 sdpa, 1 shared'
    env = {'cpu_kind': {'kind': 'k', 'summary': 's'}, 'threads': 1, 'torch': 't',
           'choices': {'cached': cached, 'cache_file': '~/.cache/structformer/choices/x.json', 'overrides': {}}}
    lines = kinds.header_lines(env)
    line = next(line for line in lines if 'cached' in line)
    assert line.endswith('linear_kernel 78 onednn, 2 torch; ssa_impl 1 sdpa, 1 shared') and len(line) < 300
    assert '~/.cache/structformer/choices/x.json' in line
    assert not any('cached' in line for line in kinds.header_lines(dict(env, choices={'cached': {}})))


def test_the_records_command_names_a_benchmark_per_goal():
    judged = [goal for _, goals, _ in kind_tables.RECORDS for goal in goals]
    assert sorted(judged) == sorted(kinds.GOALS)
    line = kind_tables.command_line(kind_tables.RECORDS[3][2], 1, 'docs/kinds/k/mlp/mlp.json')
    assert line[:3] == ['structformer', 'bench', 'mlp'] and line[-2:] == ['--threads', '1']
    assert 'docs/kinds/k/mlp' in line


def test_the_readme_quotes_the_avx512_amd_record():
    """README's prose numbers for the AVX-512 AMD EPYC, and for it capped to AVX2, are their records' (re-measured
    records: update the README; the table above them is generated)."""
    def values(kind):
        return {g['goal']: g['value'] for g in json.loads((DOCS / 'kinds' / f'{kind}.json').read_text())['goals']}
    goals, capped = values('amd-avx512-bf16'), values('amd-avx512-bf16+cap-avx2')
    readme = ' '.join((DOCS.parent / 'README.md').read_text().replace('**', '').split())
    for goal, text in (('crate_vit', f"{goals['crate_vit']:.2f}× ViT-T's speed on AVX-512 AMD"),
                       ('soft_sdpa', f"{goals['soft_sdpa']:.1f}× SOFT's on one thread on AVX-512 AMD"),
                       ('lowrank_layer', f"{goals['lowrank_layer']:.2f}× faster than nn.Linear on AVX-512 AMD"),
                       ('lowrank_layer', f"{capped['lowrank_layer']:.2f}× with its kernels held to AVX2"),
                       ('lowrank_stack', f"{goals['lowrank_stack']:.2f}× on AVX-512 AMD"),
                       ('sparsifiner_sdpa', f"{goals['sparsifiner_sdpa']:.2f}× fused SDPA's time on 1 thread on "
                                            "AVX-512 AMD"),
                       ('sparsifiner_sdpa', f"{capped['sparsifiner_sdpa']:.2f}× with its kernels held to AVX2"),
                       ('monarch_step', f"{goals['monarch_step']:.1f}× faster than `nn.Linear`'s"),
                       ('monarch_step', f"{capped['monarch_step']:.1f}× with its kernels held to AVX2")):
        assert text in readme, (goal, text)


def test_the_readme_speed_table_is_the_render_of_every_kind_record():
    """README's table of every kind's verdicts is `render_summary` of docs/kinds/*.json (`make bench-records` and
    `python -m structformer.bench.kind_tables render` rewrite it), so no README cell is typed by hand."""
    records = kind_tables.kind_records()
    readme = (DOCS.parent / 'README.md').read_text()
    assert kind_tables.summary_in_readme(readme) == kind_tables.render_summary(records)
    assert kind_tables.update_readme(readme, records) == readme
    with pytest.raises(ValueError, match='kind-summary'):
        kind_tables.update_readme('no table here', records)


def test_the_speed_table_marks_what_a_cell_rests_on():
    """A cell says met / not met, BUSY for a busy run, the threads when not 1, 'no record' for a transcribed number
    without a committed JSON; a kind the README has no label for is headed by its id, after the known ones."""
    entry = dict(goal='crate_vit', what='CRATE-T / ViT-T', target='>= 0.9', threads=1, met=True, busy=False,
                 record='docs/kinds/x/models.json')
    records = {}
    for kind, changes in (('zz-new-kind', {}), ('amd-avx512-bf16', {'value': 12.34}),
                          ('intel-avx512-vnni', {'value': 0.8, 'met': False, 'threads': 2, 'record': None}),
                          ('amd-avx2', {'value': 0.85, 'met': False, 'busy': True})):
        goals = [dict(entry, goal=g, **({'value': 0.95} if kind == 'zz-new-kind' else changes)) for g in kinds.GOALS]
        records[kind] = {'kind': kind, 'goals': goals}
    records['zz-new-kind']['goals'][1]['value'] = None
    records['zz-new-kind']['goals'][1]['record'] = None
    lines = kind_tables.render_summary(records).splitlines()
    assert lines[0].split(' | ')[2:] == ['AMD EPYC, AVX2 only', 'AMD EPYC, AVX-512 + BF16 (Zen 5)',
                                         'Intel Xeon, AVX-512 VNNI', 'zz-new-kind |']
    first = lines[3].split(' | ')
    assert first[:2] == ['| CRATE-T / ViT-T', '≥ 0.9']
    assert first[2:] == ['0.85× **not met** (BUSY)', '12.3× met', '0.80× **not met** (2 threads, no record)',
                         '0.95× met |']
    assert lines[4].endswith('| — (none committed) |') and len(lines) == 3 + len(kinds.GOALS)


@pytest.mark.parametrize('kind', TRANSCRIBED)
def test_the_transcribed_kinds_carry_the_splits_their_numbers_give(kind):
    """A transcribed miss says why as a measured one does: its ratio split into FLOPs (counted from the measured
    kind's records) and FLOP rates; the record equals that split recomputed, so no bound is retyped."""
    record = json.loads((DOCS / 'kinds' / f'{kind}.json').read_text())
    assert record == kind_tables.with_splits(record, kind_tables.goal_flop_ratios())
    entries = {g['goal']: g for g in record['goals']}
    soft = entries['soft_sdpa']
    assert soft['met'] is False and "SOFT at 56% of SDPA's FLOP rate" in soft['bound']
    assert soft['rates']['flop_ratio'] * soft['rates']['rate'] == pytest.approx(soft['value'])


def test_the_flop_ratios_are_the_goals_arithmetic():
    """Monarch at n 4096 with 64 blocks: n² / (2·n·64) = 32; RP-Mixer permutes the Mixer's own products: 1."""
    ratios = kind_tables.goal_flop_ratios()
    assert ratios['monarch_step'] == 32 and ratios['rp_mixer_step'] == 1


def test_a_records_command_is_the_one_that_made_it():
    """RECORDS' attention command gained --profile; records made without it show their command without it."""
    arguments = next(a for name, _, a in kind_tables.RECORDS if name == 'attention.json')
    assert '--profile' in arguments
    assert '--profile' not in kind_tables._as_run(arguments, {'profile': False, 'pairs': 20})
    assert kind_tables._as_run(arguments, {'profile': True}) == arguments == kind_tables._as_run(arguments, {})
    assert kind_tables._as_run(['x', '--pairs', '20'], {'pairs': 0}) == ['x', '--pairs', '20']    # a value, kept


# ---- `make bench-records` on a kind: all records published together, or none ----------------------------------

@pytest.fixture
def docs_copy(tmp_path, monkeypatch):
    """kind_tables pointed at a copy of docs/kinds, docs/benchmarks.md and README.md; the CPU kind faked as
    `docs_copy.kind` (default: a kind transcribed by hand while one is left, else a kind never met), and each benchmark a fake that writes its
    record of that kind: `docs_copy.busy` / `docs_copy.fail` name the records measured busy / failing,
    `docs_copy.interrupt_at` the one at which Ctrl-C arrives."""
    import shutil
    import tempfile
    import types
    docs = tmp_path / 'docs'
    shutil.copytree(DOCS / 'kinds', docs / 'kinds')
    shutil.copy(DOCS / 'benchmarks.md', docs / 'benchmarks.md')
    shutil.copy(DOCS.parent / 'README.md', tmp_path / 'README.md')
    monkeypatch.setattr(kind_tables, 'KINDS_DIR', docs / 'kinds')
    monkeypatch.setattr(kind_tables, 'BENCHMARKS_MD', docs / 'benchmarks.md')
    monkeypatch.setattr(kind_tables, 'README_MD', tmp_path / 'README.md')
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path / 'tmp'))
    (tmp_path / 'tmp').mkdir()
    state = types.SimpleNamespace(kind=UNMEASURED, busy=(), fail=(), interrupt_at=None, docs=docs, root=tmp_path,
                                  ran=[])
    monkeypatch.setattr('structformer.records.cpu_kind', lambda: {'kind': state.kind})

    def fake_benchmark(argv):
        name = next(n for n, _, arguments in kind_tables.RECORDS if arguments[0] == argv[4])
        state.ran.append(name)
        if name == state.interrupt_at:
            raise KeyboardInterrupt
        if name in state.fail:
            return 1
        told = argv[argv.index('--json' if '--json' in argv else '--output') + 1]
        out = Path(told) / 'mlp.json' if name.startswith('mlp/') else Path(told)
        goals = next(g for n, g, _ in kind_tables.RECORDS if n == name)
        record = {'environment': {'cpu_kind': {'kind': state.kind, 'summary': 'a CPU'}, 'threads': 1, 'choices': {}},
                  'settings': {}, 'machine_load': {'busy': name in state.busy, 'other_cores': 0.0, 'wall_s': 60.0},
                  'kind_goals': [kinds.goal_entry(g, 1.0, threads=1, busy=name in state.busy) for g in goals],
                  'args': {'output': told, 'threads': 1}}        # the benchmarks record where they were told to write
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record))
        return 0

    monkeypatch.setattr(kind_tables.subprocess, 'call', fake_benchmark)
    return state


def _docs_state(state) -> dict:
    return {str(p.relative_to(state.root)): p.read_bytes() for p in sorted(state.root.rglob('*'))
            if p.is_file() and 'tmp' not in p.relative_to(state.root).parts}


@pytest.mark.parametrize('case', ['failed', 'busy', 'interrupted', 'foreign'])
def test_a_records_run_that_cannot_publish_leaves_the_docs_as_they_were(docs_copy, case, capsys):
    """A benchmark failing, one measured on a busy machine, Ctrl-C half-way, or a record of another kind: the
    unmeasured kind's record (if transcribed), both tables and every folder stay byte for byte; the run says why and where the
    records it made are (a busy one: how long a quiet rerun takes)."""
    before = _docs_state(docs_copy)
    if case == 'failed':
        docs_copy.fail = ('lowrank.json',)
    elif case == 'busy':
        docs_copy.busy = ('models.json',)
    elif case == 'interrupted':
        docs_copy.interrupt_at = 'mlp/mlp.json'
    if case == 'foreign':
        original = kind_tables.subprocess.call
        kind_tables.subprocess.call = lambda argv: original(argv) if 'models' not in argv else (
            docs_copy.__setattr__('kind', 'intel-amx'), original(argv), docs_copy.__setattr__('kind', UNMEASURED))[1]
        assert kind_tables.record_kind(1) == 1
    else:
        assert kind_tables.record_kind(1) == (130 if case == 'interrupted' else 1)
    assert _docs_state(docs_copy) == before
    assert not (docs_copy.docs / 'kinds' / UNMEASURED).exists()
    assert [p.name for p in (docs_copy.docs / 'kinds').iterdir() if '.tmp-' in p.name or '.old-' in p.name] == []
    message = capsys.readouterr().err
    if case == 'failed':
        assert 'failed: lowrank.json' in message and 'docs/ are as they were' in message
    if case == 'foreign':                 # one line, not a traceback after the benchmarks' minutes
        assert f"measured on a 'intel-amx' CPU, not '{UNMEASURED}'" in message and 'docs/ are as they were' in message
    if case == 'busy':
        assert 'BUSY: models.json' in message and 'make bench-records RECORDS_FLAGS=--allow-busy' in message
        assert kinds.records_minutes(UNMEASURED, docs_copy.docs) in message and kinds.RECORDS_COMMAND in message
    if case in ('failed', 'busy', 'foreign'):        # the records made are kept where the message says
        staged = Path(message.split('records are in ')[1].split('. ')[0].strip())
        assert (staged / 'sparse_attention.json').exists()
    if case == 'interrupted':
        assert docs_copy.ran[-1] == 'mlp/mlp.json' and 'nothing published' in message
        assert list((docs_copy.root / 'tmp').iterdir()) == []


def test_a_records_run_publishes_a_new_kind_whole_and_leaves_the_other_kinds_alone(docs_copy):
    """A kind met for the first time: its folder, its kind record (= collect of the folder), its table appended to
    docs/benchmarks.md, its column in README's table; every other kind's table is unchanged. A busy run publishes
    only with allow_busy, and says BUSY in the table."""
    docs_copy.kind = 'intel-avx512-bf16'
    old = (docs_copy.docs / 'benchmarks.md').read_text()
    docs_copy.busy = ('attention.json',)
    assert kind_tables.record_kind(1, allow_busy=True) == 0
    folder = docs_copy.docs / 'kinds' / 'intel-avx512-bf16'
    record = json.loads((folder.parent / 'intel-avx512-bf16.json').read_text())
    assert record == json.loads(json.dumps(kind_tables.collect('intel-avx512-bf16', folder)))
    assert all(entry['value'] == 1.0 for entry in record['goals'])
    assert {e['goal'] for e in record['goals'] if e['busy']} == {'soft_sdpa'}
    # each record names where it was published, relative to the repository, not the staging folder since deleted
    published = {str(p.relative_to(folder)): json.loads(p.read_text())['args']['output'] for p in folder.rglob('*.json')}
    assert published == {name: f'docs/kinds/intel-avx512-bf16/{name}'.removesuffix('/mlp.json')
                         for name, _, _ in kind_tables.RECORDS}, published
    text = (docs_copy.docs / 'benchmarks.md').read_text()
    assert kind_tables.table_in_docs(text, 'intel-avx512-bf16') == kind_tables.render(record)
    last = old.rindex(kind_tables.END) + len(kind_tables.END)       # the new kind's table right after the others'
    assert text.startswith(old[:last] + '\n\n### intel-avx512-bf16\n\n<!-- kind-table intel-avx512-bf16 -->\n')
    assert text.endswith(old[last:])
    for kind in kind_tables.kind_records():
        if kind != 'intel-avx512-bf16':
            assert kind_tables.table_in_docs(text, kind) == kind_tables.table_in_docs(old, kind)
    readme = (docs_copy.root / 'README.md').read_text()
    assert kind_tables.summary_in_readme(readme) == kind_tables.render_summary(kind_tables.kind_records())
    header = next(line for line in readme.splitlines() if line.startswith('| goal (1 thread'))
    assert header.rstrip(' |').endswith('intel-avx512-bf16')
    assert 'measured by `make bench-records`' in readme


@pytest.mark.skipif(not TRANSCRIBED, reason='every kind met has been measured by make bench-records')
def test_a_records_run_on_a_transcribed_kind_replaces_it_by_its_measured_records(docs_copy):
    """A transcribed kind measured at last: its folder appears, its record is collected from it (the transcription goes), and
    the test of measured kinds then holds for it; a second run replaces the folder, no old file left in it."""
    assert kind_tables.record_kind(1) == 0
    folder = docs_copy.docs / 'kinds' / UNMEASURED
    record = json.loads((folder.parent / f'{UNMEASURED}.json').read_text())
    assert record == json.loads(json.dumps(kind_tables.collect(UNMEASURED, folder)))
    assert f'Collected from docs/kinds/{UNMEASURED}/' in record['provenance']
    (folder / 'stale.json').write_text('{}')
    assert kind_tables.record_kind(1) == 0
    assert not (folder / 'stale.json').exists() and (folder / 'mlp' / 'mlp.json').exists()
    assert sorted(p.name for p in folder.parent.iterdir() if p.is_dir()) == sorted(
        [p.name for p in (DOCS / 'kinds').iterdir() if p.is_dir()] + [UNMEASURED])


def test_an_interrupted_bench_says_what_it_left(monkeypatch, capsys):
    """Ctrl-C in a benchmark: exit 130 and a line about records (not the trainer's 'checkpoints ... intact')."""
    from structformer.bench import lowrank

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(lowrank, 'run', interrupted)
    assert main(['bench', 'lowrank', '--depth', '0']) == 130
    err = capsys.readouterr().err
    assert 'interrupted; a record is written whole at the end of a run, or not at all' in err and 'checkpoint' not in err


def test_render_of_a_foreign_kind_record_is_one_line_and_writes_nothing(docs_copy, capsys):
    """`python -m structformer.bench.kind_tables render` with a kind record that is not one (hand-edited, truncated):
    one line, exit 2, neither page rewritten (the render is made whole before either is written)."""
    before = _docs_state(docs_copy)
    (docs_copy.docs / 'kinds' / 'amd-avx2.json').write_text('{"kind": "amd-avx2"}')
    before['docs/kinds/amd-avx2.json'] = b'{"kind": "amd-avx2"}'
    assert kind_tables.main(['render']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'render: error: KeyError' in err
    assert _docs_state(docs_copy) == before


@pytest.mark.parametrize('argv, env, message', [
    (['record', '--threads', '0'], {}, '--threads: accepted integers >= 1, got 0'),
    (['record'], {'STRUCTFORMER_CHOICE_SSA_IMPL': 'flash'}, "STRUCTFORMER_CHOICE_SSA_IMPL='flash': accepted"),
])
def test_make_bench_records_refuses_bad_settings_before_measuring(docs_copy, monkeypatch, capsys, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        kind_tables.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err and docs_copy.ran == []


def test_how_long_a_records_run_takes_comes_from_the_committed_records(tmp_path):
    """This kind's records' measuring time where it has them, else the range over the kinds measured, else the
    constant; a record that is not JSON is skipped, not fatal, and records the run does not make are not counted."""
    docs = tmp_path / 'docs'
    assert kinds.records_minutes('amd-x', docs) == f"about {kinds.RECORDS_MINUTES} min"
    assert [name for name, _, _ in kind_tables.RECORDS] == list(kinds.RECORD_FILES)
    for kind, walls in (('amd-x', (600.0, 60.0)), ('intel-y', (1500.0, 120.0))):
        for name, wall in zip(('lowrank.json', 'mlp/mlp.json'), walls):
            path = docs / 'kinds' / kind / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({'machine_load': {'wall_s': wall}}))
        (docs / 'kinds' / kind / 'models_bf16.json').write_text(json.dumps({'machine_load': {'wall_s': 9e4}}))
    (docs / 'kinds' / 'amd-x' / 'models.json').write_text('{not json')
    assert kinds.records_minutes('amd-x', docs).startswith('about 11 min on this kind')
    assert kinds.records_minutes('intel-y', docs).startswith('about 27 min on this kind')
    assert kinds.records_minutes('arm-z', docs).startswith('11–27 min by CPU kind')
    assert kinds.records_minutes(None, docs).startswith('11–27 min by CPU kind')
