"""torch.compile: every small registered model compiles to one graph, once per input shape.

`fullgraph=True` raises on any graph break; dynamo's `CompileCounter` backend (eager execution) counts
the graphs dynamo hands it, so a recompile (a guard that fails on the second call with the same shape)
shows up as a second frame. Graph breaks and recompiles are decided by dynamo, not by the backend, so
this cheap backend checks them (the inductor compile time is measured by hand, see the project's issue 9).
"""
import pytest
import timm
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from structformer.functional.newton_pinv import newton_pinv
from structformer.models import list_structformer_models
from structformer.models.sparsifiner import predictor_parameter_names

SMALL_MODELS = [name for name in list_structformer_models() if name.endswith('_digits')]
# the SOFT pyramid with each baseline attention, at 28 px: every attention class compiles too, traced with one
# block per stage (a graph break or a recompile is a property of the block's code, not of how many there are;
# at the Tiny depths these five took 4 % of the suite's time)
BASELINE_MODELS = [name for name in list_structformer_models()
                   if name.startswith('soft_tiny_') and name.endswith('_mnist')]
ONE_BLOCK_PER_STAGE = {'depths': (1, 1, 1, 1)}


def _build(name: str) -> torch.nn.Module:
    """The model to trace: SOFT pyramids (the digits variants' third stage has two blocks alike) at one block per
    stage."""
    return timm.create_model(name, **(ONE_BLOCK_PER_STAGE if name in BASELINE_MODELS or name.startswith('soft')
                                      else {}))


def _input(model: torch.nn.Module, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, *model.pretrained_cfg['input_size'])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_small_models_are_listed():
    assert {'crate_digits', 'soft_digits', 'softpp_digits'} <= set(SMALL_MODELS)
    assert len(BASELINE_MODELS) >= 4


@pytest.mark.parametrize('name', SMALL_MODELS + BASELINE_MODELS)
def test_eval_forward_compiles_once_without_graph_breaks(name):
    model = _build(name).eval()
    x = _input(model)
    with torch.no_grad():
        expected = model(x)
        backend = CompileCounter()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        first, second = compiled(x), compiled(x)
    assert backend.frame_count == 1                 # compiled once: the second call hit the cache
    assert counters['stats']['unique_graphs'] == 1
    assert not counters['graph_break'], dict(counters['graph_break'])
    # compiled, Newton–Schulz is one opaque operator running the eager iteration (functional/newton_pinv.py)
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(second, first)


@pytest.mark.parametrize('name', SMALL_MODELS)
def test_train_step_compiles_once_without_graph_breaks(name):
    model = _build(name).train()
    x, y = _input(model), torch.tensor([0, 1])
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for _ in range(2):
        model.zero_grad()
        torch.nn.functional.cross_entropy(compiled(x), y).backward()
    assert backend.frame_count == 1
    assert not counters['graph_break'], dict(counters['graph_break'])
    distilled = predictor_parameter_names(model)      # Sparsifiner's predictors: distillation only
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad and n not in distilled)


def test_newton_pinv_compiles_to_one_graph():
    """The host loop's `.tolist()` early exit would break the graph; compiled, it runs as one operator."""
    a = torch.randn(3, 6, 6, dtype=torch.float64)
    a = a @ a.transpose(-2, -1)
    backend = CompileCounter()
    compiled = torch.compile(newton_pinv, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(a, 30), newton_pinv(a, 30))
    torch.testing.assert_close(compiled(a, 30), newton_pinv(a, 30))
    assert backend.frame_count == 1


def test_soft_train_step_through_aot_autograd_matches_eager():
    """aot_eager traces forward and backward (as inductor does): the opaque Newton–Schulz operator needs
    its fake implementation there, and the gradients must equal eager ones (SOFT Eq. 12 backward)."""
    torch.manual_seed(0)
    model = timm.create_model('soft_digits', **ONE_BLOCK_PER_STAGE).train()     # each stage's SOFT block once
    x, y = _input(model), torch.tensor([0, 1])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend='aot_eager', fullgraph=True)
    torch.nn.functional.cross_entropy(compiled(x), y).backward()
    for got, want in zip([p.grad for p in model.parameters()], expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('how', ['compile', 'export', 'export_strict'])
def test_recording_graph_is_true_in_export_only(how):
    """The fast paths' switch: False under torch.compile, True under torch.export (both modes). In torch 2.8 to 2.11
    dynamo folded `torch.compiler.is_exporting()` into True inside every compile, so compiled models took the export
    path; `tracing._exporting` reads the flag itself (the test runs on whatever torch is installed)."""
    from structformer.functional.tracing import recording_graph

    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1 if recording_graph() else x

    x = torch.zeros(2)
    if how == 'compile':
        out = torch.compile(Probe(), backend='eager', fullgraph=True)(x)
    else:
        out = torch.export.export(Probe(), (x,), strict=how == 'export_strict').module()(x)
    assert float(out[0]) == (0.0 if how == 'compile' else 1.0)
    assert not recording_graph()                       # eager, after either
