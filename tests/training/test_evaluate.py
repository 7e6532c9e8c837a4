"""The end-of-training evaluation's figures from injected timings (no real timing): the speed
is the spread of per-prompt ratios, not a ratio of summed times; the printed lines and the
warnings come from the report alone."""

from __future__ import annotations

import pytest

from specdec.bench.timing import Out
from specdec.outputs import RequestMetrics
from specdec.training import evaluate as ev


class Timed:
    """An engine stand-in: ``seconds[i]`` for the i-th timed prompt, 10 tokens each."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds, self.calls = list(seconds), []

    def run(self, prompts, salt=None):
        self.calls.append(salt)
        seconds = 1.0 if salt == ev.WARMUP_SALT else self.seconds.pop(0)
        return seconds, [Out(list(range(10)), RequestMetrics())], [seconds]


def test_speed_is_the_median_of_per_prompt_ratios_not_a_ratio_of_sums():
    # one slow plain prompt (a first call, a busy moment): summed times say 3.1x, every
    # other prompt 1.0x
    plain, goodput = Timed([10.0, 1.0, 1.0, 1.0]), Timed([1.0, 1.0, 1.0, 1.0])
    systems = {"plain": plain, "static": Timed([1.0] * 4), "goodput": goodput}
    outs, rates = ev._run(systems, [[1], [2], [3], [4]])
    assert all(s.calls[0] == ev.WARMUP_SALT for s in systems.values())
    ratios = [g / p for g, p in zip(rates["goodput"], rates["plain"])]
    assert ratios == [10.0, 1.0, 1.0, 1.0]
    s = ev.spread(ratios)
    assert (s["median"], s["min"], s["max"]) == (1.0, 1.0, 10.0)
    assert s["q1"] == 1.0 and s["q3"] == pytest.approx(3.25)
    assert ev.spread([2.0]) == dict(median=2.0, q1=2.0, q3=2.0, min=2.0, max=2.0)
    assert ev.spread([])["median"] is None


def _report(**kw) -> dict:
    report = {"num_prompts": 9, "seconds": 30.0, "run_seconds": 40.0, "greedy_match_rate": 1.0,
              "quality": {"controller": "static", "budget": 8, "tau": 1.5,
                          "acceptance_by_depth": [0.4, 0.1], "draft_tokens_proposed": 99},
              "speed": {"controller": "goodput", **ev.spread([1.0, 1.0, 1.2]),
                        "draft_tokens_proposed": 0},
              "split": {"held_out": 9, "train_conversations": 1}}
    report.update(kw)
    return report


def test_warnings_and_summary_lines():
    report = _report()
    warnings = ev.run_warnings(report, max_steps=2)
    assert [w.split(" ")[:2] for w in warnings] == [["trained", "on"], ["the", "evaluation"],
                                                    ["the", "goodput"]]
    assert "trained on 1 conversation (9 held out" in warnings[0]
    report["warnings"] = warnings
    lines = ev.summary_lines(report)
    assert lines[0].startswith("quality (static controller, 8-node tree, 9 held-out prompts): "
                               "tau 1.50, acceptance by depth 0.400 / 0.100")
    assert "median 1.00x, quartiles 1.00-1.10x, range 1.00-1.20x" in lines[1]
    assert lines[2:] == [f"warning: {w}" for w in warnings]
    # enough data, a short evaluation, drafts proposed: nothing to warn of
    fine = _report(seconds=1.0, split={"held_out": 9, "train_conversations": 500})
    fine["speed"]["draft_tokens_proposed"] = 5
    assert ev.run_warnings(fine, max_steps=None) == []
    # a recalibration trains nothing on purpose
    assert not any("trained on" in w for w in ev.run_warnings(report, max_steps=0))
    assert ev.summary_lines({"num_prompts": 0})[0].startswith("no held-out prompts")
