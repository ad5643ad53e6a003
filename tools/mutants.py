"""Do the tests catch a wrong equation? Each mutant below changes one equation of the five papers (or one rule of
the public code we match) in a throw-away copy of the tree, runs the test modules that guard it, and counts it
killed (a test failed) or survived (every test passed: a wrong equation the suite would ship).

Some mutants change the fast path only (its reference then disagrees), others change a shared helper or a constant
in the fast path and the reference alike, so only a test against the paper's own numbers or the public code can
kill them: those are the ones this tool is for.

    .venv/bin/python tools/mutants.py --output docs/mutants.json          # every mutant (~15-30 min, 2 cores)
    .venv/bin/python tools/mutants.py --only soft_kernel_scale crate_tied_eps

The copy is a detached `git worktree` of HEAD (uncommitted changes are not in it), imported ahead of the installed
package through PYTHONPATH, and removed at the end whatever happens. Tests run with one thread and `-x`.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, what the mutant gets wrong, [(file, old, new, count)], test modules). `count`: how many occurrences of
# `old` the file must hold (all are replaced): a mutant that no longer applies is an error, not a pass.
MUTANTS = [
    # ---- CRATE ----
    ('crate_ista_fused_transpose', "ISTA's fused matrix I + η(Dᵀ − DᵀD) instead of I + η(D − DᵀD) (Eq. 17)",
     [('structformer/layers/mlp/ista.py', 'eye + self.eta * (d - d.t() @ d)',
       'eye + self.eta * (d.t() - d.t() @ d)', 1)],
     ['test_crate_numerics']),
    ('crate_ista_threshold', "ISTA's threshold λ instead of ηλ, in the fast path and the reference (Eq. 17)",
     [('structformer/layers/mlp/ista.py', '-self.eta * self.lambd)', '-self.lambd)', 1),
      ('structformer/functional/crate_ops.py', '- eta * lambd)', '- lambd)', 1)],
     ['test_crate_numerics', 'test_crate_fidelity']),
    ('crate_mssa_scale', "MSSA's softmax scale 1/p instead of p^-½ (Eq. 115, the public code)",
     [('structformer/layers/attention/mssa.py', 'self.scale = attn_head_dim ** -0.5',
       'self.scale = attn_head_dim ** -1.0', 1)],
     ['test_crate_numerics', 'test_crate_fidelity']),
    ('crate_tied_eps', "MSSA's tied output p/(Nε) instead of p/(Nε²) (Eq. 12)",
     [('structformer/layers/attention/mssa.py', 'self.head_dim / (n * self.eps ** 2)',
       'self.head_dim / (n * self.eps)', 1)],
     ['test_crate_numerics', 'test_crate_fidelity']),
    ('crate_mm_gain', "the MM step's gain 1 + 4/(9α) instead of 1 + 4/(9(1+α)) (Eq. 92)",
     [('structformer/functional/crate_ops.py', '4.0 / (9.0 * (1.0 + alpha))', '4.0 / (9.0 * alpha)', 1)],
     ['test_crate_numerics', 'test_crate_fidelity']),
    ('crate_coding_rate_eps', "the coding rate's d/(Nε) instead of d/(Nε²) (Eq. 7)",
     [('structformer/functional/coding_rate.py', 'd / (n * _checked_eps(eps) ** 2)', 'd / (n * _checked_eps(eps))', 1)],
     ['test_crate_numerics', 'test_whitebox_estimators']),
    ('crate_shared_backward_sym', "the shared-QKV backward drops dSᵀ W (W is query and key)",
     [('structformer/functional/shared_qkv_attention.py', 'd_sym = d_scores + d_scores.transpose(1, 2)',
       'd_sym = d_scores + d_scores', 1)],
     ['test_shared_qkv_attention']),
    # ---- SOFT ----
    ('soft_kernel_scale', "the Gaussian kernel's exp(−‖q−k‖²/√d) instead of /(2√d), kernel and reference (Eq. 5)",
     [('structformer/functional/gaussian_kernel.py', '1.0 / (2.0 * math.sqrt(d))', '1.0 / math.sqrt(d)', 1)],
     ['test_soft_functional', 'test_soft_official']),
    ('soft_layer_scale', "SoftAttention's per-head scale 1/√d instead of 1/(2√d) (Eq. 5)",
     [('structformer/layers/attention/soft.py', 'self.scale = 1.0 / (2.0 * math.sqrt(self.head_dim))',
       'self.scale = 1.0 / math.sqrt(self.head_dim)', 1)],
     ['test_soft_functional', 'test_soft_official', 'test_attention_layers']),
    ('soft_newton_step', "Newton–Schulz X ← 2X − 0.9·XAX instead of 2X − XAX (Eq. 10)",
     [('structformer/functional/newton_pinv.py', 'beta=2.0, alpha=-1.0', 'beta=2.0, alpha=-0.9', 1)],
     ['test_soft_functional', 'test_soft_official']),
    ('soft_newton_backward', "the implicit backward −X ∇ X instead of −Xᵀ ∇ Xᵀ (Eq. 12; equal for symmetric A)",
     [('structformer/functional/newton_pinv.py', 'xt = x.transpose(-2, -1)', 'xt = x', 1)],
     ['test_soft_functional', 'test_double_backward']),
    ('soft_initial_guess', "X₀ = αA instead of αAᵀ (equal for symmetric A; Nyström's A is not)",
     [('structformer/functional/newton_pinv.py', 'alpha[:, None, None] * a.transpose(-2, -1)',
       'alpha[:, None, None] * a', 1)],
     ['test_soft_functional']),
    ('soft_stop_tolerance', "the per-matrix freeze at eps^¼ instead of eps^½ (stops before convergence)",
     [('structformer/functional/newton_pinv.py', 'tol = torch.finfo(a.dtype).eps ** 0.5',
       'tol = torch.finfo(a.dtype).eps ** 0.25', 2)],
     ['test_soft_functional']),
    ('soft_public_halvings', "the public SOFT++ rule halves α at most 9 times instead of 10",
     [('structformer/functional/newton_pinv.py', 'PUBLIC_SOFTPP_TOL, PUBLIC_SOFTPP_HALVINGS = 1.01, 10',
       'PUBLIC_SOFTPP_TOL, PUBLIC_SOFTPP_HALVINGS = 1.01, 9', 1)],
     ['test_soft_official', 'test_soft_functional']),
    ('soft_public_step', "the public SOFT rule's step 2/‖A‖∞² instead of 0.9·2/‖A‖∞²",
     [('structformer/functional/newton_pinv.py', 'PUBLIC_SOFT_STEP = 0.9', 'PUBLIC_SOFT_STEP = 1.0', 1)],
     ['test_soft_official', 'test_soft_functional']),
    ('soft_normalize', "SOFT++'s normalisation D⁻¹ instead of D^-½ on each side",
     [('structformer/layers/attention/soft.py', 'd_inv_sqrt = a.sum(-1, keepdim=True).rsqrt()          #',
       'd_inv_sqrt = a.sum(-1, keepdim=True).reciprocal()          #', 1)],
     ['test_soft_functional', 'test_soft_official']),
    # ---- Sparsifiner ----
    ('sparsifiner_budget', "B = ⌊keep·n⌋ instead of ⌈keep·n⌉ keys per query",
     [('structformer/functional/sparsifiner.py', 'math.ceil(keep_ratio * num_tokens - 1e-9)',
       'math.floor(keep_ratio * num_tokens + 1e-9)', 1)],
     ['test_sparsifiner', 'test_sparsifiner_public']),
    ('sparsifiner_tau', "Eq. 2's threshold τ/2 instead of τ",
     [('structformer/functional/sparsifiner.py', 'F.threshold(a_down, tau, 0.0)',
       'F.threshold(a_down, 0.5 * tau, 0.0)', 1),
      ('structformer/functional/sparsifiner.py', 'a_down * (a_down > tau)', 'a_down * (a_down > 0.5 * tau)', 1)],
     ['test_sparsifiner', 'test_sparsifiner_public']),
    ('sparsifiner_up_threshold', "Eq. 3's basis kept where w ≥ t instead of |w| ≥ t (token and tile paths)",
     [('structformer/functional/sparsifiner.py', 'w_up * (w_up.abs() >= up_threshold)',
       'w_up * (w_up >= up_threshold)', 2)],
     ['test_sparsifiner', 'test_sparsifiner_public']),
    ('sparsifiner_down_scale', "Eq. 1's logits scaled 1/d instead of 1/√d (the torch ops and the CPU kernel)",
     [('structformer/functional/sparsifiner.py', 'return k.shape[-1] ** -0.5 if scale is None else scale',
       'return k.shape[-1] ** -1.0 if scale is None else scale', 1)],
     ['test_sparsifiner', 'test_sparsifiner_public']),
    ('sparsifiner_reference_softmax_dim', "the masked reference's softmax over queries instead of keys (Eq. 4–6)",
     [('structformer/functional/sparsifiner.py', "masked_fill(~mask, float('-inf')), dim=-1)",
       "masked_fill(~mask, float('-inf')), dim=-2)", 1)],
     ['test_sparsifiner']),
    ('sparsifiner_ties', "top-k ties to the higher key index instead of the lower",
     [('structformer/functional/sparsifiner.py', 'order = torch.arange(n - 1, -1, -1,',
       'order = torch.arange(0, n, 1,', 1)],
     ['test_sparsifiner', 'test_sparsifiner_tiles',
      'test_export::test_topk_indices_ties_to_the_lower_index_and_equals_topk_without_ties']),
    ('sparsifiner_tile_budget', "⌊B/bs⌋ key tiles instead of ⌈B/bs⌉",
     [('structformer/functional/sparsifiner.py', '-(-keys // block_size))', 'max(1, keys // block_size))', 1)],
     ['test_sparsifiner', 'test_sparsifiner_tiles']),
    # the CPU kernel's own copy of Eq. 1-3 (csrc/block_connectivity.cpp: it makes its down-projected keys and
    # pooled basis itself, so the torch ops' tests do not reach it; the kernel tests compare it with them)
    ('sparsifiner_kernel_up_threshold', "the CPU kernel's Eq. 3 basis kept where w ≥ t instead of |w| ≥ t",
     [('structformer/csrc/block_connectivity.cpp', 'T(std::abs(w[c * n + i]) >= threshold)',
       'T(w[c * n + i] >= threshold)', 1)],
     ['test_sparsifiner_kernel']),
    ('sparsifiner_kernel_logit_scale', "the CPU kernel's Eq. 1 logits unscaled (scale 1 instead of 1/√d)",
     [('structformer/csrc/block_connectivity.cpp', 'T(scale), k_down.data()', 'T(1), k_down.data()', 1)],
     ['test_sparsifiner_kernel']),
    ('sparsifiner_kernel_partial_tile', "the CPU kernel's partial key tile a plain mean, not shrunk toward the row's",
     [('structformer/csrc/block_connectivity.cpp',
       'row[key_tiles - 1] = shrink * row[key_tiles - 1] + (T(1) - shrink) * (total / T(n));', ';', 1)],
     ['test_sparsifiner_kernel', 'test_sparsifiner_tiles']),
    ('sparsifiner_coef_topk_ties', "coef_topk keeps values > the k-th instead of ≥ (drops the k-th itself)",
     [('structformer/functional/sparsifiner.py', 'a_down * (a_down >= kth)', 'a_down * (a_down > kth)', 1)],
     ['test_sparsifiner', 'test_sparsifiner_public']),
    ('sparsifiner_kl_direction', "Eq. 9's KL(p_student ‖ p_teach) instead of KL(p_teach ‖ p_student)",
     [('structformer/train/distill.py',
       'F.kl_div(F.log_softmax(ctx.logits, dim=-1), F.log_softmax(teacher, dim=-1)',
       'F.kl_div(F.log_softmax(teacher, dim=-1), F.log_softmax(ctx.logits, dim=-1)', 1)],
     ['test_sparsifiner_distill']),
    # ---- MLP-Mixer as a wide sparse MLP ----
    ('mixer_kron_order', "KroneckerLinear.to_dense B ⊗ A instead of A ⊗ B (Eq. 6–8)",
     [('structformer/layers/linear/kronecker.py', 'torch.kron(self.weight_rows, self.weight_cols)',
       'torch.kron(self.weight_cols, self.weight_rows)', 1)],
     ['test_mixer_layers', 'test_mixer_fidelity']),
    ('mixer_kron_init', "Kronecker factors N(0, 1/p₁²) instead of N(0, 1/p₁)",
     [('structformer/layers/linear/kronecker.py', 'std=1 / math.sqrt(self.in_shape[0])',
       'std=1 / self.in_shape[0]', 1)],
     ['test_mixer_layers', 'test_mixer_fidelity']),
    ('mixer_pk_transpose', "PKLinear's 'transpose' J₁ read as the identity",
     [('structformer/layers/linear/permuted.py',
       'return x.reshape(*lead, self.block_in, self.num_blocks).transpose(-1, -2)',
       'return x.reshape(*lead, self.num_blocks, self.block_in)', 1)],
     ['test_mixer_layers', 'test_mixer_fidelity']),
    ('mixer_pk_dense_columns', "PKLinear.to_dense places columns by J₁⁻¹ instead of J₁ (Def. 5.1)",
     [('structformer/layers/linear/permuted.py', 'dense[:, self.input_permutation()] = block_diagonal',
       'dense[:, :] = block_diagonal[:, self.input_permutation()]', 1)],
     ['test_mixer_layers', 'test_mixer_fidelity']),
    ('mixer_pk_seed', "J₂ seeded like J₁ (seed, not seed + 1): the two random permutations coincide",
     [('structformer/layers/linear/permuted.py', 'self.seed + 1)', 'self.seed)', 2)],     # built and reset
     ['test_mixer_layers', 'test_mixer_fidelity', 'test_mixer_models']),
    ('mixer_monarch_dense', "MonarchLinear.to_dense without the middle permutation P",
     [('structformer/layers/linear/monarch.py', '(left @ right[middle_shuffle])[out_shuffle]',
       '(left @ right)[out_shuffle]', 1)],
     ['test_mixer_layers', 'test_mixer_fidelity']),
    ('mixer_token_out_perm', "the Mixer's token mixing J₂ = I instead of J_cᵀ (Eq. S.10–S.12)",
     [('structformer/models/mixer.py', "'random' if random else 'transpose', 'random' if random else 'transpose',",
       "'random' if random else 'transpose', 'random' if random else 'identity',", 1)],
     ['test_mixer_fidelity', 'test_mixer_models']),
    # ---- low-rank training ----
    ('lowrank_spectral_sigma', "spectral init U = ÛΣ, V = V̂Σ instead of Σ^½ each (Eq. 3)",
     [('structformer/layers/linear/factorized.py', 'scale = torch.ones_like(s) if ones else s.sqrt()',
       'scale = torch.ones_like(s) if ones else s', 1)],
     ['test_lowrank']),
    ('lowrank_he_std', "He init of U with std √(2/m) instead of √(2/r)",
     [('structformer/layers/linear/factorized.py', 'math.sqrt(2.0 / rank)', 'math.sqrt(2.0 / out_features)', 1)],
     ['test_lowrank']),
    ('lowrank_rank_rounding', "a fractional rank truncated instead of rounded",
     [('structformer/layers/linear/factorized.py', 'int(round(rank * full))', 'int(rank * full)', 1)],
     ['test_lowrank']),
    ('lowrank_conv_factor_layout', "FactorizedConv2d's V filled from v instead of vᵀ",
     [('structformer/layers/linear/factorized.py', 'self.V.copy_(v.T.reshape(self.V.shape))',
       'self.V.copy_(v.reshape(self.V.shape))', 1)],
     ['test_lowrank']),
    ('lowrank_frobenius_gram', "Frobenius decay as Σ((UᵀU)(VᵀV)) (a matrix product) instead of tr((UᵀU)(VᵀV))",
     [('structformer/train/lowrank_decay.py', '((u.T @ u) * (v.T @ v)).sum()', '((u.T @ u) @ (v.T @ v)).sum()', 1)],
     ['test_lowrank', 'test_lowrank_train']),
    ('lowrank_frobenius_half', "the regularisers without their ½ (‖UVᵀ‖²_F, ‖U‖² + ‖V‖²), fast forms and reference",
     [('structformer/train/lowrank_decay.py', 'return 0.5 * torch.stack(terms).sum()',
       'return torch.stack(terms).sum()', 3)],
     ['test_lowrank', 'test_lowrank_train']),

    ('mixer_omega', "Ω = γ(CS² + C²S) without the ½ (Eq. 14), integer and float forms",
     [('structformer/models/mixer_design.py', 'return g * (C * S * S + C * C * S) / 2',
       'return g * (C * S * S + C * C * S)', 1),
      ('structformer/models/mixer_design.py', '(tokens + channels) // 2)', '(tokens + channels))', 1)],
     ['test_mixer_analysis']),
    ('mixer_optimal_width', "the widest Mixer at C* = (Ω/γ)^½ instead of (Ω/γ)^⅓ (§4.2)",
     [('structformer/models/mixer_design.py', '** (1 / 3)', '** (1 / 2)', 1)],
     ['test_mixer_analysis']),
    ('mixer_tokens_for_omega', "S from γ(CS² + C²S)/2 = Ω with 4Ω for 8Ω under the root",
     [('structformer/models/mixer_design.py', 'C * C + 8 * O / (g * C)', 'C * C + 4 * O / (g * C)', 1)],
     ['test_mixer_analysis', 'test_reproduce_mixer']),
    ('lowrank_effective_rank', "the effective rank as Σσ²/σ₁² (stable rank) instead of Σσ/σ₁",
     [('structformer/models/lowrank_spectra.py', 'return float(s.sum() / top)',
       'return float(s.pow(2).sum() / top ** 2)', 1)],
     ['test_lowrank']),
    # ---- measurements ----
    ('measure_linear_cka', "linear CKA from Σ|YᵀX| instead of ‖YᵀX‖²_F",
     [('structformer/analysis/cka.py', '(y.t() @ x).square().sum()', '(y.t() @ x).abs().sum()', 1)],
     ['test_mixer_analysis']),
    ('measure_hsic_cross', "the unbiased HSIC's cross term 1/(n−2) instead of 2/(n−2)",
     [('structformer/analysis/cka.py', 'cross = 2 / (n - 2) *', 'cross = 1 / (n - 2) *', 1)],
     ['test_mixer_analysis']),
    ('measure_cka_roots', "minibatch CKA normalised by HSIC(X,X)·√HSIC(Y,Y) instead of the root of both",
     [('structformer/analysis/cka.py', 'roots = self.self_a.clamp_min(0).sqrt()[:, None]',
       'roots = self.self_a.clamp_min(0)[:, None]', 1)],
     ['test_mixer_analysis', 'test_analysis']),
    ('measure_density_dense_rows', "Sparsifiner's realised density without its dense cls row (block paths)",
     [('structformer/functional/sparsifiner.py', 'pairs = (kept * rows).sum(-1).mean() + dense_rows * n',
       'pairs = (kept * rows).sum(-1).mean()', 1)],
     ['test_sparsifiner_tiles']),
    ('bench_goal_direction', "a ≤ goal judged met when the ratio is above it",
     [('structformer/bench/kinds.py', "return value >= target if comparison == '>=' else value <= target",
       "return value >= target if comparison == '>=' else value >= target", 1)],
     ['test_cpu_kinds', 'test_kind_tables']),
    # ---- data ----
    ('data_shard_quota', "a process's samples dealt to its workers without the remainder (counts that do not divide)",
     [('structformer/data/shards.py', 'return n // workers + (worker < n % workers)', 'return n // workers', 1)],
     ['test_shards_scale']),
    ('data_shard_rank', "every process reads the first process's run of samples (the rank's offset dropped)",
     [('structformer/data/shards.py', 'start = self.rank * self.per_process(False) + sum(',
       'start = 0 * self.per_process(False) + sum(', 1)],
     ['test_shards_scale']),
    ('data_shard_resume_turn', "a resumed epoch's workers take up their own turns instead of the straight epoch's",
     [('structformer/data/shards.py', 'worker = (worker + turn) % workers', 'worker = worker % workers', 1)],
     ['test_shards_scale']),
    ('data_devkit_class_order', "ImageNet's devkit classes in ILSVRC2012_ID order instead of sorted WNIDs (timm's)",
     [('structformer/data/imagenet.py', 'return sorted(words), words, ids', 'return list(words), words, ids', 1)],
     ['test_imagenet_layout']),
    ('data_split_swapped', "the stratified held-out split's two sides swapped",
     [('structformer/data/tensor.py', 'return np.sort(train_idx), np.sort(val_idx)',
       'return np.sort(val_idx), np.sort(train_idx)', 1)],
     ['test_data']),
    # ---- model structure and training ----
    ('crate_ista_residual', "a CRATE layer with a residual around ISTA (Eq. 18 has none)",
     [('structformer/models/crate.py', '        return self.mlp(self.norm2(x))',
       '        return x + self.mlp(self.norm2(x))', 1)],
     ['test_convert::test_crate_official_converts_to_equal_logits', 'test_crate_fidelity']),
    ('crate_mssa_residual', "a CRATE layer without MSSA's residual (Eq. 18: Z + MSSA(Z))",
     [('structformer/models/crate.py', 'x = x + self.drop_path(self.attn(self.norm1(x)))',
       'x = self.drop_path(self.attn(self.norm1(x)))', 1)],
     ['test_convert::test_crate_official_converts_to_equal_logits', 'test_crate_fidelity']),
    ('crate_sparsity_tol', "the sparsity ‖Z‖₀ counts |z| ≥ 0 (every entry) instead of |z| > 0",
     [('structformer/functional/coding_rate.py', '(z.abs() > tol)', '(z.abs() >= tol)', 1)],
     ['test_crate_numerics', 'test_whitebox_estimators']),
    ('crate_official_eps', "the official R_c estimator's ε = 0.01 instead of 0.1 (its code's eps² = 0.01)",
     [('structformer/functional/coding_rate.py', 'OFFICIAL_EPS = 0.1', 'OFFICIAL_EPS = 0.01', 1)],
     ['test_whitebox_estimators', 'test_crate_numerics']),
    ('soft_landmarks_pool_init', "the conv landmark sampler starts at k× the window mean instead of the mean",
     [('structformer/layers/attention/soft_landmarks.py', 'expand_as(self.weight) / (k * k))',
       'expand_as(self.weight) / k)', 1)],
     ['test_soft_official', 'test_attention_layers', 'test_soft_functional']),
    ('sparsifiner_cls_row', "the cls query row sparse like the others (the public code keeps it dense)",
     [('structformer/layers/attention/sparsifiner.py', 'dense_rows = 1 if self.dense_cls_row else 0',
       'dense_rows = 0', 2)],
     ['test_sparsifiner', 'test_sparsifiner_public']),
    ('sparsifiner_token_prefix', "Eq. 8's token distillation over the cls token too (patch tokens only)",
     [('structformer/train/distill.py', 'return F.mse_loss(student[:, p:], teacher[:, p:])',
       'return F.mse_loss(student, teacher)', 1)],
     ['test_sparsifiner_distill']),
    ('lowrank_lr_scale', "--factorize-lr-scale ignored (the factorised model at the dense lr)",
     [('structformer/train/build.py', "(cfg.factorize_lr_scale if factorised else 1.0)", '1.0', 1)],
     ['test_lowrank_lr_scale']),
    ('train_ema_decay', "--model-ema-decay ignored (timm's default 0.9998 instead)",
     [('structformer/train/parts.py', 'WeightAverage(model, config.model_ema_decay, config.model_ema_warmup)',
       'WeightAverage(model, 0.9998, config.model_ema_warmup)', 1)],
     ['test_paper_scale_training::test_weight_average_follows_the_configured_decay',
      'test_paper_scale_training::test_weight_average_is_evaluated_saved_and_scored_by_eval']),
    ('train_ema_warmup', "--model-ema-warmup ignored (the average at its full decay from the second step)",
     [('structformer/train/parts.py', 'WeightAverage(model, config.model_ema_decay, config.model_ema_warmup)',
       'WeightAverage(model, config.model_ema_decay, False)', 1)],
     ['test_paper_scale_training::test_weight_average_follows_the_configured_decay',
      'test_paper_scale_training::test_weight_average_is_evaluated_saved_and_scored_by_eval']),
    ('train_label_smoothing', "--smoothing never reaches the loss",
     [('structformer/train/step.py', 'logits, cfg.label_smoothing, extras)', 'logits, 0.0, extras)', 1)],
     ['test_training_controls::test_smoothing_reaches_the_training_loss',
      'test_paper_scale_training::test_soft_targets_take_soft_target_cross_entropy']),
    ('train_lr_base_sqrt', "--lr-base scaled linearly for AdamW too (timm: square root for ada*, lamb)",
     [('structformer/train/config.py', "('sqrt' if any(o in name for o in ('ada', 'lamb')) else 'linear')",
       "'linear'", 1)],
     ['test_training_controls']),
]


def _apply(tree: Path, edits) -> None:
    for rel, old, new, count in edits:
        path = tree / rel
        text = path.read_text()
        found = text.count(old)
        if found != count:
            raise SystemExit(f"mutant no longer applies: {rel} holds {found} copies of {old!r}, expected {count}")
        path.write_text(text.replace(old, new))


def _restore(tree: Path, edits) -> None:
    subprocess.run(['git', '-C', str(tree), 'checkout', '--', *sorted({rel for rel, *_ in edits})], check=True)


def _test_path(entry: str) -> str:
    """'test_x' -> tests/test_x.py (the module); 'test_x::test_y' -> that one test (a slow module's fast test)."""
    module, _, test = entry.partition('::')
    return f'tests/{module}.py' + (f'::{test}' if test else '')


def run_mutant(tree: Path, mutant, timeout: float) -> dict:
    name, what, edits, modules = mutant
    _apply(tree, edits)
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS='1', PYTHONDONTWRITEBYTECODE='1')
    command = [sys.executable, '-m', 'pytest', '-x', '-q', '-p', 'no:cacheprovider', '-p', 'no:randomly',
               *[_test_path(m) for m in modules]]
    start = time.monotonic()
    try:
        proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        outcome = 'survived' if proc.returncode == 0 else 'killed'
        tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
        failed = next((line.split(' ')[1] for line in proc.stdout.splitlines() if line.startswith('FAILED ')), None)
    except subprocess.TimeoutExpired:
        outcome, tail, failed = 'timeout', [], None
    finally:
        _restore(tree, edits)
    return {'name': name, 'what': what, 'outcome': outcome, 'seconds': round(time.monotonic() - start, 1),
            'tests': modules, 'killed_by': failed, 'summary': tail[0] if tail else ''}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--only', nargs='+', metavar='NAME', help='these mutants (default: all)')
    parser.add_argument('--timeout', type=float, default=900, help='seconds per mutant (default 900)')
    parser.add_argument('--output', help='JSON record of the outcomes')
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m[0] in args.only]
    unknown = set(args.only or ()) - {m[0] for m in MUTANTS}
    if unknown:
        print(f"--only: no mutant named {', '.join(sorted(unknown))}; accepted: {', '.join(m[0] for m in MUTANTS)}",
              file=sys.stderr)
        return 2
    if args.output:                                        # before the run: a long run never dies at its write
        from structformer.records import check_output_file
        try:
            check_output_file(args.output, '--output')
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
    head = subprocess.run(['git', '-C', str(ROOT), 'rev-parse', 'HEAD'], capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix='structformer-mutants-') as scratch:
        tree = Path(scratch) / 'tree'
        subprocess.run(['git', '-C', str(ROOT), 'worktree', 'add', '--detach', str(tree), head], check=True,
                       capture_output=True)
        shared = ROOT.parent / 'shared'
        if shared.exists():                                # tests find ../shared beside the tree
            (Path(scratch) / 'shared').symlink_to(shared)
        try:
            results = []
            for mutant in chosen:
                result = run_mutant(tree, mutant, args.timeout)
                results.append(result)
                print(f"{result['outcome']:8s} {result['seconds']:6.1f} s  {result['name']}: {result['what']}"
                      + (f"  [{result['killed_by']}]" if result['killed_by'] else ''), flush=True)
        finally:
            subprocess.run(['git', '-C', str(ROOT), 'worktree', 'remove', '--force', str(tree)], capture_output=True)
            subprocess.run(['git', '-C', str(ROOT), 'worktree', 'prune'], capture_output=True)   # if remove failed
    survived = [r['name'] for r in results if r['outcome'] != 'killed']
    print(f"{len(results) - len(survived)} of {len(results)} mutants killed" +
          (f"; not killed: {', '.join(survived)}" if survived else ''))
    if args.output:
        from structformer.records import environment, write_json
        write_json(args.output, {'commit': head, 'environment': environment(), 'results': results})
    return 1 if survived else 0


if __name__ == '__main__':
    sys.exit(main())
