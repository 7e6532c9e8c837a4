#!/usr/bin/env bash
# specdec plain and ngram against HF generate and HF prompt lookup, MT-Bench and HumanEval at
# batch 1, plain at batch 8 (docs/benchmarks.md, "Earlier numbers"; ~25 minutes on 2 cores).
set -euo pipefail
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh ngram_vs_hf)}
mkdir -p "$OUT"
specdec bench --dataset $D/mt_bench.jsonl --num-prompts 16 --max-new-tokens 128 --batch-size 1 \
  --baseline hf --extra-baseline hf-pld --drafter ngram --repeats 1 --warmup 1 --json $OUT/mtbench_ngram_b1.json
specdec bench --dataset $D/humaneval.jsonl.gz --num-prompts 16 --max-new-tokens 128 --batch-size 1 \
  --baseline hf --extra-baseline hf-pld --drafter ngram --repeats 1 --warmup 1 --json $OUT/humaneval_ngram_b1.json
specdec bench --dataset $D/mt_bench.jsonl --num-prompts 16 --max-new-tokens 128 --batch-size 8 \
  --baseline hf --repeats 1 --warmup 1 --json $OUT/mtbench_plain_b8.json
