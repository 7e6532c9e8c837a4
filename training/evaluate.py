"""End-of-training evaluation: the new drafter in the real engine, against plain decoding.

Held-out prompts (a split of the training data, plus `--eval` files) run greedily through two
engines on the same weights, interleaved prompt by prompt: plain, and speculative with the new
drafter. Reported: tau, acceptance by depth, draft share of step time, tokens/s of both and their
ratio (the speedup), and the greedy match rate (1.0: speculation is exact).
"""

from __future__ import annotations

import statistics
import time

from specdec.bench.compare import EngineSystem, match_rates, speculation_summary
from specdec.models.tokenizer import chat_token_ids


def evaluate(target: str, prompts: list[list[dict]], drafter: str, drafter_args: dict, *,
             max_tokens: int, budget: int, dtype: str = "float32", device: str = "cpu") -> dict:
    """prompts: chats (lists of messages) ending with a user turn."""
    from specdec import LLM

    if not prompts:
        return {"num_prompts": 0}
    plain = EngineSystem(LLM(model=target, dtype=dtype, device=device), max_tokens)
    spec = EngineSystem(LLM(model=target, dtype=dtype, device=device, drafter=drafter,
                            drafter_args=drafter_args, controller_args={"budget": budget}),
                        max_tokens)
    tok = spec.llm.tokenizer
    ids = [chat_token_ids(tok, p) for p in prompts]
    spec.run(ids[:1])  # warm-up: kernels, caches
    plain.run(ids[:1])
    times = {"plain": [], "spec": []}
    outs = {"plain": {}, "spec": {}}
    tokens = {"plain": 0, "spec": 0}
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        for name, system in (("plain", plain), ("spec", spec)):
            seconds, out, _ = system.run([p])
            times[name].append(seconds)
            outs[name][i] = out[0]
            tokens[name] += len(out[0].token_ids)
    report = {"num_prompts": len(ids), "seconds": time.perf_counter() - t0,
              "plain_tokens_per_s": tokens["plain"] / sum(times["plain"]),
              "tokens_per_s": tokens["spec"] / sum(times["spec"])}
    report["speedup_vs_plain"] = report["tokens_per_s"] / report["plain_tokens_per_s"]
    report["greedy_match_rate"] = match_rates(outs["spec"], outs["plain"])[0]
    report.update(speculation_summary(list(outs["spec"].values())))
    totals = spec.llm.engine.totals
    report["draft_share"] = totals.draft_seconds / totals.step_seconds if totals.step_seconds else None
    report["median_prompt_speedup"] = statistics.median(
        a / b for a, b in zip(times["plain"], times["spec"]) if b > 0)
    return report
