"""Distillation from a dense teacher: Sparsifiner's losses (Wei et al., CVPR 2023, Eq. 7–12) and its two stages.

    L = L_cls + λ_tok·MSE(x, x_teach) + λ_cls·KL(y_pred‖y_teach) + λ_attn·MSE(Ã_down·W_up, A_teach) + λ_spa·Σ w_up²   (12)

Loss terms registered in `LOSS_TERMS` (names used by a phase's `losses`):
  `ce`             Eq. 7, the task cross-entropy (train/phases.py);
  `distill_token`  Eq. 8, MSE between the student's and the teacher's final tokens (after the final norm),
                   patch tokens only, as in the public code (its `features` are the 196 patch tokens);
  `distill_kl`     Eq. 9, written KL(y_pred‖y_teach) in the paper; the public code computes
                   F.kl_div(log p_student, log p_teacher, log_target=True) = KL(p_teach‖p_student), the usual
                   distillation direction, and so do we;
  `distill_attn`   Eq. 10, squared error between every Sparsifiner layer's connectivity scores Ã_down·W_up and
                   the teacher's attention softmax(QKᵀ/√d) at the same layer, over the query rows the predictor
                   decides (the cls row is left out when it is kept dense, as in the public code). The public code
                   sums the squares over the whole batch (reduction='sum') and averages over layers; we divide
                   that sum by the batch size so the weight does not depend on it.
  Eq. 11 (λ_spa Σ w_up²) is the optimiser's weight decay, as in the paper (W_up is a matrix, so timm decays it).

Stages (§4, `distillation_phases`): (1) `predictor`: the backbone frozen, only the connectivity predictors
train, on `distill_attn` alone (λ_tok = λ_cls = 0, λ_attn = 1), each Sparsifiner layer in its `stage1` mode (by
default the public code's: dense attention, scores without τ and the W_up threshold; `learning_predictor` is set
for a phase whose only loss is distill_attn); (2) `joint`: everything but the connectivity
predictors (W_down, W_up and the q/k reductions of `predictor_dim`) trains on ce + 0.5·distill_token + 0.5·distill_kl
(λ_attn = 0; with it off the predictors get no gradient, so they are frozen, as the public code's stage-2 optimiser
leaves out its whole `mask_predictor`, which also lets DDP run the stage). The teacher is a finished run of the dense model the
student was converted from; the student starts from its weights (`init_from_teacher`).
"""
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError
from .phases import LossContext, register_loss_term

__all__ = ['DISTILL_TERMS', 'PREDICTOR_PATTERNS', 'Distiller', 'distillation_phases', 'load_teacher',
           'init_from_teacher', 'attention_probabilities', 'student_only_parameters']

DISTILL_TERMS = ('distill_token', 'distill_kl', 'distill_attn')
# parameters of the connectivity predictors, the only ones stage 1 trains (fnmatch over parameter names)
PREDICTOR_PATTERNS = ['*basis.w_down', '*basis.w_up', '*predictor_q.*', '*predictor_k.*']


def distillation_phases(epochs: int, predictor_epochs: int) -> List[dict]:
    """The paper's two stages as engine phases: `predictor_epochs` of stage 1, the rest stage 2."""
    phases = []
    if predictor_epochs:
        phases.append({'name': 'predictor', 'epochs': predictor_epochs, 'trainable': list(PREDICTOR_PATTERNS),
                       'losses': {'distill_attn': 1.0}})
    if epochs > predictor_epochs:
        # the predictors (W_down, W_up and, with predictor_dim, the q/k reductions) reach the loss only through
        # distill_attn (the kept keys are a discrete choice), so stage 2 freezes all of them: they would get no
        # gradient anyway, and DDP refuses trainable parameters that produce no gradient ("parameters that were
        # not used in producing loss"). Freezing only W_down, W_up left the q/k reductions trainable, gradient-free
        phases.append({'name': 'joint', 'epochs': epochs - predictor_epochs, 'frozen': list(PREDICTOR_PATTERNS),
                       'losses': {'ce': 1.0, 'distill_token': 0.5, 'distill_kl': 0.5}})
    return phases


def note_untaught_predictors(model: nn.Module, config, is_main: bool = True) -> None:
    """Sparsifiner's connectivity predictors learn only from the attention-distillation loss (Eq. 10): without a
    teacher they keep their random initialisation and the kept keys stay random. Say so before training."""
    from ..models.sparsifiner import predictor_parameter_names
    names = predictor_parameter_names(model)
    uses_attn = any(p.get('losses', {}).get('distill_attn') for p in config.phases)
    if is_main and names and not uses_attn:
        import sys
        print(f"note: {config.model} has {len(names)} connectivity-predictor tensors (e.g. {sorted(names)[0]}) that "
              "learn only from attention distillation (Sparsifiner Eq. 10); without --teacher RUN_DIR they keep their "
              "initialisation and the kept keys stay random", file=sys.stderr, flush=True)


def student_only_parameters(student: nn.Module) -> set:
    """Names of the parameters a converted student adds to its dense teacher's: Sparsifiner's predictors
    (W_down, W_up, the q/k reductions) and Linformer's E, F. Every other weight must come from the teacher."""
    from ..layers.attention.linformer import LinformerAttention
    from ..models.sparsifiner import predictor_parameter_names
    names = predictor_parameter_names(student)
    for prefix, module in student.named_modules():
        if isinstance(module, LinformerAttention):
            owner = f"{prefix}.seq_proj" if prefix else 'seq_proj'
            names |= {f"{owner}.{n}" for n, _ in module.seq_proj.named_parameters()}
    return names


def load_teacher(path, data_info=None, device='cpu', config=None) -> nn.Module:
    """The dense teacher from a run directory or checkpoint, frozen and in eval mode; checked against the
    data (classes, channels, image size). Every problem is a UsageError naming --teacher. With the run's `config`,
    also a weights file / folder or a registered model name (`initial_weights.build_teacher`)."""
    from .checkpoint import CheckpointError, load_model
    from .initial_weights import build_teacher, is_run_or_checkpoint
    if config is not None and not is_run_or_checkpoint(path):
        return build_teacher(str(path), config, data_info).to(device)
    if not Path(path).exists():
        raise UsageError(f"--teacher {path}: does not exist (expected the run directory of a trained dense model)")
    try:
        teacher, state = load_model(path, map_location=device)
    except (CheckpointError, FileNotFoundError) as e:
        raise UsageError(f"--teacher {path}: {str(e).split('--checkpoint: ', 1)[-1]}") from None
    if getattr(teacher, 'token_pruning', None) is not None:
        # the losses compare the student's tokens / attention with the teacher's at their original positions
        raise UsageError(f"--teacher {path}: the teacher was trained with token pruning (transform prune_tokens); "
                         "a teacher must keep every token: give the dense run it was trained from")
    if data_info is not None:
        saved = state.get('data_info') or {}
        for key in ('num_classes', 'in_chans', 'img_size'):
            want, got = getattr(data_info, key, None), saved.get(key)
            if got is not None and want is not None and got != want:
                raise UsageError(f"--teacher {path}: trained with {key}={got}, but this run's data has "
                                 f"{key}={want}; a teacher must be trained on the same data")
    for param in teacher.parameters():
        param.requires_grad_(False)
    return teacher


def init_from_teacher(student: nn.Module, teacher: nn.Module, where: str = '--teacher') -> None:
    """Copy the teacher's weights into the student. Every teacher tensor must exist in the student with the
    same shape, and the student may add only its own attention parameters (`student_only_parameters`);
    anything else means another architecture or shape, refused by name."""
    check_compatible(student, teacher, where)
    weights = teacher.state_dict()
    missing = student.load_state_dict(weights, strict=False).missing_keys
    assert set(missing) <= student_only_parameters(student) | _buffer_names(student), missing


def _buffer_names(model: nn.Module) -> set:
    return {n for n, _ in model.named_buffers()}


def check_compatible(student: nn.Module, teacher: nn.Module, where: str = '--teacher') -> None:
    ours, theirs = student.state_dict(), teacher.state_dict()
    absent = sorted(set(theirs) - set(ours))
    if absent:
        raise UsageError(f"{where}: the teacher is another architecture: {len(absent)} of its tensors have no "
                         f"place in the student (e.g. {', '.join(absent[:3])})")
    shapes = [k for k in theirs if tuple(theirs[k].shape) != tuple(ours[k].shape)]
    if shapes:
        k = shapes[0]
        raise UsageError(f"{where}: the teacher has another shape: {len(shapes)} tensors differ (e.g. {k}: "
                         f"teacher {list(theirs[k].shape)}, student {list(ours[k].shape)})")
    extra = sorted(set(ours) - set(theirs) - student_only_parameters(student) - _buffer_names(student))
    if extra:
        raise UsageError(f"{where}: the student has {len(extra)} weights the teacher lacks besides its attention "
                         f"predictors (e.g. {', '.join(extra[:3])}); it must be the teacher's architecture converted "
                         "with sparsify / swap_attention")


def attention_probabilities(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """softmax(QKᵀ·scale) [B, H, n, n] of a timm `Attention` or a structformer attention with separate
    q, k, from its input tokens x (recomputed: fused attention kernels never form this matrix)."""
    if hasattr(module, 'project'):
        q, k, _ = module.project(x)
    else:
        b, n, _ = x.shape
        q, k, _ = module.qkv(x).reshape(b, n, 3, module.num_heads, module.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = module.q_norm(q), module.k_norm(k)
    scale = getattr(module, 'scale', q.shape[-1] ** -0.5)
    return torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1)


class Distiller:
    """The teacher's outputs for the current batch and the student's matching quantities.

    The engine calls `start_phase(phase)` before each epoch and `start_batch(images)` before each step; the
    loss terms then read `teacher()` (logits, final tokens, per-layer attention, computed once per batch
    under no_grad), `student_tokens()` and `student_scores()`."""

    def __init__(self, student: nn.Module, teacher: nn.Module):
        from ..layers.attention.sparsifiner import SparsifinerAttention
        self.student, self.teacher_model = student, teacher.eval()
        self.sparse_layers = {name: m for name, m in student.named_modules() if isinstance(m, SparsifinerAttention)}
        self.prefix_tokens = getattr(student, 'num_prefix_tokens', 1)
        self._images: Optional[torch.Tensor] = None
        self._teacher: Optional[Dict] = None
        self._tokens: Optional[torch.Tensor] = None
        self._need_attn = False
        self._hook = None
        norm = getattr(student, 'norm', None)
        if isinstance(norm, nn.Module):           # a ViT's final norm: its output are the final tokens (Eq. 8)
            self._hook = norm.register_forward_hook(self._keep_tokens)

    def check_phase_terms(self, terms) -> None:
        """Refuse, before training, a phase whose distillation terms this student / teacher cannot give."""
        if 'distill_attn' in terms:
            if not self.sparse_layers:
                raise UsageError("phase loss distill_attn needs Sparsifiner attention layers in the student "
                                 "(--model sparsifiner_* or --transform sparsify)")
            missing = [n for n in self.sparse_layers if not _has_module(self.teacher_model, n)]
            if missing:
                raise UsageError(f"--teacher: no attention at {missing[0]} to distil from; the teacher must be the "
                                 "dense model the student was converted from")
        if 'distill_token' in terms and (self._hook is None or not hasattr(self.teacher_model, 'forward_features')):
            raise UsageError("phase loss distill_token needs ViTs with a final `norm` (student) and forward_features "
                             "(teacher)")

    def start_phase(self, phase) -> None:
        self._need_attn = bool(phase.losses.get('distill_attn'))
        # stage 1 (the attention-distillation loss alone): each layer learns its predictor in its `stage1` mode,
        # the public code's dense attention with the thresholds off by default (layers/attention/sparsifiner.py)
        alone = self._need_attn and not any(w for t, w in phase.losses.items() if t != 'distill_attn')
        for layer in self.sparse_layers.values():
            layer.keep_scores, layer.learning_predictor = self._need_attn, alone

    def stop(self) -> None:
        """Leave the student as it was: no score keeping, no hook."""
        for layer in self.sparse_layers.values():
            layer.keep_scores, layer.last_scores, layer.last_mask = False, None, None
            layer.learning_predictor = False
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def start_batch(self, images: torch.Tensor) -> None:
        self._images, self._teacher, self._tokens = images, None, None

    def _keep_tokens(self, module, inputs, output) -> None:
        if self.student.training:
            self._tokens = output

    def teacher(self) -> Dict:
        if self._teacher is None:
            self._teacher = self._run_teacher(self._images)
        return self._teacher

    @torch.no_grad()
    def _run_teacher(self, images: torch.Tensor) -> Dict:
        maps: Dict[str, torch.Tensor] = {}
        hooks = []
        if self._need_attn:
            for name in self.sparse_layers:
                module = self.teacher_model.get_submodule(name)
                hooks.append(module.register_forward_hook(
                    lambda m, args, out, name=name: maps.__setitem__(name, attention_probabilities(m, args[0]))))
        try:
            model = self.teacher_model
            if hasattr(model, 'forward_features') and hasattr(model, 'forward_head'):
                tokens = model.forward_features(images)
                logits = model.forward_head(tokens)
            else:
                tokens, logits = None, model(images)
        finally:
            for hook in hooks:
                hook.remove()
        return {'logits': logits, 'tokens': tokens, 'attention': maps}

    def student_tokens(self) -> torch.Tensor:
        if self._tokens is None:
            raise RuntimeError("distill_token: the student's final tokens were not seen in this step")
        return self._tokens

    def student_scores(self) -> Dict[str, torch.Tensor]:
        return {name: layer.last_scores for name, layer in self.sparse_layers.items()}

    def positions(self, block: Optional[int] = None) -> Optional[torch.Tensor]:
        """With EViT token pruning (`prune_tokens`): the original index of every token entering block `block`
        (None: the final tokens), [B, n'], −1 for a fused token; None where nothing was pruned."""
        state = getattr(self.student, 'token_pruning', None)
        return None if state is None else state.pruned_positions(block)


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def _distiller(ctx: LossContext) -> Distiller:
    distiller = ctx.extras.get('distiller')
    if distiller is None:
        raise UsageError("distillation loss terms need --teacher RUN_DIR")
    return distiller


@register_loss_term('distill_token')
def token_distillation_term(ctx: LossContext) -> torch.Tensor:
    """Eq. 8: MSE(x, x_teach) over the patch tokens after the final norm."""
    d = _distiller(ctx)
    student, teacher = d.student_tokens(), d.teacher()['tokens']
    p = d.prefix_tokens
    positions = d.positions()
    if positions is None:
        return F.mse_loss(student[:, p:], teacher[:, p:])
    # pruned: each kept token against the teacher's token at its original position; a fused one has none
    kept = positions[:, p:] >= 0
    gathered = teacher.gather(1, positions[:, p:].clamp(min=0).unsqueeze(-1).expand(-1, -1, teacher.shape[-1]))
    return (student[:, p:] - gathered)[kept].pow(2).mean()


@register_loss_term('distill_kl')
def logit_distillation_term(ctx: LossContext) -> torch.Tensor:
    """Eq. 9: KL(p_teach ‖ p_student), mean over the batch (see the module docstring for the direction)."""
    teacher = _distiller(ctx).teacher()['logits'].float()         # float32 as the student's (LossContext)
    return F.kl_div(F.log_softmax(ctx.logits, dim=-1), F.log_softmax(teacher, dim=-1), reduction='batchmean',
                    log_target=True)


@register_loss_term('distill_attn')
def attention_distillation_term(ctx: LossContext) -> torch.Tensor:
    """Eq. 10: Σ (Ã_down·W_up − A_teach)² over the predicted rows, per image, averaged over layers."""
    d = _distiller(ctx)
    teacher_maps = d.teacher()['attention']
    total = 0.0
    scores = d.student_scores()
    for name, s in scores.items():
        if s is None:
            raise RuntimeError(f"distill_attn: {name} kept no connectivity scores in this step")
        rows = 1 if d.sparse_layers[name].dense_cls_row else 0
        target = teacher_maps[name]
        positions = d.positions(_block_index(name))
        error = s - target if positions is None else _pruned_error(s, target, positions)
        total = total + error[..., rows:, :].pow(2).sum() / s.shape[0]
    return total / max(len(scores), 1)


def _block_index(name: str) -> Optional[int]:
    """3 for 'blocks.3.attn' (the block whose tokens a pruned layer sees)."""
    parts = name.split('.')
    return int(parts[1]) if len(parts) > 2 and parts[0] == 'blocks' and parts[1].isdigit() else None


def _pruned_error(scores: torch.Tensor, target: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """scores [B, H, n', n'] minus the teacher's map [B, H, n, n] at the kept tokens' original rows and
    columns; rows and columns of a fused token (position −1) count zero."""
    b, h, m, n = scores.shape[0], scores.shape[1], scores.shape[-1], target.shape[-1]
    idx = positions.clamp(min=0)
    rows = target.gather(2, idx[:, None, :, None].expand(b, h, m, n))
    both = rows.gather(3, idx[:, None, None, :].expand(b, h, m, m))
    valid = positions >= 0
    return (scores - both) * (valid[:, None, :, None] & valid[:, None, None, :])
