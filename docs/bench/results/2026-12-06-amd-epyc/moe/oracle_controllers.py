"""Oracle speculation on one GGUF at batch 1 and 8: each controller (static budgets and goodput)
beside the plain engine, greedy, the default mode (q8 activations on the file's native blocks).

The oracle drafter (drafters/oracle.py) proposes the plain engine's greedy continuation, each of
its --depth chain nodes wrong with the rate that gives tau at that depth (error_rate_for_tau):
a drafter of a fixed per-token quality; a static budget b < depth drafts b nodes of it, the
goodput controller picks per request and step (its default args; on an MoE it prices a step
by the experts it expects to wake). Per tau and pass: plain batch 1 (each prompt alone) and
batch 8 (the 8 prompts in one generate call), then each controller's engine (built after the
previous one is freed; one untimed warm-up prompt) at batch 1 and 8. Speedup = spec tok/s /
the same pass's plain tok/s, median over passes.

    .venv/bin/python docs/bench/results/2026-12-06-amd-epyc/moe/oracle_controllers.py \
        --model FILE.gguf [--taus 2,3] [--depth 4] [--controllers static:1,...,goodput] \
        [--num-prompts 8] [--b1-prompts 4] [--max-new-tokens 32] [--repeats 1] [--json OUT]
"""
import argparse, gc, json, os, statistics, time
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
p.add_argument("--controllers", default="static:1,static:2,static:3,static:4,goodput")
p.add_argument("--num-prompts", type=int, default=8)
p.add_argument("--b1-prompts", type=int, default=2)
p.add_argument("--max-new-tokens", type=int, default=32)
p.add_argument("--repeats", type=int, default=1)
p.add_argument("--batches", default="1,8")
p.add_argument("--json")
a = p.parse_args()
kw = dict(model=a.model, activations="q8", max_model_len=1024)
batches = [int(b) for b in a.batches.split(",")]
plain = LLM(**kw)
prompts = [it.prompt_ids for it in first_turn_items(load_questions(DATASET, a.num_prompts),
                                                    plain.tokenizer)]
params = SamplingParams(temperature=0, max_tokens=a.max_new_tokens, ignore_eos=True)


def run(llm, b):
    """(decode tok/s, outputs, mean tau or None) at batch b: batch 1 = each of the first
    b1-prompts alone, else one call of b prompts. Decode tok/s = tokens after each request's
    first / (wall - the latest first-token time) per call: prefill left out (the prompts are
    in the prefix cache anyway, warmed before)."""
    groups = [[q] for q in prompts[:a.b1_prompts]] if b == 1 else [prompts[:b]]
    toks, secs, outs = 0, 0.0, []
    for g in groups:
        t0 = time.perf_counter()
        o = llm.generate(g, params)
        wall = time.perf_counter() - t0
        outs += o
        secs += wall - max(x.metrics.ttft or 0.0 for x in o)
        toks += sum(len(x.token_ids) - 1 for x in o)
    taus = [x.metrics.tau for x in outs if x.metrics.tau is not None]
    return toks / secs, outs, (statistics.fmean(taus) if taus else None)


truth = {tuple(q): plain.generate([q], params)[0].token_ids for q in prompts}
plain.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # plain warm-up at batch 8
out = {"model": a.model, "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg(),
       "depth": a.depth, "max_new_tokens": a.max_new_tokens, "num_prompts": len(prompts),
       "b1_prompts": a.b1_prompts, "repeats": a.repeats, "runs": []}
for tau in [float(t) for t in a.taus.split(",")]:
    rate = error_rate_for_tau(tau, a.depth)
    plain_tps = {b: [] for b in batches}
    spec = {c: {b: {"tps": [], "tau": [], "same": True} for b in batches}
            for c in a.controllers.split(",")}
    for _ in range(a.repeats):
        for b in batches:
            plain_tps[b].append(run(plain, b)[0])
        for c in spec:
            name, _, budget = c.partition(":")
            ckw = {"budget": int(budget)} if budget else {}
            llm = LLM(drafter="oracle", controller=name, controller_args=ckw,
                      plugins=(oracle_plugin(truth, rate, a.depth),), **kw)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up: batch shapes, prompts into the prefix cache
            for b in batches:
                tps, outs, t = run(llm, b)
                s = spec[c][b]
                s["tps"].append(tps)
                if t is not None:
                    s["tau"].append(t)
                s["same"] &= all(o.token_ids == truth[tuple(q)] for q, o in zip(prompts, outs))
            del llm
            gc.collect()
    for b in batches:
        pl = statistics.median(plain_tps[b])
        row = {"tau_target": tau, "error_rate": rate, "batch": b, "plain_tok_s": pl,
               "plain_tok_s_all": plain_tps[b], "controllers": {}}
        for c, d in spec.items():
            s = d[b]
            row["controllers"][c] = {
                "tok_s": statistics.median(s["tps"]), "tok_s_all": s["tps"],
                "speedup": statistics.median(x / y for x, y in zip(s["tps"], plain_tps[b])),
                "tau": statistics.fmean(s["tau"]) if s["tau"] else None,
                "outputs_equal_plain": s["same"]}
        static = {c: v for c, v in row["controllers"].items() if c.startswith("static")}
        best = max(static, key=lambda c: static[c]["tok_s"])
        row["best_static"] = best
        if "goodput" in row["controllers"]:
            row["goodput_over_best_static"] = (row["controllers"]["goodput"]["tok_s"]
                                               / static[best]["tok_s"])
        out["runs"].append(row)
        print(f"tau {tau} batch {b}: plain {pl:.2f} tok/s | " + " | ".join(
            f"{c} {v['tok_s']:.2f} ({v['speedup']:.2f}x, tau {v['tau'] or 0:.2f}"
            f"{'' if v['outputs_equal_plain'] else ', DIFFERS'})"
            for c, v in row["controllers"].items())
            + f" | best static {best}; goodput/best {row.get('goodput_over_best_static', 0):.3f}",
            flush=True)
out["loadavg_end"] = os.getloadavg()
print("loadavg", out["loadavg_start"], "->", out["loadavg_end"])
if a.json:
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
