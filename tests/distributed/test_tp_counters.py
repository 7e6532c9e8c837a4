"""The TP group's counters (issue #54, "Measured"): every collective a rank calls is counted
with its seconds and its tensor's bytes, cheaply, and rank 0's per-step figures reach the
engine's step stats and ``specdec bench``'s report."""

from __future__ import annotations

import multiprocessing

import pytest
import tp_counter_workers

from specdec.distributed import launch

pytestmark = pytest.mark.xdist_group("distributed_spawn")

TIMEOUT_S = 30.0


def test_counters_count_calls_seconds_and_bytes():
    with launch(tp_counter_workers.run, 2, args=(TIMEOUT_S,), timeout_s=TIMEOUT_S,
                threads_per_rank=1) as workers:
        with workers.group(backend="gloo") as group:
            found = tp_counter_workers.collectives(group)
        workers.join()
    assert not multiprocessing.active_children()
    counts = found["counts"]
    nbytes = tp_counter_workers.ROWS * tp_counter_workers.HIDDEN * 4
    assert counts["all_reduce"][0] == 5 and counts["all_reduce"][2] == 5 * nbytes
    assert counts["all_gather"][0] == 1 and counts["all_gather"][2] == nbytes
    assert counts["broadcast_object"][0] == 2 and counts["broadcast_object"][2] == 0
    assert counts["all_gather_object"][0] == 1 and counts["barrier"][0] == 1
    assert all(seconds > 0 for calls, seconds, _ in counts.values() if calls)
    # a copy stays as it was taken; minus gives the interval
    assert found["halfway"]["all_reduce"][0] == 3 and found["halfway"]["all_gather"][0] == 0
    assert found["halfway"]["all_reduce"][1] <= counts["all_reduce"][1]
    assert found["interval"] == 2


def test_the_reduce_mode_is_checked():
    from specdec.config import EngineConfig

    with pytest.raises(ValueError, match=r"tensor_parallel_reduce must be one of exact, "
                                         r"library.*got 'ring'"):
        EngineConfig(tensor_parallel_reduce="ring")
    assert EngineConfig().tensor_parallel_reduce == "exact"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1]))
    import cli_helpers

    return str(cli_helpers.make_tokenizer_model(tmp_path_factory.mktemp("chat_model")))


@pytest.fixture
def dataset(tmp_path) -> str:
    import json

    from cli_helpers import MT_BENCH

    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH))
    return str(path)


def test_bench_reports_the_collectives_per_step_and_the_mismatch_at_tp2(
        tmp_path, chat_model, dataset, capsys):
    """`specdec bench -tp 2 --tensor-parallel-reduce library`: each system's reductions per
    step (two a layer a forward), their seconds, the control messages (a forward's, a KV
    move's), and the library mode's mismatch against plain decoding (none at 2 ranks:
    a + b = b + a)."""
    import json

    from specdec.cli import main
    from specdec.models.loader import load_hf_config

    layers = load_hf_config(chat_model).num_hidden_layers
    out = tmp_path / "report.json"
    argv = ["bench", "--dataset", dataset, "--model", chat_model, "--dtype", "float64",
            "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0",
            "--baseline", "plain", "--drafter", "ngram", "--tensor-parallel-size", "2",
            "--tensor-parallel-reduce", "library", "--json", str(out)]
    assert main(argv) == 0
    assert not multiprocessing.active_children()
    report = json.loads(out.read_text())
    tp = report["tensor_parallel"]
    assert (tp["size"], tp["reduce"]) == (2, "library")
    assert report["runtime"]["tensor_parallel"]["reduce"] == "library"
    assert set(tp["per_step"]) == {"engine", "plain"}
    for name, system in report["step_budget"]["systems"].items():
        per = system["tensor_parallel"]
        assert per == tp["per_step"][name] and per["steps"] > 0
        assert per["reductions_per_step"] == 2 * layers  # every step here runs one forward
        assert per["reduce_ms_per_step"] > 0 and per["reduce_bytes_per_step"] > 0
        assert per["messages_per_step"] >= 1 and per["message_ms_per_step"] > 0
        assert 0 < per["collective_share"] < 1
        for kind in system["kinds"].values():  # and per step kind
            assert kind["tensor_parallel"]["reductions_per_step"] == 2 * layers
    assert tp["mismatch_vs_plain"] == {"requests": 0.0, "tokens": 0.0}
    assert report["mismatch_vs_plain"] == tp["mismatch_vs_plain"]
    assert "library" in tp["note"]
    printed = capsys.readouterr().out
    assert "reductions / messages per step" in printed and "mismatch vs plain" in printed


def test_the_mismatch_counts_tokens_from_the_first_difference():
    from specdec.bench.compare import mismatch
    from specdec.bench.timing import Out

    a = {"x": Out([1, 2, 3, 4], None), "y": Out([5, 6], None)}
    b = {"x": Out([1, 2, 9, 9], None), "y": Out([5, 6], None)}
    assert mismatch(a, b) == {"requests": 0.5, "tokens": 2 / 6}
    assert mismatch(a, a) == {"requests": 0.0, "tokens": 0.0}
