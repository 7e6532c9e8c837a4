"""Q5_K's per-32 kernel format (Q5_F, before) against its super-block format (Q5_K) on one
GGUF, in one process: the weight bytes a decode step streams and the tokens/s of a 64-token
greedy decode, float and q8 activations, and whether both formats give the same tokens (they
must: the super-block kernels are bitwise the Q5_F ones).

    .venv/bin/python docs/bench/shape_gguf.py --shape smollm2-1.7b --ftype q5_k_m \\
        --out /tmp/q5k/s.gguf
    .venv/bin/python docs/bench/q5k_formats.py /tmp/q5k/s.gguf [--cache /tmp/q5k] [--threads 2]

The old format is chosen by setting gguf_blocks.KERNEL_FORMAT["Q5_K"] to "Q5_F" in this
process only (a measurement, not a mode of specdec); each format prepares its panels into a
cache of its own (SPECDEC_CACHE=<cache>/cache_<old|new>), so neither reads the other's.
Per engine: an 8-token warm-up, then two 64-token rounds (decode only: the first token's time
excluded, as docs/bench/tg128.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from specdec import LLM, SamplingParams
from specdec.models.gguf import blocks as gb

VARIANTS = (("old", "Q5_F"), ("new", "Q5_K"))
MODES = ("float", "q8")


def decode_tok_s(llm: LLM, tokens: int) -> tuple[float, list[int]]:
    """Tokens/s of one greedy decode of ``tokens`` after a one-token prompt, and its tokens."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    (out,) = llm.generate([[0]], params)
    seconds = time.perf_counter() - t0
    ttft = out.metrics.ttft if out.metrics and out.metrics.ttft else 0.0
    return (len(out.token_ids) - 1) / (seconds - ttft), list(out.token_ids)


def measure(model: str, cache: str, tokens: int = 64, rounds: int = 2) -> dict:
    """{"old/float": {...}, ...}: weight bytes a step, tok/s per round, load seconds, tokens."""
    res = {}
    for variant, fmt in VARIANTS:
        gb.KERNEL_FORMAT["Q5_K"] = fmt
        os.environ["SPECDEC_CACHE"] = os.path.join(cache, f"cache_{variant}")
        for mode in MODES:
            t0 = time.perf_counter()
            llm = LLM(model=model, activations=mode)
            load = time.perf_counter() - t0
            llm.generate([[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            runs = [decode_tok_s(llm, tokens) for _ in range(rounds)]
            res[f"{variant}/{mode}"] = dict(
                weight_bytes=llm.engine.parts.weight_bytes_per_forward,
                tok_s=[round(t, 2) for t, _ in runs], load_s=round(load, 1),
                tokens=runs[-1][1])
            del llm
    gb.KERNEL_FORMAT["Q5_K"] = "Q5_K"
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--cache", default="/tmp/q5k")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = measure(args.model, args.cache)
    for mode in MODES:
        old, new = res[f"old/{mode}"], res[f"new/{mode}"]
        print(mode, f"weight bytes a step {old['weight_bytes'] / 1e6:.0f} -> "
              f"{new['weight_bytes'] / 1e6:.0f} MB, tok/s {old['tok_s']} -> {new['tok_s']},",
              "same tokens" if old["tokens"] == new["tokens"] else "TOKENS DIFFER")
    print(json.dumps({k: {f: v for f, v in r.items() if f != "tokens"} for k, r in res.items()}))


if __name__ == "__main__":
    main()
