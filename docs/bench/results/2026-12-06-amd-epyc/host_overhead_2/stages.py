"""stages.py TREE [BATCH]: per-stage medians (us) of host_overhead.py's decode steps, plain vs
speculative, for the engine in TREE (a `git archive` as compare.sh makes them).

perf_counter around each stage method of the engine (and a few functions inside them), with
host_overhead's setup (replay stubbed, SmolLM2 vocabulary, oracle chains of 4, static
controller); 380 steps, 2 runs of each kind, medians. The wrappers add ~0.3 us each, and the
argmax (``argmax``) is inside ``verify``.
"""
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[1] + "/docs/bench")
import host_overhead as ho  # noqa: E402

torch.set_num_threads(1)
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.drafters.oracle import oracle_plugin  # noqa: E402

acc = collections.defaultdict(float)


def wrap(obj, name, label=None):
    f = getattr(obj, name)
    label = label or name

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t0
    setattr(obj, name, timed)


def wrap_module(mod, names):
    """Module functions wrapped once per engine (the originals kept: no wrapper of a wrapper)."""
    for n in names:
        key = "_unwrapped_" + n
        if not hasattr(mod, key):
            setattr(mod, key, getattr(mod, n))
        setattr(mod, n, getattr(mod, key))
        wrap(mod, n)


def run(folder, batch, spec, steps=380):
    import specdec.engine.core as core
    import specdec.engine.drafting.controller_stage as cs
    import specdec.engine.drafting.drafter_stage as ds
    from specdec.verifiers import greedy as g
    from specdec.verifiers import gumbel as gu

    prompts = [[1 + (7 * i + j) % 1000 for j in range(ho.PROMPT)] for i in range(batch)]
    kw = {}
    if spec:
        truth = {tuple(p): [ho.TOKEN] * (steps * (ho.DEPTH + 1) + 8) for p in prompts}
        kw = dict(drafter="oracle", plugins=(oracle_plugin(truth, 0.0, depth=ho.DEPTH),),
                  controller="static", controller_args={"budget": ho.DEPTH})
    llm = LLM(model=str(folder), device="cpu", dtype="float32", max_model_len=2048,
              max_num_seqs=max(batch, 8), enable_prefix_caching=False, **kw)
    e = llm.engine
    ho.stub_replay(e, ho.VOCAB)
    orig = g.greedy

    def argmax(logits):
        t0 = time.perf_counter()
        try:
            return orig(logits)
        finally:
            acc["argmax"] += time.perf_counter() - t0
    g.greedy = gu.greedy = argmax
    for obj, names in ((e.scheduler, ("schedule", "_reserve_drafts", "_reserve_running",
                                      "trim_drafts")),
                       (e.controlling, ("idle", "budgets", "prune", "observe", "release")),
                       (e.drafting, ("stop", "propose", "hidden_layers_for", "on_verified")),
                       (e.parts.runner, ("forward",)), (e.verifying, ("verify", "_run")),
                       (e.outputs, ("append",)), (e.commits, ("commit",)),
                       (e.recorder, ("record",))):
        for n in names:
            wrap(obj, n)
    wrap(e.verifying.verifier, "verify", "verifier.verify")
    wrap_module(core, ("build_forward_batch",))
    wrap_module(ds, ("_request", "_tree_problem", "isolate"))
    wrap_module(cs, ("_report", "_view"))
    if e.drafting.drafter is not None:
        wrap(e.drafting.drafter, "propose", "drafter.propose")
    per = collections.defaultdict(list)
    params = SamplingParams(temperature=0, max_tokens=steps * (ho.DEPTH + 1 if spec else 1),
                            ignore_eos=True)
    for p in prompts:
        e.add_request(p, params)
    while e.has_unfinished():
        acc.clear()
        t0 = time.perf_counter()
        out = e.step()
        dt = time.perf_counter() - t0
        if not out.stats.num_prefill_tokens and out.stats.num_requests == batch:
            per["STEP"].append(dt)
            for k, v in acc.items():
                per[k].append(v)
    g.greedy = gu.greedy = orig
    llm.close()
    return {k: statistics.median(v) * 1e6 for k, v in per.items()}


with tempfile.TemporaryDirectory() as tmp:
    folder = ho.tiny_smollm2(Path(tmp) / "model", vocab=ho.VOCAB)
    b = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    res = [[run(folder, b, s) for s in (False, True)] for _ in range(2)]
    keys = sorted(res[0][1], key=lambda k: -res[0][1][k])
    for k in keys:
        pl = statistics.median([r[0].get(k, 0) for r in res])
        sp = statistics.median([r[1].get(k, 0) for r in res])
        print(f"{k:22s} plain {pl:7.1f}  spec {sp:7.1f}  diff {sp - pl:6.1f}")
