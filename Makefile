# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.structformer-installed
DEMO_OUT ?= outputs/demo

.PHONY: demo test test-fast venv bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# Train CRATE on the embedded digits data, then run the white-box analysis on the result.
demo: $(STAMP)
	$(BIN)/structformer train --model crate_digits --data digits --epochs 20 --lr 3e-3 --output $(DEMO_OUT) --overwrite
	$(BIN)/structformer analyze --checkpoint $(DEMO_OUT) --compare init --data digits --output $(DEMO_OUT)/analysis
	@echo
	@echo "checkpoints: $(DEMO_OUT)/checkpoints (latest.json names the newest)"
	@echo "metrics:    $(DEMO_OUT)/metrics.jsonl"
	@echo "report:     $(DEMO_OUT)/analysis/report.md"

# Two test processes with one torch thread each (pytest-xdist): on 2 cores that is what keeps the suite
# inside its time, where two processes of two threads each oversubscribe the cores (OpenMP's waiting made a
# test that raised itself to 2 threads 4x slower). Only tests about thread counts set more, and conftest puts
# it back; `$(BIN)/python -m pytest tests` runs the suite serially at torch's default.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --timeout=900 -n 2 tests

# The inner loop (under 2 minutes on 2 cores): the equations against their slow references, the layers, the
# CLI's bad inputs, the layout rules and the docs' records; no training beyond a few tiny runs, no exports,
# no torchrun. `make test` runs everything (these included).
FAST_TESTS := $(addprefix tests/test_,$(addsuffix .py, \
	soft_functional crate_numerics whitebox_estimators sparsifiner_tiles sparse_flops flops onednn_linear \
	mixer_fidelity autocast_policy attention_layers shared_qkv_attention mixer_layers lowrank sparsifiner \
	sparsifiner_kernel token_pruning hooks strict_options cli_errors help_examples layout records docs_records))
# one process: for a run this short, starting a second one costs more than it saves
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --timeout=300 $(FAST_TESTS)

bench: $(STAMP)
	$(BIN)/structformer bench models

clean:
	rm -rf $(VENV) outputs .pytest_cache
