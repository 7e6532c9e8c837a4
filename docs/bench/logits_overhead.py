"""What logprobs, structured output and penalties cost per token, with and without a drafter
(issue 32's performance target: a JSON schema within 10 % of TPOT; speculation still paying).

    .venv/bin/python docs/bench/logits_overhead.py [--prompts 12] [--tokens 64]
        [--batch-sizes 1,8] [--drafters none,ngram] [--json OUT]

SmolLM2-135M-Instruct, q8 activations, MT-Bench first turns. For each drafter (goodput controller)
and batch size one engine; every mode runs on the same prompts, modes interleaved prompt batch
by prompt batch (the machine's drift spreads over all of them): plain (no option), logprobs
(5 alternatives), penalties (frequency 0.3, presence 0.3, repetition 1.1), json_object, and a
JSON schema. Reported per mode: generated tokens per second, the mean time per output token of
each request (its decode time / its tokens after the first: TPOT), and both against plain.
Ratios only mean something within one run: say which CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from specdec import LLM, SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "points": {"type": "array", "items": {"type": "string"}},
    "score": {"type": "integer"}}, "required": ["title", "points", "score"]}
MODES = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"frequency_penalty": 0.3, "presence_penalty": 0.3, "repetition_penalty": 1.1},
    "json_object": {"structured_outputs": StructuredOutputs(json_object=True)},
    "json_schema": {"structured_outputs": StructuredOutputs(json=SCHEMA)},
}


def _chats(path: Path, n: int) -> list:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    return [[{"role": "user", "content": r["turns"][0] + " Answer in JSON."}] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="../shared/data/eval/mt_bench.jsonl")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--drafters", default="none,ngram")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    chats = _chats(Path(args.dataset), args.prompts)
    results = []
    for drafter in args.drafters.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            llm = LLM(activations="q8", max_num_seqs=batch,
                      drafter=None if drafter == "none" else drafter)
            llm.generate(chats[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
            totals = {m: [0.0, 0, []] for m in MODES}  # seconds, tokens, per-request TPOTs
            for start in range(0, len(chats), batch):
                group = chats[start:start + batch]
                for mode, extra in MODES.items():
                    params = SamplingParams(temperature=0, max_tokens=args.tokens, **extra)
                    t0 = time.perf_counter()
                    outs = llm.generate(group, params)
                    totals[mode][0] += time.perf_counter() - t0
                    totals[mode][1] += sum(len(o.token_ids) for o in outs)
                    totals[mode][2] += [o.metrics.tpot for o in outs if o.metrics.tpot]
            base = totals["plain"]
            for mode, (secs, toks, tpots) in totals.items():
                tpot = sum(tpots) / len(tpots) * 1e3
                base_tpot = sum(base[2]) / len(base[2]) * 1e3
                row = {"drafter": drafter, "batch": batch, "mode": mode,
                       "tok_s": toks / secs, "tpot_ms": tpot,
                       "tok_s_vs_plain": (toks / secs) / (base[1] / base[0]),
                       "tpot_vs_plain": tpot / base_tpot}
                results.append(row)
                print(f"{drafter:6} b{batch:<2} {mode:12} {row['tok_s']:8.1f} tok/s "
                      f"TPOT {tpot:6.2f} ms  tok/s x{row['tok_s_vs_plain']:.3f}  "
                      f"TPOT x{row['tpot_vs_plain']:.3f}", flush=True)
            llm.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": platform.processor(), "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
