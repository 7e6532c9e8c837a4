"""The row-invariant attention backend (specdec/attention/invariant_backend.py): against the torch
reference on mixed steps, its plan staged by the runner in one copy, and in an engine whose
every runner replays graphs (the CPU stand-ins), greedy speculation in bfloat16 equal to plain
decoding token for token, the promise it exists for. Without a GPU the kernel runs under
Triton's interpreter (TRITON_INTERPRET=1, set before the kernel module is imported)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from gpu.gpu_helpers import random_cache, random_step  # noqa: E402
from graph_helpers import graph_everything  # noqa: E402

from specdec.attention.backend import AttentionSpec  # noqa: E402
from specdec.attention.invariant_backend import InvariantAttentionBackend  # noqa: E402
from specdec.attention.torch_backend import TorchAttentionBackend  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, HKV, D, PAGE, PAGES = 6, 2, 16, 4, 64
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("kinds", [["decode"] * 3, ["prefill", "tree", "decode", "chunk", "tree"]])
def test_invariant_backend_matches_the_torch_backend(kinds):
    gen = torch.Generator().manual_seed(len(kinds))
    step = random_step(gen, kinds, PAGES, PAGE, (H, HKV, D), DEV, torch.float32)
    cache = random_cache(gen, PAGES, PAGE, HKV, D, DEV, torch.float32)
    outs, caches = [], []
    for backend in (TorchAttentionBackend(kernels=None),
                    InvariantAttentionBackend(AttentionSpec(H, HKV, D, torch.float32,
                                                            torch.device(DEV)))):
        c = cache.clone()
        backend.plan(step.md)
        outs.append(backend.run(step.q, step.k, step.v, c, D**-0.5))
        caches.append(c)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(caches[0], caches[1])  # the same slots written


def test_invariant_backend_refuses_what_it_cannot_run():
    from specdec.attention.invariant_backend import check_supported

    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        check_supported(AttentionSpec(H, HKV, D, torch.float64, torch.device(DEV)))
    with pytest.raises(ValueError, match="a multiple of the KV heads"):
        check_supported(AttentionSpec(5, 2, D, torch.float32, torch.device(DEV)))


@pytest.fixture(scope="module")
def bf16_plain(tiny_llama):
    """(engine keywords, prompts, params, plain decoding's tokens) for the bfloat16 tests: the
    plain engine graphed too, both prompts in one batch (a row's result is what it is alone:
    the tree case, one prompt, compares with its tokens from this batch)."""
    from specdec.engine.llm import LLM
    from specdec.sampling_params import SamplingParams

    prompts = [[5, 6, 7, 8, 5, 6, 9], [3, 4, 3, 4, 3]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(model=str(tiny_llama), dtype="bfloat16", device=DEV, max_num_seqs=2,
              max_num_batched_tokens=32,
              attention_backend="invariant", enable_prefix_caching=False)
    plain = LLM(**kw)
    graph_everything(plain.engine)
    return kw, prompts, params, [o.token_ids for o in plain.generate(prompts, params)]


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_bf16_greedy_speculation_through_graphs_equals_plain(bf16_plain, tree):
    """bfloat16, where rounding flips argmax near-ties wherever a row's result depends on the
    rest of the step: every runner graphed, the row-invariant attention and matmuls, the
    oracle's chains (or trees with a wrong sibling each): token for token plain decoding, with
    staged plans (one host -> device copy a forward) and one read a step."""
    from conftest import oracle_plugin as tree_oracle

    from specdec.drafters.oracle import oracle_plugin
    from specdec.engine.llm import LLM

    kw, prompts, params, want = bf16_plain
    prompts, want = prompts[:1 if tree else 2], want[:1 if tree else 2]
    truth = {tuple(p): w for p, w in zip(prompts, want)}
    plugin = (tree_oracle(prompts[0] + want[0], depth=3) if tree  # one request: its tokens
              else oracle_plugin(truth, 0.3, depth=4))
    spec = LLM(**kw, drafter="oracle", plugins=(plugin,), controller="static",
               controller_args={"budget": 4})
    capture = graph_everything(spec.engine)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    totals = spec.engine.totals.budget["speculative"]
    assert totals.steps and totals.eager_steps == 0 and totals.d2h_reads == totals.steps
    assert totals.h2d_copies <= 2 * totals.steps
    assert sum(g.replays for g in capture.graphs) >= totals.steps


def test_eagle3_head_attends_through_the_invariant_backend(tiny_llama):
    """An EAGLE-3 head's expansion rows see the prefix and only their ancestors among the rows
    fed before them (not all their context): the invariant kernel takes such masks, and
    speculation with a random head equals plain decoding (float32, graphs stand-ins). A
    2-layer target (its one capturable layer three times) and 8 tokens: every kernel launch is
    interpreted here (~5 ms a program), and the target's layers were most of them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafters"))
    from drafter_helpers import random_head

    from specdec.engine.llm import LLM
    from specdec.models.loader import load_model
    from specdec.sampling_params import SamplingParams

    folder = tiny_llama
    head = random_head(*load_model(folder, torch.float32, DEV, 256), aux_layer_ids=(1, 1, 1))
    # 8 tokens: 6 speculative steps, 20 draft nodes from the head's expansion rows
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 5, 6, 9]]
    kw = dict(model=str(folder), dtype="float32", device=DEV, attention_backend="invariant",
              enable_prefix_caching=False, max_num_seqs=2, max_num_batched_tokens=64)
    want = [o.token_ids for o in LLM(**kw).generate(prompts, params)]
    spec = LLM(**kw, drafter="eagle3", drafter_args={"head": head, "depth": 3, "topk": 2},
               controller="static", controller_args={"budget": 5})
    graph_everything(spec.engine)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert got[0].metrics.draft_tokens_proposed > 0
