"""The prefix cache's bookkeeping (lookups, in-flight pages, key hashing, registration, figures)
as a share of step time on a workload without a hit (a distinct cache_salt per request),
SmolLM2, float, batch 1 and 8. Run from the repository root:

    .venv/bin/python docs/bench/prefix_overhead.py
"""

from __future__ import annotations

import time
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.bench.data import first_turn_items, load_questions
from specdec.engine.commit_stage import CommitStage
from specdec.engine.scheduler import Scheduler
from specdec.engine.step_stats import StepRecorder

SPENT = {"seconds": 0.0}
# the methods that do the cache's bookkeeping (lookups, in-flight pages, hit counts, page
# registration, step figures); when they move, this list follows them
TIMED = ((Scheduler, "_reuse_prefix"), (Scheduler, "_mark_in_flight"), (Scheduler, "_count_hit"),
         (CommitStage, "_register"), (StepRecorder, "_prefix"))


def timed(fn):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT["seconds"] += time.perf_counter() - t0
    return call


def main() -> None:
    for cls, name in TIMED:
        setattr(cls, name, timed(getattr(cls, name)))
    llm = LLM()
    questions = load_questions(Path("../shared/data/eval/mt_bench.jsonl"), 16)
    prompts = [it.prompt_ids for it in first_turn_items(questions, llm.tokenizer)]
    for batch in (1, 8):
        SPENT["seconds"], before = 0.0, llm.engine.totals.step_seconds
        for i in range(0, 8 if batch == 1 else 16, batch):
            params = [SamplingParams(temperature=0, max_tokens=128, cache_salt=f"{batch}-{i}-{j}")
                      for j in range(batch)]
            llm.generate(prompts[i:i + batch], params)
        steps = llm.engine.totals.step_seconds - before
        print(f"batch {batch}: prefix-cache bookkeeping {SPENT['seconds'] * 1e3:.1f} ms of "
              f"{steps * 1e3:.0f} ms of steps = {SPENT['seconds'] / steps:.4%}")


if __name__ == "__main__":
    main()
