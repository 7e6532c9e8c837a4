#!/usr/bin/env bash
# Prefix caching and the disk tier (issue 20): with vs without the cache, side by side in one
# run per workload. Run from the repository root with the venv of the README; nothing else heavy
# may run meanwhile. ~7 min on 2 cores.
set -euo pipefail
out=${OUT:-$(bash docs/bench/results_dir.sh prefix)}
mkdir -p "$out"
lscpu | grep -E "Model name|^CPU\(s\)" > "$out/cpu.txt"
.venv/bin/specdec bench-prefix --dataset ../shared/data/eval/mt_bench.jsonl --num-prompts 16 \
    --max-new-tokens 128 --repeats 5 --json "$out/prefix.json" 2>"$out/prefix.log" | tee "$out/prefix.txt"
# the no-hit comparison again with more repeats (this machine's run-to-run spread is ~±7 %)
.venv/bin/specdec bench-prefix --dataset ../shared/data/eval/mt_bench.jsonl --num-prompts 16 \
    --max-new-tokens 128 --repeats 9 --workloads nohit --json "$out/nohit.json" 2>"$out/nohit.log" | tee "$out/nohit.txt"
# the cache's own bookkeeping, timed inside the engine
.venv/bin/python docs/bench/prefix_overhead.py 2>/dev/null | grep batch | tee "$out/overhead.txt"
