#!/usr/bin/env bash
# Where a bench script writes its outputs: docs/bench/results/<YYYY-MM-DD>-<cpu>/<what>, <cpu> a
# slug of lscpu's model name (CPU=... overrides it). Every script here calls it for its default
# OUT, so a run never overwrites an earlier machine's figures:
#
#   OUT=$(bash docs/bench/results_dir.sh prefix)   # docs/bench/results/2026-12-03-amd-epyc/prefix
#
# Quick form (the test suite's, tests/bench/test_bench_scripts.py): as it is, `results_dir.sh quick`.
set -euo pipefail
what=${1:?usage: results_dir.sh WHAT}
model=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1 || true)
slug=$(printf '%s' "${CPU:-${model:-unknown-cpu}}" | tr 'A-Z' 'a-z' \
  | sed -E 's/\((r|tm)\)//g; s/ (cpu|processor)( .*)?$//; s/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
echo "docs/bench/results/$(date +%F)-${slug:-unknown-cpu}/$what"
