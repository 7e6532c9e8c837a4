"""Acceptance by depth of drafters on prompts they never saw (issue 19 item 4, issue 31 item 6).

Prompts come from a training recipe's held-out split (`--recipe`: the `holdout` conversations
of its seeded split, exactly as `specdec train` sets them aside) or from an evaluation file
(`--dataset`: MT-Bench / Spec-Bench first turns, HumanEval, GSM8K test, read as `specdec bench`
reads them), so drafters trained on different data are compared on prompts none saw. Every
drafter runs greedily under the static controller at fixed budgets (`--budgets 1,8`: budget 1 is
one node, so tau - 1 is the depth-1 acceptance, i.e. the drafter's top-1 agreement with the
target along the target's own greedy text), so the figures do not depend on timing (the goodput
controller's do): acceptance at depth d is the share of verification steps that accepted at
least d drafted tokens, tau the tokens per target forward. Greedy outputs are checked against
plain decoding. No speed is measured.

With `--steps-json` every verification step is recorded (prompt, output position, nodes
proposed, nodes accepted), and the report breaks acceptance down by category, by position in the
answer and by prompt length.

    .venv/bin/python docs/bench/holdout_acceptance.py --recipe recipes/eagle3_smollm2_general_all.yaml \
        --drafter eagle3=drafters/shipped/eagle3-smollm2-135m-instruct-general --json out.json
    .venv/bin/python docs/bench/holdout_acceptance.py --dataset ../shared/data/eval/mt_bench.jsonl \
        --drafter ngram --drafter mtp=drafters/shipped/mtp-smollm2-135m-instruct-general \
        --budgets 1,8 --max-tokens 64 --activations q8 --json mt_bench.json --steps-json steps.json

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--model`` a tiny GGUF with a
chat template, a 4-question ``--dataset``, ``--drafter ngram --budgets 1,2 --max-tokens 4
--num-prompts 2 --steps-json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from specdec import LLM
from specdec.bench.compare import match_rates, speculation_summary
from specdec.bench.data import first_turn_items, load_questions
from specdec.models.tokenizer import chat_token_ids
from specdec.sampling_params import SamplingParams
from specdec.training.config import TrainConfig
from specdec.training.data import load_conversations
from specdec.training.trainer import held_out_split

POSITION_BUCKETS = (0, 8, 16, 32, 64, 128, 256)
PROMPT_BUCKETS = (0, 32, 64, 128, 256, 512, 100000)


def held_out_prompts(recipe: str) -> list[list[dict]]:
    config = TrainConfig.from_sources(recipe, {"out": "unused"})  # only the split
    convs = load_conversations([Path(f) for f in config.data], config.limit, config.seed)
    return held_out_split(convs, config)[1]


def prompt_ids(args, tokenizer) -> tuple[list[list[int]], list[str]]:
    """(token ids, category) of every prompt: the recipe's held-out chats, or the dataset's
    first turns (all of them, or `--num-prompts` picked round-robin over categories)."""
    if args.recipe:
        prompts = held_out_prompts(args.recipe)[:args.num_prompts]
        return [chat_token_ids(tokenizer, p) for p in prompts], ["held_out"] * len(prompts)
    items = first_turn_items(load_questions(Path(args.dataset), args.num_prompts), tokenizer)
    return [it.prompt_ids for it in items], [it.category for it in items]


class StepTap:
    """Records, per request, each verification step's output position (tokens generated before
    the step), nodes proposed and nodes accepted, from the controller's own calls."""

    def __init__(self, controller) -> None:
        self.position: dict[str, int] = {}
        self.steps: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
        budgets, observe = controller.budgets, controller.observe

        def tapped_budgets(requests, batch):
            for r in requests:
                self.position[r.request_id] = r.num_output_tokens
            return budgets(requests, batch)

        def tapped_observe(report):
            for o in report.outcomes:
                self.steps[o.request_id].append(
                    (self.position.get(o.request_id, -1), o.num_proposed, o.num_accepted))
            return observe(report)

        controller.budgets, controller.observe = tapped_budgets, tapped_observe


def breakdown(rows: list[dict], key, depths: int = 3) -> dict:
    """Acceptance at depth 1..depths and nodes accepted per node proposed, grouped by key(row)."""
    groups: dict = defaultdict(lambda: [0, [0] * depths, 0, 0])
    for r in rows:
        for pos, proposed, accepted in r["steps"]:
            g = groups[key(r, pos)]
            g[0] += 1
            for d in range(min(accepted, depths)):
                g[1][d] += 1
            g[2] += proposed
            g[3] += accepted
    return {str(k): {"steps": n, "acceptance_by_depth": [a / n for a in acc],
                     "accepted_per_proposed": acc_all / prop if prop else None}
            for k, (n, acc, prop, acc_all) in sorted(groups.items(), key=lambda kv: str(kv[0]))}


def bucket(value: int, edges: tuple[int, ...]) -> str:
    for lo, hi in zip(edges, edges[1:]):
        if lo <= value < hi:
            return f"{lo:04d}-{hi}"
    return f">={edges[-1]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--recipe", help="training recipe (YAML) whose held-out split to use")
    src.add_argument("--dataset", help="evaluation file as specdec bench reads it (first turns)")
    p.add_argument("--num-prompts", type=int, default=None, help="default: all")
    p.add_argument("--drafter", action="append", required=True, metavar="KIND[=PATH]",
                   help="a drafter kind and its folder (repeatable; ngram needs no folder)")
    p.add_argument("--budget", type=int, default=None, help="one static budget (default 8)")
    p.add_argument("--budgets", default=None, help="several static budgets, e.g. 1,8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--activations", default="float", choices=("float", "q8"))
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="the target: an alias, HF folder or .gguf file")
    p.add_argument("--json", required=True)
    p.add_argument("--steps-json", default=None,
                   help="every verification step here, and breakdowns in --json")
    args = p.parse_args()
    if args.budget is not None and args.budgets is not None:
        raise SystemExit("give --budget or --budgets, not both")
    budgets = ([int(b) for b in args.budgets.split(",")] if args.budgets
               else [args.budget if args.budget is not None else 8])
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    plain_llm = LLM(model=args.model, activations=args.activations)
    ids, categories = prompt_ids(args, plain_llm.tokenizer)
    plain = plain_llm.generate(ids, params)
    ref = {i: o for i, o in enumerate(plain)}
    del plain_llm
    report = {"command": " ".join(sys.argv), "source": args.recipe or args.dataset,
              "num_prompts": len(ids), "budgets": budgets, "max_tokens": args.max_tokens,
              "activations": args.activations, "drafters": {}}
    if len(budgets) == 1:
        report["budget"] = budgets[0]
    steps_out: dict = {"prompts": [{"category": c, "prompt_tokens": len(x)}
                                   for c, x in zip(categories, ids)], "systems": {}}
    for spec in args.drafter:
        kind, _, path = spec.partition("=")
        for budget in budgets:
            llm = LLM(model=args.model, activations=args.activations, drafter=kind,
                      drafter_args={"path": path} if path else {},
                      controller="static", controller_args={"budget": budget})
            tap = StepTap(llm.engine.controlling.controller)
            outs = llm.generate(ids, params)
            bad = [o for o in outs if o.finish_reason == "error"]
            if bad:
                raise RuntimeError(f"{spec} budget {budget}: {bad[0].error}")
            row = speculation_summary(outs)
            row["greedy_match_rate"] = match_rates(dict(enumerate(outs)), ref)[0]
            if args.steps_json:
                rows = [{"category": c, "prompt_tokens": len(x), "steps": tap.steps[o.request_id]}
                        for c, x, o in zip(categories, ids, outs)]
                row["by_category"] = breakdown(rows, lambda r, pos: r["category"])
                row["by_position"] = breakdown(rows, lambda r, pos: bucket(pos, POSITION_BUCKETS))
                row["by_prompt_tokens"] = breakdown(
                    rows, lambda r, pos: bucket(r["prompt_tokens"], PROMPT_BUCKETS))
            name = spec if len(budgets) == 1 else f"{spec}@static{budget}"
            if args.steps_json:
                steps_out["systems"][name] = [r["steps"] for r in rows]
            report["drafters"][name] = row
            print(name, json.dumps({k: row[k] for k in ("tau", "acceptance_by_depth",
                                                        "acceptance_rate", "greedy_match_rate")}),
                  flush=True)
            del llm
    report["seconds"] = time.perf_counter() - t0
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.steps_json:
        Path(args.steps_json).write_text(json.dumps(steps_out) + "\n")


if __name__ == "__main__":
    main()
