"""Sparsifiner attention (Wei et al., "Sparsifiner: Learning Sparse Instance-Dependent Attention for
Efficient Vision Transformers", CVPR 2023), with timm's `attn_layer` signature.

A connectivity-mask predictor (Eq. 1–3) picks B = ⌈keep_ratio · n⌉ keys per query from a low-rank,
sparsified attention estimate; multi-head attention then runs on those keys only (Eq. 4–6). The mask is
computed without gradient (the paper detaches it from the attention path); the predictor learns through
its connectivity scores Ã_down·W_up, which `last_scores` keeps for the attention-distillation loss
(Eq. 10) when `keep_scores` is on.

Hyper-parameters (defaults = the paper's): `n_down` 32, `tau` 0.05, `up_threshold` 1e-2, `keep_ratio`
0.25, `predictor_dim` None (the public code reduces q/k channels to 32 inside the predictor: pass 32),
`dense_cls_row` True (the public code's choice: the cls query attends to every token; the paper is
silent), `connectivity` 'token' (the paper) or 'block' (`block_size` tiles, ours). `keys_per_query` fixes
the budget B as a count instead (the paper's "budget ≥ 40" rows); it must not exceed n.

Where the public code (lim142857/Sparsifiner) differs from the paper's text, its choice is the default, as the
code that produced the paper's tables (docs/sparsifiner.md lists them): `up_basis` 'abs' (scores use |W_up|
thresholded at t, as its `basis_threshold(basis.abs())`; 'signed': W_up ⊙ 1[|W_up| ≥ t], the paper's Eq. 3);
`stage1` 'dense' (while a distillation phase trains on the attention loss alone, `learning_predictor`, the layer
attends densely and scores with τ and t off and W_up signed, as the public code's attention-reconstruction
stage; 'sparse': the sparse path with the thresholds on, which stalls at DeiT size: a near-uniform A_down row,
1/32 per coefficient, is all below τ = 0.05, its scores are zero and so is its gradient); `predictor_bias` True
(its q/k channel reductions are nn.Linear with bias); `basis_init` 'trunc_normal' (W_down, W_up ~ trunc-normal
std 0.02; 'scaled': N(0, 1/n) and N(0, 1/n_down), ours before).

Three more choices of the public code are options, off by default here (the paper's text) and set by `structformer
convert --from sparsifiner-official` to the public values, so a converted public checkpoint keeps the keys the
public code keeps (tested against a forward written from its equations): `coef_topk` (None: Eq. 2's threshold τ;
8: each row's top 8 coefficients, its default config's `BASIS_COEF.USE_TOPK`, τ then unused), `predictor_scale`
('dim': Eq. 1's 1/√d of the predictor's channels; 'heads': num_heads^-½, its MaskPredictor's scale), and
`up_threshold` (ours 1e-2; its default config's `BASIS_THRESHOLD` 2e-2).

Execution (`impl`): 'masked' (dense logits, −∞ off the mask: the reference and a CPU training path),
'gather' (each query's B keys gathered, ∝ n·B), 'flex' (FlexAttention on the kept tiles, compiled on CUDA,
training included; on CPU eager it materialises the scores; no attention dropout), 'auto': on a CPU the
masked path, in training and inference (`structformer bench sparse-attention` measured gather 4–100× slower
than masked at n = 197–1025, its per-query K/V copies cost more than the logits they save); on CUDA flex in
training (no n×n probabilities kept for the backward) and masked in inference and under attention dropout
(masked was 1.3–6.4× faster than compiled flex on an H100 at n = 197–4097). With connectivity='block',
'gather' and 'flex' run the predictor on tile means and attend to whole kept tiles, with no n×n tensor,
unless `keep_scores` asks for the n×n scores; 'auto' takes 'gather' on every device (on the H100 it was
faster than flex or within 8 % of it at every size, and it trains in bfloat16 and with dropout), except on
a CPU, where it takes 'kernel' in training and inference: the CPU tile kernel (`functional/tile_kernel.py`,
block connectivity only, float32/64, no attention dropout, built on first use; under attention dropout or
where it cannot load, 'auto' stays on 'gather').

Dtype policy under autocast (docs/precision.md): the predictor (its q/k reductions, Eq. 1–3, the scores kept for
distillation, the top-k) computes in float32 with autocast off, because a top-k over bf16 scores ties and changes
which keys are kept; the attention (Eq. 4–6) runs in the autocast dtype (masked, gathered, flex), and the output
is in that dtype. On a CPU under autocast 'auto' takes the gathered tiles in the autocast dtype, not the
float32-only tile kernel; impl='kernel' still runs the kernel, in float32, cast in and out (`tile_kernel.py`).

W_down and W_up have n columns, so the token count is fixed per layer: pass `seq_len`, or they are
created at the first forward from its n (the model factory's `materialize_lazy` does that before an
optimiser exists).

After EViT token pruning (`structformer.models.token_pruning`, ours: the paper only combines the two
methods) a layer sees n' < n tokens. `forward(x, token_sources=S)` then takes S [B, n', n], row i the
convex weights of the original tokens that token i stands for (one-hot for a kept token, the fusion
weights for a fused one), and the predictor runs with per-sample bases W·Sᵀ [B, n_down, n']: a kept
token uses its own W_down, W_up columns, a fused token the mix of its tokens' columns (one column, as
the fused token takes one softmax slot); the threshold of Eq. 3 applies to the mixed columns, and
B = ⌈keep · n'⌉. `token_sources=None` is the unpruned path unchanged.
"""
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from ...functional.sparsifiner import (block_indices_to_mask, block_mask_from_scores, budget, connectivity_scores,
                                       flex_attention_path, gathered_attention, low_rank_attention,
                                       low_rank_attention_per_sample, mask_from_indices, masked_attention,
                                       pooled_block_scores, predicted_tiles, realised_density, source_columns,
                                       tile_attention, tile_budget, tile_candidates, tile_shape_class, top_tiles,
                                       topk_indices)
from ...functional import autotune, tile_kernel
from ...functional.precision import float32_island, upcast
from ...functional.sparsifiner_flex import flex_attention_available
from ...functional.tracing import recording_graph
from ..lazy import drop_lazy_hooks, is_uninitialized
from ..linear.base import linear_weight
from .registry import register_attention
from ...arguments import optional_positive_int, positive_int
from .softmax import AttentionBase, check_no_mask

IMPLS = ('auto', 'masked', 'gather', 'flex', 'kernel')
CONNECTIVITY = ('token', 'block')
UP_BASES = ('abs', 'signed')          # the basis the scores use outside stage 1: |W_up| (public code) or W_up (paper)
STAGE1_MODES = ('dense', 'sparse')    # while the predictor learns: dense attention, no thresholds (public) or not
BASIS_INITS = ('trunc_normal', 'scaled')
PREDICTOR_SCALES = ('dim', 'heads')   # Eq. 1's logits · 1/√d (paper), or · num_heads^-½ (public MaskPredictor)


class ConnectivityBasis(LazyModuleMixin, nn.Module):
    """W_down and W_up, both [n_down, n] (Eq. 1, 3), created at the first forward when n is not given."""

    def __init__(self, n_down: int, seq_len: Optional[int] = None, device=None, dtype=None, init: str = 'trunc_normal'):
        super().__init__()
        optional_positive_int('seq_len', seq_len, 'tokens per image')
        if init not in BASIS_INITS:
            raise ValueError(f"basis_init={init!r}: accepted {', '.join(map(repr, BASIS_INITS))}")
        self.n_down, self.init = n_down, init
        if seq_len is None:
            self.w_down = nn.UninitializedParameter(device=device, dtype=dtype)
            self.w_up = nn.UninitializedParameter(device=device, dtype=dtype)
        else:
            self.w_down = nn.Parameter(torch.empty(n_down, seq_len, device=device, dtype=dtype))
            self.w_up = nn.Parameter(torch.empty(n_down, seq_len, device=device, dtype=dtype))
            self.reset_parameters()
            drop_lazy_hooks(self)

    @property
    def seq_len(self) -> Optional[int]:
        return None if is_uninitialized(self.w_down) else self.w_down.shape[-1]

    def reset_parameters(self) -> None:
        if self.has_uninitialized_params():
            return
        if self.init == 'trunc_normal':
            # the public code's (proj_n, proj_back_n): trunc-normal, std 0.02, cut at ±2 (absolute, as timm's)
            nn.init.trunc_normal_(self.w_down, std=0.02)
            nn.init.trunc_normal_(self.w_up, std=0.02)
            return
        # 'scaled' (ours before issue 34): W_down as Linformer's E (a token at the scale of one token); W_up's
        # entries well above the 1e-2 threshold at init, so the first masks are not decided by ties at zero
        nn.init.normal_(self.w_down, std=self.w_down.shape[-1] ** -0.5)
        nn.init.normal_(self.w_up, std=self.n_down ** -0.5)

    def materialize(self, num_tokens: int, device=None) -> bool:
        """Create W_down, W_up for `num_tokens` tokens now and initialise them; False (and nothing changed)
        when they already exist. Registered models call it at construction, where n is known."""
        if not self.has_uninitialized_params():
            return False
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        with torch.no_grad():
            self.w_down.materialize((self.n_down, num_tokens), device=device)
            self.w_up.materialize((self.n_down, num_tokens), device=device)
        self.reset_parameters()
        drop_lazy_hooks(self)
        return True

    def initialize_parameters(self, k: torch.Tensor, num_tokens: Optional[int] = None) -> None:
        n = k.shape[-2] if num_tokens is None else num_tokens
        if self.materialize(n, device=k.device):
            warnings.warn(f"Sparsifiner W_down, W_up created at the first forward for seq_len={n}; build the "
                          "optimizer after one forward pass, or pass seq_len= at construction")

    def forward(self, k: torch.Tensor, num_tokens: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(W_down, W_up); `num_tokens`: the unpruned token count when k holds a pruned sequence."""
        n = k.shape[-2] if num_tokens is None else num_tokens
        if n != self.w_down.shape[-1]:
            what = 'got n' if num_tokens is None else 'token_sources come from n'
            raise ValueError(f"Sparsifiner was built for seq_len={self.w_down.shape[-1]} tokens, {what}={n}")
        return self.w_down, self.w_up

    def extra_repr(self) -> str:
        return f"n_down={self.n_down}, seq_len={self.seq_len}"


@register_attention('sparsifiner')
class SparsifinerAttention(AttentionBase):
    """Sparsifiner MHSA with timm's `attn_layer` signature (see the module docstring for the options)."""

    takes_token_sources = True          # forward accepts token_sources= (pruned sequences, see the module doc)

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False, qk_norm: bool = False,
                 scale_norm: bool = False, proj_bias: bool = True, attn_drop: float = 0., proj_drop: float = 0.,
                 norm_layer=None, *, keep_ratio: float = 0.25, n_down: int = 32, tau: float = 0.05,
                 up_threshold: float = 1e-2, predictor_dim: Optional[int] = None, dense_cls_row: bool = True,
                 connectivity: str = 'token', block_size: int = 64, impl: str = 'auto',
                 seq_len: Optional[int] = None, keep_scores: bool = False, attn_head_dim: Optional[int] = None,
                 keys_per_query: Optional[int] = None, up_basis: str = 'abs', stage1: str = 'dense',
                 predictor_bias: bool = True, basis_init: str = 'trunc_normal', coef_topk: Optional[int] = None,
                 predictor_scale: str = 'dim', device=None, dtype=None):
        super().__init__(dim, num_heads, qkv_bias, qk_norm, scale_norm, proj_bias, attn_drop, proj_drop,
                         norm_layer, attn_head_dim=attn_head_dim, device=device, dtype=dtype)
        budget(1, keep_ratio)                                     # validates keep_ratio
        if keys_per_query is not None:
            positive_int('keys_per_query', keys_per_query, 'the budget B')
            if seq_len is not None and keys_per_query > seq_len:
                raise ValueError(f"keys_per_query={keys_per_query} is larger than the seq_len={seq_len} tokens; "
                                 f"accepted 1..{seq_len}")
            if connectivity == 'block':
                raise ValueError("keys_per_query applies to connectivity='token'; a block mask keeps keep_ratio of the tiles")
        self.keys_per_query = keys_per_query
        positive_int('n_down', n_down)
        positive_int('block_size', block_size)
        if coef_topk is not None and (isinstance(coef_topk, bool) or not isinstance(coef_topk, int) or coef_topk < 1):
            raise ValueError(f"coef_topk must be None (Eq. 2's threshold tau) or a positive integer (coefficients "
                             f"kept per row; n_down={n_down} or more keeps them all), got {coef_topk!r}")
        if predictor_scale not in PREDICTOR_SCALES:
            raise ValueError(f"predictor_scale={predictor_scale!r}: accepted 'dim' (1/sqrt(d), Eq. 1) or 'heads' "
                             "(num_heads^-1/2, the public code)")
        self.coef_topk, self.predictor_scale = coef_topk, predictor_scale
        if not _is_number(tau) or not 0 <= tau < 1:
            raise ValueError(f"tau={tau!r} must be a number in [0, 1) (a threshold on softmax coefficients)")
        if not _is_number(up_threshold) or not 0 <= up_threshold < float('inf'):   # NaN too: it zeroed the basis
            raise ValueError(f"up_threshold={up_threshold!r} must be a finite number >= 0 (|W_up| entries below it "
                             "are zeroed)")
        # 0 built q/k maps to no channels (every score 0, silently); -1 failed inside torch.empty
        optional_positive_int('predictor_dim', predictor_dim, "the predictor's q/k channels")
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r}: accepted {', '.join(map(repr, IMPLS))}")
        if impl in ('flex', 'kernel') and attn_drop:
            raise ValueError(f"impl={impl!r} has no attention dropout, got attn_drop={attn_drop!r}; "
                             "use attn_drop=0, or impl='auto' / 'masked'")
        if connectivity not in CONNECTIVITY:
            raise ValueError(f"connectivity={connectivity!r}: accepted 'token' (the paper) or 'block'")
        if impl == 'kernel' and connectivity != 'block':
            raise ValueError("impl='kernel' (the CPU tile kernel) runs connectivity='block' only; "
                             "token connectivity takes 'auto', 'masked', 'gather' or 'flex'")
        if up_basis not in UP_BASES:
            raise ValueError(f"up_basis={up_basis!r}: accepted 'abs' (the public code) or 'signed' (the paper's text)")
        if stage1 not in STAGE1_MODES:
            raise ValueError(f"stage1={stage1!r}: accepted 'dense' (the public code) or 'sparse'")
        self.up_basis, self.stage1 = up_basis, stage1
        # set by the distillation while a phase trains on the attention-distillation loss alone (stage 1)
        self.learning_predictor = False
        self.keep_ratio, self.tau, self.up_threshold = float(keep_ratio), float(tau), float(up_threshold)
        self.dense_cls_row, self.connectivity, self.block_size, self.impl = dense_cls_row, connectivity, block_size, impl
        self.keep_scores = keep_scores
        self.basis = ConnectivityBasis(n_down, seq_len, device=device, dtype=dtype, init=basis_init)
        self.predictor_q = self.predictor_k = None
        if predictor_dim is not None:
            bias = bool(predictor_bias)
            self.predictor_q = nn.Linear(self.head_dim, predictor_dim, bias=bias, device=device, dtype=dtype)
            self.predictor_k = nn.Linear(self.head_dim, predictor_dim, bias=bias, device=device, dtype=dtype)
        self.last_scores: Optional[torch.Tensor] = None
        # with keep_scores: the last forward's connectivity mask [batch, heads, n, n]; None in dense stage 1
        # (`dense_stage1`: training with stage1='dense' attends to every key, last_density 1), as without keep_scores
        self.last_mask: Optional[torch.Tensor] = None
        # the fraction of (query, key) pairs the last forward attended to, dense rows included (0-dim tensor):
        # what the path really computed, beside the nominal keep ratio (`functional.sparsifiner.realised_density`)
        self.last_density: Optional[torch.Tensor] = None

    def __getstate__(self):
        # a copy (copy.deepcopy: EMA, weight averaging; pickling) has run no forward: the last forward's scores, which
        # hold the predictor's graph for the distillation loss, are left out (deepcopy refused that non-leaf tensor)
        state = super().__getstate__()
        state['last_scores'] = None
        return state

    def budget(self, num_tokens: int) -> int:
        if self.keys_per_query is None:
            return budget(num_tokens, self.keep_ratio)
        if self.keys_per_query > num_tokens:
            raise ValueError(f"keys_per_query={self.keys_per_query} is larger than the n={num_tokens} tokens this "
                             f"layer sees; accepted 1..{num_tokens}")
        return self.keys_per_query

    def low_rank(self, q: torch.Tensor, k: torch.Tensor, token_sources: Optional[torch.Tensor] = None):
        """Eq. 1: (A_down [B, H, n, n_down], W_up [n_down, n] or per sample [B, 1, n_down, n]). With
        `token_sources` [B, n, n_full] the bases are the per-sample columns W·Sᵀ (module docstring)."""
        if token_sources is None:
            w_down, w_up = self.basis(k)
        else:
            w_down, w_up = (source_columns(w, token_sources) for w in self.basis(k, token_sources.shape[-1]))
        q, k = self._predictor_inputs(q, k)
        w_up, scale = self._scoring_basis(w_up), self.logit_scale(q)
        if token_sources is None:
            return low_rank_attention(q, k, w_down.to(q.dtype), scale), w_up.to(q.dtype)
        return low_rank_attention_per_sample(q, k, w_down.to(q.dtype), scale), w_up.to(q.dtype).unsqueeze(1)

    def logit_scale(self, q: torch.Tensor) -> float:
        """The scale of Eq. 1's logits for the predictor's queries q [..., d']: 1/√d' ('dim'), or num_heads^-½
        ('heads', the public MaskPredictor's `qk_scale or num_heads ** -0.5`)."""
        return self.num_heads ** -0.5 if self.predictor_scale == 'heads' else q.shape[-1] ** -0.5

    def active_coef_topk(self) -> Optional[int]:
        """`coef_topk` as this forward applies it: off in dense stage 1 (the public code reconstructs the teacher's
        attention from every coefficient there, `thresholds`)."""
        return None if self.dense_stage1 else self.coef_topk

    @property
    def dense_stage1(self) -> bool:
        """True while the predictor learns in the public code's way (stage1='dense', a distillation phase on the
        attention loss alone, training): the layer attends densely and scores without thresholds."""
        return self.training and self.learning_predictor and self.stage1 == 'dense'

    def _scoring_basis(self, w_up: torch.Tensor) -> torch.Tensor:
        """W_up as the scores use it: |W_up| with up_basis='abs' (the public code at inference and in its stage 2:
        `basis_threshold(basis.abs())`), W_up itself with 'signed' (the paper's Eq. 3) and in dense stage 1 (the
        public code distils W_up's signed product)."""
        return w_up.abs() if self.up_basis == 'abs' and not self.dense_stage1 else w_up

    def thresholds(self) -> Tuple[float, float]:
        """(τ, t) of Eq. 2–3 as this forward applies them: off (0, 0) in dense stage 1, where the public code
        reconstructs the teacher's attention from every coefficient and basis entry (with the paper's n_down 32
        and τ 0.05, a near-uniform row of A_down, 1/32 each, is all below τ: zero scores, zero gradient)."""
        return (0.0, 0.0) if self.dense_stage1 else (self.tau, self.up_threshold)

    def scoring_basis(self, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(W_down, the W_up the scores use) in k's dtype: the bases as the predictor applies them."""
        w_down, w_up = self.basis(k)
        return w_down.to(k.dtype), self._scoring_basis(w_up).to(k.dtype)

    def _predictor_inputs(self, q: torch.Tensor, k: torch.Tensor):
        """q and k as the predictor sees them: float16/bfloat16 upcast to float32 (the predictor's dtype policy:
        its scores feed a top-k), then reduced to `predictor_dim` channels when it is set, by its two linear maps
        in float32 with autocast off."""
        q, k = upcast(q), upcast(k)
        if self.predictor_q is None:
            return q, k
        with float32_island(q.device.type):
            # linear_weight: the [out, in] matrix also after `factorize` swaps the maps; the bias (public code's
            # default, predictor_bias) where the map has one
            return tuple(F.linear(x, linear_weight(m).to(x.dtype), _bias(m, x.dtype))
                         for x, m in ((q, self.predictor_q), (k, self.predictor_k)))

    def predict(self, q: torch.Tensor, k: torch.Tensor, token_sources: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Eq. 1–3 up to the top-k: the connectivity scores [B, H, n, n] (differentiable in the predictor)."""
        a_down, w_up = self.low_rank(q, k, token_sources)
        return connectivity_scores(a_down, w_up, *self.thresholds(), self.active_coef_topk())

    def _resolve_impl(self, q: torch.Tensor, dropout_p: float) -> str:
        if self.impl != 'auto':
            return self.impl
        if q.is_cuda:
            # measured on an H100 (docs/sparsifiner.md): gathered tiles ran faster than FlexAttention's full tiles or
            # within 8 % of them, and support dropout and bfloat16 training; token masks: the masked softmax beat
            # FlexAttention in inference at every n, while in training FlexAttention keeps no n×n probabilities
            if self.connectivity == 'block' and not self.keep_scores:
                return 'gather'
            if self.training and not dropout_p and flex_attention_available():   # FlexAttention has no dropout
                return 'flex'
            return 'masked'
        # CPU, token connectivity: the n² masked softmax (two GEMMs) beat gathering every query's keys at every
        # measured n and keep ratio (bench sparse-attention): the [B, H, n, B, d] copies cost more than the
        # logits they save. Block connectivity: whole tiles are gathered once per query tile and the predictor
        # runs on tile means, with no n×n tensor, unless the n×n scores are asked for (keep_scores)
        if self.connectivity == 'block' and not self.keep_scores:
            # under CPU autocast `usable` is False: the attention then runs in the autocast dtype on gathered tiles,
            # not in float32 in the kernel (its dtype policy, module docstring). Otherwise:
            # the tile kernel, no K/V copies (bench sparse-attention at n = 577, keep 0.25: 0.4-0.6x SDPA alone with
            # its predictor against 0.7-1.1x gathered in inference; whole module 0.68-0.70x against 0.84-0.94x
            # in training), where this machine runs it faster than the gathered tiles for the shape class (timed
            # once, cached: `functional.autotune`, choice 'sparsifiner_tiles'); under dropout or where it cannot
            # load: gathered tiles
            if not tile_kernel.usable(q, dropout_p):
                return 'gather'
            dense_rows = 1 if self.dense_cls_row else 0
            kept = tile_budget(q.shape[-2], self.block_size, self.keep_ratio)
            return autotune.decide('sparsifiner_tiles', tile_shape_class(q, self.block_size, kept, dense_rows),
                                   'kernel', lambda: tile_candidates(q, self.block_size, kept, dense_rows))
        return 'masked'

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                grid_size=None, token_sources: Optional[torch.Tensor] = None) -> torch.Tensor:
        check_no_mask(type(self).__name__, attn_mask, is_causal)
        q, k, v = self.project(x)
        n = q.shape[-2]
        if token_sources is not None and token_sources.shape[:2] != q.shape[:1] + q.shape[2:3]:
            raise ValueError(f"token_sources must be [batch, tokens, n_full] = [{q.shape[0]}, {n}, ...], "
                             f"got {list(token_sources.shape)}")
        keys = self.budget(n)
        dense_rows = 1 if self.dense_cls_row else 0
        dropout_p = self.attn_drop.p if self.training else 0.
        impl = self._resolve_impl(q, dropout_p)
        if impl in ('flex', 'kernel') and dropout_p:
            raise ValueError(f"impl={impl!r} has no attention dropout, and attn_drop.p={dropout_p} in training; "
                             "set attn_drop.p=0 or impl='auto' / 'masked'")
        if impl == 'flex' and not q.is_cuda and torch.is_grad_enabled() and q.requires_grad:
            # torch's FlexAttention has no CPU backward (eager or compiled): say so by our argument, before the
            # predictor's work, not from inside torch
            raise ValueError("impl='flex' cannot train on a CPU (torch's FlexAttention has no CPU backward); use "
                             "impl='auto', 'masked', 'gather' or 'kernel' there, or run it under torch.no_grad()")
        if impl == 'kernel' and self.connectivity != 'block':
            raise ValueError("impl='kernel' (the CPU tile kernel) runs connectivity='block' only")
        if self.dense_stage1:
            # the public code's stage 1: the student attends densely (its tokens are the teacher's when the backbone
            # is frozen) while the predictor's unthresholded scores learn the teacher's attention
            self.last_scores = self.predict(q, k, token_sources) if self.keep_scores else None
            self._remember(torch.ones(()), None)
            return self.merge(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p))
        # block connectivity on tile means alone, no n×n tensor (flex only when the n×n scores are not asked for)
        if self.connectivity == 'block' and (impl in ('gather', 'kernel') or (impl == 'flex' and not self.keep_scores)):
            return self.merge(self._block_tiles(q, k, v, token_sources, dense_rows, dropout_p, impl))
        scores = self.predict(q, k, token_sources)
        self.last_scores = scores if self.keep_scores else None
        with torch.no_grad():                                   # the mask is detached from the attention path
            if self.connectivity == 'block':
                mask, indices = block_mask_from_scores(scores, self.block_size, self.keep_ratio), None
                if dense_rows:
                    mask[..., :dense_rows, :] = True
                density = mask.float().mean((-2, -1)).mean()
            else:
                indices = topk_indices(scores, keys)
                mask = mask_from_indices(indices, n, dense_rows) if impl != 'gather' else None
                density = realised_density(n, dense_rows, keys=keys)
        self._remember(density, mask if self.keep_scores else None)
        if impl == 'gather':
            out = gathered_attention(q, k, v, indices, dropout_p=dropout_p, dense_rows=dense_rows)
        elif impl == 'flex':
            out = flex_attention_path(q, k, v, mask, block_size=self.block_size if self.connectivity == 'block' else 128)
        else:
            out = masked_attention(q, k, v, mask, dropout_p=dropout_p)
        return self.merge(out)

    def _remember(self, density: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
        """Keep the forward's realised density and (with `keep_scores`) its mask for diagnostics. Not while a
        graph is recorded: an exported program cannot write module attributes (torch.export warns, and the values
        would be the trace's, not a run's)."""
        if not recording_graph():
            self.last_density, self.last_mask = density, mask

    def _block_tiles(self, q, k, v, token_sources, dense_rows: int, dropout_p: float, impl: str) -> torch.Tensor:
        """Block connectivity without an n×n tensor: tile-mean scores by linearity (`pooled_block_scores`), the
        top `tile_budget` key tiles per query tile, attention on those tiles: gathered (impl='gather'), by the CPU
        kernel (impl='kernel', its predictor too unless the scores are kept or the sequence is pruned) or as
        FlexAttention's full tiles (impl='flex'). Picks the tiles the masked block path picks (exact ties to the
        lower tile, `top_tiles`; near ties may fall either way by rounding)."""
        if self.keep_scores or token_sources is not None:
            a_down, w_up = self.low_rank(q, k, token_sources)
            if self.keep_scores:
                self.last_scores = connectivity_scores(a_down, w_up, *self.thresholds(), self.active_coef_topk())
            with torch.no_grad():
                tiles = pooled_block_scores(a_down, w_up, self.tau, self.up_threshold, self.block_size,
                                            self.coef_topk)
                block_indices = top_tiles(tiles, tile_budget(q.shape[-2], self.block_size, self.keep_ratio))
        else:                                  # no scores wanted: the tiles alone (in the kernel's pass on 'kernel')
            w_down, w_up = self.scoring_basis(q)
            q_p, k_p = self._predictor_inputs(q, k)
            block_indices = predicted_tiles(q_p, k_p, w_down, w_up, self.tau, self.up_threshold, self.keep_ratio,
                                            self.block_size, impl == 'kernel', self.coef_topk, self.logit_scale(q_p))
        self._remember(realised_density(q.shape[-2], dense_rows, block_indices=block_indices,
                                        block_size=self.block_size),
                       block_indices_to_mask(block_indices, q.shape[-2], self.block_size, dense_rows)
                       if self.keep_scores else None)
        return tile_attention(q, k, v, block_indices, self.block_size, dense_rows, dropout_p, impl)

    def extra_repr(self) -> str:
        budget_text = f"keys_per_query={self.keys_per_query}" if self.keys_per_query else f"keep_ratio={self.keep_ratio}"
        coefficients = f"coef_topk={self.coef_topk}" if self.coef_topk else f"tau={self.tau}"
        scale = f", predictor_scale={self.predictor_scale!r}" if self.predictor_scale != 'dim' else ''
        return (f"{budget_text}, {coefficients}{scale}, up_threshold={self.up_threshold}, "
                f"dense_cls_row={self.dense_cls_row}, connectivity={self.connectivity!r}, impl={self.impl!r}, "
                f"up_basis={self.up_basis!r}, stage1={self.stage1!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bias(layer: nn.Module, dtype: torch.dtype) -> Optional[torch.Tensor]:
    bias = getattr(layer, 'bias', None)
    return bias.to(dtype) if isinstance(bias, torch.Tensor) else None
