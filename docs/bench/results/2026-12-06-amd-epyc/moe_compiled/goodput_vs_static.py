"""The goodput controller against each static budget, interleaved round by round, on one GGUF.

The oracle drafter (drafters/oracle.py) proposes the plain engine's greedy continuation, each of
its --depth chain nodes wrong at the rate giving tau at that depth (error_rate_for_tau). One
goodput engine is built once (it learns across the rounds, as a serving engine would); each
static budget's engine is built in turn and, for --rounds rounds, the two alternate: goodput at
batch 1 (each of --b1-prompts prompts alone) and 8 (one call of 8), then static the same. The
ratio goodput / static is the median over rounds of the per-round ratios: each pair ran within
seconds of each other, so a machine's drift divides out. goodput / best static = the smallest
of those ratios (the best static budget is the one goodput does worst against).

    .venv/bin/python docs/bench/results/2026-12-06-amd-epyc/moe_compiled/goodput_vs_static.py \
        --model FILE.gguf [--taus 2,3] [--budgets 1,2,3,4] [--rounds 5] [--json OUT]
"""
import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.bench.data import first_turn_items, load_questions
from specdec.drafters.oracle import error_rate_for_tau, oracle_plugin

DATASET = Path(__file__).resolve().parents[5].parent / "shared" / "data" / "eval" / "mt_bench.jsonl"

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--taus", default="2,3")
p.add_argument("--depth", type=int, default=4)
p.add_argument("--budgets", default="1,2,3,4")
p.add_argument("--b1-prompts", type=int, default=3)
p.add_argument("--max-new-tokens", type=int, default=64)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--batches", default="1,8")
p.add_argument("--json")
a = p.parse_args()
kw = dict(model=a.model, activations="q8", max_model_len=1024)
batches = [int(b) for b in a.batches.split(",")]
plain = LLM(**kw)
prompts = [it.prompt_ids for it in first_turn_items(load_questions(DATASET, 8), plain.tokenizer)]
params = SamplingParams(temperature=0, max_tokens=a.max_new_tokens, ignore_eos=True)
truth = {tuple(q): plain.generate([q], params)[0].token_ids for q in prompts}
del plain
gc.collect()


def run(llm, b):
    """(decode tok/s, mean tau, outputs equal the plain ones) at batch b."""
    groups = [[q] for q in prompts[:a.b1_prompts]] if b == 1 else [prompts[:b]]
    toks, secs, taus, same = 0, 0.0, [], True
    for g in groups:
        t0 = time.perf_counter()
        outs = llm.generate(g, params)
        secs += time.perf_counter() - t0 - max(o.metrics.ttft or 0.0 for o in outs)
        toks += sum(len(o.token_ids) - 1 for o in outs)
        taus += [o.metrics.tau for o in outs if o.metrics.tau is not None]
        same &= all(o.token_ids == truth[tuple(q)] for q, o in zip(g, outs))
    return toks / secs, (statistics.fmean(taus) if taus else None), same


def engine(tau, controller, args):
    llm = LLM(drafter="oracle", controller=controller, controller_args=args,
              plugins=(oracle_plugin(truth, error_rate_for_tau(tau, a.depth), a.depth),), **kw)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    return llm


out = {"model": a.model, "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg(),
       "depth": a.depth, "rounds": a.rounds, "max_new_tokens": a.max_new_tokens,
       "b1_prompts": a.b1_prompts, "cells": []}
for tau in [float(t) for t in a.taus.split(",")]:
    good = engine(tau, "goodput", {})
    for b in batches:  # the goodput engine's first use: learning, not timed
        run(good, b)
    pairs = {}
    for budget in [int(x) for x in a.budgets.split(",")]:
        static = engine(tau, "static", {"budget": budget})
        rec = {b: {"goodput": [], "static": [], "tau_goodput": [], "tau_static": [],
                   "same": True} for b in batches}
        for _ in range(a.rounds):
            for b in batches:
                g, gt, gs = run(good, b)
                s, st, ss = run(static, b)
                r = rec[b]
                r["goodput"].append(g), r["static"].append(s)
                r["tau_goodput"].append(gt), r["tau_static"].append(st)
                r["same"] &= gs and ss
        del static
        gc.collect()
        pairs[budget] = rec
        for b in batches:
            r = rec[b]
            ratio = statistics.median(x / y for x, y in zip(r["goodput"], r["static"]))
            print(f"tau {tau} batch {b} static:{budget}: goodput {statistics.median(r['goodput']):.1f}"
                  f" (tau {statistics.fmean(r['tau_goodput']):.2f}) vs static "
                  f"{statistics.median(r['static']):.1f} (tau {statistics.fmean(r['tau_static']):.2f})"
                  f": ratio {ratio:.3f}{'' if r['same'] else ' DIFFERS'}", flush=True)
    del good
    gc.collect()
    for b in batches:
        ratios = {k: statistics.median(x / y for x, y in zip(v[b]["goodput"], v[b]["static"]))
                  for k, v in pairs.items()}
        best = min(ratios, key=ratios.get)
        out["cells"].append({"tau": tau, "batch": b, "ratios": ratios, "best_static": best,
                             "goodput_over_best_static": ratios[best],
                             "runs": {k: v[b] for k, v in pairs.items()}})
        print(f"tau {tau} batch {b}: goodput / best static (static:{best}) = {ratios[best]:.3f}",
              flush=True)
out["loadavg_end"] = os.getloadavg()
if a.json:
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
