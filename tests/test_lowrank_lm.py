"""The LM side of low-rank training: byte-level text data (the standard library's sources, local
files), the GPT-2-style causal LM, per-token loss and perplexity through the engine and `eval`."""
import json
import math

import pytest
import timm
import torch
import torch.nn.functional as F

from structformer.cli import main
from structformer.data import build_datasets
from structformer.data.text import ByteWindows, stdlib_sources
from structformer.models.factorize import factorize
from structformer.models.factorize import factorized_layers
from structformer.train import evaluate

TINY = dict(embed_dim=32, depth=2, num_heads=2)


def test_byte_windows_are_shifted_pairs():
    ds = ByteWindows(b'abcdefghij', 3)
    assert len(ds) == 3
    x, y = ds[1]
    assert bytes(x.tolist()) == b'def' and bytes(y.tolist()) == b'efg'
    assert x.dtype == y.dtype == torch.int64                               # token ids, as nn.Embedding takes them
    with pytest.raises(IndexError):
        ds[3]
    # the stream is held at one byte per byte (it was int64: 8 bytes per byte, 32 GB for the LM1B recipes' text)
    big = ByteWindows(bytes(range(256)) * 64, 128)
    assert big.tokens.untyped_storage().nbytes() == 256 * 64


def test_pysource_is_the_standard_library_split_by_whole_files():
    train, val, info = build_datasets('pysource', seed=0, val_fraction=0.2, max_bytes=200_000, seq_len=64)
    again, _, _ = build_datasets('pysource', seed=0, val_fraction=0.2, max_bytes=200_000, seq_len=64)
    assert torch.equal(train.tokens, again.tokens)                        # deterministic for a seed
    assert info.num_classes == 256 and info.img_size == 64 and info.extra['task'] == 'lm'
    assert 'standard library' in info.description and len(stdlib_sources()) > 50
    total = info.extra['train_bytes'] + info.extra['val_bytes']
    assert total <= 200_000 + 4 * 64 and 0 < info.extra['val_bytes'] <= 0.2 * total
    assert len(train) == (info.extra['train_bytes'] - 1) // 64


@pytest.mark.parametrize('seed', [0, 1])
def test_the_held_out_files_stay_within_val_fraction(seed):
    # docs/lowrank.md's LM command (max_bytes=100000): files were held out until the fraction was passed, so one
    # large file first in the seeded order held out 97 % of the text and left 23 training windows (seed 0)
    _, _, info = build_datasets('pysource', seed=seed, val_fraction=0.2, max_bytes=100_000, seq_len=128)
    held, trained = info.extra['val_bytes'], info.extra['train_bytes']
    assert 0 < held <= 0.2 * (held + trained) and info.train_size > 3 * info.val_size


def test_text_file_and_folder(tmp_path):
    (tmp_path / 'a.txt').write_text('hello world\n' * 200)
    train, val, info = build_datasets(f'text:{tmp_path / "a.txt"}', seed=0, val_fraction=0.25, seq_len=16)
    assert info.extra['val_bytes'] == 2400 - int(2400 * 0.75)
    (tmp_path / 'b.md').write_text('# title\n' * 100)
    train, val, info = build_datasets(f'text:{tmp_path}', seed=0, val_fraction=0.25, seq_len=16)
    assert info.train_size > 0 and info.val_size > 0
    (tmp_path / 'empty').mkdir()
    with pytest.raises(ValueError, match='no text files'):
        build_datasets(f'text:{tmp_path / "empty"}')
    with pytest.raises(FileNotFoundError, match='does not exist'):
        build_datasets(f'text:{tmp_path / "missing"}')
    with pytest.raises(ValueError, match='seq_len'):
        build_datasets('pysource', seq_len=1)


def test_a_folder_of_shards_without_a_text_suffix_is_read_by_a_files_glob(tmp_path):
    # the LM1B recipes' text is a folder of shards named news.en-00001-of-00100: no suffix the folder rule reads
    for i in range(3):
        (tmp_path / f'news.en-0000{i}-of-00100').write_text(f'shard {i} says hello\n' * 40)
    (tmp_path / 'README').write_text('not part of the text\n' * 40)
    with pytest.raises(ValueError, match="files=PATTERN"):
        build_datasets(f'text:{tmp_path}', seq_len=16)
    train, val, info = build_datasets(f'text:{tmp_path}', seq_len=16, files='news.en-*')
    assert '3 files' in info.description and b'not part' not in bytes(train.tokens.tolist() + val.tokens.tolist())
    with pytest.raises(ValueError, match=r"matches --data-kwargs files='x\*'"):
        build_datasets(f'text:{tmp_path}', seq_len=16, files='x*')
    with pytest.raises(ValueError, match='is one file'):                      # not silently ignored
        build_datasets(f'text:{tmp_path / "README"}', seq_len=16, files='news*')
    with pytest.raises(ValueError, match='unknown option.*files'):             # a folder option of text: only
        build_datasets('pysource', files='*.py')


def test_gpt_is_causal_and_factorises_qkv_and_ffn_only():
    torch.manual_seed(0)
    model = timm.create_model('gpt2_byte_tiny', **TINY).eval()
    x = torch.randint(0, 256, (2, 20))
    y = x.clone()
    y[:, 12] = (y[:, 12] + 1) % 256
    a, b = model(x), model(y)
    assert a.shape == (2, 20, 256)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=0)   # the future does not leak: same ops
    assert not torch.allclose(a[:, 12:], b[:, 12:])
    factorize(model, rank=0.25, verbose=False)
    assert sorted(factorized_layers(model)) == [f'blocks.{i}.{n}' for i in range(2)
                                                for n in ('attn.qkv', 'mlp.fc1', 'mlp.fc2')]
    with pytest.raises(ValueError, match='context'):
        model(torch.randint(0, 256, (1, 129)))
    with pytest.raises(ValueError, match='token ids'):
        model(torch.randn(1, 1, 8, 8))


def test_gpt_attention_equals_its_explicit_reference_and_is_counted():
    """SDPA (is_causal) against softmax(QKᵀ/√d + causal mask)·V, outputs and gradients in float64; the explicit
    path is what FLOP counting sees (the fused kernel is invisible to FlopCounterMode on CPU)."""
    from structformer.bench.flops import model_flops
    from structformer.models.gpt import CausalSelfAttention
    torch.manual_seed(0)
    layer = CausalSelfAttention(16, 4).double()
    x = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    fused = layer(x)
    grads = torch.autograd.grad(fused.square().sum(), [x, *layer.parameters()])
    layer.fused = False
    explicit = layer(x)
    torch.testing.assert_close(explicit, fused, rtol=1e-10, atol=1e-12)
    for a, b in zip(torch.autograd.grad(explicit.square().sum(), [x, *layer.parameters()]), grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    counted = model_flops('gpt2_byte_tiny')
    d, t, depth = 128, 128, 4
    assert counted['breakdown_macs']['attention'] == depth * (4 * t * d * d + 2 * t * t * d)   # qkv, proj, QKᵀ, AV


def test_gpt_forward_intermediates_and_cka():
    """timm's feature interface on the LM (hidden states after each block, NLC), which `analyze --cka` uses."""
    from structformer.analysis.cka import minibatch_cka
    torch.manual_seed(0)
    model = timm.create_model('gpt2_byte_tiny', **TINY).eval()
    x = torch.randint(0, 256, (2, 20))
    final, hidden = model.forward_intermediates(x)
    torch.testing.assert_close(final, model.forward_features(x))
    assert len(hidden) == 2 and all(h.shape == (2, 20, 32) for h in hidden)
    manual = model._embed(x)
    for block, h in zip(model.blocks, hidden):
        manual = block(manual)
        torch.testing.assert_close(h, manual)
    last, = model.forward_intermediates(x, indices=[-1], norm=True, intermediates_only=True)
    torch.testing.assert_close(last, final)
    with pytest.raises(ValueError, match="'NLC'"):
        model.forward_intermediates(x, output_fmt='NCHW')
    cka = minibatch_cka(model, model, [torch.randint(0, 256, (4, 20)), torch.randint(0, 256, (5, 20))])
    torch.testing.assert_close(cka['cka'].diagonal(), torch.ones(2, dtype=cka['cka'].dtype))   # a model with itself


def test_gpt_features_only_gives_the_hidden_states():
    """`timm.create_model(..., features_only=True)` on the LM: timm's getter asked forward_intermediates for NCHW,
    which the LM refuses, and `output_fmt='NLC'` could not be passed (it went to GPT.__init__), so features_only
    could not be built at all; the LM's extractor now asks for NLC."""
    torch.manual_seed(0)
    model = timm.create_model('gpt2_byte_tiny', **TINY).eval()
    features = timm.create_model('gpt2_byte_tiny', features_only=True, **TINY).eval()
    features.model.load_state_dict({k: v for k, v in model.state_dict().items() if k in features.model.state_dict()})
    x = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        got = features(x)
        want = model.forward_intermediates(x, intermediates_only=True)
    assert features.feature_info.channels() == [32, 32] and len(got) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_gpt_reset_classifier_refuses_a_pooling_it_would_not_do():
    """timm's `reset_classifier(n, global_pool)`: the LM's logits are per token, so a pooling is refused by name
    (it was dropped without a word and the output stayed [B, T, n]); '' (no pooling) is what it does."""
    model = timm.create_model('gpt2_byte_tiny', **TINY).eval()
    assert model.global_pool == ''
    model.reset_classifier(7, '')
    assert model(torch.randint(0, 256, (2, 5))).shape == (2, 5, 7)
    with pytest.raises(ValueError, match="global_pool='avg'"):
        model.reset_classifier(3, 'avg')
    assert model.num_classes == 7


def test_evaluate_reports_per_token_loss_and_perplexity():
    torch.manual_seed(0)
    model = timm.create_model('gpt2_byte_tiny', **TINY)
    x = torch.randint(0, 256, (5, 16))
    y = torch.randint(0, 256, (5, 16))
    metrics = evaluate(model, [(x[:3], y[:3]), (x[3:], y[3:])], 'cpu')
    with torch.no_grad():
        expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert metrics['loss'] == pytest.approx(expected, rel=1e-5)
    assert metrics['perplexity'] == pytest.approx(math.exp(expected), rel=1e-5)


def test_lm_train_and_eval_through_the_cli(tmp_path, capsys):
    run = tmp_path / 'lm'
    assert main(['train', '--model', 'gpt2_byte_tiny', '--model-kwargs', 'embed_dim=32', 'depth=1', 'num_heads=2',
                 '--data', 'pysource', '--data-kwargs', 'max_bytes=20000', 'seq_len=32', '--epochs', '2',
                 '--smoothing', '0', '--limit-train-batches', '3', '--rank', '0.25', '--factorize-at', '1',
                 '--output', str(run), '--no-progress']) == 0
    records = [json.loads(line) for line in (run / 'metrics.jsonl').read_text().splitlines()]
    assert all(r['val_perplexity'] == pytest.approx(math.exp(r['val_loss'])) for r in records)
    assert 0 <= records[-1]['train_top1'] <= 100 and 'factorized_val_perplexity' in records[1]
    assert 'final_val_perplexity' in json.loads((run / 'summary.json').read_text())
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(run)]) == 0
    out = capsys.readouterr().out
    assert 'perplexity' in out and ' sequences)' in out and 'images' not in out    # windows, not images


def test_a_vocabulary_smaller_than_the_bytes_is_one_usage_line(tmp_path, capsys):
    """num_classes is the GPT's vocabulary: fewer than the data's 256 byte values used to fail inside the input
    check's forward (the embedding's IndexError, a traceback) instead of naming the argument."""
    run = tmp_path / 'lm'
    assert main(['train', '--model', 'gpt2_byte_tiny', '--model-kwargs', 'embed_dim=16', 'depth=1', 'num_heads=2',
                 'num_classes=100', '--data', 'pysource', '--data-kwargs', 'max_bytes=6000', 'seq_len=16',
                 '--epochs', '1', '--output', str(run), '--no-progress']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and 'num_classes=100' in err[0] and 'num_classes=256' in err[0]
    assert not run.exists()


def test_the_text_windows_follow_the_language_models_context(tmp_path, capsys):
    """Without seq_len the text was cut at its default 128 whatever the model: gpt2_byte_small (context 256) trained
    on 128-byte windows, and a GPT built with img_size=32 was refused. Now the windows follow the model's context
    (as images follow its input size), and a run records the length it used for eval and resume."""
    follows = lambda model, **kw: build_datasets('pysource', max_bytes=20000, model=model, **kw)[2].extra['seq_len']  # noqa: E731
    assert follows('gpt2_byte_small') == 256
    assert follows('gpt2_byte_tiny', model_kwargs={'img_size': 48}) == 48
    assert follows('gpt2_byte_small', seq_len=64) == 64                       # given: kept
    assert follows('resnet18') == 128                                           # not a language model: the default
    run = tmp_path / 'lm'
    assert main(['train', '--model', 'gpt2_byte_tiny', '--model-kwargs', 'embed_dim=16', 'depth=1', 'num_heads=2',
                 'img_size=32', '--data', 'pysource', '--data-kwargs', 'max_bytes=6000', '--epochs', '1',
                 '--limit-train-batches', '1', '--output', str(run), '--no-progress']) == 0
    import yaml
    assert yaml.safe_load((run / 'config.yaml').read_text())['data_kwargs']['seq_len'] == 32
    capsys.readouterr()
    assert main(['eval', '--checkpoint', str(run), '--json']) == 0
    assert json.loads(capsys.readouterr().out)['sequences'] == len(build_datasets(
        'pysource', max_bytes=6000, seq_len=32)[1])


def test_a_run_that_recorded_no_seq_len_resumes_at_the_default(tmp_path):
    """A run records seq_len only when the text followed the model to another length; one that did not (trained at
    128, as every run did before) must not follow the model's context (256) on --resume and be refused."""
    import yaml
    run = tmp_path / 'lm'
    common = ['--model-kwargs', 'embed_dim=16', 'depth=1', 'num_heads=2', '--no-progress']
    assert main(['train', '--model', 'gpt2_byte_small', *common, '--data', 'pysource', '--data-kwargs',
                 'max_bytes=6000', 'seq_len=128', '--epochs', '2', '--limit-train-batches', '1', '--stop-after', '1',
                 '--output', str(run)]) == 0
    for path in (run / 'config.yaml', run / 'checkpoints' / 'epoch_0001' / 'state.json'):
        text = path.read_text()                          # as a run from before the text followed the model
        saved = json.loads(text) if path.suffix == '.json' else yaml.safe_load(text)
        del (saved.get('config') or saved)['data_kwargs']['seq_len']
        path.write_text(json.dumps(saved) if path.suffix == '.json' else yaml.safe_dump(saved))
    assert main(['train', '--resume', str(run), '--no-progress']) == 0
    assert len((run / 'metrics.jsonl').read_text().splitlines()) == 2


@pytest.mark.parametrize('model, data, expected', [
    ('gpt2_byte_tiny', 'pysource', 0.0),          # a language model on text: no smoothing, as the seed's GPT-2
    ('gpt2_byte_tiny', 'digits', 0.0),            # a model that takes token ids is a language model whatever --data
    ('crate_digits', 'digits', 0.1),              # image classes: timm's 0.1
])
def test_label_smoothing_defaults_to_zero_for_a_language_model(model, data, expected):
    """The LM trained with timm's image default 0.1 unless --smoothing 0 was given (the docs asked for it): its
    training loss was cross-entropy against smoothed next-token targets, not the per-token NLL its perplexity is.
    Unset now resolves by the task; a value given is kept."""
    from structformer.train import TrainConfig
    assert TrainConfig(model=model, data=data).validate().label_smoothing == expected
    assert TrainConfig(model=model, data=data, label_smoothing=0.05).validate().label_smoothing == 0.05


def test_an_lm_run_from_the_cli_records_no_smoothing(tmp_path):
    import yaml
    out = tmp_path / 'lm'
    assert main(['train', '--model', 'gpt2_byte_tiny', '--data', 'pysource', '--data-kwargs', 'max_bytes=20000',
                 'seq_len=32', '--epochs', '1', '--limit-train-batches', '1', '-b', '4', '--output', str(out)]) == 0
    assert yaml.safe_load((out / 'config.yaml').read_text())['label_smoothing'] == 0.0
