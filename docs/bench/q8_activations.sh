#!/usr/bin/env bash
# 8-bit activations over the GGUF's blocks (--activations q8), measured on
# whatever CPU this runs (say which in the notes), nothing else running:
#  1. T(rows) of the target forward, q8 vs float activations (docs/bench/forward_rows.py);
#  2. plain decoding and every shipped drafter under goodput with q8 activations, MT-Bench at
#     batch 1 and 8, HumanEval at batch 1 (sweeps: systems interleaved), plus float plain and
#     float ngram beside them (one more sweep, same prompts);
#  3. EAGLE-3 and MTP at fixed budgets 1, 2, 4 with q8 (what a drafted level costs and yields).
#
#   bash docs/bench/q8_activations.sh     # ~20 min on 2 cores; N, TOK, OUT override
set -euo pipefail
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh q8_activations)}
N=${N:-16}
TOK=${TOK:-64}
BIN=${BIN:-.venv/bin/specdec}
PY=${PY:-.venv/bin/python}
DRAFTERS=ngram,eagle3,mtp,block_diffusion
mkdir -p "$OUT"
"$PY" docs/bench/forward_rows.py --configs float32:invariant:native:q8,float32:invariant:native \
  --rounds 2 --json "$OUT/forward_rows.json" > "$OUT/forward_rows.log" 2>&1
"$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts "$N" --max-new-tokens "$TOK" \
  --repeats 1 --warmup 1 --batch-sizes 1,8 --drafters "$DRAFTERS" --controllers goodput \
  --baseline plain --activations q8 --json "$OUT/mt_bench_q8.json" > "$OUT/mt_bench_q8.log" 2>&1
"$BIN" bench --dataset "$D/humaneval.jsonl.gz" --num-prompts "$N" --max-new-tokens "$TOK" \
  --repeats 1 --warmup 1 --batch-sizes 1 --drafters "$DRAFTERS" --controllers goodput \
  --baseline plain --activations q8 --json "$OUT/humaneval_q8.json" > "$OUT/humaneval_q8.log" 2>&1
for act in float q8; do
  "$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts "$N" --max-new-tokens "$TOK" \
    --repeats 1 --warmup 1 --batch-sizes 1 --drafters ngram --controllers goodput \
    --baseline hf --activations "$act" --json "$OUT/mt_bench_plain_$act.json" \
    > "$OUT/mt_bench_plain_$act.log" 2>&1
done
"$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts 8 --max-new-tokens "$TOK" \
  --repeats 1 --warmup 1 --batch-sizes 1 --drafters eagle3,mtp \
  --controllers static:1,static:2,static:4,goodput --baseline plain --activations q8 \
  --json "$OUT/mt_bench_q8_static.json" > "$OUT/mt_bench_q8_static.log" 2>&1
