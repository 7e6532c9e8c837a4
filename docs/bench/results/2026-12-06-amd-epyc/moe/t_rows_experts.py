"""T(rows)/T(1) on a mixture-of-experts GGUF with the distinct experts each layer woke, for n
random ids (rows route as independently as they can) and one random id repeated n times (rows
route alike): the two extremes of routing. The engine's own profile path
(controllers/costs.py _time_forward, as profile_experts runs it: n rows over 64 cached slots,
logits for every row, fastest of >= repeats runs). Also a dense file's T(rows) for comparison.

    .venv/bin/python docs/bench/results/2026-12-06-amd-epyc/moe/t_rows_experts.py \
        --model /tmp/moe/olmoe-1b-7b-q4km.gguf [--rows 1,2,4,8,16] [--repeats 3] [--json OUT]
"""
import argparse, json, os, statistics, torch
from specdec import LLM
from specdec.kv.block_table import BlockTable
from specdec.controllers.costs import DEFAULT_CONTEXT, time_forward as _time_forward

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--rows", default="1,2,4,8,16")
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--activations", default="q8")
p.add_argument("--json")
a = p.parse_args()
rows = [int(r) for r in a.rows.split(",")]
llm = LLM(model=a.model, activations=a.activations, max_model_len=1024)
runner = llm.engine.parts.runner
cfg, kv = runner.cfg, runner.kv
table = BlockTable()
assert kv.try_reserve(table, DEFAULT_CONTEXT + max(rows))
gen = torch.Generator().manual_seed(0)
out = {"model": a.model, "activations": a.activations, "threads": torch.get_num_threads(),
       "loadavg_start": os.getloadavg(), "is_moe": bool(getattr(cfg, "is_moe", False)),
       "num_experts": getattr(cfg, "num_experts", None),
       "top_k": getattr(cfg, "num_experts_per_tok", None), "points": []}
for n in rows:
    spread = torch.randint(cfg.vocab_size, (n,), generator=gen).tolist()
    alike = [int(torch.randint(cfg.vocab_size, (1,), generator=gen))] * n
    for kind, ids in (("random", spread), ("repeated", alike)):
        s, woken = _time_forward(runner, ids, DEFAULT_CONTEXT, table, a.repeats, 0.03)
        pt = {"rows": n, "ids": kind, "ms": 1e3 * s}
        if woken:
            pt.update(experts_mean=statistics.fmean(woken), experts_min=min(woken),
                      experts_max=max(woken), experts_per_layer=list(woken))
        out["points"].append(pt)
        if not out["is_moe"]:
            break
kv.release(table)
t1 = {k: next(p["ms"] for p in out["points"] if p["rows"] == rows[0] and p["ids"] == k)
      for k in ("random", "repeated") if any(p["ids"] == k for p in out["points"])}
for pt in out["points"]:
    pt["t_over_t1"] = pt["ms"] / t1[pt["ids"]]
    pt["t_over_t1_random"] = pt["ms"] / t1["random"]
out["loadavg_end"] = os.getloadavg()
print(f"{'rows':>4} {'ids':>8} {'ms':>8} {'T/T1':>6} {'experts/layer mean [min,max]':>30}")
for pt in out["points"]:
    e = (f"{pt['experts_mean']:.2f} [{pt['experts_min']},{pt['experts_max']}]"
         if "experts_mean" in pt else "-")
    print(f"{pt['rows']:>4} {pt['ids']:>8} {pt['ms']:8.1f} {pt['t_over_t1']:6.2f} {e:>30}")
print("loadavg", out["loadavg_start"], "->", out["loadavg_end"])
if a.json:
    open(a.json, "w").write(json.dumps(out, indent=1) + "\n")
