"""Two engines side by side at one batch size, no baseline: tokens/s and where step time goes.

    python docs/bench/engine_batch.py [--batch 8] [--tokens 96] [--kernels tuned plain]

Run it from two checkouts alternately (old, new, old, new, ...) to compare commits; an older
commit without `linear_kernels` is run with `--kernels default`.
"""

import argparse
import json
import time

from specdec import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--tokens", type=int, default=96)
parser.add_argument("--kernels", nargs="+", default=["tuned"])
parser.add_argument("--data", default="../shared/data/eval/mt_bench.jsonl")
args = parser.parse_args()
qs = [json.loads(line) for line in open(args.data)][:args.batch]
prompts = [[{"role": "user", "content": q["turns"][0]}] for q in qs]
params = SamplingParams(temperature=0, max_tokens=args.tokens)
for kern in args.kernels:
    for drafter in (None, "ngram"):
        extra = {} if kern == "default" else {"linear_kernels": kern}
        llm = LLM(drafter=drafter, **extra)
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8))  # warm-up
        t = llm.engine.totals
        before = (t.steps, t.forward_seconds, t.step_seconds)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        steps, fwd, step = (a - b for a, b in zip((t.steps, t.forward_seconds, t.step_seconds),
                                                 before))
        print(f"{kern:7s} {str(drafter):6s} {n / wall:6.1f} tok/s  {steps} steps  forward "
              f"{fwd:.2f} s of {step:.2f} s", flush=True)
