"""The GPU suite's own tools and the GPU benchmark's code, on the CPU (issue: a GPU suite and benchmark ready to
run in a few GPU minutes): the suite collects and skips without CUDA; its loss tolerance and loss-parity harness on
CPU bfloat16, including a broken cast it must catch; its op / module log; `structformer bench gpu`'s dry path at a
tiny size, its goals and its markdown."""
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch

from gpu.checks import (DEADLINE_ENV, OpLog, custom_op_violations, deadline_skip_reason, fake_cuda, forward_band,
                        loss_sensitivity, loss_tolerance, module_dtype_violations, parity_failures, recorded_step_losses,
                        skipped_steps, step_tolerance, unit_roundoff)
from gpu.runs import FAMILIES
from structformer.bench import gpu as bench_gpu
from structformer.bench.gpu_report import NO_RECORD, goal_line, goals, render_markdown, replace_section, section_of
from structformer.cli import main
from structformer.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


# ---- the suite collects and skips -------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason='CUDA is present: the suite runs instead of skipping')
def test_gpu_suite_collects_and_skips_without_cuda():
    env = {k: v for k, v in os.environ.items() if k != 'STRUCTFORMER_GPU_SUITE_DEVICE'}
    proc = subprocess.run([sys.executable, '-m', 'pytest', 'tests/gpu', '-q', '-rs', '-p', 'no:cacheprovider',
                           '-p', 'no:randomly'], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env=dict(env, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    skipped = int(summary.split(' skipped')[0].split()[-1])
    assert skipped >= 50 and 'passed' not in summary and 'error' not in summary, summary
    assert 'needs a CUDA device' in proc.stdout


def test_the_suite_deadline_skips_what_has_not_started():
    """No deadline, or one ahead: tests run. One passed: a test is skipped, naming the budget. A malformed one
    is refused (the suite's conftest turns that into one usage line at its start)."""
    assert deadline_skip_reason(None, 1000.0) is None and deadline_skip_reason(' ', 1000.0) is None
    assert deadline_skip_reason('1000.5', 1000.0) is None
    reason = deadline_skip_reason('990', 1000.0)
    assert reason and 'time budget' in reason and '10 s' in reason
    for bad in ('soon', 'nan', 'inf'):
        with pytest.raises(ValueError, match=DEADLINE_ENV):
            deadline_skip_reason(bad, 1000.0)


def test_the_suite_past_its_deadline_skips_every_test_before_its_fixtures():
    """The suite's code run on the CPU (every test would otherwise train) with a deadline already passed: all are
    skipped within seconds, for the budget, and none errors (its session fixtures are never built); a malformed
    deadline ends the run at its start with one line, exit status 4 (pytest's usage error)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), STRUCTFORMER_GPU_SUITE_DEVICE='cpu')
    args = [sys.executable, '-m', 'pytest', 'tests/gpu', '-q', '-rs', '-p', 'no:cacheprovider', '-p', 'no:randomly']
    start = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(env, **{DEADLINE_ENV: str(int(time.time()) - 1)}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert 'skipped' in summary and 'passed' not in summary and 'error' not in summary, summary
    assert int(summary.split(' skipped')[0].split()[-1]) >= 50 and "time budget was spent" in proc.stdout
    assert time.time() - start < 60
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(env, **{DEADLINE_ENV: 'soon'}))
    assert proc.returncode == 4 and f"{DEADLINE_ENV} must be a Unix time" in proc.stderr + proc.stdout


# ---- tolerances ----------------------------------------------------------------------------------------------

def test_unit_roundoff_is_half_the_spacing_above_one():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert unit_roundoff(dtype) == torch.finfo(dtype).eps / 2


def test_loss_tolerance_is_three_random_walks_of_the_roundings():
    """3·√(3P)·u: CRATE-T's P ≈ 62 gives 16 % in bfloat16 and 2 % in float16 (the docstring's examples); the
    forward band scales it by the loss's sensitivity and the batch's √B; a step adds the loss's own rounding."""
    assert loss_tolerance(torch.bfloat16, 62) == pytest.approx(3 * math.sqrt(186) / 256)
    assert loss_tolerance(torch.bfloat16, 62) == pytest.approx(0.16, abs=0.005)
    assert loss_tolerance(torch.float16, 62) == pytest.approx(0.02, abs=0.001)
    assert loss_tolerance(torch.float16, 62) * 8 == pytest.approx(loss_tolerance(torch.bfloat16, 62))
    with pytest.raises(ValueError, match='products'):
        loss_tolerance(torch.bfloat16, 0)
    assert forward_band(torch.bfloat16, 62, 0.5, 16) == pytest.approx(loss_tolerance(torch.bfloat16, 62) * 0.5 / 4)
    # after the first step float32's own movement widens the band by the updates' rounding (or all of it after a
    # skipped float16 step); at the first step the forward's band alone
    reference = [2.0, 1.8, 1.9]
    band = forward_band(torch.bfloat16, 62, 0.5, 16)
    assert step_tolerance(torch.bfloat16, 62, 0.5, 16, reference, 0) == pytest.approx(band + 2.0 / 256)
    assert step_tolerance(torch.bfloat16, 62, 0.5, 16, reference, 1) == pytest.approx(
        band + 1.8 / 256 + 3 * math.sqrt(6 * 62) / 256 * 0.2)
    assert step_tolerance(torch.float16, 62, 0.5, 16, reference, 2, skipped=True) == pytest.approx(
        forward_band(torch.float16, 62, 0.5, 16) + 1.9 / 2048 + 0.1)
    assert [skipped_steps(s) for s in (65536.0, 32768.0, 4096.0)] == [0, 1, 4]


def test_loss_sensitivity_is_zero_at_zero_logits_and_grows_with_them():
    targets = torch.tensor([0, 1, 2, 3])
    assert loss_sensitivity(torch.zeros(4, 10), targets) == 0
    small, large = torch.randn(4, 10, generator=torch.Generator().manual_seed(0)) * 0.1, None
    large = small * 10
    assert 0 < loss_sensitivity(small, targets) < loss_sensitivity(large, targets)


def test_parity_failures_name_the_step():
    reference = [1.0, 1.0]
    assert parity_failures(reference, [1.001, 0.999], torch.float16, 10, 1.0, 1) == []
    failures = parity_failures(reference, [1.0, 1.5], torch.float16, 10, 1.0, 1)
    assert len(failures) == 1 and failures[0].startswith('step 2')
    assert parity_failures(reference, [1.0, float('nan')], torch.bfloat16, 10, 1.0, 1)
    assert parity_failures(reference, [1.0], torch.bfloat16, 10, 1.0, 1)


# ---- the loss-parity harness on CPU bfloat16 --------------------------------------------------------------------

STEP_IMAGES = 32 * 2          # batch 32, 2 accumulated batches: the images behind one logged step loss


def _digits_run(tmp_path, name, **extra):
    from structformer.train import TrainConfig, train
    config = TrainConfig(model='crate_digits', data='digits', epochs=1, batch_size=STEP_IMAGES // 2, lr=1e-3,
                         warmup_epochs=0, sched='none', limit_train_batches=6, grad_accum_steps=2, mixup=0.8, cutmix=1.0,
                         model_ema=True, val_fraction=0.1, log_interval=0, output=str(tmp_path / name), **extra)
    with recorded_step_losses() as losses:
        result = train(config, progress=False)
    return result, losses


@pytest.fixture(scope='module')
def float32_digits(tmp_path_factory):
    return _digits_run(tmp_path_factory.mktemp('parity'), 'float32')


def _measured(result) -> tuple:
    """The products of a bfloat16 forward and the loss's sensitivity, on held-out digits through float32's model."""
    from structformer.data import build_datasets
    from structformer.train import load_model
    model, _ = load_model(result.last_checkpoint)
    _, val, _ = build_datasets('digits', seed=0, val_fraction=0.1)
    images, labels = torch.utils.data.default_collate([val[i] for i in range(64)])
    _, log = module_dtype_violations(model.eval(), images, torch.bfloat16, 'cpu')
    with torch.no_grad():
        return log.products(torch.bfloat16), loss_sensitivity(model(images), labels)


def test_parity_harness_passes_bfloat16_on_the_cpu(tmp_path, float32_digits):
    reference_run, reference = float32_digits
    result, losses = _digits_run(tmp_path, 'bf16', amp=True, amp_dtype='bfloat16')
    products, sensitivity = _measured(reference_run)
    assert products >= 10 and sensitivity > 0 and len(losses) == len(reference) == 3
    assert parity_failures(reference, losses, torch.bfloat16, products, sensitivity, STEP_IMAGES) == []


def test_parity_harness_catches_a_broken_cast(tmp_path, float32_digits, monkeypatch):
    """An attention that under autocast returns its output 25 % too large (as a lost float32 island or a custom op
    in the wrong dtype would move it) leaves the band. Not necessarily at the first step: the step's loss is the mean
    over both accumulated batches, and at initialisation the error moves their losses by a few thousandths, of
    either sign; after an update it has moved the weights as well."""
    from structformer.layers import MSSA
    reference_run, reference = float32_digits
    forward = MSSA.forward

    def broken(self, x, *args, **kwargs):
        out = forward(self, x, *args, **kwargs)
        return out * 1.25 if torch.is_autocast_enabled('cpu') else out
    monkeypatch.setattr(MSSA, 'forward', broken)
    _, losses = _digits_run(tmp_path, 'broken', amp=True, amp_dtype='bfloat16')
    failures = parity_failures(reference, losses, torch.bfloat16, *_measured(reference_run), STEP_IMAGES)
    assert failures, failures


def test_recorded_step_losses_puts_the_step_log_back():
    from structformer.train.steplog import StepLog
    original = StepLog.step
    with recorded_step_losses() as losses:
        assert StepLog.step is not original
    assert StepLog.step is original and losses == []


# ---- the op / module log ------------------------------------------------------------------------------------------

class _Islands(torch.nn.Module):
    """A linear layer that leaves autocast (returns float32: against the policy) and an op on another device."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        with torch.autocast('cpu', enabled=False):
            y = self.inner(x.float())
        torch.ones(5, device='meta')                        # computed somewhere else than the model's device
        return self.head(y)


def test_module_log_flags_a_layer_out_of_policy_and_an_op_off_the_device():
    model = _Islands()
    wrong, log = module_dtype_violations(model, torch.randn(2, 4), torch.bfloat16, 'cpu')
    assert any(w.startswith('inner (Linear) returned torch.float32') for w in wrong), wrong
    assert any('aten.ones.default computed off cpu' in w for w in wrong), wrong
    assert not any(w.startswith('head') for w in wrong) and log.products(torch.bfloat16) == 1
    ok, _ = module_dtype_violations(torch.nn.Linear(4, 3), torch.randn(2, 4), torch.bfloat16, 'cpu', backward=True)
    assert ok == []


@pytest.mark.parametrize('family', list(FAMILIES))
def test_family_forward_on_a_fake_cuda_device_keeps_the_gpu_policy(family):
    """The suite's `test_ops_stay_on_the_gpu_in_their_policy_dtype` before a GPU is lent: each family's model on a
    faked CUDA device (`checks.fake_cuda`), channels-last, float16 autocast as CUDA applies it (a CPU has none to
    test): every layer in its policy dtype, the custom ops in theirs, no op computing on the CPU, none mixing a CPU
    tensor in and no read back to the host (a FakeTensor has no data); in training mode too, but for Sparsifiner,
    whose training forward on CUDA is FlexAttention."""
    from structformer.models.factory import build_model
    model, recipe = build_model(FAMILIES[family]['model'], {'num_classes': 4}, None, [])
    model.to(memory_format=torch.channels_last)              # here: a fake module's weights cannot be swapped
    with fake_cuda():
        model = model.to('cuda')
        assert {t.device.type for t in model.state_dict().values()} == {'cuda'}
        images = torch.randn(2, *recipe.input_size, device='cuda').contiguous(memory_format=torch.channels_last)
        for training in (False, True) if family != 'sparsifiner' else (False,):
            wrong, log = module_dtype_violations(model.train(training), images, torch.float16, 'cuda')
            assert not wrong, (training, wrong[:8])
            assert log.products(torch.float16) > 0 and all(d == 'cuda' for _, _, out in log.calls for d, _, n in out
                                                           if n > 1)


class _CpuTensorInForward(torch.nn.Module):
    """A layer that makes a tensor without `device=` in its forward (fine on a CPU, wrong on a GPU), or
    (`sync=True`) reads a number back to the host, which stalls a GPU's queue."""

    def __init__(self, sync: bool = False):
        super().__init__()
        self.proj, self.sync = torch.nn.Linear(4, 4), sync

    def forward(self, x):
        y = self.proj(x)
        return y * float(y.abs().max()) if self.sync else y + torch.linspace(0, 1, 4)


def test_a_fake_cuda_device_catches_a_cpu_tensor_or_a_host_sync_in_a_forward():
    from torch._subclasses.fake_tensor import DataDependentOutputException
    for sync, error in ((False, RuntimeError), (True, DataDependentOutputException)):
        model = _CpuTensorInForward(sync)
        with fake_cuda():
            model = model.to('cuda')
            with pytest.raises(error, match='device' if not sync else 'local_scalar_dense'):
                module_dtype_violations(model, torch.randn(2, 4, device='cuda'), torch.float16, 'cuda')
    # CUDA's autocast is as torch has it again: off where no GPU is found
    assert torch.cuda.amp.common.amp_definitely_not_available() == (not torch.cuda.is_available())


def test_custom_op_policy_is_docs_precision():
    log = OpLog()
    log.calls = [('structformer.newton_schulz.default', [torch.bfloat16], [('cuda', torch.bfloat16, 16)]),
                 ('structformer.shared_qkv_attention_forward.default', [torch.float16], [('cuda', torch.float16, 8)]),
                 ('structformer.mystery.default', [torch.float32], [('cuda', torch.float32, 8)])]
    wrong = custom_op_violations(log, torch.float16)
    assert len(wrong) == 2
    assert wrong[0].startswith('structformer.newton_schulz.default: computed in') and 'float32' in wrong[0]
    assert 'no policy' in wrong[1]


# ---- bench gpu ---------------------------------------------------------------------------------------------------

def _row(section, mode, status='ok', **values):
    return dict(section=section, mode=mode, status=status, **values)


def _synthetic_rows(crate=900.0, sdpa_oom=True):
    rows = [_row('models', m, label=label, train_img_per_s=v, params=5e6, peak_gib=1.0, compile_s=3.0)
            for m in ('eager', 'compiled') for label, v in (('ViT-T', 1000.0), ('CRATE-T', crate), ('ViT-S', 400.0),
                                                            ('ViT-S factorised rank 0.25', 500.0))]
    for n, grid in ((8192, [64, 128]), (50176, [224, 224])):
        rows.append(_row('attention', 'eager', attention='soft', grid=grid, forward_ms=1.0, forward_backward_ms=3.0,
                         peak_mib=10.0))
        rows.append(_row('attention', 'eager', attention='softmax', grid=grid, forward_ms=2.0,
                         forward_backward_ms=6.0, peak_mib=20.0) if n == 8192 or not sdpa_oom else
                    _row('attention', 'eager', 'oom', attention='softmax', grid=grid, note='CUDA out of memory'))
    rows += [_row('sparse', 'eager', tokens=4097, keep=0.25, path='block-gather', ms=1.0, vs_dense=0.9, density=0.3),
             _row('sparse', 'eager', tokens=4097, keep=0.25, path='dense SDPA', ms=1.1, vs_dense=1.0, density=1.0),
             _row('sparse', 'compiled', 'not timed', tokens=4097, keep=0.25, path='masked')]
    return rows


def test_goals_are_judged_from_the_rows():
    verdicts = {g['goal']: g for g in goals(_synthetic_rows())}
    assert verdicts['crate_over_vit']['met'] and verdicts['crate_over_vit']['measured']['eager'] == pytest.approx(0.9)
    assert verdicts['soft_over_sdpa']['met']                 # 2x at 8,192; SDPA out of memory at 50,176
    assert verdicts['sparsifiner_at_4097']['met'] and verdicts['sparsifiner_at_4097']['measured'] == {
        'block-gather (eager)': 0.9}
    assert not verdicts['lowrank_over_dense']['met']         # 1.25x < 1.5x
    slow = {g['goal']: g for g in goals(_synthetic_rows(crate=800.0, sdpa_oom=False))}
    assert slow['crate_over_vit']['met'] is False and slow['soft_over_sdpa']['met'] is False   # 2x < 4x at 50,176
    assert all(g['met'] is None for g in goals([]))


def _pair_row(subject, reference, ratio, status='ok'):
    spec = lambda label: {'label': label, 'model': 'm', 'kwargs': {}, 'transforms': []}    # noqa: E731
    values = dict(ratio=ratio, ratio_q1=ratio - 0.02, ratio_q3=ratio + 0.01, rounds=20, subject_ms=22.0,
                  reference_ms=20.0) if status == 'ok' else {}
    return _row('pairs', 'eager', status, label=f"{subject} / {reference}", subject=spec(subject),
                reference=spec(reference), **values)


def test_a_paired_row_decides_the_eager_training_goals():
    """With the goal's pair timed back to back, its ratio is the eager measurement (the models rows, each timed in
    turn, would say 0.9x here and meet the goal; the pair says 0.85x and does not); compiled rows still count."""
    rows = [r for r in _synthetic_rows() if not (r['section'] == 'models' and r['mode'] == 'compiled')]
    rows.append(_pair_row('CRATE-T', 'ViT-T', 0.85))
    crate = next(g for g in goals(rows) if g['goal'] == 'crate_over_vit')
    assert crate['measured'] == {'eager, paired': 0.85} and crate['met'] is False
    assert '0.85x eager, paired' in goal_line(crate)
    # a pair that failed leaves the goal to the models rows
    failed = rows[:-1] + [_pair_row('CRATE-T', 'ViT-T', None, status='error')]
    crate = next(g for g in goals(failed) if g['goal'] == 'crate_over_vit')
    assert crate['measured'] == {'eager': pytest.approx(0.9)} and crate['met']
    # the compiled rows still judge beside the pair
    lowrank = next(g for g in goals(_synthetic_rows() + [_pair_row('ViT-S factorised rank 0.25', 'ViT-S', 1.6)])
                   if g['goal'] == 'lowrank_over_dense')
    assert lowrank['measured'] == {'eager, paired': 1.6, 'compiled': pytest.approx(1.25)} and lowrank['met']


def test_markdown_of_a_record_and_the_doc_section():
    rows = _synthetic_rows()
    record = {'environment': {'device': 'NVIDIA H100 80GB HBM3', 'torch': '2.11.0', 'cuda': '13.0'}, 'rows': rows,
              'goals': goals(rows), 'date': '2026-12-01', 'command': 'structformer bench gpu', 'wall_s': 200.0,
              'budget_s': 230.0, 'notes': [],
              'settings': dict(bench_gpu.SIZES['gpu'], dtype='bfloat16')}
    text = render_markdown(record, 'docs/gpu/h100-80gb-hbm3_2026-12-01.json')
    assert text.startswith('Record: `docs/gpu/h100-80gb-hbm3_2026-12-01.json`. NVIDIA H100 80GB HBM3')
    assert '| CRATE-T | 5.00 | 900 | 1.0 | 900 | 1.0 | 3 |' in text
    assert '| SDPA | 2.00 (6.00, 20) | OOM |' in text and '| SOFT | 1.00 (3.00, 10) | 1.00 (3.00, 10) |' in text
    assert '| 4097 | 1.10 | 1.00 (0.90x, 0.300) |' in text and '| 4097 | - | not timed |' in text
    assert '**met**' in text and '**not met**' in text
    page = 'intro\n<!-- bench gpu: begin -->\nold\n<!-- bench gpu: end -->\nafter\n'
    updated = replace_section(page, text, bench_gpu.BEGIN, bench_gpu.END)
    assert section_of(updated, bench_gpu.BEGIN, bench_gpu.END) == text and updated.endswith('after\n')
    with pytest.raises(ValueError, match='one'):
        replace_section('no markers', text, bench_gpu.BEGIN, bench_gpu.END)
    assert render_markdown(None) == NO_RECORD
    assert 'paired' not in text                        # no pairs measured, no pair table
    # a core row with its predictor / tiles split shows both
    core = _row('sparse', 'eager', tokens=4097, keep=0.25, path='block-gather core', ms=0.8, vs_dense=0.7, density=0.3,
                predictor_vs_dense=0.5, tiles_vs_dense=0.25)
    split = render_markdown(dict(record, rows=rows + [core]))
    assert '0.80 (0.70x, 0.300; predictor 0.50x + tiles 0.25x)' in split and "its tiles' times over SDPA's" in split
    assert "its tiles' times" not in text
    paired = render_markdown(dict(record, rows=rows + [_pair_row('CRATE-T', 'ViT-T', 0.95),
                                                         _pair_row('ViT-S factorised rank 0.25', 'ViT-S', 0, 'oom')]))
    assert '| CRATE-T / ViT-T | 0.950 (0.930–0.960) | 20 | 22.0 | 20.0 |' in paired
    assert '| ViT-S factorised rank 0.25 / ViT-S | OOM | - | - | - |' in paired
    # compiled attention rows taken with CUDA graphs say so in their label
    graphs = rows + [dict(r, mode='compiled', compile_mode='reduce-overhead') for r in rows
                     if r['section'] == 'attention' and r['status'] == 'ok']
    text = render_markdown(dict(record, rows=graphs), None)
    assert '| SOFT, compiled (CUDA graphs) | 1.00 (3.00, 10) |' in text and '| SOFT |' in text


def test_plan_deadlines_and_names():
    plan = bench_gpu.make_plan(bench_gpu.SIZES['gpu'], compiled=True)
    eager = [p for p in plan if p['mode'] == 'eager' and p['section'] == 'models']
    compiled = [p for p in plan if p['mode'] == 'compiled' and p['section'] == 'models']
    assert [p['label'] for p in eager] == [m[0] for m in bench_gpu.MODELS]
    # the goals' pairs first, eager only, each naming both models as `models` rows build them
    assert plan[0]['section'] == 'pairs' and bench_gpu.SHARES[0][:2] == ('pairs', 'eager')
    pairs = [p for p in plan if p['section'] == 'pairs']
    assert [(p['subject']['label'], p['reference']['label'], p['mode']) for p in pairs] == [
        ('CRATE-T', 'ViT-T', 'eager'), ('ViT-S factorised rank 0.25', 'ViT-S', 'eager')]
    factorised = next(p for p in eager if p['label'] == 'ViT-S factorised rank 0.25')
    assert pairs[1]['subject'] == {k: factorised[k] for k in ('label', 'model', 'kwargs', 'transforms')}
    assert [p['label'] for p in compiled][:4] == ['ViT-T', 'CRATE-T', 'ViT-S', 'ViT-S factorised rank 0.25']
    grids = [p['grid'] for p in plan if p['section'] == 'attention' and p['mode'] == 'eager']
    assert {g[0] * g[1] for g in grids} == {784, 3136, 8192, 12544, 50176}
    assert {p['tokens'] for p in plan if p['section'] == 'sparse'} == {577, 1025, 4097}
    ends = bench_gpu.deadlines(100.0, 200.0, compiled=True)
    assert ends['models', 'eager'] == pytest.approx(164.0) and ends['sparse', 'compiled'] == pytest.approx(300.0)
    # compiled: attention (the SOFT goal's sizes first, smallest first), the models, then Sparsifiner, in the order
    # of their cumulative shares
    sections = [p['section'] for p in plan if p['mode'] == 'compiled']
    assert sections == sorted(sections, key=bench_gpu.COMPILED_ORDER.index)
    assert [s for s, m, _ in bench_gpu.SHARES if m == 'compiled'] == list(bench_gpu.COMPILED_ORDER)
    first = next(p for p in plan if p['mode'] == 'compiled')
    assert first['section'] == 'attention' and first['grid'][0] * first['grid'][1] == 8192
    compiled = [(p['attention'], p['grid'][0] * p['grid'][1]) for p in plan
                if p['mode'] == 'compiled' and p['section'] == 'attention']
    # SDPA and SOFT at the goal's sizes (smallest first), then SOFT++ there, then the rest largest first
    assert compiled[:6] == [(a, n) for n in (8192, 12544, 50176) for a in ('softmax', 'soft')]
    assert compiled[6:9] == [('softpp', n) for n in (8192, 12544, 50176)]
    assert list(dict.fromkeys(n for _, n in compiled[9:])) == [3136, 784] and len(compiled) == 15
    assert ends['attention', 'compiled'] < ends['models', 'compiled'] < ends['sparse', 'compiled']
    from structformer.bench.gpu_measure import attention_compile_mode
    assert attention_compile_mode('cuda', 'inductor') == 'reduce-overhead'         # CUDA graphs on a GPU
    assert attention_compile_mode('cpu', 'inductor') is None and attention_compile_mode('cuda', 'eager') is None
    assert bench_gpu.deadlines(0.0, 100.0, compiled=False)['sparse', 'eager'] == pytest.approx(100.0)
    assert bench_gpu.device_slug('NVIDIA H100 80GB HBM3') == 'h100-80gb-hbm3'
    assert bench_gpu.device_slug('NVIDIA H200') == 'h200'


def test_a_worker_is_stopped_at_its_deadline():
    """A worker that has not finished by its deadline is killed: its rows so far are kept (none here: it is
    stopped while it imports torch), and the note says why."""
    start = time.time()
    rows, note = bench_gpu.stream_rows({'settings': {'device': 'cpu'}, 'items': []}, time.time() + 0.2)
    assert rows == [] and 'deadline' in note and time.time() - start < 10


def _cpu_bfloat16_sdpa_failure():
    """torch's own error for a tiny bfloat16 SDPA on this CPU, or None where it runs. torch 2.14 raises
    'pack_vnni2 is only supported when avx512 is supported' on an AMX Xeon whose ATen kernels are capped below
    AVX-512 (ATEN_CPU_CAPABILITY=default or avx2): its flash-attention kernel picks the AMX packing by the CPU's
    flags, not by the capability it was dispatched at (seen on family 6 model 207, 2026-11-28)."""
    q = torch.randn(1, 2, 65, 32, dtype=torch.bfloat16)        # the size of the bench's Sparsifiner rows
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None


@pytest.mark.slow
def test_bench_gpu_dry_path_on_the_cpu(tmp_path, capsys):
    """`structformer bench gpu --device cpu`: every planned row is measured or marked not timed, the record holds
    the goals and renders, and `--render ... --doc` writes a page's section from it. Its rows run in bfloat16, so
    where torch's CPU bfloat16 SDPA itself fails (`_cpu_bfloat16_sdpa_failure`) there is nothing of ours to test."""
    failure = _cpu_bfloat16_sdpa_failure()
    if failure:
        pytest.skip(f"torch's CPU bfloat16 SDPA fails in this setting: {failure}")
    out = tmp_path / 'dry.json'
    assert main(['bench', 'gpu', '--device', 'cpu', '--budget-s', '100', '--output', str(out)]) == 0
    record = json.loads(out.read_text())
    planned = bench_gpu.make_plan(bench_gpu.SIZES['tiny'], compiled=True)
    keys = {bench_gpu._key(r) for r in record['rows']}
    assert all(bench_gpu._key(p) in keys for p in planned)
    assert {r['status'] for r in record['rows']} <= {'ok', 'not timed'}, [r for r in record['rows']
                                                                          if r['status'] not in ('ok', 'not timed')]
    vit = next(r for r in record['rows'] if r['section'] == 'models' and r['label'] == 'ViT-T' and r['mode'] == 'eager')
    pair = next(r for r in record['rows'] if r['section'] == 'pairs')
    assert pair['status'] == 'ok' and pair['rounds'] == 2 and pair['ratio_q1'] <= pair['ratio'] <= pair['ratio_q3']
    assert pair['subject_ms'] > 0 and pair['reference_ms'] > 0
    crate = next(g for g in record['goals'] if g['goal'] == 'crate_over_vit')
    assert crate['measured']['eager, paired'] == pair['ratio']
    with torch.device('meta'):                      # the dry path builds two blocks of ViT-T
        vit_t = timm.create_model('vit_tiny_patch16_224', img_size=32, num_classes=1000, depth=2)
    assert vit['kwargs'] == {'depth': 2} and vit['params'] == sum(p.numel() for p in vit_t.parameters())
    assert vit['status'] == 'ok' and vit['train_img_per_s'] > 0
    sparse = [r for r in record['rows'] if r['section'] == 'sparse' and r['status'] == 'ok' and r['mode'] == 'eager']
    assert any(r['path'] == 'block-gather' and 0 < r['density'] <= 1 for r in sparse)
    assert len(record['goals']) == 4 and record['environment']['device'] == 'cpu'
    assert 'the dry path' in capsys.readouterr().out
    page = tmp_path / 'page.md'
    page.write_text(f"# page\n\n{bench_gpu.BEGIN}\n{NO_RECORD}\n{bench_gpu.END}\n")
    assert main(['bench', 'gpu', '--render', str(out), '--doc', str(page)]) == 0
    assert section_of(page.read_text(), bench_gpu.BEGIN, bench_gpu.END) == render_markdown(record, str(out))


# ---- CUDA hazards found by reading the training code, checked without a GPU ----------------------------------------

def test_checkpoints_keep_the_cuda_generators(monkeypatch):
    """Dropout, drop path and Mixup's masks on a GPU draw from the CUDA generators: a checkpoint saves each device's
    state once CUDA is in use and a resume puts it back (devices this machine has; none on a CPU-only resume)."""
    from structformer.train import checkpoint
    states = [torch.arange(8, dtype=torch.uint8), torch.arange(8, 16, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'is_initialized', lambda: True)
    monkeypatch.setattr(torch.cuda, 'get_rng_state_all', lambda: states)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    monkeypatch.setattr(torch.cuda, 'set_rng_state', lambda state, device: restored.append((device, state)))
    tensors, meta = checkpoint.capture_rng()
    assert torch.equal(tensors['rng.cuda.0'], states[0]) and torch.equal(tensors['rng.cuda.1'], states[1])
    checkpoint.restore_rng(tensors, json.loads(json.dumps(meta)))          # the meta goes through state.json
    assert [d for d, _ in restored] == [0] and torch.equal(restored[0][1], states[0])   # one device here
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    restored.clear()
    checkpoint.restore_rng(tensors, meta)                  # a CPU-only machine keeps its CPU streams
    assert restored == []
    assert not any(k.startswith('rng.cuda') for k in checkpoint.capture_rng()[0])   # no CUDA: nothing of it saved


class _Checked(Exception):
    """Stops a run's build at its input check."""


def test_the_input_check_runs_on_the_runs_device(monkeypatch, tmp_path):
    """The trainer's pre-flight forward (one batch, before anything is written) runs where the run trains, under its
    autocast: on a GPU, a model left on the CPU under CUDA's autocast checked no dtype and took the CPU's paths
    (kernel choices timed, the CPU tile kernel compiled). The meta device stands in for a GPU here."""
    from structformer.train import engine, scoring_data
    seen = []

    def check(model, batch, precision, refusal, channel_remedy=None):
        seen.append((next(model.parameters()).device.type, batch.device.type, precision.device.type))
        raise _Checked
    monkeypatch.setattr(engine, 'init_distributed', lambda device: (0, 1, torch.device('meta')))
    monkeypatch.setattr(scoring_data, 'check_model_input', check)
    trainer = engine.Trainer(TrainConfig(model='crate_digits', data='digits', epochs=1, output=str(tmp_path / 'run')),
                             progress=False)
    with pytest.raises(_Checked):
        trainer._build()
    assert seen == [('meta', 'meta', 'meta')]
    assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('variable, device, shared, backend', [
    ('', 'cuda', False, 'nccl'), ('', 'cuda', True, 'gloo'), ('', 'cpu', False, 'gloo'),
    ('gloo', 'cuda', False, 'gloo'), ('nccl', 'cuda', True, 'nccl'), (' NCCL ', 'cuda', False, 'nccl')])
def test_process_group_backend(monkeypatch, variable, device, shared, backend):
    """nccl for one GPU per process; gloo on CPUs and where torchrun's processes share one GPU (--device cuda:N),
    which nccl refuses; $STRUCTFORMER_DIST_BACKEND overrides."""
    from structformer.train.distributed import process_group_backend
    monkeypatch.setenv('STRUCTFORMER_DIST_BACKEND', variable)
    assert process_group_backend(torch.device(device), shared) == backend


def test_process_group_backend_refuses_what_cannot_run(monkeypatch):
    from structformer.errors import UsageError
    from structformer.train.distributed import process_group_backend
    monkeypatch.setenv('STRUCTFORMER_DIST_BACKEND', 'mpi')
    with pytest.raises(UsageError, match='STRUCTFORMER_DIST_BACKEND.*nccl or gloo'):
        process_group_backend(torch.device('cuda'), False)
    monkeypatch.setenv('STRUCTFORMER_DIST_BACKEND', 'nccl')
    with pytest.raises(UsageError, match='needs CUDA'):
        process_group_backend(torch.device('cpu'), False)


def test_export_errors_read_outputs_on_any_device():
    """export/graphs.py's error measures take a CUDA model's outputs (moved to the CPU), as the GPU suite's export
    test gives them; here a CPU tensor with a graph and a NumPy array, as ONNX Runtime returns."""
    from structformer.export.graphs import relative_error
    want = torch.tensor([1.0, -2.0, 4.0])
    assert relative_error(want.numpy() * (1 + 1e-3), want) == pytest.approx(1e-3, rel=1e-3)
    assert relative_error(want.clone(), want.requires_grad_()) == 0.0
