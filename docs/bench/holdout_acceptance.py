"""Acceptance by depth of drafters on a training recipe's held-out split (issue 19, item 4).

The held-out prompts are the recipe's own (`holdout` conversations of its seeded split, exactly
as `specdec train` sets them aside), so drafters trained before and after on different data
are compared on prompts neither saw. Every drafter runs greedily under the static controller
at one fixed budget, so the figures do not depend on timing (the goodput controller's do):
acceptance at depth d is the share of verification steps that accepted at least d drafted
tokens, tau the tokens per target forward. Greedy outputs are checked against plain decoding.

    .venv/bin/python docs/bench/holdout_acceptance.py --recipe recipes/eagle3_smollm2_general_all.yaml \
        --drafter eagle3=drafters/shipped/eagle3-smollm2-135m-instruct-general --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec import LLM
from specdec.bench.compare import EngineSystem, match_rates, speculation_summary
from specdec.models.tokenizer import chat_token_ids
from specdec.training.config import TrainConfig
from specdec.training.data import load_conversations
from specdec.training.trainer import held_out_split


def held_out_prompts(recipe: str) -> list[list[dict]]:
    config = TrainConfig.from_sources(recipe, {"out": "unused"})  # only the split
    convs = load_conversations([Path(f) for f in config.data], config.limit, config.seed)
    return held_out_split(convs, config)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, help="training recipe (YAML) whose split to use")
    p.add_argument("--drafter", action="append", required=True, metavar="KIND=PATH",
                   help="a drafter kind and its folder (repeatable)")
    p.add_argument("--budget", type=int, default=8, help="static draft budget (nodes per step)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--activations", default="float", choices=("float", "q8"))
    p.add_argument("--json", required=True)
    args = p.parse_args()
    prompts = held_out_prompts(args.recipe)
    t0 = time.perf_counter()
    plain_llm = LLM(activations=args.activations)
    ids = [chat_token_ids(plain_llm.tokenizer, p) for p in prompts]
    plain = EngineSystem(plain_llm, args.max_tokens).run(ids)[1]
    ref = dict(enumerate(plain))
    report = {"recipe": args.recipe, "num_prompts": len(prompts), "budget": args.budget,
              "max_tokens": args.max_tokens, "activations": args.activations, "drafters": {}}
    for spec in args.drafter:
        kind, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"--drafter wants KIND=PATH, got {spec!r}")
        llm = LLM(activations=args.activations, drafter=kind, drafter_args={"path": path},
                  controller="static", controller_args={"budget": args.budget})
        outs = EngineSystem(llm, args.max_tokens).run(ids)[1]
        row = speculation_summary(outs)
        row["greedy_match_rate"] = match_rates(dict(enumerate(outs)), ref)[0]
        report["drafters"][spec] = row
        print(spec, json.dumps(row), flush=True)
    report["seconds"] = time.perf_counter() - t0
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
