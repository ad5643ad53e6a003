# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.structformer-installed
DEMO_OUT ?= outputs/demo

.PHONY: demo test venv bench bench-records clean

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
# inside its time, where two processes of two threads each oversubscribe the cores. Tests that need
# several threads set them themselves; `$(BIN)/python -m pytest tests` runs it serially at torch's default.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --timeout=900 -n 2 tests

bench: $(STAMP)
	$(BIN)/structformer bench models

# Re-measure every goal's record for this machine's CPU kind (docs/kinds/KIND/, KIND.json) and rewrite its table in
# docs/benchmarks.md. Run it on a quiet machine: a benchmark refuses to write into docs/ from a busy run.
THREADS ?= 1
bench-records: $(STAMP)
	$(BIN)/python -m structformer.bench.kind_tables record --threads $(THREADS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
