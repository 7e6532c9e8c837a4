#!/usr/bin/env bash
# Every shipped drafter under goodput beside plain decoding, and what EAGLE-3's drafting costs
# (issue 19), on whatever CPU this runs (say which in the notes), nothing else running:
#  1. every shipped drafter and eagle3+ngram under the goodput controller beside plain decoding,
#     MT-Bench at batch 1, 8 and 32, HumanEval at batch 1 and 8 (sweeps: systems interleaved);
#  2. the code EAGLE-3 drafter against the general one on HumanEval at a fixed tree (static
#     budget 8, depth 6): tau and speed;
#  3. EAGLE-3's draft share at depth 6 with fp32 and with Q8_0 head weights (--draft-weights).
#
#   bash docs/bench/drafters_sweep.sh     # ~25 min on 2 cores; N, TOK, OUT override
set -euo pipefail
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh drafters_sweep)}
N=${N:-32}
TOK=${TOK:-64}
BIN=${BIN:-.venv/bin/specdec}
DRAFTERS=ngram,eagle3,mtp,block_diffusion,eagle3+ngram
mkdir -p "$OUT"
"$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts "$N" --max-new-tokens "$TOK" \
  --repeats 1 --warmup 1 --batch-sizes 1,8,32 --drafters "$DRAFTERS" --controllers goodput \
  --baseline plain --json "$OUT/mt_bench_sweep.json" > "$OUT/mt_bench_sweep.log" 2>&1
"$BIN" bench --dataset "$D/humaneval.jsonl.gz" --num-prompts 16 --max-new-tokens "$TOK" \
  --repeats 1 --warmup 1 --batch-sizes 1,8 --drafters "$DRAFTERS" --controllers goodput \
  --baseline plain --json "$OUT/humaneval_sweep.json" > "$OUT/humaneval_sweep.log" 2>&1
for variant in general code; do
  "$BIN" bench --dataset "$D/humaneval.jsonl.gz" --num-prompts 16 --max-new-tokens "$TOK" \
    --repeats 1 --warmup 1 --drafter eagle3 --drafter-args "{\"variant\": \"$variant\"}" \
    --controller static --budget 8 --baseline plain \
    --json "$OUT/humaneval_eagle3_${variant}_static8.json" \
    > "$OUT/humaneval_eagle3_${variant}_static8.log" 2>&1
done
for w in float q8_0; do
  "$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts 8 --max-new-tokens "$TOK" \
    --repeats 1 --warmup 1 --drafter eagle3 --controller static --budget 8 --draft-weights "$w" \
    --baseline plain --json "$OUT/mt_bench_eagle3_static8_$w.json" \
    > "$OUT/mt_bench_eagle3_static8_$w.log" 2>&1
done
