"""Plain decode beside llama.cpp's own ``llama-bench`` on the same GGUF, the same threads:
tg128 (128 tokens generated; llama-bench after an empty prompt, specdec after a one-token one,
decode only: the first token's time excluded), rounds interleaved so that drift spreads over
both.

    .venv/bin/python docs/bench/tg128.py --model runs/shapes/smollm2-1.7b_q4_k_m.gguf \\
        [--activations q8,float] [--rounds 3] [--threads 2] [--tokens 128] [--json OUT]

Per round: ``llama-bench -m FILE -t THREADS -p 0 -n 128 -r 1 -o json`` in a subprocess, then
one 128-token greedy generation per activations mode on engines built once (one LLM per mode;
``ignore_eos``). Reported: tokens/s per round and their medians, the ratio specdec / llama.cpp
(of the medians), and the weight bytes a specdec decode step streams against the file's size.
``llama-bench`` must be on PATH (build it from llama.cpp: docs/benchmarks.md says how).

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``SPECDEC_BENCH_QUICK=1``
with a tiny GGUF, ``--tokens 4 --rounds 1``; without ``llama-bench`` on PATH it says so and
measures specdec alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import time

import torch

from specdec import LLM, SamplingParams


def llama_bench(model: str, threads: int, tokens: int) -> float:
    out = subprocess.run(["llama-bench", "-m", model, "-t", str(threads), "-p", "0", "-n",
                          str(tokens), "-r", "1", "-o", "json"], check=True,
                         capture_output=True, text=True).stdout
    (row,) = [r for r in json.loads(out) if r.get("n_gen") == tokens]
    return float(row["avg_ts"])


def specdec_tg(llm: LLM, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    bos = llm.tokenizer.bos_token_id
    prompt = [bos if bos is not None else 0]
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt], params)
    seconds = time.perf_counter() - t0
    ttft = out.metrics.ttft if out.metrics and out.metrics.ttft else 0.0
    return (len(out.token_ids) - 1) / (seconds - ttft)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a .gguf file")
    ap.add_argument("--activations", default="q8,float")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated (tg128: 128)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    have_llama = shutil.which("llama-bench") is not None
    if not have_llama and os.environ.get("SPECDEC_BENCH_QUICK") != "1":
        raise SystemExit("llama-bench is not on PATH")
    if not have_llama:
        print("skipped: llama-bench (not on PATH; quick form: specdec alone)", flush=True)
    torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.activations.split(",") if m.strip()]
    engines = {m: LLM(model=args.model, activations=m) for m in modes}
    for llm in engines.values():  # warm-up: kernels, step costs, page cache
        llm.generate([[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    if have_llama:
        llama_bench(args.model, args.threads, args.tokens)
    rounds: dict[str, list[float]] = {**({"llama-bench": []} if have_llama else {}),
                                      **{m: [] for m in modes}}
    for r in range(args.rounds):
        if have_llama:
            rounds["llama-bench"].append(llama_bench(args.model, args.threads, args.tokens))
        for m, llm in engines.items():
            rounds[m].append(specdec_tg(llm, args.tokens))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rounds.items()),
              flush=True)
    med = {k: statistics.median(v) for k, v in rounds.items()}
    report = {"model": args.model, "threads": args.threads, "cpu": platform.processor(),
              "tokens": args.tokens, "tokens_per_s": rounds, "median": med,
              "vs_llama_bench": {m: med[m] / med["llama-bench"] for m in modes} if have_llama
              else None,
              "weight_bytes_per_token": {
                  m: engines[m].engine.parts.weight_bytes_per_forward for m in modes}}
    for m in modes:
        vs = (f" = {report['vs_llama_bench'][m]:.3f} x llama-bench ({med['llama-bench']:.2f})"
              if have_llama else "")
        print(f"{m}: {med[m]:.2f} tok/s{vs}; "
              f"{report['weight_bytes_per_token'][m] / 1e9:.3f} GB of weights a token "
              "(a one-row step's: of an MoE, its top-k experts' share)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
