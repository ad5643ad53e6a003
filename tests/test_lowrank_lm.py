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
from structformer.lowrank import factorize
from structformer.lowrank.transform import factorized_layers
from structformer.train import evaluate

TINY = dict(embed_dim=32, depth=2, num_heads=2)


def test_byte_windows_are_shifted_pairs():
    ds = ByteWindows(b'abcdefghij', 3)
    assert len(ds) == 3
    x, y = ds[1]
    assert bytes(x.tolist()) == b'def' and bytes(y.tolist()) == b'efg'
    with pytest.raises(IndexError):
        ds[3]


def test_pysource_is_the_standard_library_split_by_whole_files():
    train, val, info = build_datasets('pysource', seed=0, val_fraction=0.2, max_bytes=200_000, seq_len=64)
    again, _, _ = build_datasets('pysource', seed=0, val_fraction=0.2, max_bytes=200_000, seq_len=64)
    assert torch.equal(train.tokens, again.tokens)                        # deterministic for a seed
    assert info.num_classes == 256 and info.img_size == 64 and info.extra['task'] == 'lm'
    assert 'standard library' in info.description and len(stdlib_sources()) > 50
    total = info.extra['train_bytes'] + info.extra['val_bytes']
    assert total <= 200_000 + 4 * 64 and 0.2 <= info.extra['val_bytes'] / total < 0.6
    assert len(train) == (info.extra['train_bytes'] - 1) // 64


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
