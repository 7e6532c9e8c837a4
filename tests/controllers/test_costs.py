"""The measured step-cost curve: profiled on the engine's own runner (pages given back), cached
per model/dtype/device/threads, and shown to the goodput controller; step stats carry the
controller's figures."""

from __future__ import annotations

import logging

import pytest

from specdec import LLM, SamplingParams
from specdec.controllers.costs import StepCosts, profile_forward


def test_profile_times_every_grid_point_and_gives_pages_back(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32")
    runner = llm.engine.parts.runner
    free = runner.kv.pool.num_free
    costs = profile_forward(runner, (1, 4, 16), context=20, repeats=2)
    assert costs.rows == [1, 4, 16] and all(t > 0 for t in costs.times)
    assert costs.times == sorted(costs.times)
    assert runner.kv.pool.num_free == free


def test_engine_profiles_once_then_reads_the_cache(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    import specdec.engine.step_profile as engine_mod

    calls = []
    real = engine_mod.profile_forward

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(engine_mod, "profile_forward", counting)
    kw = dict(model=str(tiny_llama), dtype="float32", drafter="ngram")
    first = LLM(**kw)
    assert first.engine.config.controller_name == "goodput" and len(calls) == 1
    files = list((tmp_path / "step_costs").glob("*.json"))
    assert len(files) == 1 and StepCosts.load(files[0]) is not None
    LLM(**kw)
    assert len(calls) == 1, "the second engine should read the cached curve"
    # a plain engine, or one with a static controller, does not profile
    LLM(model=str(tiny_llama), dtype="float32")
    LLM(**kw, controller="static")
    assert len(calls) == 1


def test_step_stats_carry_the_controller_figures(tiny_llama):
    from specdec.hookspecs import hookimpl

    class Observer:
        def __init__(self):
            self.stats = []

        @hookimpl
        def specdec_step_end(self, stats):
            self.stats.append(stats)

    obs = Observer()
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="ngram",
              drafter_args={"min_ngram": 1}, plugins=(obs,))
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]],
                 SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    figures = [s.controller for s in obs.stats if s.controller]
    assert figures, "the goodput controller's decisions should reach the step stats"
    assert {"depths", "expected_tokens", "predicted_step_seconds"} <= set(figures[-1])
    assert "measured_step_seconds" in figures[-1]


# ---- the profile fits the engine it runs in ---------------------------------------------------

def test_plan_profile_fits_the_kv_and_the_model_length():
    from specdec.controllers.costs import DEFAULT_GRID, plan_profile

    assert plan_profile(DEFAULT_GRID, 10_000, 4096) == (64, DEFAULT_GRID)
    context, grid = plan_profile(DEFAULT_GRID, 96, 80)  # 24 pages of 4, max_model_len 80
    assert context == 10 and grid == tuple(n for n in DEFAULT_GRID if n <= 64)
    context, grid = plan_profile(DEFAULT_GRID, 10_000, 256)  # max_position_embeddings 256
    assert context + grid[-1] <= 256 and grid[-1] == 192
    assert plan_profile((1, 2, 4), 2, 100) == (0, (1, 2))
    assert plan_profile((1, 2, 4), 0, 100) == (0, ())
    with pytest.raises(ValueError, match="grid points"):
        plan_profile((0, 2), 100, 100)


def test_profile_refuses_positions_past_the_model(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="max_positions=64"):
        profile_forward(llm.engine.parts.runner, (1, 8), context=60, max_positions=64)


def _goodput_engine_logs(caplog, **kw):
    """Build an LLM with drafter ngram (goodput controller, empty cache) and generate a little;
    returns (llm, the "specdec" log)."""
    with caplog.at_level(logging.INFO, logger="specdec"):
        llm = LLM(dtype="float64", drafter="ngram", drafter_args={"min_ngram": 1}, **kw)
        out = llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]],
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.engine.config.controller_name == "goodput"
    assert len(out[0].token_ids) == 16
    return llm, caplog.text


@pytest.fixture
def full_profile(monkeypatch):
    """Rows up to 256 profiled on the CPU too (as on a GPU), for the plan's tests."""
    import specdec.engine.step_profile as step_profile

    monkeypatch.setattr(step_profile, "CPU_PROFILE_ROWS", 256)


def test_a_cpu_profiles_up_to_32_rows_and_extrapolates(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    llm = LLM(model=str(tiny_llama), dtype="float32", drafter="ngram")
    costs = llm.engine.controlling.controller.costs
    assert costs.rows[-1] == 32
    slope = (costs.seconds(32) - costs.seconds(24)) / 8
    assert costs.seconds(256) == pytest.approx(costs.seconds(32) + 224 * slope)


def test_goodput_starts_with_a_small_kv_budget(tiny_llama, tmp_path, monkeypatch, caplog,
                                               full_profile):
    """24 pages of 4 (96 slots) cannot hold the full profile (64 + 256 slots): fewer points over
    a shorter context, said in the log (issue 16: 'profiling needs 320 free KV slots')."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    llm, log = _goodput_engine_logs(caplog, model=str(tiny_llama), page_size=4, num_pages=24,
                                    max_model_len=80)
    costs = llm.engine.controlling.controller.costs
    assert costs.rows[-1] == 64 and "over a context of 10" in log and "96 free slots" in log
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_pages


def test_goodput_starts_with_a_short_model(tmp_path, monkeypatch, caplog, full_profile):
    """max_position_embeddings 256: the profile stays inside the model's positions (issue 16:
    IndexError in rope.py)."""
    from conftest import make_tiny_model

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    folder = make_tiny_model(tmp_path / "short", max_position_embeddings=256)
    llm, log = _goodput_engine_logs(caplog, model=str(folder))
    costs = llm.engine.controlling.controller.costs
    assert costs.rows[-1] == 192 and "max_model_len is 256" in log


def test_a_small_profile_is_not_reused_for_a_large_engine(tiny_llama, tmp_path, monkeypatch,
                                                          full_profile):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    kw = dict(model=str(tiny_llama), dtype="float32", drafter="ngram")
    small = LLM(**kw, page_size=4, num_pages=24, max_model_len=80)
    large = LLM(**kw)
    assert small.engine.controlling.controller.costs.rows[-1] == 64
    assert large.engine.controlling.controller.costs.rows[-1] == 256
    assert len(list((tmp_path / "step_costs").glob("*.json"))) == 2


def test_no_room_for_a_curve_gives_a_flat_one(tiny_llama, monkeypatch, caplog):
    """Where not even two grid points fit, every row count costs the one measured row."""
    import specdec.engine.step_profile as engine_mod

    llm = LLM(model=str(tiny_llama), dtype="float32")
    eng = llm.engine
    monkeypatch.setattr(engine_mod, "plan_profile", lambda grid, free, n: (0, (1,)))
    with caplog.at_level(logging.WARNING, logger="specdec"):
        costs = eng.parts.step_costs()
    assert "too few to profile" in caplog.text and "1 row" in caplog.text
    assert costs.seconds(1) == costs.seconds(256) > 0
    monkeypatch.setattr(engine_mod, "plan_profile", lambda grid, free, n: (0, ()))
    assert eng.parts.step_costs().seconds(8) == pytest.approx(1e-3)
