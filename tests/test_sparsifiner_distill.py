"""Sparsifiner's distillation (Eq. 7–12) and its two stages through the engine."""
import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file

from structformer.errors import UsageError
from structformer.models.attention_swap import swap_attention
from structformer.models.factory import build_model
from structformer.train import TrainConfig, train
from structformer.train.distill import (Distiller, PREDICTOR_PATTERNS, attention_probabilities, distillation_phases,
                                        init_from_teacher)
from structformer.train.phases import LOSS_TERMS, LossContext, Phase


@pytest.fixture
def teacher_run(vit_digits_teacher):
    """vit_digits trained one epoch (conftest: once per session, read-only)."""
    return vit_digits_teacher


def _weights(run: Path, epoch: int):
    return load_file(str(run / 'checkpoints' / f'epoch_{epoch:04d}' / 'model.safetensors'))


def _is_predictor(name: str) -> bool:
    return '.basis.' in name or '.predictor_' in name


def test_attention_probabilities_reproduce_timm_attention():
    torch.manual_seed(0)
    attn = timm.layers.Attention(32, num_heads=4, qkv_bias=True).double().eval()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    probs = attention_probabilities(attn, x)
    v = attn.qkv(x).reshape(2, 7, 3, 4, 8).permute(2, 0, 3, 1, 4)[2]
    out = attn.proj((probs @ v).transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(out, attn(x))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 7, dtype=torch.float64))


def test_student_from_teacher_at_keep_one_gives_the_teachers_logits(teacher_run):
    from structformer.train.checkpoint import load_model
    teacher, _ = load_model(teacher_run)
    student, _ = build_model('sparsifiner_digits', {'keep_ratio': 1.0}, None, [])
    init_from_teacher(student, teacher)
    x = torch.randn(3, 1, 8, 8)
    torch.testing.assert_close(student.eval()(x), teacher(x), rtol=1e-5, atol=1e-5)


def _context(student, teacher, images, phase):
    d = Distiller(student, teacher)
    d.start_phase(phase)
    d.start_batch(images)
    logits = student(images)
    return d, LossContext(student, images, torch.zeros(len(images), dtype=torch.long), logits, 0.0, {'distiller': d})


def test_loss_terms_follow_their_equations():
    torch.manual_seed(0)
    teacher, _ = build_model('vit_digits', {}, None, [])
    student, _ = build_model('sparsifiner_digits', {}, None, [])
    init_from_teacher(student, teacher)
    with torch.no_grad():                        # a student that differs from its teacher
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    student.train()
    teacher.eval()
    images = torch.randn(4, 1, 8, 8)
    phase = Phase('all', 1, losses={'distill_token': 1, 'distill_kl': 1, 'distill_attn': 1})
    d, ctx = _context(student, teacher, images, phase)
    with torch.no_grad():
        t_tokens = teacher.forward_features(images)
        t_logits = teacher.forward_head(t_tokens)
    # Eq. 8: patch tokens after the final norm, cls left out
    s_tokens = student.norm(student.blocks(student._pos_embed(student.patch_embed(images))))
    expected = ((s_tokens[:, 1:] - t_tokens[:, 1:]) ** 2).mean()
    torch.testing.assert_close(LOSS_TERMS['distill_token'](ctx), expected, rtol=1e-4, atol=1e-6)
    # Eq. 9: Σ_c p_t (log p_t − log p_s), mean over images
    p_t = t_logits.softmax(-1)
    expected = (p_t * (p_t.log() - ctx.logits.log_softmax(-1))).sum(-1).mean()
    torch.testing.assert_close(LOSS_TERMS['distill_kl'](ctx), expected, rtol=1e-5, atol=1e-7)
    # Eq. 10: per layer Σ (scores − A_teacher)² over the patch query rows, / batch; mean over layers
    per_layer = []
    x = teacher._pos_embed(teacher.patch_embed(images))
    for block, s_block in zip(teacher.blocks, student.blocks):
        a_t = attention_probabilities(block.attn, block.norm1(x))
        scores = s_block.attn.last_scores
        per_layer.append(((scores[..., 1:, :] - a_t[..., 1:, :]) ** 2).sum() / len(images))
        x = block(x)
    torch.testing.assert_close(LOSS_TERMS['distill_attn'](ctx), torch.stack(per_layer).mean(), rtol=1e-4, atol=1e-6)
    d.stop()
    assert all(layer.last_scores is None and not layer.keep_scores for layer in d.sparse_layers.values())


def test_attention_distillation_reaches_only_the_predictor_and_teaches_it():
    torch.manual_seed(0)
    teacher, _ = build_model('vit_digits', {}, None, [])
    student, _ = build_model('sparsifiner_digits', {}, None, [])
    init_from_teacher(student, teacher)
    phase = distillation_phases(2, 1)[0]
    phase = Phase(**phase)
    phase.apply(student)
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trainable and all(_is_predictor(n) for n in trainable)
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    images = torch.randn(16, 1, 8, 8)
    losses = []
    for _ in range(25):
        _, ctx = _context(student, teacher, images, phase)
        loss = phase.loss(ctx)['distill_attn']
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]                 # the predictor moves towards the teacher's attention


def _distill_config(tmp_path, teacher_run, **overrides):
    values = dict(model='sparsifiner_digits', data='digits', epochs=3, lr=3e-3, limit_train_batches=3,
                  teacher=str(teacher_run), predictor_epochs=1, keep_last=3, output=str(tmp_path / 'student'))
    values.update(overrides)
    return TrainConfig(**values)


def test_two_stages_through_the_engine(tmp_path, teacher_run):
    result = train(_distill_config(tmp_path, teacher_run), progress=False)
    assert [r['phase'] for r in result.history] == ['predictor', 'joint', 'joint']
    assert set(result.history[0]) >= {'train_distill_attn'} and 'train_ce' not in result.history[0]
    assert {'train_ce', 'train_distill_token', 'train_distill_kl'} <= set(result.history[1])
    teacher = load_file(str(sorted((teacher_run / 'checkpoints').glob('epoch_*'))[-1] / 'model.safetensors'))
    run = tmp_path / 'student'
    start, stage1, stage2 = _weights(run, 0), _weights(run, 1), _weights(run, 2)
    for name, value in teacher.items():           # the student starts as the teacher
        assert torch.equal(start[name], value), name
    changed = {n for n in start if not torch.equal(start[n], stage1[n])}
    assert changed and all(_is_predictor(n) for n in changed), changed     # stage 1: the predictor only
    backbone_changed = {n for n in start if not _is_predictor(n) and not torch.equal(stage1[n], stage2[n])}
    assert backbone_changed                                                  # stage 2: everything trains
    saved = json.loads((run / 'checkpoints' / 'epoch_0001' / 'state.json').read_text())['config']
    assert Path(saved['teacher']).name.startswith('epoch_')                  # the exact checkpoint is recorded


def test_resume_across_the_stage_boundary_is_bit_exact(tmp_path, teacher_run):
    straight = train(_distill_config(tmp_path / 'a', teacher_run), progress=False)
    train(_distill_config(tmp_path / 'b', teacher_run), progress=False, stop_after=1)
    resumed = train(_distill_config(tmp_path / 'b', teacher_run), progress=False, resume=True)
    assert [r['phase'] for r in resumed.history] == ['joint', 'joint']
    a = load_file(str(straight.last_checkpoint / 'model.safetensors'))
    b = load_file(str(resumed.last_checkpoint / 'model.safetensors'))
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_linformer_student_of_the_same_teacher(tmp_path, teacher_run):
    """Table 4's comparison: the same backbone with Linformer at rank = the sparse budget; no stage 1."""
    config = _distill_config(tmp_path, teacher_run, model='vit_digits', predictor_epochs=None, epochs=2,
                             transforms=[{'name': 'swap_attention', 'kwargs': {'attn': 'linformer', 'num_landmarks': 5}}])
    result = train(config, progress=False)
    assert [r['phase'] for r in result.history] == ['joint', 'joint']
    model, _ = build_model('vit_digits', {}, None, [])
    swap_attention(model, 'linformer', num_landmarks=5)
    assert model.blocks[0].attn.seq_proj.e.shape == (5, 17)


def test_distillation_terms_without_a_teacher_are_refused(tmp_path):
    config = TrainConfig(model='sparsifiner_digits', data='digits', epochs=1, output=str(tmp_path / 'x'),
                         phases=[{'name': 'p', 'epochs': 1, 'losses': {'distill_kl': 1.0}}])
    with pytest.raises(ValueError, match='--teacher'):
        train(config, progress=False)
    assert not (tmp_path / 'x').exists()


def test_attention_distillation_needs_a_sparsifiner_student(tmp_path, teacher_run):
    config = TrainConfig(model='vit_digits', data='digits', epochs=2, output=str(tmp_path / 'x'),
                         teacher=str(teacher_run), predictor_epochs=1)
    with pytest.raises(UsageError, match='Sparsifiner attention'):
        train(config, progress=False)
    assert not (tmp_path / 'x').exists()


def test_paper_stage_weights():
    stage1, stage2 = distillation_phases(45, 5)
    assert stage1 == {'name': 'predictor', 'epochs': 5, 'trainable': PREDICTOR_PATTERNS, 'losses': {'distill_attn': 1.0}}
    assert stage2['epochs'] == 40 and stage2['losses'] == {'ce': 1.0, 'distill_token': 0.5, 'distill_kl': 0.5}
    assert 'trainable' not in stage2
    assert TrainConfig(epochs=45).default_predictor_epochs() == 5


def test_stage2_trains_only_parameters_that_get_a_gradient():
    """Stage 2 (λ_attn = 0) must freeze every predictor parameter, the q/k reductions of predictor_dim included:
    none reaches its loss (the mask is detached), and DDP (find_unused_parameters=False) refuses a trainable
    parameter without a gradient. The public code's stage-2 optimiser leaves out its whole mask_predictor."""
    torch.manual_seed(0)
    teacher, _ = build_model('vit_digits', {}, None, [])
    student, _ = build_model('sparsifiner_digits', {'predictor_dim': 8}, None, [])
    init_from_teacher(student, teacher)
    phase = Phase(**distillation_phases(2, 1)[1])
    phase.apply(student)
    student.train()
    _, ctx = _context(student, teacher, torch.randn(4, 1, 8, 8), phase)
    sum(phase.loss(ctx).values()).backward()
    trainable = {n for n, p in student.named_parameters() if p.requires_grad}
    assert any('.predictor_q.' in n for n, _ in student.named_parameters())
    assert trainable and not any(_is_predictor(n) for n in trainable)
    assert [n for n, p in student.named_parameters() if p.requires_grad and p.grad is None] == []


@pytest.mark.parametrize('keep_rate, kept', [(0.5, 8), (0.9, 15)])
def test_pruned_student_is_distilled_at_the_original_positions(keep_rate, kept):
    """With EViT pruning the student's kept tokens (and attention rows / columns) are compared with the
    teacher's at their original positions; a fused token has no counterpart. At keep 0.9 the 16 patches become
    15 kept + 1 fused: as many tokens as the teacher's, yet not the same ones (once compared index by index)."""
    torch.manual_seed(0)
    teacher, _ = build_model('vit_digits', {}, None, [])
    student, _ = build_model('sparsifiner_digits', {}, None,
                             [{'name': 'prune_tokens', 'kwargs': {'keep_rate': keep_rate, 'layers': [1]}}])
    init_from_teacher(student, teacher)
    student.train()
    images = torch.randn(3, 1, 8, 8)
    phase = Phase('all', 1, losses={'distill_token': 1, 'distill_attn': 1})
    d, ctx = _context(student, teacher, images, phase)
    positions = student.token_pruning.positions                   # [B, 1 + kept + 1 fused]
    assert positions.shape == (3, kept + 2) and (positions[:, -1] == -1).all()
    with torch.no_grad():
        t_tokens = teacher.forward_features(images)
    s_tokens = d.student_tokens()
    expected = torch.stack([(s_tokens[b, 1:kept + 1] - t_tokens[b, positions[b, 1:kept + 1]]).pow(2)
                            for b in range(3)]).mean()
    torch.testing.assert_close(LOSS_TERMS['distill_token'](ctx), expected, rtol=1e-5, atol=1e-7)
    # blocks 2 and 3 see the pruned tokens: their error uses the teacher's rows / columns at the kept positions
    x = teacher._pos_embed(teacher.patch_embed(images))
    per_layer = []
    for i, block in enumerate(teacher.blocks):
        a_t = attention_probabilities(block.attn, block.norm1(x))
        scores = student.blocks[i].attn.last_scores
        pos = student.token_pruning.entering.get(i, (None,))[0]
        if i < 2:
            assert pos is None or pos.shape[1] == 17
            per_layer.append((scores[..., 1:, :] - a_t[..., 1:, :]).pow(2).sum() / 3)
        else:
            assert scores.shape[-1] == kept + 2 and torch.equal(pos, positions)
            err = 0.0
            for b in range(3):
                keep = pos[b] >= 0
                sub = a_t[b][:, pos[b][keep]][:, :, pos[b][keep]]
                err = err + (scores[b][:, keep][:, :, keep][:, 1:] - sub[:, 1:]).pow(2).sum()
            per_layer.append(err / 3)
        x = block(x)
    total = LOSS_TERMS['distill_attn'](ctx)
    torch.testing.assert_close(total, torch.stack(per_layer).mean(), rtol=1e-4, atol=1e-6)
    total.backward()
    assert student.blocks[3].attn.basis.w_up.grad is not None


def test_a_token_pruned_teacher_is_refused_by_name(tmp_path):
    """Its tokens and attention maps are no longer at the original positions the losses index (a traceback in
    distill_attn before; silently compared index by index where pruning kept the count)."""
    from structformer.train.checkpoint import save_checkpoint
    from structformer.train.distill import load_teacher
    model, recipe = build_model('vit_digits', {}, None,
                                [{'name': 'prune_tokens', 'kwargs': {'keep_rate': 0.9, 'layers': [1]}}])
    run = tmp_path / 'pruned'
    save_checkpoint(run / 'checkpoints' / 'epoch_0001', model, with_rng=False,
                    state={'model': 'vit_digits', 'model_kwargs': {}, 'recipe': recipe.to_dict(), 'epoch': 1})
    with pytest.raises(UsageError, match='--teacher .*token pruning'):
        load_teacher(run)


def test_extending_a_run_on_resume_keeps_the_stage_one_it_trained(tmp_path, teacher_run, capsys):
    """Stage 1's default length follows --epochs (about 1/9): a run of 9 epochs trains 1; resumed with --epochs 27
    after that epoch it must go on in stage 2 (the default of 27 would put epochs 2-3 back in stage 1)."""
    from structformer.cli import main
    out = tmp_path / 'student'
    common = ['--output', str(out), '--no-progress', '--log-interval', '0']
    assert main(['train', '--model', 'sparsifiner_digits', '--data', 'digits', '--epochs', '9', '--lr', '3e-3',
                 '--limit-train-batches', '2', '--teacher', str(teacher_run), '--stop-after', '1', *common]) == 0
    assert main(['train', '--resume', '--epochs', '27', '--stop-after', '1', *common]) == 0
    phases = [json.loads(line)['phase'] for line in (out / 'metrics.jsonl').read_text().splitlines()]
    assert phases == ['predictor', 'joint']
    capsys.readouterr()
