"""Repeated work (issue 34, item 4; Spec-Bench style): one task family asked many times, where
earlier answers help later ones. The GSM8K test questions and the HumanEval prompts, each
streamed in file order as a sequence of requests to one engine at batch 1.

    .venv/bin/python docs/bench/repeated_work.py [--requests 30] [--max-tokens 128]
        [--activations q8,float] [--drafters none,ngram,suffix] [--threads 1] [--json OUT]

SmolLM2-135M-Instruct, greedy, the default controller (goodput with a drafter). Per dataset and
activations mode, one engine per drafter, fresh for the dataset (the suffix drafter's history
starts empty); request i runs on every engine before request i + 1 (interleaved, so the
machine's drift spreads over all of them). Reported per drafter, for the first ``--warm``
requests and for those after: generated tokens per second (tokens / wall time of the requests,
prefill included), its ratio to plain, tau (tokens emitted per decode step: 1 + accepted draft
tokens per step), and the draft stage's time per decode step (drafting alone, scheduling
excluded). Every drafter's tokens are checked against plain's (greedy speculation is exact).
Ratios only mean something within one run on one machine: say which CPU. ``--threads`` (torch
threads, default 1): on a machine other jobs share, two OpenMP threads can wait on each other
for whole scheduler slices (plain decoding measured 1 token/s with 2 threads beside a training
job, 130 with 1).

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--model`` a tiny GGUF with a chat
template, ``--eval`` a folder of 2-question files, ``--requests 2 --warm 1 --max-tokens 4
--activations q8``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.bench.data import load_questions
from specdec.metrics import StepBudget

EVAL = Path("../shared/data/eval")
DATASETS = {"gsm8k": ("gsm8k_test.jsonl", "{}"),
            "humaneval": ("humaneval.jsonl.gz",
                          "Complete this Python function.\n```python\n{}```")}


def chats(name: str, n: int | None, folder: Path = EVAL) -> list[list[dict]]:
    file, template = DATASETS[name]
    return [[{"role": "user", "content": template.format(q.turns[0])}]
            for q in load_questions(folder / file, None)[:n]]


def budgets(llm: LLM) -> dict[str, StepBudget]:
    """Copies of the engine's step budgets by step kind (plain, speculative, prefill)."""
    return {k: dataclasses.replace(b, seconds=dict(b.seconds))
            for k, b in llm.engine.totals.budget.items()}


def decode_draft(llm: LLM) -> tuple[int, float]:
    """(decode steps, seconds of drafting in them) the engine has run so far."""
    steps, seconds = 0, 0.0
    for kind in ("plain", "speculative"):
        b = llm.engine.totals.budget.get(kind)
        if b is not None:
            steps += b.steps
            seconds += b.seconds["draft"]
    return steps, seconds


def run_one(llm: LLM, chat, params) -> dict:
    steps0, draft0 = decode_draft(llm)
    before = budgets(llm)
    start = time.perf_counter()
    (out,) = llm.generate([chat], params)
    seconds = time.perf_counter() - start
    steps, draft = decode_draft(llm)
    budget = {k: b.minus(before.get(k, StepBudget())) for k, b in budgets(llm).items()}
    return {"tokens": out.token_ids, "seconds": seconds, "steps": steps - steps0,
            "draft_seconds": draft - draft0, "budget": budget}


def summarize(rows: list[dict]) -> dict:
    tokens = sum(len(r["tokens"]) for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    steps = sum(r["steps"] for r in rows)
    kinds: dict[str, StepBudget] = {}
    for r in rows:
        for k, b in r["budget"].items():
            total = kinds.setdefault(k, StepBudget())
            total.steps, total.rows = total.steps + b.steps, total.rows + b.rows
            total.draft_nodes += b.draft_nodes
            for part, v in b.seconds.items():
                total.seconds[part] += v
    return {"requests": len(rows), "tokens": tokens, "tokens_per_s": tokens / seconds,
            "tau": sum(len(r["tokens"]) - 1 for r in rows) / max(steps, 1),
            "draft_ms_per_step": 1000 * sum(r["draft_seconds"] for r in rows) / max(steps, 1),
            "seconds": seconds,
            "by_step_kind": {k: b.per_step_ms() for k, b in kinds.items() if b.steps}}


def stream(name: str, activations: str, drafters: list[str], args) -> dict:
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engines = {d: LLM(model=args.model, activations=activations,
                      drafter=None if d == "none" else d)
               for d in drafters}
    # warm-up on the file's last two questions (outside the stream), under a salt of their own
    # so that the suffix drafter's history for the stream starts empty
    warm = chats(name, None, args.eval)[-2:]
    for llm in engines.values():
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=16, cache_salt="warm-up"))
    rows: dict[str, list[dict]] = {d: [] for d in drafters}
    for i, chat in enumerate(chats(name, args.requests, args.eval)):
        for d, llm in engines.items():
            rows[d].append(run_one(llm, chat, params))
        print(f"{name} {activations} request {i + 1}/{args.requests}", flush=True)
    out = {}
    for d in drafters:
        parts = {"first": rows[d][:args.warm], "after": rows[d][args.warm:]}
        out[d] = {k: summarize(v) for k, v in parts.items() if v}
        out[d]["mismatches_vs_plain"] = sum(
            r["tokens"] != p["tokens"] for r, p in zip(rows[d], rows[drafters[0]]))
        drafter = engines[d].engine.drafting.drafter
        if hasattr(drafter, "stats"):
            out[d]["history"] = drafter.stats()
    for d in drafters:
        for k, s in out[d].items():
            if isinstance(s, dict) and "tokens_per_s" in s and k in out[drafters[0]]:
                s["vs_plain"] = s["tokens_per_s"] / out[drafters[0]][k]["tokens_per_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--warm", type=int, default=20, help="requests in the first window")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--datasets", default="gsm8k,humaneval")
    ap.add_argument("--activations", default="q8,float")
    ap.add_argument("--drafters", default="none,ngram,suffix",
                    help="comma-separated; the first is the baseline ('none' = plain)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--model", default="smollm2-135m-instruct",
                    help="an alias, HF folder or .gguf file")
    ap.add_argument("--eval", type=Path, default=EVAL, help="the folder of the data sets")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    drafters = args.drafters.split(",")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines()
                  if line.startswith("Model name")), platform.processor())
    report = {"command": "docs/bench/repeated_work.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"),
        "cpu": model, "results": {}}
    for name in args.datasets.split(","):
        for act in args.activations.split(","):
            report["results"][f"{name}/{act}"] = stream(name, act, drafters, args)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
