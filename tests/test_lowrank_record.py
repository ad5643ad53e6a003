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
