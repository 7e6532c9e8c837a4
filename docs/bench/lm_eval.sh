#!/usr/bin/env bash
# lm-evaluation-harness against `specdec serve`, with and without a drafter (issue 32, item 5):
# local-completions (a generative task and a loglikelihood task: completions with echo and
# logprobs) and local-chat-completions (the generative task through the chat template), on
# GSM8K test questions from ../shared/data/eval (tasks in docs/bench/lm_eval_tasks/). Greedy:
# the scores, and every generation, must be the same with the drafter as without.
#
#   .venv/bin/pip install "lm_eval[api]==0.4.13"  # not in the dev extras (heavy)
#   bash docs/bench/lm_eval.sh                   # LIMIT (40), DRAFTER (eagle3), ACT (q8), OUT
#
# Writes lm_eval's results and samples per drafter and model type under $OUT, and compare.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT=${LIMIT:-40}
DRAFTER=${DRAFTER:-eagle3}
ACT=${ACT:-q8}
OUT=${OUT:-$(bash docs/bench/results_dir.sh lm_eval)}
PORT=${PORT:-8765}
PY=.venv/bin/python
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt" 2>&1 || true
TOK=$($PY -c "from specdec.models.aliases import alias_folder; print(alias_folder('smollm2-135m-instruct'))")
TASKS=docs/bench/lm_eval_tasks
for d in none "$DRAFTER"; do
  .venv/bin/specdec serve --drafter "$d" --activations "$ACT" --port "$PORT" \
    --served-model-name smollm2 > "$OUT/serve-$d.log" 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' EXIT
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done
  base="model=smollm2,tokenizer_backend=huggingface,tokenizer=$TOK,num_concurrent=1,max_retries=1"
  .venv/bin/lm_eval --model local-completions \
    --model_args "$base,base_url=http://127.0.0.1:$PORT/v1/completions" \
    --tasks gsm8k_local,gsm8k_local_mc --include_path "$TASKS" --limit "$LIMIT" \
    --output_path "$OUT/$d-completions" --log_samples > "$OUT/$d-completions.log" 2>&1
  .venv/bin/lm_eval --model local-chat-completions \
    --model_args "$base,base_url=http://127.0.0.1:$PORT/v1/chat/completions" \
    --apply_chat_template --tasks gsm8k_local --include_path "$TASKS" --limit "$LIMIT" \
    --output_path "$OUT/$d-chat" --log_samples > "$OUT/$d-chat.log" 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
$PY - "$OUT" "$DRAFTER" <<'PYEOF' | tee "$OUT/compare.txt"
import json
import sys
from pathlib import Path

out, drafter = Path(sys.argv[1]), sys.argv[2]


def load(d, kind):
    res = next((out / f"{d}-{kind}").rglob("results_*.json"))
    scores = {t: {k: v for k, v in r.items() if isinstance(v, float)}
              for t, r in json.loads(res.read_text())["results"].items()}
    samples = {}
    for f in (out / f"{d}-{kind}").rglob("samples_*.jsonl"):
        task = f.name.split("_", 1)[1].rsplit("_", 1)[0]
        samples[task] = [(s["doc_id"], s["resps"]) for s in map(json.loads, f.read_text().splitlines())]
    return scores, samples


same = True
for kind in ("completions", "chat"):
    (s0, g0), (s1, g1) = load("none", kind), load(drafter, kind)
    for task in sorted(s0):
        print(f"{kind:12} {task:16} none {s0[task]}  {drafter} {s1[task]}")
        same &= s0[task] == s1[task]
    for task in g0:
        diff = sum(a != b for a, b in zip(sorted(g0[task]), sorted(g1[task])))
        print(f"{kind:12} {task:16} responses differing: {diff} of {len(g0[task])}")
        same &= diff == 0
print("same scores and responses with and without the drafter:", same)
PYEOF
