"""The target's forward seconds by rows for one engine: profiled once, cached, within what the
engine has.

``engine_step_costs(engine)`` is ``LLMEngine.step_costs`` (what the goodput controller's
``setup`` asks for). The profile fits the engine (``costs.plan_profile``: its free KV slots and
max_model_len); the plan is part of the cache key, so a table profiled in a small configuration
is never taken for a full one. Where not even two grid points fit, a flat curve (refined online)
stands in, and is not cached. The cache key also holds the model's shape, dtype, device,
attention backend, CUDA graphs, CPU / torch / threads and the matmul kernels.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import torch

from specdec.controllers.costs import (
    DEFAULT_CONTEXT,
    DEFAULT_GRID,
    StepCosts,
    plan_profile,
    profile_forward,
)
from specdec.controllers.expert_costs import ExpertCosts, profile_experts
from specdec.models.aliases import cache_dir
from specdec.models.matmul.linear import cache_key

logger = logging.getLogger("specdec")


# On a CPU the profile stops at this many rows: a forward's time is linear in its rows well
# before it (the kernels are compute-bound from a few rows on), so larger row counts extrapolate
# the last slope and are refined online, and a first start spends ~1 s profiling, not the ~8
# that rows up to 256 took (logits for every row included) on a 2-core CPU
CPU_PROFILE_ROWS = 32


def _plan(engine) -> tuple[tuple[int, ...], int, int, tuple[int, ...]]:
    """(the row counts wanted, the KV's free slots, the context and the row counts that fit)
    of the engine's profile (``plan_profile``)."""
    most = engine.config.max_num_batched_tokens
    if engine.device.type == "cpu":
        most = min(most, CPU_PROFILE_ROWS)
    wanted = tuple(n for n in DEFAULT_GRID if n <= most)
    free = engine.runner.kv.num_free_pages * engine.config.page_size
    return (wanted, free, *plan_profile(wanted, free, engine.max_model_len))


def engine_step_costs(engine) -> StepCosts:
    """Reads the engine's runner, config, model config, dtype, device, kernels, max_model_len."""
    wanted, free, context, grid = _plan(engine)
    if len(grid) < 2:
        return _flat_costs(engine, wanted, context, grid, free)
    if context != DEFAULT_CONTEXT or grid != wanted:
        logger.info("step costs: profiling rows %d..%d over a context of %d (the full profile "
                    "is rows up to %d over %d, but the KV has %d free slots and max_model_len "
                    "is %d); larger row counts extrapolate the last slope, refined online",
                    grid[0], grid[-1], context, wanted[-1], DEFAULT_CONTEXT, free,
                    engine.max_model_len)
    path = _cache_path(engine, context, grid)
    costs = StepCosts.load(path)
    if costs is None:
        t0 = time.perf_counter()
        costs = profile_forward(engine.runner, grid, context, max_positions=engine.max_model_len)
        logger.info("step costs profiled in %.1f s: %s", time.perf_counter() - t0,
                    costs.describe())
        costs.save(path)
    return costs


def engine_expert_costs(engine) -> ExpertCosts | None:
    """``LLMEngine.expert_costs``: on a mixture-of-experts target, the forward's seconds by rows
    and experts woken, its prior profiled over the same plan as ``engine_step_costs`` (each row
    count with random ids and with one repeated id: ``expert_costs.profile_experts``), cached beside
    it. None for a dense target. Where not even two grid points fit, the prior is the rows
    curve's (``ExpertCosts.from_step_costs``), reshaped by the steps."""
    cfg = engine.model_config
    if not cfg.is_moe:
        return None
    _, _, context, grid = _plan(engine)
    if len(grid) < 2:
        return ExpertCosts.from_step_costs(engine_step_costs(engine), cfg.num_experts,
                                           cfg.num_experts_per_tok)
    path = _cache_path(engine, context, grid, "experts")
    costs = ExpertCosts.load(path)
    if costs is None:
        t0 = time.perf_counter()
        try:
            costs = profile_experts(engine.runner, grid, context,
                                    max_positions=engine.max_model_len)
        except ValueError as e:  # (a forward that reports no routing)
            logger.warning("expert costs: %s; steps priced by rows only", e)
            return None
        logger.info("expert costs profiled in %.1f s: %s", time.perf_counter() - t0,
                    costs.describe())
        costs.save(path)
    return costs


def _cache_path(engine, context: int, grid: tuple[int, ...], what: str = "") -> Path:
    cfg = engine.model_config
    shape = f"{cfg.num_layers}x{cfg.hidden_size}x{cfg.intermediate_size}x{cfg.vocab_size}"
    graphs = "graphs" if engine.runner.graphs is not None else "eager"
    plan = "" if (context, grid[-1]) == (DEFAULT_CONTEXT, DEFAULT_GRID[-1]) else \
        f" context {context} rows {','.join(map(str, grid))}"
    key = (f"{shape} {engine.dtype} {engine.device} {engine.runner.backend.name} {graphs} "
           f"{cache_key(engine.dtype, torch.get_num_threads())} {engine.kernels.key} "
           f"weights {engine.weights} activations {engine.activations}{plan}")
    if cfg.is_moe:  # (the experts' shape: the dense figures above do not tell them)
        key += f" experts {cfg.num_experts} top {cfg.num_experts_per_tok} " \
               f"width {cfg.moe_intermediate_size} shared {cfg.shared_expert_intermediate_size}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return cache_dir() / "step_costs" / f"{shape}-{digest}{'-' + what if what else ''}.json"


def _flat_costs(engine, wanted, context: int, grid: tuple[int, ...], free: int) -> StepCosts:
    """Too little room to profile a curve: every row count costs what one row measured (or 1 ms
    where not even that fits), refined online from the steps the engine runs."""
    seconds = 1e-3
    if grid:
        seconds = profile_forward(engine.runner, grid, context,
                                  max_positions=engine.max_model_len).seconds(1)
    logger.warning("step costs: the KV has %d free slots and max_model_len is %d, too few to "
                   "profile the forward by rows; assuming every row count costs %.1f ms "
                   "(measured for %s), refined online", free, engine.max_model_len,
                   1e3 * seconds, "1 row" if grid else "nothing, a guess")
    return StepCosts.flat(list(wanted), seconds)
