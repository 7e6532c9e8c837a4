"""`specdec bench` in-process: a complete report against each baseline, bad args and datasets.

Bench runs in float64, so greedy outputs of the engine, the plain engine and HF transformers
must be identical token for token.
"""

from __future__ import annotations

import gzip
import json

import cli_helpers
import pytest
from cli_helpers import MT_BENCH

from specdec.bench.data import load_questions
from specdec.cli import main

chat_model, dataset, repeat_drafter = (cli_helpers.chat_model, cli_helpers.dataset,
                                       cli_helpers.repeat_drafter)  # fixtures

SUMMARY_KEYS = ("engine", "baseline", "speedup_vs_baseline", "speedup_vs_plain",
                "greedy_match_rate", "token_match_rate", "ttft_ms", "tpot_ms", "itl_ms",
                "per_category", "tau", "acceptance_by_depth", "draft_ms_share", "config",
                "num_prompts", "total_new_tokens")


def run_bench(tmp_path, model: str, dataset: str, *extra: str) -> dict:
    out = tmp_path / "report.json"
    argv = ["bench", "--dataset", dataset, "--model", model, "--dtype", "float64",
            "--num-prompts", "4", "--max-new-tokens", "8", "--repeats", "2", "--warmup", "1",
            "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def check_common(report: dict, num_requests: int = 4) -> None:
    for key in SUMMARY_KEYS:
        assert key in report, key
    assert report["num_prompts"] == 4 and report["num_requests"] == num_requests
    assert report["total_new_tokens"] > 0
    assert report["engine"]["tokens_per_s"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        p = report[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"], key
    assert set(report["per_category"]) == {"writing", "coding"}
    assert report["config"]["dtype"] == "float64" and report["config"]["num_threads"] >= 1


def test_bench_hf_baseline(tmp_path, chat_model, dataset):
    report = run_bench(tmp_path, chat_model, dataset, "--baseline", "hf", "--batch-size", "2")
    check_common(report)
    assert report["baseline"]["name"] == "hf" and report["baseline"]["tokens_per_s"] > 0
    assert report["greedy_match_rate"] == 1.0 and report["token_match_rate"] == 1.0
    assert report["numbers"]["same"] and report["numbers"]["note"] is None  # float64 both
    assert report["speedup_vs_baseline"] > 0 and report["speedup_vs_plain"] is None
    assert report["tau"] == pytest.approx(1.0)  # no drafter: one token per target forward
    assert report["draft_ms_share"] is None
    for row in report["per_category"].values():
        assert row["engine_tokens_per_s"] > 0 and row["baseline_tokens_per_s"] > 0
        assert row["speedup"] > 0 and row["num_requests"] == 2


def test_a_match_with_other_numbers_is_said_to_be_one():
    """Issue 51: by default (q8 activations over a GGUF's blocks) HF's fp32 tokens are not the
    engine's; the report says what it compares and why they differ, beside the exact match
    with plain decoding, instead of a bare "greedy match rate 0.0 %"."""
    from specdec.bench.compare import compared_numbers
    from specdec.bench.report import _match_rows

    q8 = {"dtype": "torch.float32", "weights": "native", "activations": "q8"}
    numbers = compared_numbers(q8, "hf")
    assert not numbers["same"] and "--activations float" in numbers["note"]
    assert "q8 activations" in numbers["engine"] and "float" in numbers["baseline"]
    assert compared_numbers(dict(q8, activations="float"), "hf")["same"]
    assert compared_numbers(dict(q8, activations="float"), "hf-pld")["same"]
    assert not compared_numbers(dict(q8, weights="q8_0", activations="float"), "hf")["same"]
    assert not compared_numbers(q8, "llama.cpp")["same"]
    assert compared_numbers(q8, "plain")["same"]
    report = {"baseline": {"name": "hf"}, "numbers": numbers, "greedy_match_rate": 0.0,
              "token_match_rate": 0.146, "greedy_match_rate_vs_plain": 1.0,
              "token_match_rate_vs_plain": 1.0}
    rows = dict(_match_rows(report))
    assert rows["greedy match agreement with hf (other numbers)"] == "0.0%"
    assert rows["greedy match vs plain (same numbers)"] == "100.0%"
    assert "not an exactness check" in rows["why they differ"]
    same = dict(_match_rows(dict(report, numbers=compared_numbers(
        dict(q8, activations="float"), "hf"))))
    assert same["greedy match vs hf"] == "0.0%" and "why they differ" not in same


def test_bench_plain_baseline_multi_turn(tmp_path, chat_model, dataset, capsys):
    report = run_bench(tmp_path, chat_model, dataset, "--baseline", "plain", "--multi-turn")
    check_common(report, num_requests=8)
    assert report["greedy_match_rate"] == 1.0 and report["greedy_match_rate_vs_plain"] == 1.0
    assert report["speedup_vs_plain"] == report["speedup_vs_baseline"] > 0
    out = capsys.readouterr().out
    assert "speedup vs baseline" in out  # the printed table
    # the step budget of both engine systems over the timed runs, beside the physics
    budget = report["step_budget"]
    assert budget["bandwidth_gbs"] > 0 and set(budget["systems"]) == {"engine", "plain"}
    for system in budget["systems"].values():
        assert system["forward_memory_bound_ms"] > 0
        plain = system["kinds"]["plain"]
        assert plain["steps"] > 0 and plain["ms"]["forward"] > 0
        assert plain["ms"]["step"] == pytest.approx(sum(
            v for k, v in plain["ms"].items() if k != "step"))
    assert "step budget" in out and "beside the physics" in out
    assert budget["fp32_macs_per_s"] > 0 and budget["int8_macs_per_s"] > 0
    for system in budget["systems"].values():
        rows = system["forward_rows_ms"]
        assert set(rows) == {"1", "2", "4", "8", "16"} and all(v > 0 for v in rows.values())
        assert system["row_compute_bound_ms"] > 0 and system["draft_ms_by_depth"] is None


def test_bench_hf_pld_no_baseline(tmp_path, chat_model, dataset):
    report = run_bench(tmp_path, chat_model, dataset, "--baseline", "hf-pld")
    assert report["greedy_match_rate"] == 1.0
    report = run_bench(tmp_path, chat_model, dataset, "--baseline", "none")
    assert report["baseline"] is None and report["greedy_match_rate"] is None


def check_speculative(report: dict) -> None:
    check_common(report)
    assert report["greedy_match_rate"] == 1.0 and report["greedy_match_rate_vs_plain"] == 1.0
    assert report["plain"]["tokens_per_s"] > 0 and report["speedup_vs_plain"] > 0
    assert report["tau"] >= 1.0
    assert report["acceptance_by_depth"] and all(0 <= a <= 1 for a in report["acceptance_by_depth"])
    assert 0 < report["draft_ms_share"] < 1
    assert all(row["tau"] >= 1.0 for row in report["per_category"].values())


def test_bench_with_drafter(tmp_path, chat_model, dataset, repeat_drafter):
    report = run_bench(tmp_path, chat_model, dataset, "--baseline", "hf", "--drafter", "repeat",
                       "--controller", "static", "--budget", "3", "--batch-size", "2")
    check_speculative(report)
    assert report["tau"] > 1.0  # the tiny model repeats itself, so repeats get accepted
    assert report["config"]["controller_args"] == {"budget": 3}


def test_bench_ngram_with_extra_baseline(tmp_path, chat_model, dataset):
    report = run_bench(tmp_path, chat_model, dataset, "--baseline", "hf", "--drafter", "ngram",
                       "--controller", "static", "--budget", "4", "--extra-baseline", "hf-pld")
    check_speculative(report)
    extra = report["extra_baseline"]
    assert extra["name"] == "hf-pld" and extra["tokens_per_s"] > 0
    assert extra["speedup_vs_baseline"] > 0 and extra["engine_speedup_vs_it"] > 0
    assert extra["greedy_match_rate"] == 1.0  # HF prompt lookup is lossless too (float64)


@pytest.mark.parametrize("args, needle", [
    (["--drafter", "no-such-drafter"], "--drafter"),
    (["--controller", "no-such-controller"], "--controller"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--drafter-args", "{bad json"], "--drafter-args"),
    (["--controller-args", "[1, 2]"], "--controller-args"),
    (["--budget", "3", "--controller-args", '{"budget": 4}'], "--budget"),
    (["--baseline", "vllm"], "--baseline"),
    (["--drafter-args", '{"n": 2}'], "--drafter-args"),  # without --drafter
])


def test_bench_bad_args(chat_model, dataset, capsys, repeat_drafter, args, needle):
    assert main(["bench", "--dataset", dataset, "--model", chat_model, *args]) != 0
    assert needle in capsys.readouterr().err


def test_bench_missing_dataset(tmp_path, capsys):
    assert main(["bench", "--dataset", str(tmp_path / "nope.jsonl")]) != 0
    err = capsys.readouterr().err
    assert "--dataset" in err and "not found" in err


@pytest.mark.parametrize("content, needle", [
    ('{"question_id": 1}\n', "expected MT-Bench"),
    ("not json\n", "not valid JSON"),
])


def test_bench_bad_dataset(tmp_path, chat_model, capsys, content, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert main(["bench", "--dataset", str(path), "--model", chat_model, "--warmup", "0"]) == 1
    err = capsys.readouterr().err
    assert "--dataset" in err and needle in err


def test_bench_too_many_prompts(chat_model, dataset, capsys):
    assert main(["bench", "--dataset", dataset, "--model", chat_model, "--num-prompts", "9",
                 "--baseline", "none"]) == 1
    assert "--num-prompts 9" in capsys.readouterr().err


def test_humaneval_and_round_robin(tmp_path):
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for i in range(3):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():"}) + "\n")
    questions = load_questions(path, 2)
    assert [q.qid for q in questions] == ["HumanEval/0", "HumanEval/1"]
    assert all(q.category == "humaneval" and len(q.turns) == 1 for q in questions)
    mt = tmp_path / "mt.jsonl"
    mt.write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH))
    assert [q.category for q in load_questions(mt, 2)] == ["writing", "coding"]


class FakeLlama:
    """llama_cpp.Llama's surface the baseline uses: greedy tokens from a fixed rule."""

    made: list[dict] = []

    def __init__(self, model_path, draft_model=None, **kwargs):
        FakeLlama.made.append({"model_path": model_path, "draft": draft_model, **kwargs})

    def generate(self, tokens, **kwargs):
        assert kwargs["temp"] == 0.0 and kwargs["reset"]
        t = tokens[-1]
        while True:
            t = (t * 7 + 3) % 50
            yield t


def test_bench_llama_cpp_baselines(tmp_path, chat_model, dataset, monkeypatch):
    import shutil
    import sys
    import types

    fake = types.ModuleType("llama_cpp")
    fake.Llama, fake.__version__ = FakeLlama, "fake"
    spec = types.ModuleType("llama_cpp.llama_speculative")
    spec.LlamaPromptLookupDecoding = lambda num_pred_tokens: ("pld", num_pred_tokens)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    folder = tmp_path / "model"
    shutil.copytree(chat_model, folder)
    assert main(["bench", "--dataset", dataset, "--model", str(folder), "--baseline",
                 "llama.cpp"]) != 0  # no GGUF in the folder: said, not run
    (folder / "model.gguf").write_bytes(b"GGUF")  # what a converted GGUF folder keeps
    FakeLlama.made.clear()
    report = run_bench(tmp_path, str(folder), dataset, "--baseline", "llama.cpp",
                       "--extra-baseline", "llama.cpp-pld")
    check_common(report)
    assert report["baseline"]["name"] == "llama.cpp" and report["baseline"]["tokens_per_s"] > 0
    extra = report["extra_baseline"]
    assert extra["name"] == "llama.cpp-pld" and extra["greedy_match_rate"] == 1.0
    assert [m["model_path"] for m in FakeLlama.made] == [str(folder / "model.gguf")] * 2
    assert FakeLlama.made[0]["draft"] is None and FakeLlama.made[1]["draft"] == ("pld", 10)
    assert report["greedy_match_rate"] < 1.0  # the fake is not the model: reported, not forced
    assert report["runtime"]["weights"] == "dequantized"
    assert report["runtime"]["weight_bytes_per_token"] > 0
    assert report["runtime"]["q8_isa"] is None  # float activations: no q8 kernels ran


def test_bench_extra_baseline_needs_its_kind(chat_model, dataset, capsys):
    assert main(["bench", "--dataset", dataset, "--model", chat_model, "--baseline", "hf",
                 "--extra-baseline", "llama.cpp-pld"]) != 0
    assert "--extra-baseline llama.cpp-pld needs --baseline llama.cpp or llama.cpp-pld" in \
        capsys.readouterr().err
