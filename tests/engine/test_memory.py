"""One KV memory budget split between the target's and the drafters' runners (specdec.engine.memory),
by itself and as the engine applies it."""

from __future__ import annotations

import re

import pytest

from specdec import LLM
from specdec.engine.memory import split_kv

TARGET, DRAFTER = 737_280, 245_760  # the module docstring's SmolLM2 target and 10-layer drafter


def test_docstring_example():
    split = split_kv({"target": TARGET, "drafter early_exit[10]": DRAFTER}, 16, 4096,
                     memory_bytes=1 << 30)
    assert split.num_pages == 1092 and split.num_tokens == 17_472
    assert [(s.name, s.num_pages, s.bytes) for s in split.shares] == [
        ("target", 1092, 1092 * TARGET), ("drafter early_exit[10]", 1092, 1092 * DRAFTER)]
    assert sum(s.bytes for s in split.shares) <= 1 << 30
    text = split.describe()
    assert "1092 pages x 16 slots = 17472 tokens" in text and "drafter early_exit[10]" in text


def test_num_pages_given_wins_over_memory():
    split = split_kv({"target": 100}, 4, 8, memory_bytes=10**9, num_pages=3)
    assert split.num_pages == 3 and split.shares[0].bytes == 300


@pytest.mark.parametrize("kwargs", [dict(memory_bytes=2 * (TARGET + DRAFTER)), dict(num_pages=2)])
def test_too_small_names_both_runners_sizes(kwargs):
    with pytest.raises(ValueError) as err:
        split_kv({"target": TARGET, "drafter d": DRAFTER}, 16, 64, **kwargs)
    msg = str(err.value)
    assert f"target {TARGET // 16} B/token" in msg and f"drafter d {DRAFTER // 16} B/token" in msg
    assert "max_model_len=64" in msg and "needs 4 pages" in msg
    assert ("bytes" in msg) if "memory_bytes" in kwargs else ("num_pages=2" in msg)


def test_exactly_one_request_fits():
    split = split_kv({"target": 10, "drafter d": 5}, 4, 16, memory_bytes=4 * 15)
    assert split.num_pages == 4 and split.num_tokens == 16


def test_engine_splits_one_budget_between_target_and_early_exit_drafter(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="draft_model",
              drafter_args={"early_exit_layers": 1}, page_size=4, max_model_len=64,
              kv_cache_memory=300_000)
    eng = llm.engine
    target, (drafter,) = eng.parts.runner, eng.parts.drafter_runners
    assert drafter.num_layers == 1 and target.num_layers == 2
    assert drafter.bytes_per_page * 2 == target.bytes_per_page
    split = eng.parts.kv_split
    assert [s.name for s in split.shares] == ["target", f"drafter {drafter.name}"]
    assert split.num_pages == 300_000 // (target.bytes_per_page + drafter.bytes_per_page)
    assert target.kv.num_pages == drafter.kv.num_pages == split.num_pages
    assert eng.kv is target.kv
    assert drafter.kv.cache.tensor.shape[0] == 1  # the drafter's cache holds only its layers


def test_engine_without_drafter_has_one_share(tiny_llama):
    eng = LLM(model=str(tiny_llama), dtype="float32", page_size=4, max_model_len=32,
              max_num_seqs=3).engine
    (share,) = eng.parts.kv_split.shares
    assert share.name == "target" and eng.parts.drafter_runners == []
    one = eng.parts.runner.bytes_per_page // 4 * 32  # bytes of one max_model_len request
    assert share.bytes <= 3 * one and eng.parts.kv_split.num_tokens >= 32


def test_engine_budget_too_small_names_target_and_drafter(tiny_llama):
    with pytest.raises(ValueError, match="KV cache too small") as err:
        LLM(model=str(tiny_llama), dtype="float64", drafter="draft_model",
            drafter_args={"early_exit_layers": 1}, page_size=4, max_model_len=64,
            kv_cache_memory=10_000)
    sizes = re.findall(r"(target|drafter early_exit\[1\]) (\d+) B/token", str(err.value))
    assert [name for name, _ in sizes] == ["target", "drafter early_exit[1]"]
    assert int(sizes[0][1]) == 2 * int(sizes[1][1])
