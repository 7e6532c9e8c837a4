"""Plain (or one drafter's) tokens/s of the installed specdec, best of 3, for A/B runs of two
checkouts alternated in time (each checkout's own venv):

    for i in 1 2 3 4; do for py in /tmp/specdec_old/.venv/bin/python .venv/bin/python; do
      (cd /tmp && $py /work/main/docs/bench/commit_ab.py none); done; done

SmolLM2-135M-Instruct, q8 activations, 6 MT-Bench first turns one by one, 64 new tokens.
"""
import json, sys, time
from specdec import LLM, SamplingParams
drafter = None if sys.argv[1] == "none" else sys.argv[1]
qs = [json.loads(l) for l in open(sys.argv[2] if len(sys.argv) > 2 else "../shared/data/eval/mt_bench.jsonl")][:6]
llm = LLM(model="smollm2-135m-instruct", activations="q8", drafter=drafter)
prompts = [[{"role": "user", "content": q["turns"][0]}] for q in qs]
p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:1], p)
best = []
for rep in range(3):
    t = 0.0; n = 0
    for pr in prompts:
        t0 = time.perf_counter(); o = llm.generate([pr], p)[0]; t += time.perf_counter() - t0; n += len(o.token_ids)
    best.append(n / t)
print(sys.argv[1], max(best))
