# The prefix cache's bookkeeping (lookups, in-flight pages, key hashing, registration, figures) as
# a share of step time on a workload without a hit (a distinct cache_salt per request), SmolLM2,
# float, batch 1 and 8. Run from the repository root: .venv/bin/python docs/bench/issue20_overhead.py
import time, json
from specdec import LLM, SamplingParams
from specdec.scheduler import Scheduler
from specdec.engine import LLMEngine
from specdec.bench_data import load_questions, first_turn_items
from pathlib import Path
spent = {"t": 0.0}
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); spent["t"] += time.perf_counter() - t0; return r
    setattr(cls, name, g)
for cls, n in ((Scheduler, "_reuse_prefix"), (Scheduler, "_mark_in_flight"), (Scheduler, "_count_hit"),
               (LLMEngine, "_register_pages"), (LLMEngine, "_prefix_stats")):
    wrap(cls, n)
llm = LLM()
qs = load_questions(Path("../shared/data/eval/mt_bench.jsonl"), 16)
prompts = [it.prompt_ids for it in first_turn_items(qs, llm.tokenizer)]
for b in (1, 8):
    spent["t"] = 0.0; s0 = llm.engine.totals.step_seconds
    for i in range(0, 8 if b == 1 else 16, b):
        ps = [SamplingParams(temperature=0, max_tokens=128, cache_salt=f"{b}-{i}-{j}") for j in range(b)]
        llm.generate(prompts[i:i+b], ps)
    steps = llm.engine.totals.step_seconds - s0
    print(f"batch {b}: prefix-cache bookkeeping {spent['t']*1e3:.1f} ms of {steps*1e3:.0f} ms of steps = {spent['t']/steps:.4%}")
