"""docs/lowrank.md's reproduction tables are the committed record's (issue 34, item 5), and the vision pre-training
verdict states the seed's claim (parity), the tolerance and where the measurement falls."""
import json

from structformer.reproduce import lowrank

DOC = lowrank.RECORD.parents[1] / 'lowrank.md'


def test_the_docs_tables_and_findings_are_regenerated_from_the_record():
    record = json.loads(lowrank.RECORD.read_text())
    text = lowrank.tables_from_record(record, heading='####')
    assert text in DOC.read_text(), 'docs/lowrank.md differs from tables_from_record(docs/lowrank/reproduce_lowrank.json)'
    assert {r['part'] for r in record['runs']} == {'vision', 'lm'}
    assert record['sources']['lm'] == 'run' and record['lm']['args']['lm_lr_scale'] == 0.5
    # the vision runs are WRN-10-2 (wrn_16_2_mnist built with depth=10): the heading said `wrn_16_2_mnist` alone
    assert 'vision: `wrn_16_2_mnist` (depth=10) on `mnist`' in text


def test_vision_pretraining_verdict_is_parity_with_a_tolerance():
    # the record's numbers: 56.45 % pre-trained against 69.25 % from scratch is a loss, not the seed's parity
    line = lowrank.vision_pretraining_verdict(56.45, 69.25)
    assert 'seed: parity' in line and 'outside' in line and 'pre-training hurt' in line and '-12.80' in line
    assert 'tolerance ±3.03 points' in line                 # 2 SE of a difference of two accuracies on 2,000 images
    assert 'inside, parity holds' in lowrank.vision_pretraining_verdict(69.0, 69.25)
    assert 'outside, pre-training helped' in lowrank.vision_pretraining_verdict(80.0, 69.25)


def test_two_runs_that_did_not_learn_are_no_parity():
    """A 4-step run left both at 11.50 %, the share of MNIST's most frequent held-out class, and the verdict said
    'inside, parity holds': the seed's claim met by two networks that had learnt nothing."""
    from structformer.reproduce import learned
    labels = [1] * 230 + [k for k in range(2, 11) for _ in range(197)]      # 2,003 labels, the largest class 230
    majority = learned(0.0, labels)
    share = majority['majority_class']
    line = lowrank.vision_pretraining_verdict(share, share, majority=majority)
    assert 'cannot tell at this scale: neither run learnt' in line and 'parity holds' not in line
    assert 'inside, parity holds' in lowrank.vision_pretraining_verdict(69.0, 69.25, majority=majority)
    assert 'inside, parity holds' in lowrank.vision_pretraining_verdict(share, share)      # a record without labels
    runs = [{'part': 'vision', 'name': 'dense', 'group': 'baseline', 'rank': None, 'val_top1': 19.45},
            {'part': 'vision', 'name': 'r0.2_spectral', 'group': 'init', 'rank': 0.2, 'init': 'spectral',
             'val_top1': share, 'effective_rank_mean': 11.3},
            {'part': 'vision', 'name': 'r0.2_he', 'group': 'init', 'rank': 0.2, 'init': 'he', 'val_top1': 9.9},
            {'part': 'vision', 'name': 'r0.2_spectral_pretrain1', 'group': 'pretrain', 'rank': 0.2,
             'init': 'spectral', 'at': 1, 'val_top1': share}]
    assert any('neither run learnt' in c for c in lowrank.findings(runs, {}, majority))
