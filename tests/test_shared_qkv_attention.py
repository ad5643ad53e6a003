"""CRATE's SSA operator with the shared-projection backward (structformer.functional.shared_qkv_attention)
against the autograd reference and SDPA: outputs, gradients, gradcheck."""
import pytest
import torch
import torch.nn.functional as F

from structformer.functional.shared_qkv_attention import shared_qkv_attention, shared_qkv_attention_reference


@pytest.mark.parametrize('scale', [0.5, 4.0])        # 4.0: peaked softmax rows
def test_gradcheck_float64(scale):
    torch.manual_seed(0)
    w = torch.randn(2, 3, 7, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: shared_qkv_attention(t, scale), (w,))


def _value_and_grad(fn, w, probe):
    w = w.detach().clone().requires_grad_()
    out = fn(w)
    (grad,) = torch.autograd.grad((out * probe).sum(), w)
    return out.detach(), grad


def test_matches_reference_and_sdpa_in_float64():
    torch.manual_seed(1)
    w, probe = torch.randn(2, 6, 50, 64, dtype=torch.float64), torch.randn(2, 6, 50, 64, dtype=torch.float64)
    scale = 64 ** -0.5
    ours = _value_and_grad(lambda t: shared_qkv_attention(t, scale), w, probe)
    for oracle in (lambda t: shared_qkv_attention_reference(t, scale),
                   lambda t: F.scaled_dot_product_attention(t, t, t, scale=scale)):
        expected = _value_and_grad(oracle, w, probe)
        for a, b in zip(ours, expected):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10 * b.abs().max().item())


def test_float32_error_is_that_of_plain_float32_attention():
    """In float32 the fused backward may round differently from autograd, but no worse: its distance to
    the float64 result stays within a small multiple of plain float32 attention's own distance."""
    torch.manual_seed(2)
    w, probe = torch.randn(4, 6, 197, 64), torch.randn(4, 6, 197, 64)
    scale = 64 ** -0.5
    truth = _value_and_grad(lambda t: shared_qkv_attention_reference(t, scale), w.double(), probe.double())
    ours = _value_and_grad(lambda t: shared_qkv_attention(t, scale), w, probe)
    plain = _value_and_grad(lambda t: shared_qkv_attention_reference(t, scale), w, probe)
    eps = torch.finfo(torch.float32).eps
    for mine, base, exact in zip(ours, plain, truth):
        floor = eps * exact.abs().max().item()                # one rounding of the largest entry
        assert (mine.double() - exact).abs().max() <= 4 * (base.double() - exact).abs().max() + floor


def test_rejects_a_tensor_without_batch_dimension():
    with pytest.raises(ValueError, match=r'w must be \[..., N, p\]'):
        shared_qkv_attention(torch.randn(5, 4), 1.0)
