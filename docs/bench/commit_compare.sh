#!/usr/bin/env bash
# Side by side against an earlier commit: the same `specdec bench` runs from two checkouts,
# alternating old/new run by run, each run measuring HF `generate` in its own process so that
# ratios to HF are comparable across the two. Numbers: docs/benchmarks.md.
#
#   OLD=3534faf bash docs/bench/commit_compare.sh        # ~15 min on 2 cores
#
# The old commit gets a git worktree and venv under /tmp (torch from the same local wheel).
set -euo pipefail
OLD=${OLD:-3534faf}
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh commit_compare)}
N=${N:-8}
TOK=${TOK:-128}
WT=/tmp/specdec_old
mkdir -p "$OUT"
if [ ! -d "$WT" ]; then
  git worktree add -f "$WT" "$OLD"
  (cd "$WT" && python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e .)
fi
NEW_BIN=${NEW_BIN:-.venv/bin/specdec}
run() {  # $1 label, $2 specdec binary, rest: bench args
  local label=$1 bin=$2; shift 2
  "$bin" bench --num-prompts "$N" --max-new-tokens "$TOK" --repeats 1 --warmup 1 \
    --json "$OUT/$label.json" "$@" > "$OUT/$label.log" 2>&1
}
for ds in mt_bench.jsonl humaneval.jsonl.gz; do
  name=${ds%%.*}
  for v in old new; do
    bin=$NEW_BIN; [ $v = old ] && bin=$WT/.venv/bin/specdec
    run "${name}_ngram_b1_$v" "$bin" --dataset "$D/$ds" --batch-size 1 --baseline hf \
      --extra-baseline hf-pld --drafter ngram
  done
  for v in old new; do
    bin=$NEW_BIN; [ $v = old ] && bin=$WT/.venv/bin/specdec
    run "${name}_ngram_b8_$v" "$bin" --dataset "$D/$ds" --batch-size 8 --baseline hf \
      --drafter ngram
  done
done
python3 - "$OUT" <<'EOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text())
    base, plain, eng = r["baseline"] or {}, r["plain"] or {}, r["engine"]
    print(f"{f.stem:28s} engine {eng['tokens_per_s']:7.1f} tok/s  plain {plain.get('tokens_per_s', 0):7.1f}"
          f"  {base.get('name', '')} {base.get('tokens_per_s', 0):6.1f}  vs-baseline "
          f"{r['speedup_vs_baseline'] or 0:.2f}  vs-plain {r['speedup_vs_plain'] or 0:.2f}  tau {r['tau'] or 0:.2f}")
EOF
