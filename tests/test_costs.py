"""The measured step-cost curve: profiled on the engine's own runner (pages given back), cached
per model/dtype/device/threads, and shown to the goodput controller; step stats carry the
controller's figures."""

from __future__ import annotations

from specdec import LLM, SamplingParams
from specdec.costs import StepCosts, profile_forward


def test_profile_times_every_grid_point_and_gives_pages_back(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32")
    runner = llm.engine.runner
    free = runner.kv.pool.num_free
    costs = profile_forward(runner, (1, 4, 16), context=20, repeats=2)
    assert costs.rows == [1, 4, 16] and all(t > 0 for t in costs.times)
    assert costs.times == sorted(costs.times)
    assert runner.kv.pool.num_free == free


def test_engine_profiles_once_then_reads_the_cache(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    import specdec.engine as engine_mod

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
