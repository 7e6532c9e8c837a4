"""Draft time per step of the learned drafters at equal depth, and block-diffusion shapes.

    .venv/bin/python docs/bench/draft_cost.py [--json OUT.json]

SmolLM2-135M-Instruct fp32, batch 1, greedy, static budget = a chain of ``DEPTH`` nodes (every
drafter drafts ``DEPTH`` deep: eagle3 runs its catch-up and DEPTH - 1 expansion forwards,
block diffusion one forward of a block of DEPTH + 1 rows, mtp one pass of its heads). Speed does
not depend on the weights: block-diffusion shapes without a trained checkpoint use weights
initialised from the target (``init_from_target``). Reported: draft milliseconds per step
(scheduling, budget and drafting, as ``StepStats.draft_seconds``), median over prompts, with
the systems interleaved prompt by prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.bench.data import load_questions
from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel
from specdec.models.tokenizer import chat_token_ids

MT_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "eval" / "mt_bench.jsonl"

DEPTH = 7


def _bd_model(llm_plain, layers: int, block: int) -> BlockDiffusionModel:
    target = llm_plain.engine.parts.model
    cfg, hf = llm_plain.engine.parts.model_config, llm_plain.engine.parts.hf_config
    c = BlockDiffusionConfig.for_target(cfg, 8000, num_layers=layers, block_size=block)
    m = BlockDiffusionModel(c, target.embed, hf)
    m.init_from_target(target, torch.arange(0, 16000, 2))
    return m


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--trained", action="store_true",
                   help="also the shipped mtp and block_diffusion drafters")
    args = p.parse_args()
    budget = {"budget": DEPTH}
    plain = LLM(model="smollm2-135m-instruct")
    systems = {"eagle3 (shipped, depth 7, topk 4)":
               dict(drafter="eagle3", drafter_args={"depth": DEPTH})}
    for layers in (1, 2, 3):
        systems[f"block_diffusion {layers} layers, block {DEPTH + 1}"] = dict(
            drafter="block_diffusion",
            drafter_args={"model": _bd_model(plain, layers, DEPTH + 1)})
    if args.trained:
        systems["mtp (shipped)"] = dict(drafter="mtp")
        systems["block_diffusion (shipped)"] = dict(drafter="block_diffusion")
    llms = {name: LLM(model="smollm2-135m-instruct", controller="static", controller_args=budget,
                      **kw) for name, kw in systems.items()}
    tok = plain.tokenizer
    prompts = [chat_token_ids(tok, [{"role": "user", "content": q.turns[0]}])
               for q in load_questions(MT_BENCH, args.prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.tokens)
    per = {name: [] for name in llms}
    for llm in llms.values():  # warm-up
        llm.generate([prompts[0]], sp)
    for pr in prompts:
        for name, llm in llms.items():
            t = llm.engine.totals
            s0, d0 = t.steps, t.draft_seconds
            llm.generate([pr], sp)
            per[name].append(1000 * (t.draft_seconds - d0) / max(1, t.steps - s0))
    report = {name: {"draft_ms_per_step": statistics.median(v)} for name, v in per.items()}
    base = report["eagle3 (shipped, depth 7, topk 4)"]["draft_ms_per_step"]
    for r in report.values():
        r["vs_eagle3"] = r["draft_ms_per_step"] / base
    for name, r in report.items():
        print(f"{name:45s} {r['draft_ms_per_step']:7.2f} ms/step  {r['vs_eagle3']:.2f}x eagle3")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"depth": DEPTH, "prompts": args.prompts, "tokens": args.tokens,
                       "systems": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
