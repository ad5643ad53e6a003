"""Self-attention with one projection for queries, keys and values: CRATE's SSA operator (Eq. 11).

    O = softmax(s · W Wᵀ) W,    W = U_kᵀZ per head (rows: tokens),  s = the softmax scale.

Generic attention treats Q, K and V as three inputs: its backward computes dQ, dK and dV with four
N×N×p products (plus a fifth to recompute the scores) and autograd sums the three into dW. With
Q = K = V = W the gradient has a shorter form. Writing P = softmax(S), S = s·W Wᵀ, and G = dO:

    dP = G Wᵀ,    dS = P ⊙ (dP − rowsum(dP ⊙ P)),    dW = Pᵀ G + s (dS + dSᵀ) W,

and rowsum(dP ⊙ P) = rowsum(G ⊙ O) (an N×p product instead of N×N). That is three N×N×p products
in the backward instead of five. The price is keeping P (N×N per head) for the backward, which a
flash kernel does not, and N×N elementwise passes (dS and the transposed sum dS + dSᵀ) that a fused
kernel avoids. On the CPU measured (docs/benchmarks.md) it wins for short sequences and those passes
outweigh the two saved products from about N = 128 on, so `structformer.layers.attention.mssa.MSSA`
runs it by default only below that (`ssa_impl='auto'`), or whenever asked (`ssa_impl='shared'`).
"""
import torch


def shared_qkv_attention_reference(w: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale · W Wᵀ) W over the last two dims, differentiated by autograd: the oracle."""
    return torch.softmax(scale * w @ w.transpose(-2, -1), dim=-1) @ w


class _SharedQKVAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        shape = w.shape
        w3 = w.reshape(-1, shape[-2], shape[-1])                       # [batch·heads, N, p]
        probs = torch.softmax(torch.bmm(w3, w3.transpose(1, 2)).mul_(scale), dim=-1)
        out = torch.bmm(probs, w3)
        ctx.save_for_backward(w3, probs, out)
        ctx.scale, ctx.shape = scale, shape
        return out.view(shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        w3, probs, out = ctx.saved_tensors
        g = grad_out.reshape(w3.shape)
        row = (g * out).sum(-1, keepdim=True)                          # rowsum(dP ⊙ P) = rowsum(G ⊙ O)
        d_scores = torch.bmm(g, w3.transpose(1, 2)).sub_(row).mul_(probs)     # dS, in place on dP
        # W is both query and key: their gradients s·dS W and s·dSᵀ W share one product
        grad_w = torch.baddbmm(torch.bmm(probs.transpose(1, 2), g), d_scores + d_scores.transpose(1, 2), w3,
                               alpha=ctx.scale)
        return grad_w.view(ctx.shape), None


def shared_qkv_attention(w: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale · W Wᵀ) W for w of shape [..., N, p], with the shared-projection backward above."""
    if w.dim() < 3:
        raise ValueError(f"shared_qkv_attention: w must be [..., N, p] with a batch dimension, got {tuple(w.shape)}")
    return _SharedQKVAttention.apply(w, scale)
