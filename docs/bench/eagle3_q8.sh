#!/usr/bin/env bash
# The all-data EAGLE-3 head against the shipped one, with q8 activations (issue 19, sixth part), on whatever CPU this
# runs (say which in the notes), nothing else running:
#  1. acceptance by depth on the all-data recipe's held-out split (holdout_acceptance.py, static
#     8, greedy, 128 tokens, float): the retrained head from runs/eagle3-general-all/drafter
#     (the "before" figures are docs/bench/results/2026-12-01-amd-epyc-zen3/holdout_acceptance/holdout_before.json, same split and settings);
#  2. plain, ngram and eagle3 (the shipped general head) under goodput, q8, MT-Bench batch 1
#     and HumanEval batch 1 (systems interleaved prompt by prompt), HF beside plain once;
#  3. eagle3 at fixed budgets 1, 2, 4 with q8 (what a drafted level costs and yields).
#
#   bash docs/bench/eagle3_q8.sh     # ~20 min on 2 cores; N, TOK, OUT, NEW override
set -euo pipefail
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh eagle3_q8)}
N=${N:-16}
TOK=${TOK:-64}
NEW=${NEW:-runs/eagle3-general-all/drafter}
BIN=${BIN:-.venv/bin/specdec}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
if [ -d "$NEW" ]; then
  "$PY" docs/bench/holdout_acceptance.py --recipe recipes/eagle3_smollm2_general_all.yaml \
    --drafter "eagle3=$NEW" --json "$OUT/holdout_after.json" > "$OUT/holdout_after.log" 2>&1
fi
"$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts "$N" --max-new-tokens "$TOK" \
  --repeats 1 --warmup 1 --batch-sizes 1 --drafters ngram,eagle3 --controllers goodput \
  --baseline plain --activations q8 --json "$OUT/mt_bench_q8.json" > "$OUT/mt_bench_q8.log" 2>&1
"$BIN" bench --dataset "$D/humaneval.jsonl.gz" --num-prompts "$N" --max-new-tokens "$TOK" \
  --repeats 1 --warmup 1 --batch-sizes 1 --drafters ngram,eagle3 --controllers goodput \
  --baseline plain --activations q8 --json "$OUT/humaneval_q8.json" > "$OUT/humaneval_q8.log" 2>&1
"$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts 8 --max-new-tokens "$TOK" \
  --repeats 1 --warmup 1 --batch-sizes 1 --drafters eagle3 \
  --controllers static:1,static:2,static:4,goodput --baseline plain --activations q8 \
  --json "$OUT/mt_bench_q8_static.json" > "$OUT/mt_bench_q8_static.log" 2>&1
