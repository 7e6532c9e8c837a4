#!/usr/bin/env bash
# The figures table of README.md: plain decoding and every shipped drafter (ngram, eagle3, mtp,
# block_diffusion) under the goodput controller, MT-Bench, batch 1, greedy, SmolLM2-135M-Instruct
# on its own GGUF blocks, with float and with q8 activations. One `specdec bench` sweep per
# activation mode (every system on the same prompts, interleaved prompt by prompt, plain decoding
# beside them), then one markdown table with the CPU named.
#
# Run it from the repository root with the README's venv, nothing else heavy running:
#
#   bash docs/bench/readme_table.sh        # ~3 min on 2 cores; N, TOK, DATA, DRAFTERS, MODEL, OUT override
#
# Quick form (the test suite's, tests/bench/test_bench_scripts.py): MODEL a tiny GGUF with a chat
# template, DATA a folder with a 4-question mt_bench.jsonl, N=2 TOK=4 DRAFTERS=ngram, OUT a
# temporary folder (the shipped learned drafters need SmolLM2 itself).
#
# Writes to $OUT (default docs/bench/results/<date>-<cpu>/readme_table/): lscpu.txt,
# float.json / q8.json and their logs, and table.md, which goes into README.md as it is.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=${DATA:-../shared/data/eval}
OUT=${OUT:-$(bash docs/bench/results_dir.sh readme_table)}
N=${N:-16}
TOK=${TOK:-64}
BIN=${BIN:-.venv/bin/specdec}
PY=${PY:-.venv/bin/python}
DRAFTERS=${DRAFTERS:-ngram,eagle3,mtp,block_diffusion}
MODEL=${MODEL:-}  # default: specdec bench's (SmolLM2-135M-Instruct)
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt" 2>&1 || echo "Model name: unknown-cpu" > "$OUT/lscpu.txt"
for act in float q8; do
  "$BIN" bench ${MODEL:+--model "$MODEL"} --dataset "$D/mt_bench.jsonl" --num-prompts "$N" \
    --max-new-tokens "$TOK" --repeats 1 --warmup 1 --batch-sizes 1 --drafters "$DRAFTERS" --controllers goodput \
    --baseline plain --activations "$act" --json "$OUT/$act.json" > "$OUT/$act.log" 2>&1
done
"$PY" - "$OUT" "$DRAFTERS" <<'PYEOF'
import json
import re
import sys
from pathlib import Path

out = Path(sys.argv[1])
drafters = sys.argv[2].split(",")  # one drafter: bench names its system by the controller alone
lscpu = (out / "lscpu.txt").read_text()


def field(name: str) -> str:
    m = re.search(rf"^{re.escape(name)}:\s*(.+)$", lscpu, re.M)
    return m.group(1).strip() if m else "unknown"


reports = {act: json.loads((out / f"{act}.json").read_text()) for act in ("float", "q8")}
rows = {act: {r["system"]: r for r in rep["runs"] if r["batch_size"] == 1}
        for act, rep in reports.items()}
systems = list(dict.fromkeys(reports["float"]["systems"] + reports["q8"]["systems"]))
cfg, q8 = reports["float"]["config"], reports["q8"]["runtime"]
flags = field("Flags").split()
isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in flags)


def cells(r: dict | None) -> list[str]:
    r = r or {}
    return [f"{r[k]:{fmt}}" if r.get(k) is not None else "–"
            for k, fmt in (("tokens_per_s", ".1f"), ("speedup_vs_plain", ".2f"), ("tau", ".2f"))]


lines = [
    f"{field('Model name')}, {cfg['num_threads']} threads ({field('CPU(s)')} CPUs; {isa or 'ISA unknown'}),"
    f" torch {cfg['torch_version']}; MT-Bench, {cfg['num_prompts']} prompts × "
    f"{cfg['max_new_tokens']} new tokens, batch 1, greedy, SmolLM2-135M-Instruct on its own "
    f"Q4_1 / Q8_0 blocks, drafters under the goodput controller; q8 kernels: {q8.get('q8_isa')}.",
    "",
    "| system | float tok/s | vs plain | τ | q8 tok/s | vs plain | τ |",
    "|---|---|---|---|---|---|---|",
]
for s in systems:
    drafter = s.split("/")[0] if len(drafters) > 1 else drafters[0]
    name = "plain decoding" if s == "plain" else f"`{drafter}`"
    lines.append(f"| {name} | " + " | ".join(cells(rows["float"].get(s)) + cells(rows["q8"].get(s)))
                 + " |")
match = [r.get("greedy_match_rate_vs_plain") for act in rows for r in rows[act].values()]
match = [m for m in match if m is not None]
lines += ["", f"Greedy output equal to plain decoding's: {min(match):.0%} of prompts at worst "
          f"(each mode against its own plain decoding)." if match else ""]
(out / "table.md").write_text("\n".join(lines).rstrip() + "\n")
print("\n".join(lines))
PYEOF
