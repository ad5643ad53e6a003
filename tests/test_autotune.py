"""The kernel chooser (`functional/autotune.py`): its decision logic with injected timings (cache used and
invalidated, override obeyed, a bad override one line, the choice recorded), and every candidate of every choice
equal to its reference within the dtype's rounding on each shape class the chooser distinguishes. No speed is
asserted here: speed lives in the benchmarks."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

from structformer.errors import UsageError
from structformer.functional import autotune, onednn_linear, tile_kernel
from structformer.functional.newton_pinv import newton_pinv
from structformer.layers.attention import mssa
from structformer.layers.attention.sparsifiner import SparsifinerAttention
from structformer.layers.linear import FactorizedLinear


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """Timing on, a fresh disk cache and no decision of earlier tests in memory."""
    monkeypatch.setenv('STRUCTFORMER_AUTOTUNE', 'on')
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tmp_path))
    for variable in [v for v in __import__('os').environ if v.startswith(autotune.ENV_PREFIX)]:
        monkeypatch.delenv(variable)
    autotune.forget()
    yield tmp_path
    autotune.forget()


class FakeTimer:
    """Returns the set seconds per round for each candidate, calling nothing (or each call once with run=True)."""

    def __init__(self, seconds: dict, run: bool = False):
        self.seconds, self.run, self.calls = seconds, run, 0

    def __call__(self, calls):
        self.calls += 1
        if self.run:
            for call in calls.values():
                call()
        return {label: list(self.seconds[label]) for label in calls}


def _never():
    raise AssertionError('the candidates were built although nothing was to be timed')


def _decide(default='shared', shape=(197, 64, 'float32')):
    return autotune.decide('ssa_impl', shape, default, lambda: {'shared': lambda: None, 'sdpa': lambda: None})


def test_fastest_candidate_wins_only_beyond_the_margin(tuning):
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})):
        assert _decide() == 'sdpa'
    # 3 % faster: within the margin, the default stays
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.97] * 3})):
        assert _decide(shape=(17, 16, 'float32')) == 'shared'
    # the per-round ratio decides, not two medians: sdpa faster in 2 of 3 rounds
    with autotune.use_timer(FakeTimer({'shared': [1.0, 1.0, 0.1], 'sdpa': [0.5, 0.5, 1.0]})):
        assert _decide(shape=(33, 16, 'float32')) == 'sdpa'


def test_a_decision_is_cached_on_disk_and_read_back_without_timing(tuning):
    timer = FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})
    with autotune.use_timer(timer):
        assert _decide() == 'sdpa'
        assert _decide() == 'sdpa'                      # this process remembers it
    assert timer.calls == 1
    files = list((tuning / 'choices').glob('*.json'))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert data['choices']['ssa_impl']['197,64,float32']['choice'] == 'sdpa'
    assert data['machine']['torch'] == torch.__version__ and data['machine']['threads'] == torch.get_num_threads()
    autotune.forget()                                   # a new process: from the disk, nothing timed
    with autotune.use_timer(FakeTimer({'shared': [0.1] * 3, 'sdpa': [1.0] * 3})) as _:
        assert autotune.decide('ssa_impl', (197, 64, 'float32'), 'shared', _never) == 'sdpa'
    assert autotune.report()['decisions'][0]['source'] == 'cache'


@pytest.mark.parametrize('change', ['torch', 'cpu', 'threads'])
def test_a_new_torch_cpu_or_thread_count_times_again(tuning, monkeypatch, change):
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})):
        assert _decide() == 'sdpa'
    autotune.forget()
    machine = dict(autotune._static_machine())
    if change == 'threads':
        torch.set_num_threads(torch.get_num_threads() % 2 + 1)      # the fixture in conftest restores it
    else:
        key = 'torch' if change == 'torch' else 'flags'
        machine[key] = '9.9.9' if change == 'torch' else ('avx2',)
        monkeypatch.setattr(autotune, '_static_machine', lambda: tuple(machine.items()))
    timer = FakeTimer({'shared': [0.5] * 3, 'sdpa': [1.0] * 3})
    with autotune.use_timer(timer):
        assert _decide() == 'shared'
    assert timer.calls == 1
    assert len(list((tuning / 'choices').glob('*.json'))) == 2      # one file per machine key


@pytest.mark.parametrize('content', ['{not json', '[1, 2]', json.dumps({'format': 1, 'machine': {}, 'choices': {}}),
                                     json.dumps({'format': 1, 'machine': None, 'choices': {'ssa_impl': 3}}),
                                     '', '{"format": 1, "machine": {"cpu": "AMD', b'\xff\xfe\x00garbage',
                                     '[' * 100000])                  # empty, truncated, not UTF-8, too deep to parse
def test_a_corrupt_or_foreign_cache_file_is_ignored_and_rewritten(tuning, content):
    path = autotune.cache_file()
    path.parent.mkdir(parents=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    timer = FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})
    with autotune.use_timer(timer):
        assert _decide() == 'sdpa'
    assert timer.calls == 1
    assert json.loads(path.read_text())['choices'] == {'ssa_impl': {'197,64,float32': json.loads(
        path.read_text())['choices']['ssa_impl']['197,64,float32']}}


def test_a_cached_entry_naming_no_candidate_is_not_obeyed(tuning):
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})):
        _decide()
    path = autotune.cache_file()
    data = json.loads(path.read_text())
    data['choices']['ssa_impl']['197,64,float32']['choice'] = 'import os'
    path.write_text(json.dumps(data))
    autotune.forget()
    with autotune.use_timer(FakeTimer({'shared': [0.5] * 3, 'sdpa': [1.0] * 3})):
        assert _decide() == 'shared'


def test_the_override_is_obeyed_and_recorded(tuning, monkeypatch):
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})):
        assert _decide() == 'sdpa'
    monkeypatch.setenv('STRUCTFORMER_CHOICE_SSA_IMPL', 'shared')
    assert autotune.decide('ssa_impl', (197, 64, 'float32'), 'sdpa', _never) == 'shared'
    assert autotune.decide('ssa_impl', (197, 64, 'float32'), 'sdpa', _never, override='sdpa') == 'sdpa'
    report = autotune.report()
    assert report['overrides'] == {'ssa_impl': 'shared'}
    assert {(d['choice'], d['source']) for d in report['decisions']} >= {('shared', 'override'), ('sdpa', 'argument')}


def test_a_bad_override_is_one_line_naming_the_accepted_values(tuning, monkeypatch):
    monkeypatch.setenv('STRUCTFORMER_CHOICE_SSA_IMPL', 'flash')
    with pytest.raises(UsageError) as error:
        _decide()
    assert str(error.value) == "STRUCTFORMER_CHOICE_SSA_IMPL='flash': accepted 'shared', 'sdpa'"
    monkeypatch.delenv('STRUCTFORMER_CHOICE_SSA_IMPL')
    monkeypatch.setenv('STRUCTFORMER_CHOICE_SSA_IMP', 'sdpa')
    with pytest.raises(UsageError, match=r'^STRUCTFORMER_CHOICE_SSA_IMP: no such choice; accepted .*SSA_IMPL'):
        autotune.check_overrides()
    with pytest.raises(UsageError, match="accepted 'onednn', 'torch'"):
        autotune.decide('linear_kernel', (1,), 'onednn', _never, override='mkl')


def test_nothing_is_timed_while_a_graph_is_recorded_counted_or_with_timing_off(tuning, monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode
    timer = FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})
    with autotune.use_timer(timer):
        with FlopCounterMode(display=False):
            assert autotune.decide('ssa_impl', (5, 16, 'float32'), 'shared', _never) == 'shared'
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            assert autotune.decide('ssa_impl', (5, 16, 'float32'), 'shared', _never) == 'shared'
        monkeypatch.setattr(autotune, 'recording_graph', lambda: True)
        assert autotune.decide('ssa_impl', (5, 16, 'float32'), 'shared', _never) == 'shared'
        monkeypatch.undo()
        monkeypatch.setenv('STRUCTFORMER_CACHE', str(tuning))
        monkeypatch.setenv('STRUCTFORMER_AUTOTUNE', 'off')
        assert autotune.decide('ssa_impl', (5, 16, 'float32'), 'shared', _never) == 'shared'
    assert timer.calls == 0 and not (tuning / 'choices').exists()
    assert {d['source'] for d in autotune.report()['decisions']} == {'default'}
    # a hardware rule decides without timing either
    monkeypatch.setenv('STRUCTFORMER_AUTOTUNE', 'on')
    assert autotune.decide('ssa_impl', (5, 16, 'float32'), 'shared', _never, isa='sdpa') == 'sdpa'


def test_timing_leaves_the_global_random_stream_alone(tuning):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3}, run=True)):
        autotune.decide('ssa_impl', (9, 4, 'float32'), 'shared',
                        lambda: {'shared': lambda: torch.rand(7), 'sdpa': lambda: torch.rand(9)})
    torch.testing.assert_close(torch.rand(3), expected)


def test_the_real_timer_pairs_rounds_within_its_budget():
    times = autotune.paired_round_times({'a': lambda: None, 'b': lambda: sum(range(100))})
    assert autotune.MIN_ROUNDS <= len(times['a']) == len(times['b']) <= autotune.MAX_ROUNDS
    assert all(t >= 0 for t in times['a'] + times['b'])


def test_the_environment_record_carries_the_cpu_kind_and_the_choices(tuning):
    from structformer.records import cpu_kind, environment, kind_id
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})):
        _decide()
    env = environment('cpu')
    assert env['cpu_kind'] == cpu_kind() and env['cpu_kind']['kind']
    assert env['choices']['cached'] == {'ssa_impl': {'197,64,float32': 'sdpa'}}
    assert env['choices']['decisions'][0]['source'] == 'timed'
    json.dumps(env)
    assert kind_id('AuthenticAMD', {'avx2', 'fma'}) == 'amd-avx2'
    assert kind_id('AuthenticAMD', {'avx2', 'avx512f', 'avx512_vnni', 'avx512_bf16'}) == 'amd-avx512-bf16'
    assert kind_id('GenuineIntel', {'avx2', 'avx512f', 'avx512_vnni'}) == 'intel-avx512-vnni'
    assert kind_id('GenuineIntel', {'avx2', 'avx512f', 'amx_tile'}) == 'intel-amx'


def test_the_recorded_cache_file_writes_the_home_folder_as_a_tilde(tuning, monkeypatch):
    """Records are committed: the cache's path names no user's home folder."""
    monkeypatch.setenv('HOME', str(tuning))
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tuning / 'cache'))
    from structformer.records import environment
    recorded = environment('cpu')['choices']['cache_file']
    assert recorded.startswith('~' + os.sep + 'cache' + os.sep) and str(tuning) not in recorded
    assert recorded[1:] == str(autotune.cache_file())[len(str(tuning)):]


# ---- every candidate equals the reference on every shape class the chooser distinguishes --------------------

def _close_float64(got: torch.Tensor, want: torch.Tensor) -> None:
    """float64 paths that differ only in the order of their sums: within 1e-12 of the reference's largest entry."""
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * want.abs().max().item())


def _both(run, monkeypatch, name, candidates):
    """run() under each forced candidate: {candidate: result}."""
    results = {}
    for candidate in candidates:
        monkeypatch.setenv(autotune.ENV_PREFIX + name.upper(), candidate)
        results[candidate] = run()
    monkeypatch.delenv(autotune.ENV_PREFIX + name.upper())
    return results


@pytest.mark.parametrize('tokens, head_dim', [(17, 16), (150, 16), (197, 64), (300, 32)])
def test_ssa_candidates_equal_the_reference(tuning, monkeypatch, tokens, head_dim):
    """Each token class and head width: MSSA's output and gradients (input and weights) on 'shared' and 'sdpa'
    against the per-head softmax written out, float64."""
    torch.manual_seed(0)
    layer = mssa.MSSA(2 * head_dim, num_heads=2).double()
    x = torch.randn(2, tokens, 2 * head_dim, dtype=torch.float64)

    def run():
        xs = x.clone().requires_grad_()
        layer.zero_grad()
        out = layer(xs)
        out.backward(torch.ones_like(out))
        return out.detach(), xs.grad, layer.qkv.weight.grad.clone()

    results = _both(run, monkeypatch, 'ssa_impl', ('shared', 'sdpa'))
    xs = x.clone().requires_grad_()
    w = layer.qkv(xs).view(2, tokens, 2, head_dim).transpose(1, 2)
    heads = torch.softmax(layer.scale * w @ w.transpose(-2, -1), -1) @ w
    layer.zero_grad()
    reference = layer.proj(heads.transpose(1, 2).reshape(2, tokens, -1))
    reference.backward(torch.ones_like(reference))
    # float64, softmax and sums over <= 300 tokens in another order: ~1e-15 of each tensor's largest entry, so 1e-12
    # (the default float64 tolerance, 1e-7, would pass a wrong term of that size)
    for out, grad_x, grad_w in results.values():
        for got, want in ((out, reference.detach()), (grad_x, xs.grad), (grad_w, layer.qkv.weight.grad)):
            _close_float64(got, want)


@pytest.mark.skipif(not onednn_linear.onednn_available(), reason='torch built without oneDNN')
@pytest.mark.parametrize('rows', [1, 70])
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('train', [True, False])
def test_linear_kernel_candidates_equal_f_linear(tuning, monkeypatch, rows, bias, train):
    """FactorizedLinear (a transposed-weight product, then a row-major one) on either kernel against x (U Vᵀ)ᵀ + b,
    float32: outputs, and in training the gradients of x, U, V and b."""
    monkeypatch.setattr(onednn_linear, 'MIN_MULTIPLY_ADDS', 0)
    torch.manual_seed(0)
    layer = FactorizedLinear(24, 40, rank=8, bias=bias)
    x = torch.randn(rows, 24)

    def run():
        layer.zero_grad()
        xs = x.clone().requires_grad_(train)
        with torch.set_grad_enabled(train):
            out = layer(xs)
        if not train:
            return out, ()
        out.backward(torch.ones_like(out))
        return out.detach(), tuple(t.grad for t in (xs, layer.U, layer.V) + ((layer.bias,) if bias else ()))

    results = _both(run, monkeypatch, 'linear_kernel', ('onednn', 'torch'))
    layer.zero_grad()
    xs = x.clone().requires_grad_(train)
    with torch.set_grad_enabled(train):
        reference = F.linear(xs, layer.U @ layer.V.T, layer.bias)
    if train:
        reference.backward(torch.ones_like(reference))
    for out, grads in results.values():
        torch.testing.assert_close(out, reference.detach(), rtol=1e-5, atol=1e-5)
        for got, param in zip(grads, (xs, layer.U, layer.V, layer.bias)):
            torch.testing.assert_close(got, param.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('batch, m', [(1, 8), (6, 49)])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_newton_loop_candidates_equal_pinv(tuning, monkeypatch, batch, m, dtype):
    """Both loops on SPD kernel-like matrices (batch classes 1 and 4, two sizes) against torch.linalg.pinv, with
    the Eq. 12 gradient."""
    torch.manual_seed(0)
    points = torch.randn(batch, m, 3, dtype=torch.float64)
    a = (torch.exp(-torch.cdist(points, points) ** 2 / 4) + 0.1 * torch.eye(m, dtype=torch.float64)).to(dtype)

    def run():
        leaf = a.clone().requires_grad_()
        x = newton_pinv(leaf, num_iter=40)
        x.sum().backward()
        return x.detach(), leaf.grad

    results = _both(run, monkeypatch, 'newton_loop', ('host', 'device'))
    reference = torch.linalg.pinv(a.double())
    grad_reference = -(reference.transpose(-2, -1) @ torch.ones_like(reference) @ reference.transpose(-2, -1))
    if dtype == torch.float32:
        tol = dict(x=dict(rtol=1e-4, atol=1e-4), grad=dict(rtol=1e-4, atol=1e-4))
    else:
        # converged float64 Newton–Schulz: X within ~eps·cond(A) of A⁻¹ and Eq. 12's -Xᵀ G Xᵀ within ~eps·cond(A)² of
        # the true gradient, relative to each tensor's largest entry (cond ≤ ~500 here: ≤ 1e-12 and ≤ 1e-9). The old
        # rtol 1e-7 passed a loop that froze one step early (X_k, ~√eps off) at m = 8
        cond = torch.linalg.cond(a.double()).max().item()
        x_tol, grad_tol = 10 * torch.finfo(dtype).eps * cond, 10 * torch.finfo(dtype).eps * cond ** 2
        assert grad_tol < 1e-8, cond                                # well conditioned: the bound can tell
        tol = dict(x=dict(rtol=x_tol, atol=x_tol * reference.abs().max().item()),
                   grad=dict(rtol=grad_tol, atol=grad_tol * grad_reference.abs().max().item()))
    for x, grad in results.values():
        torch.testing.assert_close(x.double(), reference, **tol['x'])
        torch.testing.assert_close(grad.double(), grad_reference, **tol['grad'])


@pytest.mark.parametrize('n, train, dense_cls_row', [(41, False, True), (41, True, True), (70, False, True),
                                                  (41, False, False), (41, True, False)])
def test_sparsifiner_tile_candidates_equal_the_masked_reference(tuning, monkeypatch, n, train, dense_cls_row):
    """The layer's block attention on the kernel and on gathered tiles against impl='masked' on the same block
    mask (float64), in inference and training (input gradient), with and without the dense cls row (the shape
    class's `dense rows` 1 / 0)."""
    if tile_kernel.unavailable_reason():
        pytest.skip(f'no tile kernel here: {tile_kernel.unavailable_reason()}')
    torch.manual_seed(0)
    options = dict(keep_ratio=0.3, connectivity='block', block_size=8, seq_len=n, n_down=6, dense_cls_row=dense_cls_row)
    layer = SparsifinerAttention(32, 4, **options).double().train(train)
    masked = SparsifinerAttention(32, 4, impl='masked', **options).double().train(train)
    masked.load_state_dict(layer.state_dict())
    x = torch.randn(2, n, 32, dtype=torch.float64)

    def run(module=layer):
        xs = x.clone().requires_grad_(train)
        with torch.set_grad_enabled(train):
            out = module(xs)
        if train:
            out.backward(torch.ones_like(out))
        return out.detach(), xs.grad

    results = _both(run, monkeypatch, 'sparsifiner_tiles', ('kernel', 'gather'))
    out, grad = run(masked)
    for got, got_grad in results.values():
        _close_float64(got, out)
        if train:
            _close_float64(got_grad, grad)


def test_every_choice_builds_and_runs_its_candidates(tuning, monkeypatch):
    """Timing on, with a timer that runs each candidate once: MSSA, FactorizedLinear, SOFT's pinv and the
    Sparsifiner layer each build their stand-ins, run them, and record a timed decision per shape class."""
    monkeypatch.setattr(onednn_linear, 'MIN_MULTIPLY_ADDS', 0)
    timer = FakeTimer(None, run=True)
    timer.seconds = {c: [1.0] * 3 for names in autotune.CHOICES.values() for c in names[0]}
    with autotune.use_timer(timer):
        mssa.MSSA(32, num_heads=2)(torch.randn(2, 9, 32)).sum().backward()
        FactorizedLinear(24, 40, rank=8)(torch.randn(5, 24, requires_grad=True)).sum().backward()
        newton_pinv(torch.eye(4).expand(2, 4, 4).contiguous(), num_iter=3)
        if tile_kernel.available():
            layer = SparsifinerAttention(32, 4, keep_ratio=0.3, connectivity='block', block_size=8, seq_len=20,
                                         n_down=6)
            layer(torch.randn(1, 20, 32)).sum().backward()
    timed = {d['name'] for d in autotune.report()['decisions'] if d['source'] == 'timed'}
    expected = {'ssa_impl', 'newton_loop'} | ({'linear_kernel'} if onednn_linear.onednn_available() else set()) | (
        {'sparsifiner_tiles'} if tile_kernel.available() else set())
    assert timed == expected


@pytest.mark.skipif(not onednn_linear.onednn_available(), reason='torch built without oneDNN')
@pytest.mark.parametrize('bias', [True, False])
def test_tuned_linear_and_ista_on_either_kernel_equal_their_references(tuning, monkeypatch, bias):
    """CRATE's projections (TunedLinear) and fused ISTA step on either kernel: outputs and gradients against
    F.linear and the term-by-term ISTA reference (float32, inputs away from the ReLU's kink)."""
    from structformer.layers.linear import TunedLinear
    from structformer.layers.mlp.ista import ISTA
    monkeypatch.setattr(onednn_linear, 'MIN_MULTIPLY_ADDS', 0)
    torch.manual_seed(0)
    layer, ista = TunedLinear(24, 40, bias=bias), ISTA(24)
    reference_ista = ISTA(24, fused=False)
    reference_ista.load_state_dict(ista.state_dict())
    x = torch.randn(3, 70, 24)

    def run(modules=(layer, ista)):
        results = []
        for module in modules:
            module.zero_grad()
            xs = x.clone().requires_grad_()
            out = module(xs)
            out.backward(torch.ones_like(out))
            results.append((out.detach(), xs.grad, *(p.grad for p in module.parameters())))
        return results

    with onednn_linear.torch_kernels():                       # F.linear itself: the reference
        expected_linear = run((layer,))[0]
    expected_ista = run((reference_ista,))[0]
    for got_linear, got_ista in _both(run, monkeypatch, 'linear_kernel', ('onednn', 'torch')).values():
        for got, want in zip(got_linear + got_ista, expected_linear + expected_ista):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_deterministic_algorithms_take_the_default(tuning):
    torch.use_deterministic_algorithms(True)
    try:
        with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})):
            assert _decide() == 'shared'
    finally:
        torch.use_deterministic_algorithms(False)


def test_every_checkpoint_records_the_machine_and_its_choices(tuning, tmp_path):
    """A run's record of what ran: each checkpoint's state.json carries records.environment(), with the CPU kind
    and the kernel choices made in the process that wrote it."""
    from structformer.records import cpu_kind
    from structformer.train.checkpoint import save_checkpoint
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})):
        _decide()
    folder = save_checkpoint(tmp_path / 'epoch_0001', torch.nn.Linear(2, 3), {'epoch': 1}, with_rng=False)
    env = json.loads((folder / 'state.json').read_text())['environment']
    assert env['cpu_kind']['kind'] == cpu_kind()['kind'] and env['device'] == 'cpu'
    assert env['choices']['cached'] == {'ssa_impl': {'197,64,float32': 'sdpa'}}


def test_an_isa_cap_in_the_environment_is_another_machine(tuning, monkeypatch):
    """ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS change which kernels run without
    changing the CPU: a decision timed under a cap is not reused without it, the kind says so, and the capped file
    is read back (its machine record survives the JSON round trip)."""
    from structformer import machine as machine_module
    base = autotune.machine()
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})):
        assert _decide() == 'sdpa'
    autotune.forget()
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX2')
    monkeypatch.setenv('MKL_ENABLE_INSTRUCTIONS', 'AVX2')
    autotune._static_machine.cache_clear()
    try:
        kind = machine_module.cpu_kind()
        assert 'avx2' in kind['kind'].split('+cap-')[1].split('-')       # (ATEN_CPU_CAPABILITY may be set too)
        assert {k: kind['isa_caps'][k] for k in ('ONEDNN_MAX_CPU_ISA', 'MKL_ENABLE_INSTRUCTIONS')} == {
            'ONEDNN_MAX_CPU_ISA': 'AVX2', 'MKL_ENABLE_INSTRUCTIONS': 'AVX2'}
        assert not kind['bf16_native'] and not kind['amx']             # bfloat16 dot products need AVX-512 BF16 / AMX
        from structformer.bench.kinds import hardware_facts
        assert any('kernels capped by' in fact and 'ONEDNN_MAX_CPU_ISA=AVX2' in fact for fact in hardware_facts(kind))
        assert not any('bfloat16 dot products in hardware' in fact or 'AVX-512 on an' in fact
                       for fact in hardware_facts(kind))                # capped below AVX-512: no AVX-512 kernel runs
        assert autotune.machine() != base
        timer = FakeTimer({'shared': [0.5] * 3, 'sdpa': [1.0] * 3})
        with autotune.use_timer(timer):
            assert _decide() == 'shared'
        assert timer.calls == 1
        autotune.forget()
        again = FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})
        with autotune.use_timer(again):
            assert _decide() == 'shared'                                 # from the capped machine's file
        assert again.calls == 0
        assert len(list((tuning / 'choices').glob('*.json'))) == 2
    finally:
        monkeypatch.delenv('ONEDNN_MAX_CPU_ISA')
        monkeypatch.delenv('MKL_ENABLE_INSTRUCTIONS')
        autotune._static_machine.cache_clear()


def test_isa_caps_below_avx512():
    from structformer.machine import _below_avx512
    assert [_below_avx512(v) for v in ('default', 'avx2', 'AVX2_VNNI', 'SSE41')] == [True] * 4
    assert [_below_avx512(v) for v in ('avx512', 'AVX512_CORE_BF16', 'AVX10_1_512', 'ALL', 'AVX512_E4')] == [False] * 5


def test_an_isa_cap_below_avx512_makes_bfloat16_not_native(monkeypatch):
    """The bench's bfloat16 verdict and the trainer's warning read `cpu_bfloat16_native`: under
    ONEDNN_MAX_CPU_ISA=AVX2 the kernels cannot use AVX-512 BF16 or AMX even where the CPU has them."""
    from structformer.bench.model_goals import cpu_capability
    from structformer.train.precision import cpu_bfloat16_native
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX2')
    assert cpu_bfloat16_native() is False
    assert 'emulated' in cpu_capability('bfloat16')['text']
    monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', 'AVX512_CORE_AMX')      # a cap above BF16 changes nothing
    monkeypatch.delenv('ATEN_CPU_CAPABILITY', raising=False)
    assert cpu_bfloat16_native() == any(getattr(torch.cpu, n, lambda: False)()
                                        for n in ('_is_avx512_bf16_supported', '_is_amx_tile_supported'))


@pytest.mark.parametrize('variable, value, message', [
    ('STRUCTFORMER_AUTOTUNE', 'of', "STRUCTFORMER_AUTOTUNE='of': accepted on, off"),
    ('STRUCTFORMER_CHOICE_SSA_IMP', 'sdpa', 'STRUCTFORMER_CHOICE_SSA_IMP: no such choice; accepted'),
    ('STRUCTFORMER_CHOICE_NEWTON_LOOP', 'gpu', "STRUCTFORMER_CHOICE_NEWTON_LOOP='gpu': accepted 'host', 'device'"),
])
def test_a_bad_choice_setting_is_refused_before_any_command_runs(monkeypatch, capsys, variable, value, message):
    """A typo in STRUCTFORMER_AUTOTUNE or a STRUCTFORMER_CHOICE_* name / value: one line and exit 2 before the
    command does anything, also where the command never meets that choice (`structformer models` builds no SOFT
    layer): a run must not go ahead with the setting silently ignored."""
    from structformer.cli import main
    monkeypatch.setenv(variable, value)
    assert main(['models', '--filter', 'crate_tiny']) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith('structformer models: error: ')
    with pytest.raises(UsageError, match=message.split(':')[0]):
        autotune.check_environment()
    assert autotune.report()['timing' if variable == 'STRUCTFORMER_AUTOTUNE' else 'overrides']    # recorded, no raise


@pytest.mark.parametrize('value, on', [('off', False), ('0', False), ('FALSE', False), ('on', True), ('1', True),
                                       ('', True), (' yes ', True)])
def test_the_timing_setting_reads_its_accepted_values(monkeypatch, value, on):
    monkeypatch.setenv('STRUCTFORMER_AUTOTUNE', value)
    autotune.check_environment()
    assert autotune.report()['timing'] == ('on' if on else 'off')


@pytest.mark.skipif(os.name != 'posix', reason='the cache lock is POSIX flock')
def test_processes_adding_decisions_at_once_take_turns_and_keep_both(tuning):
    """Two processes (DDP ranks, two runs) timing at once each read, update and rewrite the machine's file: without
    a lock one rewrite drops the other's decision (2 processes × 300 classes kept 431 of 600). Here another process
    holds the lock mid-update (an flock on its own open file): our write waits for it, then keeps its entry too."""
    import fcntl
    import threading
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})):
        assert _decide(shape=(1, 64, 'float32')) == 'sdpa'                 # the file exists, with one decision
        path = autotune.cache_file()
        with open(path.with_suffix('.lock'), 'a') as other:
            fcntl.flock(other, fcntl.LOCK_EX)
            ours = threading.Thread(target=_decide, kwargs={'shape': (2, 64, 'float32')})
            ours.start()
            ours.join(0.5)
            assert ours.is_alive()                                          # waiting for the other writer
            data = json.loads(path.read_text())                             # the other process's update lands
            data['choices']['ssa_impl']['3,64,float32'] = {'choice': 'shared'}
            path.write_text(json.dumps(data))
            fcntl.flock(other, fcntl.LOCK_UN)
        ours.join(10)
    assert sorted(json.loads(path.read_text())['choices']['ssa_impl']) == ['1,64,float32', '2,64,float32',
                                                                           '3,64,float32']


def test_an_unwritable_cache_folder_keeps_the_decision_in_the_process(tuning, monkeypatch):
    """A cache folder that cannot be made or written (a read-only home; here its parent is a file, which stops root
    too): the decision is timed once and kept for this process, and the run goes on."""
    (tuning / 'not-a-folder').write_text('')
    monkeypatch.setenv('STRUCTFORMER_CACHE', str(tuning / 'not-a-folder'))
    timer = FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})
    with autotune.use_timer(timer):
        assert _decide() == 'sdpa' and _decide() == 'sdpa'
    assert timer.calls == 1 and autotune.report()['cached'] == {}


def test_a_file_system_without_locks_still_gets_the_decision_written(tuning, monkeypatch):
    """flock refused (ENOLCK on some NFS homes): the decision is written unlocked rather than never cached."""
    import fcntl

    def refused(handle, operation):
        raise OSError(37, 'No locks available')
    monkeypatch.setattr(fcntl, 'flock', refused)
    with autotune.use_timer(FakeTimer({'shared': [1.0] * 3, 'sdpa': [0.5] * 3})):
        assert _decide() == 'sdpa'
    assert autotune.report()['cached'] == {'ssa_impl': {'197,64,float32': 'sdpa'}}
