#!/usr/bin/env bash
# The step budget of every drafter beside plain decoding (issue 31): for each activation mode
# (float, q8), drafter (ngram, eagle3, mtp, block_diffusion) and controller (static 1: a
# one-node step; static 8: an 8-node tree; eagle3 also a static chain 4 deep, for its draft share
# at depth 4; goodput: what serving runs), one `specdec bench` against plain decoding in the same
# run (prompts interleaved), MT-Bench, batch 1, greedy. Each run's JSON has its `step_budget`
# (ms per step by part and step kind, forward rows beside the physics); table.md puts the
# speculative steps side by side with the plain step of the same run.
#
# Run it from the repository root with the README's venv, nothing else heavy running:
#
#   bash docs/bench/step_budget.sh        # ~8 min on 2 cores; N, TOK, DATA, DRAFTERS, ACTS, OUT
#
# Writes to $OUT (default docs/bench/results/<date>-<cpu>/step_budget/): lscpu.txt,
# <drafter>_<controller>_<activations>.json / .log, and table.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh step_budget)}
N=${N:-6}
TOK=${TOK:-64}
BIN=${BIN:-.venv/bin/specdec}
PY=${PY:-.venv/bin/python}
DRAFTERS=${DRAFTERS:-ngram eagle3 mtp block_diffusion}
ACTS=${ACTS:-q8 float}
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt" 2>&1 || echo "Model name: unknown-cpu" > "$OUT/lscpu.txt"
run() {  # drafter, label, activations, extra args...
  local drafter=$1 label=$2 act=$3
  shift 3
  "$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts "$N" --max-new-tokens "$TOK" \
    --repeats 1 --warmup 1 --baseline plain --drafter "$drafter" --activations "$act" "$@" \
    --json "$OUT/${drafter}_${label}_${act}.json" > "$OUT/${drafter}_${label}_${act}.log" 2>&1
}
for act in $ACTS; do
  for drafter in $DRAFTERS; do
    run "$drafter" static1 "$act" --controller static --budget 1
    run "$drafter" static8 "$act" --controller static --budget 8
    run "$drafter" goodput "$act" --controller goodput
  done
  case " $DRAFTERS " in
    *" eagle3 "*) run eagle3 chain4 "$act" --controller static --budget 4 \
                    --drafter-args '{"depth": 4, "topk": 1}' ;;
  esac
done
"$PY" docs/bench/step_budget_table.py "$OUT" > "$OUT/table.md"
cat "$OUT/table.md"
