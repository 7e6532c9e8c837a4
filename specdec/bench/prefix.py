"""``specdec bench-prefix``: what prefix caching and the disk tier buy, side by side in one run.

Every workload runs the same requests on an engine with the cache and one without, alternating
which goes first, and checks that both emit the same tokens:

- ``turn2``: MT-Bench second turns (the history is the first turn and the engine's own answer),
  one request at a time: TTFT with the cache vs without;
- ``shared``: one long system prompt before many short questions, batch 8: prefill tokens
  computed and TTFT;
- ``nohit``: first turns with a distinct ``cache_salt`` each (the cache's costs, none of its
  hits), batch 8: throughput with the cache vs without (``enable_prefix_caching`` default's
  price);
- ``tier``: distinct long prompts in a KV cache that holds one of them, run twice: the second
  pass's TTFT with the disk tier vs recomputing the evicted pages.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from specdec.bench.compare import percentiles
from specdec.bench.data import chat_ids, first_turn_items, load_questions, next_turn_items
from specdec.engine.llm import LLM
from specdec.sampling_params import SamplingParams

WORKLOADS = ("turn2", "shared", "nohit", "tier")

SYSTEM_PROMPT = """You are the support assistant of a company that sells kitchen appliances \
online. Follow these rules in every answer.
1. Be accurate. If you do not know something, say so and suggest where the customer can find \
it: the product manual, the order page, or the support line, which is open on weekdays from \
nine to five.
2. Be brief. Answer the question first, in one or two sentences, then give details only if \
they help. Use short paragraphs and numbered steps for instructions.
3. Orders. Customers can track an order on the order page with the order number from their \
confirmation email. Standard delivery takes three to five working days; express delivery takes \
one to two. Orders above fifty euros ship for free. An order can be changed or cancelled until \
it has been handed to the carrier.
4. Returns. Unused products can be returned within thirty days for a full refund. Used products \
can be returned within fourteen days if they are faulty. The customer starts a return on the \
order page and prints the label; refunds arrive within ten days of the return reaching the \
warehouse.
5. Warranty. Every appliance has a two-year warranty against manufacturing faults. The warranty \
does not cover damage from misuse, drops, or descaling that was not done as the manual says. \
For a warranty claim the customer needs the order number and a short description or a photo of \
the fault.
6. Safety. If a customer describes smoke, sparks, a burning smell, or water near an electrical \
part, tell them to unplug the appliance at once and stop using it, then to contact support.
7. Tone. Be friendly and calm, never blame the customer, and do not promise anything these \
rules do not allow, such as refunds outside the return window or free express delivery.
8. Privacy. Never ask for a full card number or a password. An order number and an email \
address are enough to find an order.
Now answer the customer's question."""


def run_prefix_bench(args, engine_kwargs: dict) -> dict:
    """The workloads ``args.workloads`` on engines made with ``engine_kwargs`` (the CLI's;
    each workload sets the cache and tier options itself)."""
    questions = load_questions(Path(args.dataset), args.num_prompts)
    workloads = args.workloads.split(",") if isinstance(args.workloads, str) else args.workloads
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"--workloads: unknown {sorted(unknown)}; choose from "
                         f"{', '.join(WORKLOADS)}")
    common = {k: v for k, v in engine_kwargs.items()
              if k not in ("enable_prefix_caching", "kv_tier_path", "kv_tier_bytes",
                           "kv_host_tier_bytes")}
    common["max_num_seqs"] = 32
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens)
    report: dict = {"config": {"model": args.model, "num_prompts": len(questions),
                               "max_new_tokens": args.max_new_tokens, "drafter": args.drafter,
                               "activations": args.activations}}
    if {"turn2", "shared", "nohit"} & set(workloads):
        cached, plain = LLM(**common), LLM(enable_prefix_caching=False, **common)
        if "turn2" in workloads:
            report["turn2"] = _turn2(cached, plain, questions, params)
        if "shared" in workloads:
            report["shared"] = _shared(cached, plain, questions, params)
        if "nohit" in workloads:
            report["nohit"] = _nohit(cached, plain, questions, params, args.repeats)
        del cached, plain
    if "tier" in workloads:
        report["tier"] = _tier(common, questions, params, args.tier_dir)
    return report


def _pair(cached: LLM, plain: LLM, prompts, params, turn: int, salt: str | None = None):
    """Both engines on the same prompts, the order alternating with ``turn``: (cached outputs,
    uncached outputs, cached seconds, uncached seconds)."""
    runs = {}
    for name in (("cached", "plain") if turn % 2 == 0 else ("plain", "cached")):
        llm = cached if name == "cached" else plain
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params if salt is None else _salted(params, len(prompts),
                                                                         salt))
        runs[name] = (outs, time.perf_counter() - t0)
    return runs["cached"][0], runs["plain"][0], runs["cached"][1], runs["plain"][1]


def _salted(params: SamplingParams, n: int, salt: str) -> list[SamplingParams]:
    """``params`` with a distinct cache_salt for each of n prompts (no hit among them)."""
    return [dataclasses.replace(params, cache_salt=f"{salt}-{i}") for i in range(n)]


def _same(a, b) -> bool:
    return [o.token_ids for o in a] == [o.token_ids for o in b]


def _ttft(outs) -> list[float]:
    return [o.metrics.ttft for o in outs if o.metrics.ttft is not None]


def _ratio(a: dict, b: dict) -> float | None:
    return a["p50"] / b["p50"] if a.get("p50") and b.get("p50") else None


def _turn2(cached: LLM, plain: LLM, questions, params) -> dict:
    tok = cached.tokenizer
    firsts = first_turn_items(questions, tok)
    answers = {}
    for i, item in enumerate(firsts):  # the history, computed once by each engine
        a, b, *_ = _pair(cached, plain, [item.prompt_ids], params, i)
        answers[item.key] = tok.decode(a[0].token_ids, skip_special_tokens=True)
    seconds = next_turn_items(questions, tok, answers, 1)
    got, want = [], []
    for i, item in enumerate(seconds):
        a, b, *_ = _pair(cached, plain, [item.prompt_ids], params, i)
        got += a
        want += b
    c, p = percentiles(_ttft(got)), percentiles(_ttft(want))
    return {"requests": len(seconds), "same_outputs": _same(got, want),
            "prompt_tokens_mean": statistics.mean(len(it.prompt_ids) for it in seconds),
            "cached_tokens_mean": statistics.mean(o.metrics.num_cached_tokens for o in got),
            "ttft_ms_cached": c, "ttft_ms_uncached": p, "ttft_p50_ratio": _ratio(c, p)}


def _shared(cached: LLM, plain: LLM, questions, params, batch: int = 8) -> dict:
    tok = cached.tokenizer
    prompts = [chat_ids(tok, [{"role": "system", "content": SYSTEM_PROMPT},
                              {"role": "user", "content": q.turns[0]}]) for q in questions]
    got, want = [], []
    before = cached.engine.totals.cached_tokens
    for i in range(0, len(prompts), batch):
        a, b, *_ = _pair(cached, plain, prompts[i:i + batch], params, i // batch)
        got += a
        want += b
    total = sum(len(p) for p in prompts)
    saved = cached.engine.totals.cached_tokens - before
    c, p = percentiles(_ttft(got)), percentiles(_ttft(want))
    return {"requests": len(prompts), "batch": batch, "same_outputs": _same(got, want),
            "system_prompt_tokens": len(chat_ids(tok, [{"role": "system",
                                                          "content": SYSTEM_PROMPT}])),
            "prefill_tokens_uncached": total, "prefill_tokens_cached": total - saved,
            "ttft_ms_cached": c, "ttft_ms_uncached": p, "ttft_p50_ratio": _ratio(c, p)}


def _nohit(cached: LLM, plain: LLM, questions, params, repeats: int, batch: int = 8) -> dict:
    prompts = [it.prompt_ids for it in first_turn_items(questions, cached.tokenizer)]
    ratios, tps = [], {"cached": [], "plain": []}
    hits_before = cached.engine.totals.cached_tokens
    same = True
    for r in range(repeats):
        secs = {"cached": 0.0, "plain": 0.0}
        tokens = 0
        for i in range(0, len(prompts), batch):
            a, b, sa, sb = _pair(cached, plain, prompts[i:i + batch], params, r + i // batch,
                                 salt=f"r{r}b{i}")
            same &= _same(a, b)
            secs["cached"] += sa
            secs["plain"] += sb
            tokens += sum(len(o.token_ids) for o in a)
        for k in secs:
            tps[k].append(tokens / secs[k])
        ratios.append(tps["cached"][-1] / tps["plain"][-1])
    return {"requests": len(prompts), "batch": batch, "repeats": repeats, "same_outputs": same,
            "cached_tokens": cached.engine.totals.cached_tokens - hits_before,
            "tokens_per_s_cached": tps["cached"], "tokens_per_s_uncached": tps["plain"],
            "throughput_ratio_median": statistics.median(ratios), "ratios": ratios}


def _tier(common: dict, questions, params, tier_dir: str | None, num_pages: int = 64) -> dict:
    """Distinct ~560-token prompts in a 64-page (1,024-token) KV: the second pass finds each
    prompt's pages in the tier, or recomputes them."""
    folder = Path(tier_dir) if tier_dir else Path(tempfile.mkdtemp(prefix="specdec-tier-"))
    path = folder / "bench-kv.tier"
    small = dict(common, num_pages=num_pages, max_model_len=num_pages * 16, max_num_seqs=1)
    with_tier = LLM(kv_tier_path=str(path), **small)
    without = LLM(**small)  # the cache in memory only: evicted pages are recomputed
    tok = with_tier.tokenizer
    prompts = [chat_ids(tok, [{"role": "system", "content": f"Case {i}. {SYSTEM_PROMPT}"},
                              {"role": "user", "content": q.turns[0]}])
               for i, q in enumerate(questions)]
    prompts = [p for p in prompts if len(p) + params.max_tokens <= num_pages * 16]
    got, want = [], []
    for pass_ in range(2):
        for i, p in enumerate(prompts):
            a, b, *_ = _pair(with_tier, without, [p], params, i)
            if pass_:
                got += a
                want += b
    tier = with_tier.engine.parts.tier
    c, p = percentiles(_ttft(got)), percentiles(_ttft(want))
    out = {"requests": len(prompts), "kv_pages": num_pages, "same_outputs": _same(got, want),
           "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
           "cached_tokens_mean_tier": statistics.mean(o.metrics.num_cached_tokens for o in got),
           "cached_tokens_mean_memory_only": statistics.mean(o.metrics.num_cached_tokens
                                                             for o in want),
           "tier_hits": tier.hits, "tier_stores": tier.stores, "tier_torn": tier.torn,
           "tier_seconds": tier.seconds,
           "tier_read_ms_per_page": None if tier.read_seconds is None else tier.read_seconds * 1e3,
           "ttft_ms_tier": c, "ttft_ms_recompute": p, "ttft_p50_ratio": _ratio(c, p)}
    tier.close()
    path.unlink(missing_ok=True)
    return out


def print_prefix_report(report: dict) -> None:
    from specdec.bench.report import fmt

    lines = ["specdec bench-prefix"]
    for name, key_c, key_u in (("turn2", "ttft_ms_cached", "ttft_ms_uncached"),
                               ("shared", "ttft_ms_cached", "ttft_ms_uncached"),
                               ("tier", "ttft_ms_tier", "ttft_ms_recompute")):
        r = report.get(name)
        if r:
            lines.append(f"  {name:7s} TTFT p50 {fmt(r[key_c].get('p50'), '.1f')} ms vs "
                         f"{fmt(r[key_u].get('p50'), '.1f')} ms  (ratio "
                         f"{fmt(r['ttft_p50_ratio'], '.3f')}), same outputs "
                         f"{r['same_outputs']}")
    if report.get("shared"):
        r = report["shared"]
        lines.append(f"  shared  prefill tokens {r['prefill_tokens_cached']} vs "
                     f"{r['prefill_tokens_uncached']}")
    if report.get("nohit"):
        r = report["nohit"]
        lines.append(f"  nohit   throughput ratio (cache on / off) median "
                     f"{fmt(r['throughput_ratio_median'], '.3f')} over {r['repeats']} repeats, "
                     f"cached tokens {r['cached_tokens']}, same outputs {r['same_outputs']}")
    print("\n".join(lines), file=sys.stdout)
