#!/usr/bin/env bash
# The numbers of docs/benchmarks.md "Learned drafters and the goodput controller": one process
# per run, every system of a run on the same prompts, interleaved (specdec bench's method).
#
#   N=12 TOK=96 bash docs/bench/controllers_sweep.sh    # ~30 min on 2 cores
#
# 1. MT-Bench, batch 1: the shipped general EAGLE-3 drafter and ngram (goodput controller),
#    the plain engine and HF generate.
# 2. HumanEval, batch 1: the general and the code drafter (two runs, each with plain beside it).
# 3. The controller sweeps: eagle3 and ngram at batch sizes 1, 8, 24, static budgets
#    0/2/4/8/16 vs goodput, HF at batch 1.
set -euo pipefail
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh controllers_sweep)}
N=${N:-16}
TOK=${TOK:-128}
BIN=${BIN:-.venv/bin/specdec}
mkdir -p "$OUT"
common=(--num-prompts "$N" --max-new-tokens "$TOK" --repeats 1 --warmup 1)
"$BIN" bench --dataset "$D/mt_bench.jsonl" "${common[@]}" --batch-sizes 1 \
  --drafters eagle3,ngram --controllers goodput --baseline hf \
  --json "$OUT/mtbench_b1.json" > "$OUT/mtbench_b1.log" 2>&1
for variant in general code; do
  "$BIN" bench --dataset "$D/humaneval.jsonl.gz" "${common[@]}" --drafter eagle3 \
    --drafter-args "{\"variant\": \"$variant\"}" --baseline plain \
    --json "$OUT/humaneval_eagle3_$variant.json" > "$OUT/humaneval_eagle3_$variant.log" 2>&1
done
for drafter in eagle3 ngram; do
  "$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts "${SWEEP_N:-24}" \
    --max-new-tokens "${SWEEP_TOK:-32}" --repeats 1 --warmup 1 --drafter "$drafter" \
    --batch-sizes "${SWEEP_BS:-1,8,24}" \
    --controllers static:0,static:2,static:4,static:8,static:16,goodput \
    --json "$OUT/sweep_$drafter.json" --plot "$OUT/sweep_$drafter.png" > "$OUT/sweep_$drafter.log" 2>&1
done
