"""The suffix drafter's host time per step, offline: a stream of requests replayed without a
model, so that drafting is all that is timed (issue 34: at most 0.1 ms a step at batch 1).

Each request is a training-side chat (``../shared/data/train``, never eval) whose reference
answer stands in for the target's output: at each step the drafter proposes within a budget of
``--budget`` nodes, the longest tree path that agrees with the answer is accepted, plus one
token, and the request goes on from there; a finished request joins the drafter's history, as
in the engine. One drafter per path (``native``: the compiled hot path; ``python``: numpy, the
oracle), run on the same steps interleaved; every step's drafts must be identical.

    .venv/bin/python docs/bench/suffix_draft_time.py [--requests 200] [--budget 16]
        [--data gsm8k_train.jsonl] [--profile] [--json OUT]

Reported: median and mean microseconds per ``propose`` call (one request) for each path, in
the thread's CPU time (so that a job sharing the machine does not count), their ratio, tau (tokens per step under the replay: a proxy of acceptance, not the target's), the
draft size and the history size. ``--profile`` prints cProfile's top functions for the Python
path instead. Times only compare within one run on one machine: say which CPU.

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--tokenizer`` a tiny chat
model's folder, ``--train`` a folder of a small ``gsm8k_train.jsonl``, ``--requests 6
--budget 4``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path

from specdec import SamplingParams
from specdec.controllers.base import DraftBudget
from specdec.drafters.base import DraftRequest, TokenView
from specdec.drafters.suffix import SuffixDrafter

TRAIN = Path("../shared/data/train")


def load_stream(file: Path, n: int, tokenizer: str | None = None
                ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the file's first ``n`` records, chat-templated by
    ``tokenizer`` (a folder; default SmolLM2-135M-Instruct's, converted in the cache)."""
    from transformers import AutoTokenizer

    from specdec.models.aliases import cache_dir

    tok = AutoTokenizer.from_pretrained(tokenizer or cache_dir() / "models" /
                                        "smollm2-135m-instruct")
    out = []
    with open(file) as f:
        for line in f:
            if len(out) == n:
                break
            rec = json.loads(line)
            chat = tok.apply_chat_template([{"role": "user", "content": rec["question"]}],
                                           add_generation_prompt=True, tokenize=False)
            out.append((tok.encode(chat), tok.encode(rec["answer"]) + [tok.eos_token_id]))
    return out


def accepted(tree, truth: list[int]) -> int:
    """Length of the longest tree path that agrees with ``truth``."""
    depth = {-1: 0}
    best = 0
    for i, (tok, par) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        d = depth.get(par)
        if d is not None and d < len(truth) and truth[d] == tok:
            depth[i] = d + 1
            best = max(best, d + 1)
    return best


def _same(a, b) -> bool:
    probs = [None if t.path_probs is None else t.path_probs.tolist() for t in (a, b)]
    return (a.tokens.tolist(), a.parents.tolist(), probs[0]) == (
        b.tokens.tolist(), b.parents.tolist(), probs[1])


def replay(stream, drafters: dict[str, SuffixDrafter], budget: int) -> dict:
    times = {name: [] for name in drafters}
    steps = emitted = nodes = mismatches = 0
    params = SamplingParams(temperature=0)
    for r, (prompt, answer) in enumerate(stream):
        states = {name: d.init_state(f"r{r}", prompt) for name, d in drafters.items()}
        tokens, done = list(prompt), 0
        while done < len(answer):
            trees = {}
            for name, d in drafters.items():
                req = DraftRequest(f"r{r}", TokenView(tokens), DraftBudget(budget), params,
                                   None, states[name])
                start = time.thread_time()
                (trees[name],) = d.propose([req])
                times[name].append(time.thread_time() - start)
            first, *rest = trees.values()
            for t in rest:
                mismatches += not _same(t, first)
            take = accepted(first, answer[done:]) + 1
            tokens += answer[done:done + take]
            done += take
            steps += 1
            emitted += take
            nodes += first.num_nodes
        for name, d in drafters.items():
            d.release(states[name])
    us = {name: {"median_us": 1e6 * statistics.median(t), "mean_us": 1e6 * statistics.mean(t)}
          for name, t in times.items()}
    return {"steps": steps, "tau": emitted / steps, "nodes_per_step": nodes / steps,
            "per_propose": us, "draft_mismatches": mismatches,
            "history": next(iter(drafters.values())).stats()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--data", default="gsm8k_train.jsonl")
    ap.add_argument("--train", type=Path, default=TRAIN, help="the folder of --data")
    ap.add_argument("--tokenizer", default=None,
                    help="a folder with a chat template (default SmolLM2-135M-Instruct's)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    stream = load_stream(args.train / args.data, args.requests, args.tokenizer)
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(replay, stream, {"python": SuffixDrafter(None, native=False)}, args.budget)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    drafters = {"native": SuffixDrafter(None, native=True),
                "python": SuffixDrafter(None, native=False)}
    report = replay(stream, drafters, args.budget)
    report["ratio_python_over_native"] = (report["per_propose"]["python"]["median_us"]
                                          / report["per_propose"]["native"]["median_us"])
    report["command"] = "docs/bench/suffix_draft_time.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if k not in ("json", "profile", "train", "tokenizer"))
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
