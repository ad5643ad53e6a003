# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.structformer-installed
DEMO_OUT ?= outputs/demo

.PHONY: demo test test-fast test-numerics test-mutants test-gpu gpu-wheels gpu-check venv bench bench-records clean

venv: $(STAMP)

# tools/install_venv.py: uv where pip can fetch it (a third of pip's time here), pip otherwise; both read pip's
# configuration. STRUCTFORMER_INSTALLER=pip makes it pip alone.
$(STAMP): pyproject.toml constraints.txt tools/install_venv.py
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python tools/install_venv.py
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
	sparsifiner_kernel token_pruning hooks strict_options cli_errors flag_sweep model_arguments help_examples layout records \
	docs_records))
# one process: for a run this short, starting a second one costs more than it saves
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --timeout=300 $(FAST_TESTS)

# Every fast path against its slow reference (outputs, gradients, gradcheck) with ATen's vector kernels off and one
# thread: the numerics rule's other setting, where a tolerance fitted to one CPU's kernels would fail (~2 minutes).
NUMERICS_TESTS := $(addprefix tests/test_,$(addsuffix .py, \
	soft_functional soft_official crate_numerics attention_layers shared_qkv_attention mixer_layers onednn_linear \
	sparsifiner sparsifiner_tiles sparsifiner_kernel sparse_attention_bench double_backward autotune lowrank))
test-numerics: $(STAMP)
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --timeout=300 $(NUMERICS_TESTS)

# Do the tests catch a wrong equation? Each of tools/mutants.py's mutants planted in a throw-away worktree of HEAD,
# against the tests that guard it; the record in docs/mutants.json (docs/design.md; ~11 min on 2 cores)
test-mutants: $(STAMP)
	$(BIN)/python tools/mutants.py --output docs/mutants.json

bench: $(STAMP)
	$(BIN)/structformer bench models

# Re-measure every goal's record for this machine's CPU kind (docs/kinds/KIND/, KIND.json) and rewrite its table in
# docs/benchmarks.md and README's; all of them or, when a benchmark failed or ran while the machine was busy, none.
# Run it on a quiet machine, or publish a busy run's records anyway (their tables say BUSY):
# make bench-records RECORDS_FLAGS=--allow-busy
THREADS ?= 1
RECORDS_FLAGS ?=
bench-records: $(STAMP)
	$(BIN)/python -m structformer.bench.kind_tables record --threads $(THREADS) $(RECORDS_FLAGS)

# The GPU suite (tests/gpu, skipped without CUDA; docs/gpu.md). On a lent GPU's image, with its own python and no
# .venv: `python3 -m pip install -e . --no-deps --no-build-isolation && make test-gpu TEST_PYTHON=python3`.
# Four test processes share the GPU; the tests that share a family's runs stay in one (--dist loadgroup).
TEST_PYTHON ?= $(BIN)/python
GPU_TEST_FLAGS ?= -q -rs -n 4 --dist loadgroup --timeout=300 -p no:cacheprovider
test-gpu: $(if $(filter $(BIN)/python,$(TEST_PYTHON)),$(STAMP))
	OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 $(TEST_PYTHON) -m pytest $(GPU_TEST_FLAGS) tests/gpu

# Python 3.12 wheels of what the GPU image lacks or holds at another version (docs/gpu.md: KINDS.md's list),
# carried to the GPU machine in .whl/ (git-ignored) and installed there by tools/gpu_check.sh.
GPU_WHEELS := timm==1.0.31 webdataset==1.0.2 braceexpand==0.1.7 setuptools==84.2.1
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl $(GPU_WHEELS)

# The prepared device check: the GPU suite, `structformer bench gpu`, the TF32 probe and a profile, in under
# 10 minutes
# (docs/gpu.md).
gpu-check:
	bash tools/gpu_check.sh

clean:
	rm -rf $(VENV) outputs .pytest_cache build structformer.egg-info   # build/lib: setuptools ships what it holds in the next wheel, removed modules too
