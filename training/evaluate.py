"""End-of-training evaluation: the new drafter in the real engine, against plain decoding.

Held-out prompts (a split of the training data, plus `--eval` files) run greedily, one at a
time, through three engines on the same weights:

- **quality**: the drafter under the static controller at ``budget`` nodes a step, the same
  tree every step. Its τ and acceptance by depth measure the head and nothing else (the
  goodput controller may find that drafting does not pay and never try the head: its τ of 1.0
  would say nothing of the head).
- **speed**: plain decoding and the drafter under the default (goodput) controller, what
  a user runs, interleaved prompt by prompt (the order alternating). Reported: each prompt's
  tokens/s ratio, as their median, quartiles and range. A ratio of summed times is not reported:
  one slow prompt (a first call, a busy moment) decides it.

Both speculative engines must reproduce plain decoding's tokens (``greedy_match_rate`` 1.0).
"""

from __future__ import annotations

import statistics
import time

from specdec.bench.compare import EngineSystem, match_rates, speculation_summary
from specdec.models.tokenizer import chat_token_ids

WARMUP_SALT = "eval-warmup"  # the warm-up's prefix-cache pages are not reused by timed runs


def evaluate(target: str, prompts: list[list[dict]], drafter: str, drafter_args: dict, *,
             max_tokens: int, budget: int, dtype: str = "float32", device: str = "cpu") -> dict:
    """prompts: chats (lists of messages) ending with a user turn. Returns ``{"num_prompts",
    "seconds", "quality": {...}, "speed": {...}, "greedy_match_rate"}`` (see the module
    docstring)."""
    from specdec import LLM

    if not prompts:
        return {"num_prompts": 0, "seconds": 0.0}
    t0 = time.perf_counter()
    common = dict(model=target, dtype=dtype, device=device)
    systems: dict[str, EngineSystem] = {}
    try:  # every engine closed, also when one fails to build or to run
        systems["plain"] = EngineSystem(LLM(**common), max_tokens)
        systems["static"] = EngineSystem(LLM(**common, drafter=drafter, drafter_args=drafter_args,
                                             controller="static",
                                             controller_args={"budget": budget}), max_tokens)
        systems["goodput"] = EngineSystem(LLM(**common, drafter=drafter,
                                              drafter_args=drafter_args), max_tokens)
        ids = [chat_token_ids(systems["plain"].llm.tokenizer, p) for p in prompts]
        outs, rates = _run(systems, ids)
    finally:
        for system in systems.values():
            system.llm.close()
    plain = dict(enumerate(outs["plain"]))
    quality = {"controller": "static", "budget": budget,
               **speculation_summary(outs["static"]),
               "greedy_match_rate": match_rates(dict(enumerate(outs["static"])), plain)[0]}
    ratios = [s / p for s, p in zip(rates["goodput"], rates["plain"]) if p > 0]
    speed = {"controller": "goodput", "prompt_speedups": ratios, **spread(ratios),
             "draft_tokens_proposed": speculation_summary(outs["goodput"])["draft_tokens_proposed"],
             "greedy_match_rate": match_rates(dict(enumerate(outs["goodput"])), plain)[0]}
    return {"num_prompts": len(ids), "seconds": time.perf_counter() - t0, "quality": quality,
            "speed": speed,
            "greedy_match_rate": min(quality["greedy_match_rate"], speed["greedy_match_rate"])}


def _run(systems: dict[str, EngineSystem], ids: list[list[int]]) -> tuple[dict, dict]:
    """(outputs by system, per-prompt tokens/s by system): a warm-up on the first prompt, then
    every prompt through every system, plain and goodput side by side in alternating order."""
    for system in systems.values():  # first-call costs: kernels, caches, step-cost profile
        system.run(ids[:1], WARMUP_SALT)
    outs = {name: [] for name in systems}
    rates = {name: [] for name in systems}
    for i, p in enumerate(ids):
        timed = ["plain", "goodput"] if i % 2 == 0 else ["goodput", "plain"]
        for name in (*timed, "static"):
            seconds, out, _ = systems[name].run([p])
            outs[name].append(out[0])
            rates[name].append(len(out[0].token_ids) / seconds if seconds > 0 else 0.0)
    return outs, rates


def spread(ratios: list[float]) -> dict:
    """Median, quartiles and range of per-prompt ratios (None each when there are none).

    >>> spread([1.0, 1.0, 1.1, 4.0])["median"]
    1.05
    """
    if not ratios:
        return dict.fromkeys(("median", "q1", "q3", "min", "max"))
    q1, _, q3 = (statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1
                 else ratios * 3)
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3, "min": min(ratios),
            "max": max(ratios)}


FEW_CONVERSATIONS = 100  # fewer trained on: the warning that the drafter learnt little
EVAL_SHARE = 0.5  # an evaluation longer than this share of the run: a warning


def run_warnings(report: dict, max_steps: int | None) -> list[str]:
    """What the figures of a run need beside them: too little trained on, an evaluation
    that took most of the run, a speculative engine that never drafted or was inexact.
    ``report``: the evaluation with ``split`` and ``run_seconds`` added (see trainer.train)."""
    out = []
    split = report.get("split") or {}
    trained, held = split.get("train_conversations"), split.get("held_out", 0)
    if max_steps != 0 and trained is not None and (trained < FEW_CONVERSATIONS
                                                   or trained < held):
        out.append(f"trained on {trained} conversation{'s' * (trained != 1)} ({held} held out "
                   f"for the evaluation): too few for a drafter that predicts well (give more "
                   f"--data, a larger --limit, or a smaller holdout)")
    run = report.get("run_seconds")
    if run and report.get("seconds", 0.0) > EVAL_SHARE * run:
        out.append(f"the evaluation took {report['seconds']:.0f} s of the run's {run:.0f} s: "
                   f"most of it (fewer held-out prompts or a smaller eval_max_tokens shorten it)")
    speed = report.get("speed") or {}
    if speed and not speed.get("draft_tokens_proposed"):
        out.append("the goodput controller drafted nothing on these prompts: the speed figure "
                   "is the speculative engine's overhead, not a gain from the drafter")
    if report.get("num_prompts") and report.get("greedy_match_rate") != 1.0:
        out.append(f"speculative output differs from plain decoding on some prompts (greedy "
                   f"match rate {report.get('greedy_match_rate')}): a bug, please report it")
    return out


def summary_lines(report: dict) -> list[str]:
    """The lines ``specdec train`` prints, from ``report`` alone (so eval.json, which keeps
    them under ``summary``, says the same)."""
    n = report.get("num_prompts", 0)
    if not n:
        lines = ["no held-out prompts: nothing evaluated (holdout 0 and no --eval files)"]
    else:
        q, s = report["quality"], report["speed"]
        depth = " / ".join(f"{a:.3f}" for a in q["acceptance_by_depth"]) or "-"
        lines = [f"quality (static controller, {q['budget']}-node tree, {n} held-out prompts): "
                 f"tau {_f(q['tau'])}, acceptance by depth {depth}, "
                 f"{q['draft_tokens_proposed']} draft tokens proposed",
                 f"speed vs plain (goodput controller, {n} prompts interleaved with plain "
                 f"decoding): per-prompt tokens/s ratio median {_f(s['median'])}x, quartiles "
                 f"{_f(s['q1'])}-{_f(s['q3'])}x, range {_f(s['min'])}-{_f(s['max'])}x; "
                 f"{s['draft_tokens_proposed']} draft tokens proposed"]
    return lines + [f"warning: {w}" for w in report.get("warnings", [])]


def _f(value) -> str:
    return "-" if value is None else f"{value:.2f}"
