#!/usr/bin/env bash
# specdec serve: its TPOT overhead at batch 1 and plain / ngram under load (issue 21). Run from the repository root with the venv of
# the README (pip install -e ".[serve]" or ".[dev]"); nothing else heavy may run meanwhile.
set -euo pipefail
out=${OUT:-$(bash docs/bench/results_dir.sh serve)}
mkdir -p "$out"
lscpu | grep -E "Model name|^CPU\(s\)" > "$out/cpu.txt"
data=../shared/data/eval/mt_bench.jsonl
# the server's overhead at batch 1: one request at a time, against LLM.generate on the same prompts
.venv/bin/specdec bench-serve --dataset $data --num-prompts 16 --max-new-tokens 64 \
    --request-rates 0.25 --max-concurrency 1 --compare-generate \
    --json "$out/overhead.json" 2>"$out/overhead.log" | tee "$out/overhead.txt"
# plain and ngram under load: below, near and above saturation
.venv/bin/specdec bench-serve --dataset $data --num-prompts 16 --max-new-tokens 64 \
    --request-rates 0.25,1,4 --max-concurrency 16 --drafters none,ngram --slo-tpot-ms 60 \
    --json "$out/load.json" --plot "$out/load.png" 2>"$out/load.log" | tee "$out/load.txt"
# the server's TPOT cost at batch 1, engine-side and client-side, against LLM.generate in one run
.venv/bin/python docs/bench/serve_overhead.py 2>/dev/null | tail -1 | tee "$out/engine_side.txt"
