"""The step budget of ``specdec bench``: each engine's ms per step by part and step kind over
the timed runs (``specdec.metrics.StepBudget``), beside the physics measured here
(``specdec.bench.physics``): the forward's memory-bound time, T(rows), an extra row against
its multiply-adds at the measured GEMM rate, and the drafter's fitted draft time by depth."""

from __future__ import annotations

import copy

from specdec.bench.physics import machine_rates


def snapshot(engines: dict) -> dict:
    """Each engine's step budget so far (name -> kind -> StepBudget), to subtract later."""
    return {name: copy.deepcopy(e.totals.budget) for name, e in engines.items()}


BUDGET_ROWS = (1, 2, 4, 8, 16)


def step_budget(engines: dict, before: dict) -> dict:
    """Per engine system and step kind, over the timed runs: ms per step by part (schedule,
    draft, forward, verify, commit, feedback, other: they add up to the step), rows per step.
    Beside them the physics measured here: the forward's memory-bound time (the weight bytes
    a forward streams / the stream bandwidth), T(rows) of the target forward (the engine's
    step profile) with the cost of an extra row against its compute-bound time (the target's
    multiply-adds per row / the rate of that arithmetic in specdec's own float or q8
    kernels), and the drafter's fitted draft time by depth (goodput). With tensor
    parallelism, each system's ``tensor_parallel``: its collectives per step on rank 0
    (``tensor_parallel``; per step kind inside each kind's entry too)."""
    rates = machine_rates()
    out = {**rates, "systems": {}}
    for name, old in before.items():
        engine = engines[name]
        kinds = {}
        for kind, b in engine.totals.budget.items():
            got = b.minus(old[kind]) if kind in old else b
            if got.steps:
                kinds[kind] = got.per_step_ms()
        out["systems"][name] = {"kinds": kinds, **_forward_physics(engine, rates)}
        tp = tensor_parallel(engine, engine.totals.budget, old)
        if tp is not None:
            out["systems"][name]["tensor_parallel"] = tp
    return out


def tensor_parallel(engine, budget: dict, before: dict) -> dict | None:
    """An engine's collectives over the timed runs, all step kinds together (each kind's are in
    its ``tensor_parallel`` entry): the size and the reductions' mode, and per step on rank
    0 the reductions (count, ms, bytes), the control messages (count, ms) and the share of
    the step time they took. None without tensor parallelism."""
    tp = engine.parts.tp
    if tp is None:
        return None
    from specdec.metrics import TP_FIELDS, tensor_parallel_per_step

    steps, sums, seconds = 0, dict.fromkeys(TP_FIELDS, 0.0), {}
    for kind, b in budget.items():
        got = b.minus(before[kind]) if kind in before else b
        if not got.steps or got.tp is None:
            continue
        steps += got.steps
        for k in TP_FIELDS:
            sums[k] += got.tp[k]
        for k, v in got.seconds.items():
            seconds[k] = seconds.get(k, 0.0) + v
    return {"size": tp.size, "reduce": tp.reduce_mode, "steps": steps,
            **tensor_parallel_per_step(sums, steps, seconds)}


def _forward_physics(engine, rates: dict) -> dict:
    costs = engine.parts.step_costs()
    ms = {n: 1e3 * costs.seconds(n) for n in BUDGET_ROWS}
    macs = sum(w.numel() for w in engine.parts.model.matrices())
    rate = rates["int8_macs_per_s" if engine.parts.activations == "q8" else "fp32_macs_per_s"] \
        or rates["fp32_macs_per_s"]
    draft = getattr(engine.controlling.controller, "draft", None)
    return {
        "forward_memory_bound_ms": engine.parts.weight_bytes_per_forward / rates["bandwidth_gbs"] / 1e6,
        "forward_rows_ms": {str(n): v for n, v in ms.items()},  # JSON keys
        "extra_row_ms": (ms[8] - ms[1]) / 7,
        "row_compute_bound_ms": 1e3 * macs / rate,
        "draft_ms_by_depth": ({str(d): 1e3 * draft(d) for d in (1, 2, 4)}
                              if engine.drafting.drafter is not None and callable(draft) else None),
    }
