#!/usr/bin/env bash
# llama.cpp beside the engine on the same GGUF, with what decides the race (issues 17 and 18),
# on whatever CPU this runs (say which in the notes):
#  1. T(rows) of the target forward per weights / kernels / dtype beside the memory- and
#     compute-bound times (docs/bench/forward_rows.py);
#  2. every drafter under the goodput controller, MT-Bench and HumanEval, batch 1 and 8, against
#     the plain engine and HF generate in the same run (a sweep: all systems interleaved);
#  3. llama.cpp (llama-cpp-python, if installed: see specdec/bench/llamacpp.py) on the same GGUF,
#     plain and with its prompt lookup, beside the plain engine and ngram.
#
#   bash docs/bench/llamacpp.sh     # ~40 min on 2 cores; N, TOK, OUT override
set -euo pipefail
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh llamacpp)}
N=${N:-8}
TOK=${TOK:-64}
BIN=${BIN:-.venv/bin/specdec}
mkdir -p "$OUT"
.venv/bin/python docs/bench/forward_rows.py --json "$OUT/forward_rows.json" \
  > "$OUT/forward_rows.log" 2>&1
for ds in mt_bench.jsonl humaneval.jsonl.gz; do
  name=${ds%%.*}
  "$BIN" bench --dataset "$D/$ds" --num-prompts "$N" --max-new-tokens "$TOK" --repeats 1 \
    --warmup 1 --batch-sizes 1,8 --drafters ngram,eagle3,mtp,block_diffusion \
    --controllers goodput --baseline hf --json "$OUT/${name}_sweep.json" \
    > "$OUT/${name}_sweep.log" 2>&1
done
if .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
  "$BIN" bench --dataset "$D/mt_bench.jsonl" --num-prompts "$N" --max-new-tokens 128 \
    --repeats 2 --warmup 1 --drafter ngram --baseline llama.cpp --extra-baseline llama.cpp-pld \
    --json "$OUT/llama_cpp_mt_bench.json" > "$OUT/llama_cpp_mt_bench.log" 2>&1
fi
