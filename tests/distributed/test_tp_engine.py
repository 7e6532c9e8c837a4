"""The engine at tensor_parallel_size N (issue #54): rank 0 runs the engine, the other ranks
(spawned here, gloo) run its every forward on their shards. Speculation is exact at a given N
(greedy token for token, seeded sampling the same text with and without drafts), the float64
tokens agree with N = 1, a bad N is refused before any process starts, and no process outlives
the engine (close, a killed worker)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.distributed.launch import WorkerError

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parents[1] / "drafters"))
from conftest import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.xdist_group("distributed_spawn")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4], [7, 8, 9, 7, 8, 9, 7, 8], [11, 12, 13]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """12 heads over 6 KV heads, an MLP of 96: TP 2 and 3 split both, TP 4 is refused."""
    return make_tiny_model(tmp_path_factory.mktemp("tp") / "m", hidden_size=96,
                           intermediate_size=96, num_attention_heads=12,
                           num_key_value_heads=6, num_hidden_layers=4)


def generate(folder, tp: int, prompts=PROMPTS, params=GREEDY, **kw) -> list[list[int]]:
    with LLM(model=str(folder), tensor_parallel_size=tp, max_model_len=128, **kw) as llm:
        outs = llm.generate(prompts, params)
    assert not multiprocessing.active_children()  # the workers ended with the engine
    return [o.token_ids for o in outs]


def test_speculation_is_plain_decoding_at_tp(folder):
    """(3 ranks: test_tp_speculation.py's MTP trees, test_tp_cli.py's SmolLM2 at TP 3.)"""
    plain = generate(folder, 2)
    assert generate(folder, 2, drafter="ngram", controller="static",
                    controller_args={"budget": 4}) == plain
    assert generate(folder, 2, drafter="suffix") == plain


def test_float64_tokens_agree_with_one_rank(folder):
    one = generate(folder, 1, dtype="float64")
    assert generate(folder, 2, dtype="float64") == one


def test_seeded_sampling_is_the_same_with_and_without_drafts(folder):
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=10, ignore_eos=True)
              for s in (1, 2, 3)]
    plain = generate(folder, 2, params=params)
    assert generate(folder, 2, params=params, drafter="ngram", controller="static",
                    controller_args={"budget": 3}) == plain


def test_a_size_that_does_not_split_the_heads_is_refused_before_any_process(folder):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=5 .*num_heads=12"):
        LLM(model=str(folder), tensor_parallel_size=5)
    assert not multiprocessing.active_children()


def test_a_killed_worker_is_an_error_naming_its_rank_and_nothing_is_left(folder):
    llm = LLM(model=str(folder), tensor_parallel_size=2, max_model_len=128)
    try:
        worker = llm.engine.parts.tp.workers.processes[1]
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"rank 1 of 2 failed: killed by signal SIGKILL"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 30
    finally:
        llm.close()
    assert not multiprocessing.active_children()


def test_learned_drafters_at_tp(folder):
    """EAGLE-3 reads rank 0's hidden states (the full ones, after each reduction)."""
    from drafter_helpers import random_head

    from specdec.models.loader import load_model

    plain = generate(folder, 2)
    model, cfg, hf = load_model(folder, torch.float32, "cpu", 128)
    head = random_head(model, cfg, hf, aux_layer_ids=(1, 2, 3))
    assert generate(folder, 2, drafter="eagle3", controller="static",
                    controller_args={"budget": 4},
                    drafter_args={"head": head, "depth": 3, "topk": 2}) == plain
