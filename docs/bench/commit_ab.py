"""Plain (or one drafter's) tokens/s of the installed specdec, best of 3, for A/B runs of two
checkouts alternated in time (each checkout's own venv):

    for i in 1 2 3 4; do for py in /tmp/specdec_old/.venv/bin/python .venv/bin/python; do
      (cd /tmp && $py /work/main/docs/bench/commit_ab.py none); done; done

SmolLM2-135M-Instruct, q8 activations, 6 MT-Bench first turns one by one, 64 new tokens.
"""

import json
import sys
import time

from specdec import LLM, SamplingParams

drafter = None if sys.argv[1] == "none" else sys.argv[1]
data = sys.argv[2] if len(sys.argv) > 2 else "../shared/data/eval/mt_bench.jsonl"
with open(data) as f:
    questions = [json.loads(line) for line in f][:6]
llm = LLM(model="smollm2-135m-instruct", activations="q8", drafter=drafter)
prompts = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:1], params)
best = []
for _ in range(3):
    seconds, tokens = 0.0, 0
    for prompt in prompts:
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
    best.append(tokens / seconds)
print(sys.argv[1], max(best))
