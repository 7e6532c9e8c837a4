#!/usr/bin/env bash
# Issue 8's numbers: the four drafters side by side (mtp, block_diffusion, eagle3, ngram), the
# plain engine and HF generate, on MT-Bench and HumanEval, batch 1, greedy, SmolLM2 fp32; each
# drafter under the goodput controller (what a user gets) and under a static 7-node budget (tau
# and acceptance by depth at equal size); then the draft time per step at equal depth.
#
#   N=12 TOK=96 bash docs/bench/learned_drafters.sh    # ~30 min on 2 cores
set -euo pipefail
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh learned_drafters)}
N=${N:-12}
TOK=${TOK:-96}
BIN=${BIN:-.venv/bin/specdec}
mkdir -p "$OUT"
for ds in mt_bench.jsonl humaneval.jsonl.gz; do
  name=${ds%%.*}
  "$BIN" bench --dataset "$D/$ds" --num-prompts "$N" --max-new-tokens "$TOK" --repeats 1 \
    --warmup 1 --batch-sizes 1 --drafters mtp,block_diffusion,eagle3,ngram \
    --controllers goodput,static:7 --baseline hf \
    --json "$OUT/${name}_b1.json" > "$OUT/${name}_b1.log" 2>&1
done
.venv/bin/python docs/bench/draft_cost.py --trained --json "$OUT/draft_cost.json" \
  > "$OUT/draft_cost.log" 2>&1
