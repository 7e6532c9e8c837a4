"""The `specdec` CLI in-process: generate streams, bench writes a complete report, bad args fail.

The model is a tiny random Llama with a small word-level tokenizer and a chat template (the
`tiny_llama` fixture has no tokenizer). Bench runs in float64, so greedy outputs of the engine,
the plain engine and HF transformers must be identical token for token.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model

from specdec import builtins
from specdec.bench_data import load_questions
from specdec.cli import main
from specdec.drafters.base import BaseDrafter
from specdec.hookspecs import hookimpl
from specdec.tree import DraftTree

WORDS = ("write a short poem about the sea and the sky explain how python lists work "
         "give three tips for sleep better solve two plus two now code function sum").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MT_BENCH = [
    {"question_id": 1, "category": "writing", "turns": ["write a short poem about the sea",
                                                         "now explain the poem"]},
    {"question_id": 2, "category": "writing", "turns": ["write a poem about the sky",
                                                         "give three tips"]},
    {"question_id": 3, "category": "coding", "turns": ["explain how python lists work",
                                                        "code function sum"]},
    {"question_id": 4, "category": "coding", "turns": ["code function sum of two lists",
                                                        "solve two plus two"]},
]
SUMMARY_KEYS = ("engine", "baseline", "speedup_vs_baseline", "speedup_vs_plain",
                "greedy_match_rate", "token_match_rate", "ttft_ms", "tpot_ms", "itl_ms",
                "per_category", "tau", "acceptance_by_depth", "draft_ms_share", "config",
                "num_prompts", "total_new_tokens")


def make_tokenizer_model(folder: Path) -> Path:
    """A tiny random Llama whose vocab is a word-level tokenizer with a chat template (seed 1:
    its greedy answers to the test prompts are non-empty and repeat themselves)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
    vocab = {w: i for i, w in enumerate(specials + sorted(set(WORDS)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    make_tiny_model(folder, seed=1, vocab_size=len(vocab), eos_token_id=2, bos_token_id=1)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return str(make_tokenizer_model(tmp_path_factory.mktemp("chat_model")))


@pytest.fixture
def dataset(tmp_path) -> str:
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MT_BENCH))
    return str(path)


class RepeatDrafter(BaseDrafter):
    """Proposes the last token repeated: accepted often on a tiny random model."""

    name = "repeat"

    def __init__(self, target, **kwargs) -> None:
        pass

    def propose(self, requests):
        return [DraftTree.chain([r.token_ids[-1]] * r.budget) for r in requests]


@pytest.fixture
def repeat_drafter(monkeypatch):
    @hookimpl
    def specdec_drafters():
        return {"repeat": RepeatDrafter}

    monkeypatch.setattr(builtins, "specdec_drafters", specdec_drafters)


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
    assert report["speedup_vs_baseline"] > 0 and report["speedup_vs_plain"] is None
    assert report["tau"] == pytest.approx(1.0)  # no drafter: one token per target forward
    assert report["draft_ms_share"] is None
    for row in report["per_category"].values():
        assert row["engine_tokens_per_s"] > 0 and row["baseline_tokens_per_s"] > 0
        assert row["speedup"] > 0 and row["num_requests"] == 2


def test_bench_plain_baseline_multi_turn(tmp_path, chat_model, dataset, capsys):
    report = run_bench(tmp_path, chat_model, dataset, "--baseline", "plain", "--multi-turn")
    check_common(report, num_requests=8)
    assert report["greedy_match_rate"] == 1.0 and report["greedy_match_rate_vs_plain"] == 1.0
    assert report["speedup_vs_plain"] == report["speedup_vs_baseline"] > 0
    assert "speedup vs baseline" in capsys.readouterr().out  # the printed table


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
                       "--budget", "3", "--batch-size", "2")
    check_speculative(report)
    assert report["tau"] > 1.0  # the tiny model repeats itself, so repeats get accepted
    assert report["config"]["controller_args"] == {"budget": 3}


def test_bench_ngram_with_extra_baseline(tmp_path, chat_model, dataset):
    report = run_bench(tmp_path, chat_model, dataset, "--baseline", "hf", "--drafter", "ngram",
                       "--budget", "4", "--extra-baseline", "hf-pld")
    check_speculative(report)
    extra = report["extra_baseline"]
    assert extra["name"] == "hf-pld" and extra["tokens_per_s"] > 0
    assert extra["speedup_vs_baseline"] > 0 and extra["engine_speedup_vs_it"] > 0
    assert extra["greedy_match_rate"] == 1.0  # HF prompt lookup is lossless too (float64)


@pytest.mark.parametrize("chat", [True, False])
def test_generate_streams(chat_model, capsys, chat):
    argv = ["generate", "write a poem", "--model", chat_model, "--max-tokens", "6"]
    assert main(argv + ([] if chat else ["--no-chat"])) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "6 tokens" in err and "tokens/s" in err and "TTFT" in err


def test_generate_with_drafter_prints_tau(chat_model, capsys, repeat_drafter):
    argv = ["generate", "write a poem", "--model", chat_model, "--max-tokens", "6",
            "--drafter", "repeat", "--budget", "2", "--temperature", "0.7", "--seed", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "tau" in err and "acceptance" in err


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_device_without_cuda(chat_model, capsys):
    assert main(["generate", "hi", "--model", chat_model, "--device", "cuda"]) != 0
    assert "--device" in capsys.readouterr().err


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


def test_generate_bad_args(chat_model, capsys):
    assert main(["generate", "hi", "--model", chat_model, "--max-tokens", "0"]) != 0
    assert "--max-tokens" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", chat_model, "--top-p", "2"]) == 2  # parse time
    assert "argument --top-p: top_p" in capsys.readouterr().err


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
