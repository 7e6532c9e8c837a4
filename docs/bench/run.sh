#!/usr/bin/env bash
# Reproduce the numbers in README.md / docs/benchmarks.md (CPU, ~25 minutes on 2 cores).
set -euo pipefail
D=${DATA:-../shared/data/eval}
OUT=${OUT:-docs/bench}
specdec bench --dataset $D/mt_bench.jsonl --num-prompts 16 --max-new-tokens 128 --batch-size 1 \
  --baseline hf --extra-baseline hf-pld --drafter ngram --repeats 1 --warmup 1 --json $OUT/mtbench_ngram_b1.json
specdec bench --dataset $D/humaneval.jsonl.gz --num-prompts 16 --max-new-tokens 128 --batch-size 1 \
  --baseline hf --extra-baseline hf-pld --drafter ngram --repeats 1 --warmup 1 --json $OUT/humaneval_ngram_b1.json
specdec bench --dataset $D/mt_bench.jsonl --num-prompts 16 --max-new-tokens 128 --batch-size 8 \
  --baseline hf --repeats 1 --warmup 1 --json $OUT/mtbench_plain_b8.json
