"""`structformer reproduce soft`: what its report quotes from SOFT Table 2 (cheap: no training)."""
from structformer.reproduce.soft import PAPER_TABLE2, _report


def _row(attention):
    return {'attention': attention, 'model': f'm_{attention}', 'params': 1e6, 'train_img_per_s': 1.0,
            'infer_img_per_s': 1.0, 'act_mem_mb': 1.0, 'val_top1': 90.0, 'best_val_top1': 90.0}


def test_the_softmax_rows_paper_memory_is_at_batch_256():
    """Table 2's 19.0GB for the Transformer carries †: measured at batch 256, not the 1024 of the other rows."""
    text = _report([_row('softmax'), _row('soft')], {'width': 'half'}, 'mnist')
    softmax_line = next(line for line in text.splitlines() if line.startswith('| softmax |'))
    soft_line = next(line for line in text.splitlines() if line.startswith('| soft |'))
    assert '19.0GB at batch 256' in softmax_line
    assert '15.8GB,' in soft_line and 'batch 256' not in soft_line
    assert 'batch 1024 (softmax: 256)' in text
    assert PAPER_TABLE2['softmax'][4] == 80.0 and PAPER_TABLE2['softpp'][4] == 80.9
