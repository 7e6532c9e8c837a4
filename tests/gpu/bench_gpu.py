"""The GPU bench (run by tests/gpu/run.sh): speed of the GPU path on random weights in real
shapes, written to OUT/bench.json and OUT/bench.md.

Per model shape (SmolLM2-135M, Llama-3.2-1B; bf16):
- plain decode tokens/s at batch 1, 8, 32, 64 (CUDA graphs), at batch 1 eager too, and HF
  ``generate`` at batch 1 beside it;
- flashinfer's decode kernel against its prefill kernel with one row (attention alone);
- the step cost table T(rows per request, batch): what a forward of the target costs;
- speculation at a controlled acceptance (the oracle drafter: the target's own continuation with
  a set error rate), so the speedup over plain decoding can be read off at any tau;
- the learned drafters with random weights (EAGLE-3 head, MTP heads, block diffusion) at batch 1:
  tokens/s against plain, tau, the token match (must be 1), their steps (graphed / eager,
  stage ms, the engine's copies and reads) and, off CUDA (the dry run), every host <-> device
  transfer a step makes as tests/transfer_audit.py counts them (the drafters' own included).

Every section runs on its own: one that fails is recorded (its error) and the others go on.
Usage: python tests/gpu/bench_gpu.py --out DIR [--shapes smollm2-135m,llama-1b] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_helpers import SHAPES, make_model  # noqa: E402
from learned_drafters import audited, cpu_stand_ins, learned_drafter  # noqa: E402

PROMPT_LEN = 128
DEVICE = "cuda"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", default="smollm2-135m,llama-1b")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--quick", action="store_true", help="fewer batch sizes and taus")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of a step too")
    p.add_argument("--models", default="/tmp/specdec-gpu-models")
    p.add_argument("--device", default="cuda",
                   help="cuda; cpu dry-runs the script's logic on tiny shapes (no kernels timed)")
    args = p.parse_args()
    global DEVICE, FAST
    DEVICE = args.device
    if DEVICE != "cuda":  # the dry run's stand-in for flashinfer + cuBLAS
        FAST = dict(attention_backend="torch", linear_kernels="plain")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the engine's own log (where an engine's start goes, graphs captured) into bench.log
    log = logging.getLogger("specdec")
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler(sys.stdout))
    results: dict = {"env": _env()}
    for shape in args.shapes.split(","):
        results[shape] = bench_shape(shape, Path(args.models) / shape, args, out, results)
        _write(out, results)
    _write(out, results)
    print((out / "bench.md").read_text())
    return 0


def bench_shape(shape: str, folder: Path, args, out: Path, results: dict) -> dict:
    t0 = time.perf_counter()
    res: dict = {}
    folder = make_model(folder, shape)
    res["model_seconds"] = round(time.perf_counter() - t0, 1)
    batches = [1, 8] if args.quick else [1, 8, 32, 64]
    sections = [
        ("plain", lambda: plain_decode(folder, batches, args.tokens)),
        ("hf_b1", lambda: hf_generate(folder, args.tokens)),
        ("decode_kernels", lambda: decode_kernels(shape) if DEVICE == "cuda" else {}),
        ("step_costs", lambda: step_costs(folder, [1, 8] if args.quick else [1, 8, 32, 64])),
        ("speculation", lambda: speculation(folder, args.tokens, args.quick)),
        ("learned", lambda: learned(folder, args.tokens)),
    ]
    if args.profile:
        sections.append(("profile", lambda: profile(folder)))
    for name, fn in sections:
        t1 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # recorded, and the other sections still run
            res[name] = {"error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-3000:]}
            print(f"[{shape}] {name} failed: {e!r}", flush=True)
        res[name + "_seconds"] = round(time.perf_counter() - t1, 1)
        print(f"[{shape}] {name}: {time.perf_counter() - t1:.1f} s", flush=True)
        _free()
        _write(out, {**results, shape: res})  # what a later section's time limit cuts stays
    return res


def _llm(folder, **kw):
    from specdec.engine.llm import LLM

    # the engine's default max_num_seqs (32) unless a batch needs more
    dtype = kw.pop("dtype", "bfloat16" if DEVICE == "cuda" else "float32")
    return LLM(model=str(folder), device=DEVICE, dtype=dtype, max_model_len=1024, **kw)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab - 1, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def _params(tokens: int):
    from specdec.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def _timed_generate(llm, prompts, tokens: int, steps: dict | None = None) -> tuple[float, list]:
    """(new tokens per second, outputs) after a short warm-up run of the same batch (graphs for
    its shapes captured, kernels compiled). ``steps``, if given, receives the timed run's steps
    by kind (plain / speculative / prefill): count, graphed and eager forwards, ms by stage."""
    llm.generate(prompts, _params(8))
    _sync()
    before = {k: replace(v, seconds=dict(v.seconds))
              for k, v in llm.engine.totals.budget.items()}
    t0 = time.perf_counter()
    outs = llm.generate(prompts, _params(tokens))
    _sync()
    seconds = time.perf_counter() - t0
    if steps is not None:
        for kind, budget in llm.engine.totals.budget.items():
            run = budget.minus(before[kind]) if kind in before else budget
            if run.steps:
                per = run.per_step_ms()
                per["ms"] = {k: round(v, 3) for k, v in per["ms"].items()}
                steps[kind] = per
    return sum(len(o.token_ids) for o in outs) / seconds, outs


FAST = dict(attention_backend="flashinfer", linear_kernels="plain")  # not row-invariant


def plain_decode(folder: Path, batches: list[int], tokens: int) -> dict:
    """Tokens/s of the plain engine by batch size, in the default (row-invariant) mode with
    graphs; at batch 1 also eager, and the fast mode (flashinfer + cuBLAS: what exactness
    costs)."""
    vocab = _vocab(folder)
    res = {"tokens_per_request": tokens, "prompt_len": PROMPT_LEN}
    t0 = time.perf_counter()
    graphs = _llm(folder, max_num_seqs=max(32, *batches))
    res["engine_start_s"] = round(time.perf_counter() - t0, 1)
    res["engine_start_by_stage_s"] = graphs.engine.parts.build_seconds
    res["backend"] = graphs.engine.parts.runner.backend.name
    res["linear_kernels"] = getattr(graphs.engine.parts.kernels, "key", "")
    res["graphs_enabled"] = graphs.engine.parts.runner.graphs is not None
    for b in batches:
        steps: dict = {}
        tps, _ = _timed_generate(graphs, _prompts(b, vocab, seed=b), tokens, steps)
        res[f"graphs_b{b}_tok_s"] = round(tps, 1)
        res[f"graphs_b{b}_steps"] = steps
    res["graphs_captured"] = graphs.engine.parts.runner.graphs.num_graphs if res["graphs_enabled"] else 0
    _free(graphs)
    del graphs
    for name, kw in (("eager", dict(cuda_graphs=False)), ("fast", FAST)):
        llm = _llm(folder, **kw)
        steps = {}
        tps, _ = _timed_generate(llm, _prompts(1, vocab, seed=1), tokens, steps)
        res[f"{name}_b1_tok_s"] = round(tps, 1)
        res[f"{name}_b1_steps"] = steps
        res[f"{name}_backend"] = llm.engine.parts.runner.backend.name
        del llm
        _free()
    if res.get("eager_b1_tok_s"):
        res["graphs_over_eager_b1"] = round(res["graphs_b1_tok_s"] / res["eager_b1_tok_s"], 2)
    if res.get("fast_b1_tok_s"):
        res["invariant_over_fast_b1"] = round(res["graphs_b1_tok_s"] / res["fast_b1_tok_s"], 2)
    return res


def hf_generate(folder: Path, tokens: int) -> dict:
    """transformers generate at batch 1, bf16, greedy, same prompt length and new tokens."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    from specdec.models.loader import hf_weights_kwargs

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **hf_weights_kwargs(folder))
    model = model.to(DEVICE).eval()
    ids = torch.tensor(_prompts(1, _vocab(folder), seed=1), device=DEVICE)
    kw = dict(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
        _sync()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync()
    seconds = time.perf_counter() - t0
    return {"tok_s": round((out.shape[1] - ids.shape[1]) / seconds, 1),
            "attn_implementation": model.config._attn_implementation}


def decode_kernels(shape: str) -> dict:
    """Attention alone, one layer: flashinfer's decode kernel vs its prefill kernel with one row
    per request (microseconds per call, CUDA events), at kv length 512."""
    from gpu_helpers import random_cache, random_step

    from specdec.attention.backend import AttentionSpec
    from specdec.attention.flashinfer_backend import FlashInferAttentionBackend

    s = SHAPES[shape]
    h, hkv = s["num_attention_heads"], s["num_key_value_heads"]
    d = s["hidden_size"] // h
    res = {}
    for b in (1, 8, 64):
        gen = torch.Generator().manual_seed(b)
        pages, page = b * 40, 16
        step = random_step(gen, ["decode"] * b, pages, page, (h, hkv, d), "cuda", torch.bfloat16)
        cache = random_cache(gen, pages, page, hkv, d, "cuda", torch.bfloat16)
        for path in ("decode", "prefill"):
            backend = FlashInferAttentionBackend(AttentionSpec(h, hkv, d, torch.bfloat16,
                                                               torch.device("cuda")), path)
            backend.plan(step.md)
            args = (step.q, step.k, step.v, cache, d**-0.5)
            res[f"b{b}_{path}_us"] = round(_cuda_time(backend.run, args) * 1e6, 1)
    return res


def _cuda_time(fn, args: tuple, repeats: int = 50) -> float:
    """Median seconds of fn(*args) by CUDA events, after warm-up."""
    for _ in range(5):
        fn(*args)
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def step_costs(folder: Path, batches: list[int]) -> dict:
    """T(rows per request, batch): ms of one target forward (logits for every row, as in
    verification) of `batch` requests over 256 cached tokens each feeding `rows` rows (a decode
    row plus a chain of rows - 1 draft nodes), CUDA graphs; eager beside it at batch 1. Also the
    batch-1 profile the goodput controller itself takes (engine.parts.step_costs)."""
    from specdec.kv.block_table import BlockTable
    from specdec.tree import DraftTree, step_mask

    llm = _llm(folder, max_num_seqs=max(32, *batches))
    engine = llm.engine
    runner, vocab, ctx = engine.parts.runner, _vocab(folder), 256
    table: dict = {}
    g = torch.Generator().manual_seed(0)
    for b in batches:
        tables = []
        for _ in range(b):
            t = BlockTable()
            assert runner.kv.try_reserve(t, ctx + 16), "not enough KV for the cost table"
            tables.append(t)
        graphs, runner.graphs = runner.graphs, None
        runner.forward(runner.pack([torch.randint(1, vocab, (ctx,), generator=g).tolist()
                                    for _ in range(b)], [0] * b, tables, logits="none"))
        runner.graphs = graphs
        for rows in (1, 2, 4, 8, 16):
            tree = DraftTree.chain(torch.randint(1, vocab, (rows - 1,), generator=g))
            feeds = [[int(torch.randint(1, vocab, (1,), generator=g))] + tree.tokens.tolist()
                     for _ in range(b)]
            masks = [step_mask(tree, ctx, ctx + 1) if rows > 1 else None] * b
            positions = [list(range(ctx, ctx + rows))] * b
            batch = runner.pack(feeds, [ctx] * b, tables, logits="all", positions=positions,
                                masks=masks)
            for mode in (("graphs", "eager") if b == 1 else ("graphs",)):
                saved = runner.graphs
                if mode == "eager":
                    runner.graphs = None
                table[f"{mode}_b{b}_r{rows}_ms"] = round(_median_forward(runner, batch) * 1e3, 3)
                runner.graphs = saved
        for t in tables:
            runner.kv.release(t)
    costs = engine.parts.step_costs()
    table["controller_profile_b1"] = costs.to_dict()
    return table


def _median_forward(runner, batch) -> float:
    # the CPU dry run times nothing that matters: one warm-up and three timed forwards
    warm, repeats = (3, 20) if DEVICE == "cuda" else (1, 3)
    for _ in range(warm):
        runner.forward(batch)
    return statistics.median(runner.forward(batch).seconds for _ in range(repeats))


def speculation(folder: Path, tokens: int, quick: bool) -> dict:
    """The oracle drafter at set taus (4-node chains, static budget 4) vs plain, batch 1 and 8,
    in the default (row-invariant) mode: tokens/s, measured tau, speedup (measured, and as
    tau x T(plain step) / T(spec step)), the token match (must be 1). Then the fast mode
    (flashinfer + cuBLAS) at tau 3, batch 1: its match, and where it first differs, the plain
    run's top-2 logit gap there (a near-tie flipped by a kernel difference)."""
    from specdec.drafters.oracle import error_rate_for_tau

    vocab, depth = _vocab(folder), 4
    taus = [2.0, 3.0] if quick else [1.5, 2.0, 3.0, 4.0, 5.0]
    res: dict = {"depth": depth}
    for b in (1, 8):
        prompts = _prompts(b, vocab, seed=100 + b)
        plain = _llm(folder)  # the engine's default max_num_seqs
        plain_steps: dict = {}
        plain_tps, outs = _timed_generate(plain, prompts, tokens, plain_steps)
        truth = {tuple(p): o.token_ids for p, o in zip(prompts, outs)}
        res[f"b{b}_plain_tok_s"] = round(plain_tps, 1)
        res[f"b{b}_plain_steps"] = plain_steps
        t_plain = plain_steps.get("plain", {}).get("ms", {}).get("step")
        del plain
        _free()
        for tau in taus:
            rate = error_rate_for_tau(tau, depth) if tau < depth + 1 else 0.0
            res[f"b{b}_tau{tau}"] = _spec_run(folder, prompts, truth, rate, depth, tokens,
                                              plain_tps, t_plain)
    prompts = _prompts(1, vocab, seed=101)
    fast = _llm(folder, **FAST)
    plain_tps, outs = _timed_generate(fast, prompts, tokens)
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, outs)}
    run = _spec_run(folder, prompts, truth, error_rate_for_tau(3.0, depth), depth, tokens,
                    plain_tps, None, **FAST)
    run["first_mismatch"] = _first_mismatch(fast, prompts, truth, run.pop("outputs"))
    res["fast_b1_tau3.0"] = run
    return res


def _spec_run(folder, prompts, truth, rate, depth, tokens, plain_tps, t_plain, **kw) -> dict:
    from specdec.drafters.oracle import oracle_plugin

    spec = _llm(folder, drafter="oracle", plugins=(oracle_plugin(truth, rate, depth=depth),),
                controller="static", controller_args={"budget": depth}, **kw)
    steps: dict = {}
    tps, got = _timed_generate(spec, prompts, tokens, steps)
    same = sum(a == w for o, p in zip(got, prompts) for a, w in zip(o.token_ids, truth[tuple(p)]))
    measured = sum(o.metrics.tau for o in got) / len(got)
    out = {"error_rate": round(rate, 4), "tok_s": round(tps, 1),
           "speedup": round(tps / plain_tps, 2), "measured_tau": round(measured, 2),
           "token_match": round(same / sum(len(o.token_ids) for o in got), 4), "steps": steps,
           "outputs": [o.token_ids for o in got]}
    t_spec = steps.get("speculative", {}).get("ms", {}).get("step")
    if t_plain and t_spec:  # what tau buys at these step costs
        out["speedup_from_step_costs"] = round(measured * t_plain / t_spec, 2)
    if kw == {}:
        out.pop("outputs")
    del spec
    _free()
    return out


LEARNED = ("eagle3", "mtp", "block_diffusion")


def learned(folder: Path, tokens: int) -> dict:
    """The learned drafters with random weights against plain decoding, batch 1, static budget
    4, the default (row-invariant) mode. Random heads are rarely right (tau near 1): what is
    read here is what a draft step costs beside a target step, whether the drafters' steps are
    graphed, and (off CUDA) their transfers per step, not their speedup."""
    prompts = _prompts(1, _vocab(folder), seed=7)
    mode = {} if DEVICE == "cuda" else cpu_stand_ins()
    plain = _llm(folder, **mode)
    plain_tps, outs = _timed_generate(plain, prompts, tokens)
    want = [o.token_ids for o in outs]
    del plain
    _free()
    res: dict = {"b1_plain_tok_s": round(plain_tps, 1)}
    for name in LEARNED:
        spec = _llm(folder, controller="static", controller_args={"budget": 4}, **mode,
                    **learned_drafter(name, folder, DEVICE))
        steps: dict = {}
        tps, got = _timed_generate(spec, prompts, tokens, steps)
        run = {"tok_s": round(tps, 1), "speedup": round(tps / plain_tps, 2),
               "measured_tau": round(got[0].metrics.tau, 2),
               "token_match": float([o.token_ids for o in got] == want), "steps": steps}
        if DEVICE != "cuda":
            run["audit"] = audited(spec, prompts, _params(8))
        res[name] = run
        del spec
        _free()
    return res


def _first_mismatch(plain, prompts, truth, outputs) -> dict | None:
    """The first position where the speculative output left the plain one, and the plain
    run's gap between its top two log-probabilities there (the logits' top-2 gap)."""
    from specdec.sampling_params import SamplingParams

    for p, got in zip(prompts, outputs):
        want = truth[tuple(p)]
        i = next((j for j, (a, w) in enumerate(zip(got, want)) if a != w), None)
        if i is None:
            continue
        params = SamplingParams(temperature=0, max_tokens=i + 1, ignore_eos=True, logprobs=2)
        lp = plain.generate([p], params)[0].logprobs[i]
        top = lp.top
        gap = top[0][1] - top[1][1] if len(top) > 1 else None
        return {"position": i, "plain_token": want[i], "spec_token": got[i],
                "top2_logprob_gap": gap, "top2": [list(t) for t in top]}
    return None


def profile(folder: Path, tokens: int = 32, top: int = 30) -> dict:
    """Where a step's time goes, by torch.profiler over 32-token runs at batch 1: with graphs
    (plain, and the oracle at tau 3 with 4-node chains), the ops with the most self CPU time
    (host work; kernels inside a graph are not attributed); eagerly, the kernels with the most
    device time per step (their durations are the device's own, whatever the host adds)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from specdec.drafters.oracle import error_rate_for_tau, oracle_plugin

    prompts = _prompts(1, _vocab(folder), seed=7)
    plain = _llm(folder)
    outs = plain.generate(prompts, _params(tokens))
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, outs)}
    spec = _llm(folder, drafter="oracle", plugins=(oracle_plugin(
        truth, error_rate_for_tau(3.0, 4), depth=4),), controller="static",
        controller_args={"budget": 4})
    res = {}
    cuda = DEVICE == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    runs = [("plain", plain, "self_cpu_time_total"), ("spec", spec, "self_cpu_time_total"),
            ("plain_eager_kernels", _llm(folder, cuda_graphs=False),
             "self_device_time_total" if cuda else "self_cpu_time_total")]
    for name, llm, key in runs:
        llm.generate(prompts, _params(8))
        steps0 = llm.engine.totals.steps
        with torch_profile(activities=activities) as prof:
            llm.generate(prompts, _params(tokens))
        steps = max(llm.engine.totals.steps - steps0, 1)
        events = prof.key_averages()
        rows = sorted(events, key=lambda e: -getattr(e, key, 0.0))[:top]
        res[name] = {"steps": steps, "sorted_by": key, "ops": [
            {"op": e.key, "calls_per_step": round(e.count / steps, 2),
             "self_cpu_us_per_step": round(e.self_cpu_time_total / steps, 1),
             "self_device_us_per_step": round(getattr(e, "self_device_time_total", 0.0)
                                              / steps, 1)} for e in rows]}
        print(f"--- profile {name}: {steps} steps\n" + events.table(sort_by=key,
                                                                     row_limit=top), flush=True)
    return res


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _free(*llms) -> None:
    """Drop engines now (their weights and KV on the GPU), not at some later collection (on the
    CPU dry run a collection costs more than the memory it frees)."""
    del llms
    if DEVICE == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _vocab(folder: Path) -> int:
    return json.loads((Path(folder) / "config.json").read_text())["vocab_size"]


def _env() -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except Exception as e:  # reported, not fatal: the torch backend still runs
        env["flashinfer"] = f"unavailable: {e!r}"
    return env


def _write(out: Path, results: dict) -> None:
    """bench.json (everything) and bench.md (the headline table), each written atomically."""
    for name, text in (("bench.json", json.dumps(results, indent=1)),
                       ("bench.md", _markdown(results))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text + "\n")
        tmp.replace(out / name)


def _markdown(results: dict) -> str:
    lines = [f"# GPU bench ({results['env']})", ""]
    for shape, res in results.items():
        if shape == "env":
            continue
        lines += [f"## {shape}", ""]
        plain, hf = res.get("plain", {}), res.get("hf_b1", {})
        if "graphs_b1_tok_s" in plain and "tok_s" in hf:
            lines.append(f"- plain b1 (graphs) / HF generate b1: "
                         f"{plain['graphs_b1_tok_s'] / hf['tok_s']:.2f}x (target >= 1.5)")
        if "graphs_over_eager_b1" in plain:
            lines.append(f"- CUDA graphs / eager at b1: {plain['graphs_over_eager_b1']}x "
                         "(target >= 2)")
        if "invariant_over_fast_b1" in plain:
            lines.append(f"- row-invariant / fast (flashinfer + cuBLAS) plain b1: "
                         f"{plain['invariant_over_fast_b1']}x")
        spec = res.get("speculation", {})
        for b, target in ((1, 2.0), (8, 1.3)):
            run = spec.get(f"b{b}_tau3.0")
            if run:
                lines.append(f"- speculation at tau 3 / plain, b{b}: {run['speedup']}x "
                             f"(from step costs {run.get('speedup_from_step_costs')}x; measured "
                             f"tau {run['measured_tau']}; token match {run['token_match']}; "
                             f"target >= {target})")
        fast = spec.get("fast_b1_tau3.0")
        if fast:
            lines.append(f"- fast mode, tau 3, b1: {fast['speedup']}x, token match "
                         f"{fast['token_match']}, first mismatch {fast.get('first_mismatch')}")
        for name in LEARNED:
            run = res.get("learned", {}).get(name)
            if run:
                step = run["steps"].get("speculative", {})
                audit = run.get("audit", {})
                lines.append(
                    f"- {name} (random weights) b1: {run['speedup']}x plain, tau "
                    f"{run['measured_tau']}, token match {run['token_match']}, eager steps "
                    f"{step.get('eager_steps')}, transfers per spec step (audit) h2d "
                    f"{audit.get('speculative_h2d_per_step', 'n/a')} d2h "
                    f"{audit.get('speculative_d2h_per_step', 'n/a')} (target <= 2 / <= 1)")
        for name in ("plain", "hf_b1", "decode_kernels", "step_costs", "speculation", "learned",
                     "profile"):
            lines += ["", f"### {name}", "", "```", json.dumps(res.get(name), indent=1)[:4000],
                      "```"]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
