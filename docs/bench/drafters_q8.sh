#!/usr/bin/env bash
# Every shipped drafter with q8 activations (issue 19, seventh part): the all-data MTP and block-diffusion drafters, the code EAGLE-3 head
# fine-tuned from the all-data general one, and the q8 kernels with VNNI, measured on whatever
# CPU this runs (say which in the notes), nothing else running:
#  1. acceptance by depth on the all-data recipes' held-out split (holdout_acceptance.py, static
#     8, greedy, 128 tokens, float): the earlier mtp / block-diffusion heads (in $BEFORE, default
#     the shipped ones) against the retrained ones in runs/ (whichever exist);
#  2. the code EAGLE-3 head (shipped, and the retrained one in runs/ if there) against the
#     general one on HumanEval at a fixed tree (static 8): tau by depth;
#  3. T(rows) of the target forward with q8 activations, AVX2 kernels vs this CPU's widest;
#  4. plain and every shipped drafter under goodput with q8 activations, MT-Bench batch 1 and 8,
#     HumanEval batch 1 (systems interleaved prompt by prompt);
#  5. eagle3 and mtp at fixed budgets 1, 2, 4 with q8 (what a node costs and yields).
#
#   bash docs/bench/drafters_q8.sh     # ~30 min on 2 cores; N, TOK, OUT, SKIP (e.g. "1 2") override
set -euo pipefail
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh drafters_q8)}
N=${N:-16}
TOK=${TOK:-64}
BIN=${BIN:-.venv/bin/specdec}
PY=${PY:-.venv/bin/python}
SKIP=" ${SKIP:-} "
SHIP=drafters/shipped
mkdir -p "$OUT"
if [[ "$SKIP" != *" 1 "* ]]; then
  for kind in mtp block_diffusion; do
    name=${kind//_/-}-smollm2-135m-instruct-general
    args=(--drafter "$kind=${BEFORE:-$SHIP}/$name")
    [ -d "runs/${kind//_/-}-general-all/drafter" ] && \
      args+=(--drafter "$kind=runs/${kind//_/-}-general-all/drafter")
    "$PY" docs/bench/holdout_acceptance.py --recipe recipes/eagle3_smollm2_general_all.yaml \
      "${args[@]}" --json "$OUT/holdout_$kind.json" > "$OUT/holdout_$kind.log" 2>&1
  done
fi
if [[ "$SKIP" != *" 2 "* ]]; then
  heads=(general:"$SHIP/eagle3-smollm2-135m-instruct-general"
         code_shipped:"$SHIP/eagle3-smollm2-135m-instruct-code")
  [ -d runs/eagle3-code/drafter ] && heads+=(code_new:runs/eagle3-code/drafter)
  for h in "${heads[@]}"; do
    "$BIN" bench --dataset "$D/humaneval.jsonl.gz" --num-prompts "$N" --max-new-tokens "$TOK" \
      --repeats 1 --warmup 1 --drafter eagle3 --drafter-args "{\"path\": \"${h#*:}\"}" \
      --controller static --budget 8 --baseline plain \
      --json "$OUT/humaneval_eagle3_${h%%:*}_static8.json" \
      > "$OUT/humaneval_eagle3_${h%%:*}_static8.log" 2>&1
  done
fi
if [[ "$SKIP" != *" 3 "* ]]; then
  for isa in avx2 widest avx2 widest; do
    if [ "$isa" = avx2 ]; then cap=(env SPECDEC_NATIVE_ISA=avx2); else cap=(env); fi
    echo "== $isa" >> "$OUT/forward_rows.log"
    "${cap[@]}" "$PY" docs/bench/forward_rows.py --configs float32:invariant:native:q8 \
      --rounds 1 >> "$OUT/forward_rows.log" 2>&1
  done
fi
if [[ "$SKIP" != *" 4 "* ]]; then
  DRAFTERS=ngram,eagle3,mtp,block_diffusion,eagle3+ngram
  "$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts "$N" --max-new-tokens "$TOK" \
    --repeats 1 --warmup 1 --batch-sizes 1,8 --drafters "$DRAFTERS" --controllers goodput \
    --baseline plain --activations q8 --json "$OUT/mt_bench_q8.json" > "$OUT/mt_bench_q8.log" 2>&1
  "$BIN" bench --dataset "$D/humaneval.jsonl.gz" --num-prompts "$N" --max-new-tokens "$TOK" \
    --repeats 1 --warmup 1 --batch-sizes 1 --drafters "$DRAFTERS" --controllers goodput \
    --baseline plain --activations q8 --json "$OUT/humaneval_q8.json" > "$OUT/humaneval_q8.log" 2>&1
fi
if [[ "$SKIP" != *" 5 "* ]]; then
  "$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts 8 --max-new-tokens "$TOK" \
    --repeats 1 --warmup 1 --batch-sizes 1 --drafters eagle3,mtp \
    --controllers static:1,static:2,static:4,goodput --baseline plain --activations q8 \
    --json "$OUT/mt_bench_q8_static.json" > "$OUT/mt_bench_q8_static.log" 2>&1
fi
