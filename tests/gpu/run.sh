#!/usr/bin/env bash
# Issue 10's GPU check: one prepared run on a CUDA machine (an H200 through the device tool),
# leaving its report under $OUT. Here first: `bash tests/gpu/fetch_wheels.sh` (flashinfer has to
# travel as a wheel); then, through the device tool, with `.whl` carried:
#     bash tests/gpu/run.sh
# It installs flashinfer and specdec offline, compiles flashinfer's kernels in parallel
# (warm_jit.py), runs tests/gpu (flashinfer and flex against the
# torch backend, CUDA-graph replay against eager, greedy speculation against plain, seeded
# sampling) and then tests/gpu/bench_gpu.py (speed). Each phase has its own time limit; what a
# phase measured is in $OUT even if a later one fails. $OUT: run.log (phases and their times),
# env.txt, jit.log, gpu-tests.log (with every test's seconds), checks.jsonl (errors and match
# rates the tests measured), bench.json + bench.md + bench.log: 8 files, what the device tool
# brings back at most.
# PHASES ("jit tests bench" by default; "bench" alone on a rerun on a warm machine), JIT_TIMEOUT
# / TESTS_TIMEOUT / BENCH_TIMEOUT (seconds; 240 / 300 / 200 by default: the JIT phase compiles
# what the tests then find built, so install + all three fit one 600 s device call) and
# BENCH_ARGS (e.g. --quick, or --shapes smollm2-135m) adjust it.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/specdec-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPECDEC_GPU_REPORT="$OUT/checks.jsonl" MAX_JOBS=16
START=$(date +%s)
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$OUT/run.log"; }

{ nvidia-smi; python3 -V; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/env.txt" 2>&1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >> "$OUT/run.log" 2>&1 && export PYTHONPATH=/tmp/site
else
  log "no .whl/ carried: flashinfer tests will be skipped (bash tests/gpu/fetch_wheels.sh here)"
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$OUT/run.log" 2>&1 \
  || log "pip install -e . failed (see above)"
log "flashinfer: $(python3 -c 'import flashinfer; print(flashinfer.__version__)' 2>&1 | tail -1)"

PHASES=${PHASES:-jit tests bench}
if [[ " $PHASES " == *" jit "* ]]; then
  log "flashinfer JIT: start"
  timeout "${JIT_TIMEOUT:-240}" python3 tests/gpu/warm_jit.py > "$OUT/jit.log" 2>&1
  log "flashinfer JIT: exit $? ($(tail -n 1 "$OUT/jit.log"))"
fi
if [[ " $PHASES " == *" tests "* ]]; then
  log "tests/gpu: start"
  # only the GPU tests (the CPU dry run and the rehearsal are CI's), each named as it runs and
  # under its own limit; the smoke test (LLM on the device) is the file's first
  timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest tests/gpu/test_gpu.py -v -rA \
    -p no:cacheprovider --timeout="${TEST_TIMEOUT:-120}" --durations=0 \
    > "$OUT/gpu-tests.log" 2>&1
  log "tests/gpu: exit $? ($(tail -n 1 "$OUT/gpu-tests.log"))"
fi
if [[ " $PHASES " == *" bench "* ]]; then
  log "bench: start"
  timeout "${BENCH_TIMEOUT:-200}" python3 tests/gpu/bench_gpu.py --out "$OUT" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  log "bench: exit $?"
fi

grep -E "passed|failed|error|PASSED|FAILED|ERROR" "$OUT/gpu-tests.log" | tail -n 40
cat "$OUT/checks.jsonl" 2>/dev/null
head -n 12 "$OUT/bench.md" 2>/dev/null
tail -n 5 "$OUT/bench.log"
