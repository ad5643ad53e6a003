"""What a new user trips over (issue 9): defaults that make a valid command fail, and logs full of
progress-bar carriage returns when output is redirected."""
import subprocess
import sys

import pytest

from structformer.train import TrainConfig


@pytest.mark.parametrize('epochs, expected', [(1, 0.1), (2, 0.2), (20, 2.0), (30, 2.0)])
def test_default_warmup_fits_the_run(epochs, expected):
    config = TrainConfig(epochs=epochs).validate()
    assert config.warmup_epochs is None and config.resolved_warmup_epochs() == pytest.approx(expected)


def test_an_explicit_bad_warmup_is_still_refused():
    with pytest.raises(ValueError, match=r'--warmup-epochs=2 is out of range: accepted in \[0, epochs=2\)'):
        TrainConfig(epochs=2, warmup_epochs=2).validate()


def test_two_epoch_run_with_defaults_and_a_redirected_log(tmp_path):
    """`structformer train --model crate_digits --data digits --epochs 2` (shortened) succeeds, and with
    stdout and stderr redirected it logs one line per epoch and no carriage-return updates."""
    done = subprocess.run([sys.executable, '-m', 'structformer.cli', 'train', '--model', 'crate_digits', '--data',
                           'digits', '--epochs', '2', '--limit-train-batches', '2', '--output', str(tmp_path / 'run')],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '\r' not in done.stdout + done.stderr
    epoch_lines = [line for line in done.stdout.splitlines() if line.startswith('epoch ')]
    assert [line.split()[1] for line in epoch_lines] == ['1/2', '2/2']


@pytest.mark.parametrize('decay_everything', [False, True])
def test_weight_decay_skips_norms_biases_and_cls_pos_unless_asked(tmp_path, decay_everything):
    from structformer.train.engine import Trainer
    trainer = Trainer(TrainConfig(model='crate_digits', data='digits', epochs=1, weight_decay=0.05,
                                  decay_everything=decay_everything, output=str(tmp_path / 'run')))
    trainer._build()
    decay = {id(p): group['weight_decay'] for group in trainer.optimizer.param_groups for p in group['params']}
    named = dict(trainer.model.named_parameters())
    assert len(decay) == len(named)
    for name, p in named.items():
        exempt = p.ndim <= 1 or name in ('cls_token', 'pos_embed')
        assert decay[id(p)] == (0.05 if decay_everything or not exempt else 0.0), name
    assert 'cls_token' in named and 'pos_embed' in named


def test_crate_pools_as_asked_including_the_official_mean_over_all_tokens():
    import timm
    import torch
    model = timm.create_model('crate_digits', global_pool='avg_all').eval()
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        tokens = model.forward_features(x)
        assert tokens.shape[1] == model.patch_embed.num_patches + 1
        torch.testing.assert_close(model.forward_head(tokens, pre_logits=True), model.norm(tokens.mean(1)))
        model.reset_classifier(model.num_classes, global_pool='avg')           # timm's: the cls token left out
        torch.testing.assert_close(model.forward_head(tokens, pre_logits=True), model.norm(tokens[:, 1:].mean(1)))
    with pytest.raises(ValueError, match="global_pool='mean'"):
        timm.create_model('crate_digits', global_pool='mean')
