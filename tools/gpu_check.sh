#!/usr/bin/env bash
# The prepared device check (docs/gpu.md): on a lent GPU's image, from a fresh copy of the repository, in at most
# 10 minutes: install what the image lacks from the carried wheels (.whl/, `make gpu-wheels`), install the package,
# run the GPU suite (tests/gpu, at most 225 s), then `structformer bench gpu` (a 170-s budget, at most 195 s), then
# the TF32 probe (tools/gpu_tf32.py, at most 60 s) and a profile of eager training steps (tools/gpu_profile.py, at
# most 45 s), and leave in $OUT (flat, 8 files): env.txt, suite.log, junit.xml, bench.log, the bench's JSON record
# and its markdown, tf32.json, profile.json. Every step runs whatever the one before it did; the exit status is the
# suite's, else the bench's (the two probes' are printed, not returned).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-outputs/gpu_check}"
mkdir -p "$OUT"
PY="${PY:-python3}"
INSTALL="${INSTALL:-1}"            # 0: install nothing (a dry run of this script on a machine whose python is shared)
SUITE_S="${SUITE_S:-225}"          # the suite's wall-clock limit (its longest test, SOFT-T's export, took 173 s)
LAST_START_S="${LAST_START_S:-45}" # no test starts in the suite's last 45 s (skipped): it ends before the limit
BENCH_S="${BENCH_S:-170}"          # the bench's measuring budget; its process gets BENCH_EXIT_S more to write and exit
TF32_S="${TF32_S:-60}"             # tools/gpu_tf32.py's limit (what TF32 would change; docs/training.md)
PROFILE_S="${PROFILE_S:-45}"       # tools/gpu_profile.py's limit (where an eager step's time goes; docs/gpu.md)
# the grace after each limit: the suite's SIGINT gets SUITE_KILL_S to write its junit file, the bench BENCH_EXIT_S
# after its budget, then every step KILL_S before SIGKILL. The worst case, every step at its limit and grace, is
# WORST_S (570 s with these values): under the device call's 590 s, with the rest (installs, env.txt, the render)
# in the 20 s left (tests/test_gpu_check.py holds the defaults to it)
SUITE_KILL_S=15 BENCH_EXIT_S=25 KILL_S=10
WORST_S=$(( SUITE_S + SUITE_KILL_S + BENCH_S + BENCH_EXIT_S + KILL_S + TF32_S + KILL_S + PROFILE_S + KILL_S ))
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
start=$(date +%s)
say() { echo "[gpu-check +$(( $(date +%s) - start ))s] $*"; }
say "limits: suite ${SUITE_S} s, bench ${BENCH_S} s, TF32 ${TF32_S} s, profile ${PROFILE_S} s; worst case with the graces ${WORST_S} s"
[ "$WORST_S" -gt 580 ] && say "WARNING: a worst case of ${WORST_S} s can outrun a 590-s device call (keep it under 580 s)"

if [ "$INSTALL" = 0 ]; then
    say "INSTALL=0: nothing installed"
elif ls .whl/*.whl >/dev/null 2>&1; then
    say "installing the carried wheels: $(ls .whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
    say "no .whl/ carried: webdataset's tests skip, and the image's timm is used (make gpu-wheels; docs/gpu.md)"
fi
# the editable install; the source tree first on the path either way, so the code run is this copy's
if [ "$INSTALL" != 0 ]; then
    "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.txt" 2>&1 \
        || say "pip install -e . failed (see env.txt): running from the source tree"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

{
    nvidia-smi -L 2>&1
    "$PY" - <<'EOF'
import importlib, platform, torch
print('python', platform.python_version(), '| torch', torch.__version__, '| CUDA', torch.version.cuda,
      '| device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ('structformer', 'timm', 'webdataset', 'onnx', 'onnxscript', 'onnxruntime', 'safetensors', 'einops',
             'xdist', 'pytest_timeout', 'setuptools'):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')} {getattr(module, '__file__', '')}")
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {e}")
EOF
    cat "$OUT/install.txt" 2>/dev/null
} >"$OUT/env.txt" 2>&1
rm -f "$OUT/install.txt"
say "environment: $(head -2 "$OUT/env.txt" | tr '\n' ' ')"

say "GPU suite (at most ${SUITE_S} s)"
# tests not started by the deadline are skipped, so the suite normally ends by itself and reports every test
# (an interrupt under xdist can end in an INTERNALERROR without the junit file); SIGINT at the limit is the backstop
export STRUCTFORMER_GPU_SUITE_DEADLINE=$(( $(date +%s) + SUITE_S - LAST_START_S ))
timeout -s INT -k "$SUITE_KILL_S" "$SUITE_S" "$PY" -m pytest tests/gpu -q -rs -n 4 --dist loadgroup --timeout=230 \
    -p no:cacheprovider --junitxml="$OUT/junit.xml" >"$OUT/suite.log" 2>&1
suite=$?
tail -n 40 "$OUT/suite.log"
say "suite exit status $suite"

say "bench gpu (budget ${BENCH_S} s)"
# the record is the file the bench wrote after this stamp: by time, not by a name new to the folder (a record written
# over one of the same name, which the copy of the repository holds, is the run's record too)
stamp=$(mktemp)
timeout -k "$KILL_S" $(( BENCH_S + BENCH_EXIT_S )) "$PY" -m structformer bench gpu --budget-s "$BENCH_S" >"$OUT/bench.log" 2>&1
bench=$?
record=$(find docs/gpu -maxdepth 1 -name '*.json' -newer "$stamp" -printf '%T@ %p\n' 2>/dev/null | sort -n | tail -n 1 \
         | cut -d' ' -f2-)
rm -f "$stamp"
if [ -n "$record" ]; then
    cp "$record" "$OUT/"
    "$PY" -m structformer bench gpu --render "$record" >"$OUT/bench_gpu.md" 2>&1
fi
tail -n 60 "$OUT/bench.log"
say "bench exit status $bench"

say "TF32 probe (at most ${TF32_S} s; its exit status is reported, not returned)"
timeout -k "$KILL_S" "$TF32_S" "$PY" tools/gpu_tf32.py --output "$OUT/tf32.json" --budget-s $(( TF32_S - 20 ))
say "TF32 probe exit status $?"

say "profile of eager training steps (at most ${PROFILE_S} s; its exit status is reported, not returned)"
timeout -k "$KILL_S" "$PROFILE_S" "$PY" tools/gpu_profile.py --output "$OUT/profile.json" --budget-s $(( PROFILE_S - 20 )) \
    2>&1 | grep -v '^USDT:'
say "profile exit status ${PIPESTATUS[0]}; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[ "$suite" -ne 0 ] && exit "$suite"
exit "$bench"
