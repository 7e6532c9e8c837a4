"""What speculation could give on a model: the oracle drafter (drafters/oracle.py) at chosen mean
acceptance lengths tau, beside the plain engine, batch 1, greedy.

    .venv/bin/python docs/bench/oracle_speedup.py --model runs/smollm2-1.7b-q4_k_m.gguf \\
        [--taus 1.5,2,3] [--depth 4] [--activations q8] [--num-prompts 4] \\
        [--max-new-tokens 64] [--repeats 3] [--json OUT]

The plain engine's greedy continuation of each prompt (``ignore_eos``: every answer
``--max-new-tokens`` long) is the truth the oracle proposes from, each of its ``--depth`` chain
nodes wrong with the probability that gives ``tau`` (``error_rate_for_tau``). The drafter costs
nothing, so its speedup is what a drafter reaching that tau at that depth could give at most
on this CPU: the speculation economics of the model, without a trained drafter for it.

Method: one plain engine for the whole run and one speculative engine per tau, built after the
previous one is freed (so at most two copies of the weights are held: an 8B file twice); for
each tau, after an untimed warm-up, ``--repeats`` passes over the prompts, each prompt run by
the plain engine and then by the speculative one (interleaved); tokens/s per pass, the speedup
the median of the per-pass ratios. Reported beside it: the realized tau (end effects keep it a
little under the target), whether every output equals the plain one (it must: the oracle is
lossless under greedy), and the speedup the engine's own step costs predict,
tau * T(1) / T(depth + 1) (profile_forward: the forward alone, over 64 cached tokens).

Quick form (the test suite's, tests/bench/test_bench_scripts.py): ``--model`` a tiny GGUF with a
chat template, a 4-question ``--dataset``, ``--taus 2 --depth 2 --num-prompts 2
--max-new-tokens 4 --repeats 1 --max-model-len 256``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams
from specdec.bench.data import first_turn_items, load_questions
from specdec.controllers.costs import profile_forward
from specdec.drafters.oracle import error_rate_for_tau, oracle_plugin

DATASET = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "eval" / "mt_bench.jsonl"


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    """(seconds, output) of each prompt, one generate call each (batch 1)."""
    out = []
    for p in prompts:
        t0 = time.perf_counter()
        (o,) = llm.generate([p], params)
        out.append((time.perf_counter() - t0, o))
        if o.finish_reason == "error":
            raise RuntimeError(f"request failed: {o.error}")
    return out


def _tps(runs: list[tuple]) -> float:
    return sum(len(o.token_ids) for _, o in runs) / sum(s for s, _ in runs)


def one_tau(engine_kw: dict, plain: LLM, prompts, truth: dict, params, tau: float, depth: int,
            repeats: int) -> dict:
    rate = error_rate_for_tau(tau, depth)
    spec = LLM(drafter="oracle", controller="static", controller_args={"budget": depth},
               plugins=(oracle_plugin(truth, rate, depth),), **engine_kw)
    _timed(spec, prompts[:1], params)  # warm-up
    plain_tps, spec_tps, taus, same = [], [], [], True
    for _ in range(repeats):
        p_runs, s_runs = [], []
        for p in prompts:
            p_runs += _timed(plain, [p], params)
            s_runs += _timed(spec, [p], params)
        plain_tps.append(_tps(p_runs))
        spec_tps.append(_tps(s_runs))
        taus += [o.metrics.tau for _, o in s_runs if o.metrics.tau is not None]
        same &= all(o.token_ids == truth[tuple(p)] for p, (_, o) in zip(prompts, s_runs))
    costs = profile_forward(spec.engine.parts.runner, (1, depth + 1)).times
    realized = statistics.fmean(taus) if taus else None
    del spec
    gc.collect()
    return {"tau_target": tau, "depth": depth, "error_rate": rate, "tau": realized,
            "plain_tokens_per_s": statistics.median(plain_tps),
            "spec_tokens_per_s": statistics.median(spec_tps),
            "speedup": statistics.median(s / p for s, p in zip(spec_tps, plain_tps)),
            "t1_ms": 1e3 * costs[0], "t_depth_plus_1_ms": 1e3 * costs[1],
            "predicted_speedup": realized * costs[0] / costs[1] if realized else None,
            "outputs_equal_plain": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an alias, HF folder or .gguf file")
    p.add_argument("--taus", default="1.5,2,3", help="target mean acceptance lengths")
    p.add_argument("--depth", type=int, default=4, help="chain nodes per step (tau <= depth+1)")
    p.add_argument("--activations", default="float", choices=("float", "q8"))
    p.add_argument("--weights", default="auto")
    p.add_argument("--dataset", type=Path, default=DATASET)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    taus = [float(t) for t in a.taus.split(",")]
    for tau in taus:
        error_rate_for_tau(tau, a.depth)  # fails here on a tau the depth cannot reach
    engine_kw = dict(model=a.model, activations=a.activations, weights=a.weights,
                     max_model_len=a.max_model_len)
    plain = LLM(**engine_kw)
    prompts = [it.prompt_ids for it in first_turn_items(
        load_questions(a.dataset, a.num_prompts), plain.tokenizer)]
    params = SamplingParams(temperature=0, max_tokens=a.max_new_tokens, ignore_eos=True)
    truth = {tuple(q): o.token_ids for q, (_, o) in zip(prompts, _timed(plain, prompts, params))}
    out = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "model": a.model, "activations": a.activations, "weights": plain.engine.parts.weights,
           "num_prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "runs": []}
    for tau in taus:
        run = one_tau(engine_kw, plain, prompts, truth, params, tau, a.depth, a.repeats)
        out["runs"].append(run)
        print(f"tau {tau:.2f} (depth {a.depth}, error rate {run['error_rate']:.3f}): realized "
              f"{run['tau']:.2f}, plain {run['plain_tokens_per_s']:.2f} tok/s, oracle "
              f"{run['spec_tokens_per_s']:.2f} tok/s, speedup {run['speedup']:.2f}x "
              f"(step costs predict {run['predicted_speedup']:.2f}x: T(1) {run['t1_ms']:.1f} ms, "
              f"T({a.depth + 1}) {run['t_depth_plus_1_ms']:.1f} ms), outputs equal plain: "
              f"{run['outputs_equal_plain']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
