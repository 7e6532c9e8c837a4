"""Near-duplicate prompts in the training data, across the shipped recipes' held-out splits, and
between the training data and the evaluation sets (issue 31, item 6).

Prompts are compared as `specdec.training.near_dup` does (word 3-gram Jaccard, MinHash LSH
candidates checked exactly). Reported:
  (a) per recipe: held-out prompts with a near duplicate on the training side of the split, as
      the split was drawn (`held_out_split` with the filter off) and as it is drawn now;
  (b) within all of ../shared/data/train: pairs, and prompts with a near duplicate elsewhere,
      per file and across files;
  (c) per evaluation file: prompts with a near duplicate in the training data, and prompts
      sharing a 13-word n-gram with it (the usual contamination test), per training file.
Examples near the threshold are printed so that the threshold can be judged.

    .venv/bin/python docs/bench/near_duplicates.py --json OUT.json [--threshold 0.5]

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--train`` and ``--eval``
folders of small files, ``--recipe`` a tiny recipe over them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from specdec.bench.data import load_questions
from specdec.training.config import TrainConfig
from specdec.training.data import load_conversations, prompts_of
from specdec.training.near_dup import near_duplicates, ngram_overlap, prompt_text
from specdec.training.trainer import held_out_split

TRAIN = Path("../shared/data/train")
EVAL = Path("../shared/data/eval")
RECIPES = ("recipes/eagle3_smollm2_general_all.yaml", "recipes/eagle3_smollm2_code.yaml",
           "recipes/eagle3_smollm2_general.yaml", "recipes/mtp_smollm2_recalibrate.yaml")
SHARED_BY = {"recipes/eagle3_smollm2_general_all.yaml":
             "the shipped eagle3, mtp and block-diffusion general drafters (same data and split)",
             "recipes/eagle3_smollm2_code.yaml": "the shipped code eagle3 head",
             "recipes/eagle3_smollm2_general.yaml": "the earlier general heads (1,000 prompts)",
             "recipes/mtp_smollm2_recalibrate.yaml": "the mtp recalibration"}


def short(text: str, n: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 3] + "..."


def recipe_split(recipe: str, threshold: float) -> dict:
    config = TrainConfig.from_sources(recipe, {"out": "unused", "holdout_near_dup": 0})
    convs = load_conversations([Path(f) for f in config.data], config.limit, config.seed)
    train, held = held_out_split(convs, config)[:2]
    now = held_out_split(convs, dataclasses.replace(config, holdout_near_dup=threshold))
    texts = [prompt_text(prompts_of(c)) for c in train]
    held_texts = [prompt_text(h) for h in held]
    matches = near_duplicates(held_texts, texts, threshold)
    exact = [m for m in matches if m.jaccard == 1.0]
    loose = near_duplicates(held_texts, texts, 0.3)
    sweep = {str(t): {"held_out_with_near_dup": len({m.query for m in loose if m.jaccard >= t}),
                      "train_removed": len({m.other for m in loose if m.jaccard >= t})}
             for t in (0.3, 0.4, 0.5, 0.6, 0.8, 1.0)}
    parent = None
    if config.init_from and (Path(config.init_from) / "train_config.json").exists():
        # a fine-tune also learnt from its parent's training data
        raw = json.loads((Path(config.init_from) / "train_config.json").read_text())
        pconfig = TrainConfig(**{**raw, "out": "unused", "holdout_near_dup": 0})
        pconvs = load_conversations([Path(f) for f in pconfig.data], pconfig.limit, pconfig.seed)
        ptexts = [prompt_text(prompts_of(c)) for c in held_out_split(pconvs, pconfig).train]
        pm = near_duplicates(held_texts, ptexts, threshold)
        parent = {"init_from": config.init_from, "train": len(ptexts),
                  "held_out_with_near_dup_in_parent_train": len({m.query for m in pm})}
    return {"recipe": recipe, "drafters": SHARED_BY.get(recipe), "conversations": len(convs),
            "held_out": len(held), "train": len(train),
            "held_out_with_near_dup_in_train": len({m.query for m in matches}),
            "held_out_with_exact_dup_in_train": len({m.query for m in exact}),
            "train_prompts_near_dup_to_held_out": len({m.other for m in matches}),
            "removed_now": now.near_duplicates_removed, "by_threshold": sweep,
            "parent": parent,
            "examples": [{"jaccard": round(m.jaccard, 3), "held_out": short(held_texts[m.query]),
                          "train": short(texts[m.other]),
                          "train_source": f"{Path(train[m.other].source).name}#"
                                          f"{train[m.other].index}"} for m in matches[:12]]}


def train_prompts(folder: Path = TRAIN) -> tuple[list[str], list[str]]:
    files = sorted(folder.glob("*.json*"))
    convs = load_conversations(files)
    return [prompt_text(prompts_of(c)) for c in convs], [Path(c.source).name for c in convs]


def eval_prompts(folder: Path = EVAL) -> dict[str, list[str]]:
    out = {}
    for name in ("mt_bench.jsonl", "humaneval.jsonl.gz", "gsm8k_test.jsonl"):
        out[name] = ["\n".join(q.turns) for q in load_questions(folder / name, None)]
    return out


def within_train(texts: list[str], sources: list[str], threshold: float) -> dict:
    matches = near_duplicates(texts, None, threshold)
    pairs = Counter()
    members: dict[str, set[int]] = defaultdict(set)
    for m in matches:
        a, b = sources[m.query], sources[m.other]
        key = a if a == b else " x ".join(sorted((a, b)))
        pairs[key] += 1
        members[key].update((m.query, m.other))
    # prompts that a dedup would drop: all but the first of each group (connected component)
    parent = list(range(len(texts)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for m in matches:
        parent[find(m.other)] = find(m.query)
    in_pairs = {i for m in matches for i in (m.query, m.other)}
    groups = {find(i) for i in in_pairs}
    per_file = Counter(sources)
    return {"prompts": len(texts), "per_file": dict(per_file), "pairs": len(matches),
            "exact_pairs": sum(m.jaccard == 1.0 for m in matches),
            "prompts_with_a_near_dup": len(in_pairs),
            "redundant_prompts": len(in_pairs) - len(groups),
            "pairs_by_files": dict(pairs.most_common()),
            "prompts_by_files": {k: len(v) for k, v in members.items()}}, matches


def contamination(evals: dict[str, list[str]], texts: list[str], sources: list[str],
                  threshold: float) -> dict:
    out = {}
    by_file: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(sources):
        by_file[s].append(i)
    for name, queries in evals.items():
        matches = near_duplicates(queries, texts, threshold)
        row = {"prompts": len(queries), "near_dup_in_train": len({m.query for m in matches}),
               "near_dup_by_train_file": dict(Counter(
                   sources[m.other] for m in {m.query: m for m in matches}.values())),
               "ngram13_overlap_by_train_file": {}, "examples": []}
        for f, idx in sorted(by_file.items()):
            share = ngram_overlap(queries, [texts[i] for i in idx], 13)
            row["ngram13_overlap_by_train_file"][f] = {
                "prompts_sharing_a_13gram": sum(s > 0 for s in share),
                "prompts_with_half_their_13grams": sum(s >= 0.5 for s in share)}
        # the closest training prompt of the prompts most covered by 13-grams (all files)
        share = ngram_overlap(queries, texts, 13)
        row["prompts_sharing_a_13gram"] = sum(s > 0 for s in share)
        best = {m.query: m for m in sorted(matches, key=lambda m: m.jaccard)}
        for q, m in sorted(best.items(), key=lambda kv: -kv[1].jaccard)[:8]:
            row["examples"].append({"jaccard": round(m.jaccard, 3), "eval": short(queries[q]),
                                    "train": short(texts[m.other]),
                                    "train_file": sources[m.other]})
        top = sorted(range(len(queries)), key=lambda i: -share[i])[:5]
        row["top_13gram_overlap"] = [{"share": round(share[i], 3), "eval": short(queries[i])}
                                     for i in top if share[i] > 0]
        out[name] = row
    return out


def near_threshold(texts: list[str], sources: list[str], matches, lo: float, hi: float,
                   k: int, seed: int = 0) -> list[dict]:
    """Up to k random pairs with lo <= Jaccard < hi (to judge the threshold by eye)."""
    band = [m for m in matches if lo <= m.jaccard < hi]
    rng = random.Random(seed)
    return [{"jaccard": round(m.jaccard, 3), "a": short(texts[m.query], 240),
             "b": short(texts[m.other], 240), "files": [sources[m.query], sources[m.other]]}
            for m in rng.sample(band, min(k, len(band)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threshold", type=float, default=0.5)
    p.add_argument("--scan-threshold", type=float, default=0.3,
                   help="lowest Jaccard kept for the examples and the histogram")
    p.add_argument("--train", type=Path, default=TRAIN, help="the training data's folder")
    p.add_argument("--eval", type=Path, default=EVAL, help="the evaluation sets' folder")
    p.add_argument("--recipe", action="append", default=None,
                   help="a recipe whose split to check (repeatable; default: the shipped ones)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    report = {"command": " ".join(sys.argv), "threshold": args.threshold,
              "similarity": "Jaccard of word 3-gram sets (NFKC, lower case), MinHash LSH "
                            "128 hashes x 32 bands, candidates checked exactly"}
    report["splits"] = [recipe_split(r, args.threshold) for r in args.recipe or RECIPES]
    texts, sources = train_prompts(args.train)
    within, matches = within_train(texts, sources, args.threshold)
    report["within_train"] = within
    # the histogram and the examples near the threshold come from a lower-threshold scan
    low = near_duplicates(texts, None, args.scan_threshold)
    edges = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.01]
    report["within_train_histogram"] = {
        f"{a:.1f}-{b:.1f}": sum(a <= m.jaccard < b for m in low) for a, b in zip(edges, edges[1:])}
    report["near_threshold_examples"] = {
        f"{lo}-{hi}": near_threshold(texts, sources, low, lo, hi, 6)
        for lo, hi in ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (0.6, 0.7))}
    report["contamination"] = contamination(eval_prompts(args.eval), texts, sources, args.threshold)
    report["seconds"] = time.perf_counter() - t0
    Path(args.json).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps({k: v for k, v in report.items()
                      if k not in ("near_threshold_examples",)}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
