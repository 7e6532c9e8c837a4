#!/usr/bin/env bash
# Issue 21 (server, engine loop, load benchmark). Run from the repository root with the venv of
# the README (pip install -e ".[serve]" or ".[dev]"); nothing else heavy may run meanwhile.
set -euo pipefail
out=docs/bench/issue21
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
.venv/bin/python docs/bench/issue21_engine_side.py 2>/dev/null | tail -1 | tee "$out/engine_side.txt"
