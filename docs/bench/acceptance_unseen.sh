#!/usr/bin/env bash
# Acceptance by depth on prompts the drafters never saw (issue 31, item 6): every shipped drafter
# and ngram, greedy, static 1 node (tau - 1 = depth-1 acceptance = top-1 agreement with the
# target) and a static 8-node tree, q8 activations, 64 new tokens, on
#  1. MT-Bench, first turns, all 80;
#  2. HumanEval, all 164;
#  3. the general recipes' held-out split (24 conversations) at the same settings, beside the
#     drafters' own eval.json (float, 128 tokens, 8 nodes);
#  4. the code recipe's held-out split (12 conversations).
# Acceptance only, no timing (holdout_acceptance.py), so a busy CPU changes nothing but the
# wall time. Per-step records (--steps-json) give acceptance by category, position and prompt
# length.
#
#   bash docs/bench/acceptance_unseen.sh    # ~25 min on 2 cores; OUT, TOK, N override
set -euo pipefail
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh acceptance)}
TOK=${TOK:-64}
N=${N:+--num-prompts $N}
S=drafters/shipped
G=eagle3=$S/eagle3-smollm2-135m-instruct-general
C=eagle3=$S/eagle3-smollm2-135m-instruct-code
M=mtp=$S/mtp-smollm2-135m-instruct-general
B=block_diffusion=$S/block-diffusion-smollm2-135m-instruct-general
ALL=(--drafter ngram --drafter $G --drafter $C --drafter $M --drafter $B)
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
run() {  # name, then the script's arguments
  local name=$1; shift
  echo "== $name: .venv/bin/python docs/bench/holdout_acceptance.py $* --budgets 1,8 --max-tokens $TOK --activations q8 --json $OUT/$name.json --steps-json $OUT/${name}_steps.json" | tee -a "$OUT/commands.log"
  .venv/bin/python docs/bench/holdout_acceptance.py "$@" --budgets 1,8 --max-tokens "$TOK" \
    --activations q8 --json "$OUT/$name.json" --steps-json "$OUT/${name}_steps.json" \
    2>&1 | grep -v '^\s*$' | tee "$OUT/$name.log"
}
run mt_bench --dataset $D/mt_bench.jsonl $N "${ALL[@]}"
run humaneval --dataset $D/humaneval.jsonl.gz $N "${ALL[@]}"
run holdout_general --recipe recipes/eagle3_smollm2_general_all.yaml "${ALL[@]}"
run holdout_code --recipe recipes/eagle3_smollm2_code.yaml --drafter ngram --drafter $G --drafter $C
