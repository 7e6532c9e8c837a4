#!/usr/bin/env bash
# The GPU check: one prepared run on a CUDA machine (an H200 through the device tool), leaving
# its report under $OUT. Here first: `bash tests/gpu/fetch_wheels.sh` (flashinfer and gguf travel
# as wheels) and, for the real model, `bash tests/gpu/stage_real.sh` (.gpu/: SmolLM2's GGUF folder
# and MT-Bench's prompts); then, through the device tool, with `.whl` (and `.gpu`) carried:
#     bash tests/gpu/run.sh
# Phases, each under its own time limit, each leaving what it measured in $OUT even if a later
# one fails:
#   jit    flashinfer's kernels compiled in parallel and the Triton kernels for the bench's
#          shapes (warm_jit.py)
#   tests  the GPU tests, a smoke test (LLM on the device) first, -v, a limit per test
#          (tests/gpu/test_gpu.py, tests/kernels, tests/attention/test_invariant_backend.py)
#   bench  tests/gpu/bench_gpu.py: random weights in real shapes (bench.json, bench.md)
#   real   (optional: PHASES="real", a call of its own) SmolLM2-135M-Instruct itself (if .gpu/
#          came): `specdec bench` on MT-Bench, plain and ngram / suffix / eagle3 under
#          goodput, batch 1 and 8, outputs against plain
# The default call (jit tests bench) fits 9 minutes on a fresh machine: BUDGET (540 s) bounds
# the whole run, and each phase gets the smaller of its own limit and what is left of it, so a
# slow phase shortens the next instead of running the call past the device tool's 600 s.
# $OUT (8 files, what the device tool brings back at most): run.log (machine, phases, seconds,
# JIT times), gpu-tests.log, checks.jsonl (what the tests measured), bench.json, bench.md,
# bench.log, real.json, real.log.
# PHASES ("jit tests bench" by default), TESTS_K (pytest -k: a subset of the tests),
# JIT_TIMEOUT / TESTS_TIMEOUT / TEST_TIMEOUT /
# BENCH_TIMEOUT / REAL_TIMEOUT (seconds), BENCH_ARGS (e.g. --quick, --shapes smollm2-135m) and
# REAL_ARGS (e.g. "--num-prompts 8") adjust it.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/specdec-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SPECDEC_GPU_REPORT="$OUT/checks.jsonl" MAX_JOBS=16
START=$(date +%s)
log() { echo "[$(($(date +%s) - START)) s] $*" | tee -a "$OUT/run.log"; }
BUDGET=${BUDGET:-540}
# a phase's limit: its own, or what is left of BUDGET (10 s kept for the report), whichever is less
limit() { local left=$((BUDGET - ($(date +%s) - START) - 10)); echo $(( $1 < left ? $1 : (left > 1 ? left : 1) )); }

{ nvidia-smi; python3 -V; python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"; } >> "$OUT/run.log" 2>&1
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
  log "JIT: start"
  timeout "$(limit "${JIT_TIMEOUT:-120}")" python3 tests/gpu/warm_jit.py >> "$OUT/run.log" 2>&1
  log "JIT: exit $?"
fi
if [[ " $PHASES " == *" tests "* ]]; then
  log "tests: start"
  # only the GPU tests (the CPU dry run and the rehearsal are CI's), each named as it runs and
  # under its own limit; the smoke test (LLM on the device) is test_gpu.py's first
  timeout "$(limit "${TESTS_TIMEOUT:-220}")" python3 -m pytest tests/gpu/test_gpu.py tests/kernels \
    tests/attention/test_invariant_backend.py -v -rA -p no:cacheprovider \
    --timeout="${TEST_TIMEOUT:-60}" --durations=15 ${TESTS_K:+-k "$TESTS_K"} \
    > "$OUT/gpu-tests.log" 2>&1
  log "tests: exit $? ($(tail -n 1 "$OUT/gpu-tests.log"))"
fi
if [[ " $PHASES " == *" bench "* ]]; then
  log "bench: start"
  timeout "$(limit "${BENCH_TIMEOUT:-170}")" python3 tests/gpu/bench_gpu.py --out "$OUT" ${BENCH_ARGS:-} \
    > "$OUT/bench.log" 2>&1
  log "bench: exit $?"
fi
if [[ " $PHASES " == *" real "* ]]; then
  if [[ ! -d .gpu/cache/models ]] && ls .gpu/p*/part.* > /dev/null 2>&1; then
    bash tests/gpu/stage_real.sh join >> "$OUT/run.log" 2>&1
  fi
  if [[ -f .gpu/meta/mt_bench.jsonl && -d .gpu/cache/models ]]; then
    log "real: start"
    SPECDEC_CACHE=$PWD/.gpu/cache timeout "$(limit "${REAL_TIMEOUT:-300}")" python3 -m specdec.cli bench \
      --model smollm2-135m-instruct --device cuda --dataset .gpu/meta/mt_bench.jsonl \
      --num-prompts 16 --max-new-tokens 128 --repeats 1 --warmup 1 --batch-sizes 1,8 \
      --drafters ngram,suffix,eagle3 --controllers goodput --baseline plain \
      --json "$OUT/real.json" ${REAL_ARGS:-} > "$OUT/real.log" 2>&1
    log "real: exit $?"
  else
    log "real: skipped (no .gpu/: bash tests/gpu/stage_real.sh here)"
  fi
fi

grep -E "passed|failed|error|PASSED|FAILED|ERROR" "$OUT/gpu-tests.log" | tail -n 40
cat "$OUT/checks.jsonl" 2>/dev/null
head -n 16 "$OUT/bench.md" 2>/dev/null
tail -n 5 "$OUT/bench.log" "$OUT/real.log" 2>/dev/null
