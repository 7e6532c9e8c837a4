#!/usr/bin/env bash
# Real model shapes beside llama.cpp (issue 35, item 4 and its Performance section): GGUFs of the
# SmolLM2-1.7B shape (Q4_K_M, Q8_0, and Q4_1: the 135M file's mix) and of a Llama-3-8B shape
# (Q4_K_M, when memory allows), random weights and SmolLM2's tokenizer (docs/bench/shape_gguf.py),
# and for each file, batch 1, greedy, the same threads everywhere:
#  1. cold start (empty cache, file out of the page cache) and warm start in fresh processes:
#     seconds to ready, peak RSS against file + KV, time to first token (cold_start.py);
#  2. plain decode: `specdec bench` (q8 and float activations) beside llama.cpp on the same file
#     through llama-cpp-python (--baseline llama.cpp) if importable, and beside `llama-bench`
#     tg128 (tg128.py: the two alternating round by round) if it is on PATH;
#  3. T(rows) of the forward beside the memory- and compute-bound times (forward_rows.py);
#  4. the oracle drafter at tau = 1.5, 2, 3 (a chain of 4) and 1.5, 1.8 (depth 1) beside plain
#     (oracle_speedup.py): what speculation can give at that size on this CPU.
#
# Run it from the repository root with the README's venv, nothing else heavy running:
#
#   bash docs/bench/real_shapes.sh    # SHAPES, THREADS, N, TOK, ACTS, MODELS, OUT override
#
# SHAPES: "name:ftype ..." (default: smollm2-1.7b at q4_k_m, q5_k_m, q8_0 and q4_1, then llama3-8b at
# q4_k_m, which is skipped unless MemAvailable holds 2.5 x its 4.5 GB: plain + oracle engines).
# The model files go to $MODELS (default runs/shapes/, ignored by git; ~3.9 GB for the 1.7B
# ones, 4.5 GB for the 8B one; shape_gguf.py refuses when the disk lacks room) and are reused
# when present. The engine takes the .gguf itself (a loader that reads a GGUF as it is), as
# llama.cpp does.
# Writes to $OUT (default docs/bench/results/<date>-<cpu>/real_shapes/): lscpu.txt, and per
# file <name>_<ftype>/{cold_start,bench_<acts>,tg128,forward_rows,oracle_<acts>,oracle_depth1_<acts>}.json/.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh real_shapes)}
MODELS=${MODELS:-runs/shapes}
SHAPES=${SHAPES:-smollm2-1.7b:q4_k_m smollm2-1.7b:q5_k_m smollm2-1.7b:q8_0 smollm2-1.7b:q4_1 llama3-8b:q4_k_m}
THREADS=${THREADS:-$(nproc)}
N=${N:-4}
TOK=${TOK:-64}
ACTS=${ACTS:-q8 float}
BIN=${BIN:-.venv/bin/specdec}
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=$THREADS  # torch's threads, and llama-cpp-python's (it takes torch's)
mkdir -p "$OUT" "$MODELS"
lscpu > "$OUT/lscpu.txt" 2>&1 || true
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
failed=0
step() {  # name, log, command...: run it; on failure say so and go on with the next step
  local name=$1 log=$2
  shift 2
  echo "  $name" >&2
  "$@" > "$log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "  $name FAILED (exit $rc): tail of $log:" >&2
    tail -5 "$log" >&2
    failed=$((failed + 1))
  fi
}
mem_available() { awk '/^MemAvailable:/ {print $2 * 1024}' /proc/meminfo; }

for entry in $SHAPES; do
  shape=${entry%%:*}
  ftype=${entry##*:}
  name=${shape}_${ftype}
  dir=$OUT/$name
  mkdir -p "$dir"
  echo "== $name ($THREADS threads)" >&2
  model=$MODELS/$name.gguf
  gguf=$model
  if [ "$shape" = llama3-8b ] && [ "$(mem_available)" -lt 12000000000 ]; then
    echo "  skipped: $(($(mem_available) >> 30)) GiB available, an 8B Q4_K_M run needs ~12" >&2
    continue
  fi
  if [ ! -f "$gguf" ]; then
    step "write $name" "$dir/shape_gguf.log" \
      "$PY" docs/bench/shape_gguf.py --shape "$shape" --ftype "$ftype" --out "$model"
    [ -f "$gguf" ] || continue
  fi
  step "cold start" "$dir/cold_start.log" \
    "$PY" docs/bench/cold_start.py --model "$model" --activations q8 --json "$dir/cold_start.json"
  baseline=none
  if "$PY" -c "import llama_cpp" 2>/dev/null; then baseline=llama.cpp; fi
  for act in $ACTS; do
    step "specdec bench $act vs $baseline" "$dir/bench_$act.log" \
      "$BIN" bench --model "$model" --dataset "$D/mt_bench.jsonl" --num-prompts "$N" \
      --max-new-tokens "$TOK" --repeats 2 --warmup 1 --baseline "$baseline" \
      --activations "$act" --json "$dir/bench_$act.json"
  done
  if command -v llama-bench > /dev/null; then
    step "tg128 beside llama-bench" "$dir/tg128.log" \
      "$PY" docs/bench/tg128.py --model "$model" --threads "$THREADS" --rounds 3 \
      --activations "${ACTS// /,}" --json "$dir/tg128.json"
  fi
  step "forward rows" "$dir/forward_rows.log" \
    "$PY" docs/bench/forward_rows.py --model "$model" --rows 1,2,4,8,16 --rounds 1 \
    --configs float32:invariant:native:q8,float32:invariant:native --json "$dir/forward_rows.json"
  for act in $ACTS; do
    step "oracle tau 1.5,2,3 ($act)" "$dir/oracle_$act.log" \
      "$PY" docs/bench/oracle_speedup.py --model "$model" --activations "$act" \
      --taus 1.5,2,3 --depth 4 --num-prompts "$N" --max-new-tokens "$TOK" \
      --dataset "$D/mt_bench.jsonl" --json "$dir/oracle_$act.json"
    step "oracle tau 1.5,1.8 depth 1 ($act)" "$dir/oracle_depth1_$act.log" \
      "$PY" docs/bench/oracle_speedup.py --model "$model" --activations "$act" \
      --taus 1.5,1.8 --depth 1 --num-prompts "$N" --max-new-tokens "$TOK" \
      --dataset "$D/mt_bench.jsonl" --json "$dir/oracle_depth1_$act.json"
  done
done
echo "outputs in $OUT; $failed step(s) failed" >&2
exit $((failed > 0))
