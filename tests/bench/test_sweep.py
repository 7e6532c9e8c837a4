"""`specdec bench` sweeps: several controllers and batch sizes in one run; the JSON `runs` schema,
the plot file, bad sweep arguments."""

from __future__ import annotations

import json

import cli_helpers
import pytest

from specdec.bench.sweep import parse_batch_sizes, parse_controllers
from specdec.cli import main

chat_model, dataset = cli_helpers.chat_model, cli_helpers.dataset  # fixtures

RUN_KEYS = ("system", "batch_size", "tokens_per_s", "speedup_vs_plain", "speedup_vs_hf", "tau",
            "acceptance_by_depth", "ttft_ms", "tpot_ms", "itl_ms", "goodput_tokens_per_s",
            "controller")


def test_quick_sweep_writes_runs_and_plots(tmp_path, chat_model, dataset, capsys):
    out, plot = tmp_path / "sweep.json", tmp_path / "plots" / "sweep.png"
    argv = ["bench", "--dataset", dataset, "--model", chat_model, "--dtype", "float64",
            "--quick", "--drafter", "ngram", "--batch-sizes", "1,2",
            "--controllers", "static:0,static:4,goodput,adaptive", "--slo-tpot-ms", "1000",
            "--baseline", "hf", "--plot", str(plot), "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    systems = ["plain", "static:0", "static:4", "goodput", "adaptive", "hf"]
    assert report["systems"] == systems
    runs = {(r["system"], r["batch_size"]): r for r in report["runs"]}
    assert set(runs) == {(s, b) for s in systems for b in (1, 2) if s != "hf" or b == 1}
    for (system, bs), r in runs.items():
        assert r["tokens_per_s"] > 0 and r["speedup_vs_plain"] > 0, (system, bs)
        assert r["speedup_vs_hf"] > 0
        if system != "hf":
            for key in RUN_KEYS:
                assert key in r, (system, key)
            assert r["greedy_match_rate_vs_plain"] == 1.0, (system, bs)
            assert 0 < r["tpot_ms"]["p50"] <= r["tpot_ms"]["p99"]
            assert r["goodput_tokens_per_s"] <= r["tokens_per_s"] + 1e-9
    assert runs[("static:0", 1)]["tau"] == pytest.approx(1.0)
    goodput = runs[("goodput", 1)]["controller"]
    assert goodput["steps"] > 0 and goodput["mean_predicted_step_ms"] > 0
    assert [b["batch_size"] for b in report["best_static"]] == [1, 2]
    assert plot.exists() and plot.stat().st_size > 10_000
    assert "specdec bench sweep" in capsys.readouterr().out


def test_sweep_compares_drafters(tmp_path, chat_model, dataset):
    out = tmp_path / "d.json"
    argv = ["bench", "--dataset", dataset, "--model", chat_model, "--dtype", "float64",
            "--quick", "--drafters", "ngram,draft_model", "--controllers", "goodput",
            "--drafter-args", '{"draft_model": {"early_exit_layers": 1}}', "--baseline", "none",
            "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["systems"] == ["plain", "ngram/goodput", "draft_model/goodput"]
    assert all(r["greedy_match_rate_vs_plain"] == 1.0 for r in report["runs"])
    # the draft share of step time, per system (the plain engine drafts nothing)
    plain, ngram, draft = report["runs"]
    assert plain["draft_ms_per_step"] < draft["draft_ms_per_step"]
    assert all(0 <= r["draft_share"] < 1 for r in report["runs"])


def test_sweep_argument_errors(chat_model, dataset, capsys):
    assert parse_controllers("static:0,goodput") == [("static", 0), ("goodput", None)]
    assert parse_batch_sizes("8,1,2") == [1, 2, 8]
    for bad in ("static:x", "static:2,static:2", ",goodput"):
        with pytest.raises(ValueError, match="--controllers"):
            parse_controllers(bad)
    for bad in ("0,1", "1,1", "a"):
        with pytest.raises(ValueError, match="--batch-sizes"):
            parse_batch_sizes(bad)
    argv = ["bench", "--dataset", dataset, "--model", chat_model, "--quick",
            "--controllers", "static:2"]
    assert main(argv) != 0
    assert "give --drafter" in capsys.readouterr().err


@pytest.mark.parametrize("sweep", [False, True])
def test_bench_never_serves_a_prompt_twice_under_one_salt(tmp_path, chat_model, dataset,
                                                          monkeypatch, sweep):
    """What a system keeps across requests (prefix pages, the suffix drafter's history of
    responses) must not carry one pass's answers into the next pass over the same prompts: each
    pass is its own cache salt, so no (system, salt) meets the same prompt twice."""
    from specdec.engine.llm import LLM

    seen: dict = {}
    generate = LLM.generate

    def recording(self, prompts, params=None, **kw):
        for p in prompts:
            key = (id(self), params.cache_salt, tuple(p))
            assert key not in seen, f"prompt served twice under salt {params.cache_salt!r}"
            seen[key] = True
        return generate(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", recording)
    argv = ["bench", "--dataset", dataset, "--model", chat_model, "--dtype", "float64",
            "--num-prompts", "2", "--max-new-tokens", "4", "--repeats", "2", "--warmup", "1",
            "--drafter", "suffix", "--baseline", "none", "--json", str(tmp_path / "r.json")]
    if sweep:
        argv += ["--controllers", "goodput", "--batch-sizes", "1,2"]
    assert main(argv) == 0
    salts = {salt for _, salt, _ in seen}
    assert None not in salts and "bench-warmup" in salts
    assert len(salts) == (1 + 2 * 2 if sweep else 1 + 2)


def test_a_failing_system_is_left_out_and_the_sweep_goes_on(tmp_path, chat_model, dataset,
                                                            monkeypatch, capsys):
    """A speculative system whose requests fail (here every draft_model proposal raises) is
    dropped with its error in the report; plain decoding and the other drafters are measured."""
    from specdec.drafters.draft_model import DraftModelDrafter

    def broken(self, requests):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(DraftModelDrafter, "propose", broken)
    out = tmp_path / "f.json"
    argv = ["bench", "--dataset", dataset, "--model", chat_model, "--dtype", "float64",
            "--quick", "--drafters", "ngram,draft_model", "--controllers", "static:3",
            "--drafter-args", '{"draft_model": {"early_exit_layers": 1}}', "--baseline", "none",
            "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["systems"] == ["plain", "ngram/static:3"]
    assert "broken on purpose" in report["failed"]["draft_model/static:3"]
    assert {r["system"] for r in report["runs"]} == {"plain", "ngram/static:3"}
    assert "draft_model/static:3 failed and is left out" in capsys.readouterr().err
