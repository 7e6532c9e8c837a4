"""The draft_model drafter: greedy losslessness (separate LM and early exit), mixed budgets
including 0, aborts and preemption without leaks in either KV cache, bad arguments; a draft
model from a GGUF keeps no fp32 copy where the kernels run its blocks."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import make_tiny_model
from gguf_helpers import write_tiny_gguf
from safetensors.torch import load_file, save_file

from specdec import LLM, SamplingParams
from specdec.controllers.base import DraftBudget
from specdec.hookspecs import hookimpl

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 50)), [42] * 13, [3, 1, 4, 1, 5],
           [60, 61, 62], list(range(70, 90)), [5]]


def greedy(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True)


class MixedBudgets:
    """Controller giving request k the budget BUDGETS[k % 4], zero included."""

    name = "mixed"
    BUDGETS = (3, 0, 7, 1)

    def budgets(self, requests, batch):
        return [DraftBudget(self.BUDGETS[int(r.request_id) % 4]) for r in requests]

    def observe(self, report):
        pass


class MixedPlugin:
    @hookimpl
    def specdec_controllers(self):
        return {"mixed": MixedBudgets}


@pytest.fixture(scope="module")
def other_draft(tiny_llama, tmp_path_factory):
    """The target's weights plus noise: a different model that agrees with it only partly."""
    folder = tmp_path_factory.mktemp("draft")
    shutil.copy(tiny_llama / "config.json", folder / "config.json")
    gen = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen, dtype=v.dtype)
             for k, v in load_file(tiny_llama / "model.safetensors").items()}
    save_file(noisy, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float64")
    return [o.token_ids for o in llm.generate(PROMPTS, [greedy(i) for i in range(len(PROMPTS))])]


def all_pages_free(llm: LLM) -> bool:
    assert len(llm.engine.parts.drafter_runners) == 1
    pools = [llm.engine.kv.pool, llm.engine.drafting.drafter.runner.kv.pool]
    return all(p.num_free == p.num_pages for p in pools)


@pytest.mark.parametrize("source", ["self", "other", "early_exit"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_identical_to_plain(tiny_llama, other_draft, plain_outputs, source, batch):
    args = {"self": {"model": str(tiny_llama)}, "other": {"model": str(other_draft)},
            "early_exit": {"early_exit_layers": 1}}[source]
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="draft_model", drafter_args=args,
              controller="mixed", plugins=(MixedPlugin(),))
    outs = llm.generate(PROMPTS[:batch], [greedy(i) for i in range(batch)])
    assert [o.token_ids for o in outs] == plain_outputs[:batch]
    accepted = sum(sum(o.metrics.accepted_by_depth) for o in outs)
    assert accepted > 0, "drafts must be accepted somewhere, or the test shows nothing"
    if source == "self":  # the target drafting for itself: every draft is accepted
        assert all(o.metrics.draft_tokens_proposed == sum(o.metrics.accepted_by_depth)
                   for o in outs)
    zero = [o for i, o in enumerate(outs) if i % 4 == 1]  # budget 0: plain decoding
    assert all(o.metrics.draft_tokens_proposed == 0 for o in zero)
    assert all_pages_free(llm)


def test_abort_and_preemption_leave_no_pages(tiny_llama, other_draft, plain_outputs):
    llm = LLM(model=str(tiny_llama), dtype="float64", drafter="draft_model",
              drafter_args={"model": str(other_draft)},
              controller_args={"budget": 4}, page_size=4, num_pages=24, max_model_len=80)
    eng = llm.engine
    ids = [eng.add_request(p, greedy(i)) for i, p in enumerate(PROMPTS)]
    for _ in range(3):
        eng.step()
    eng.abort(ids[2])
    while eng.has_unfinished():
        eng.step()
    done = [eng.pop_finished(i) for i in ids]
    assert done[2].finish_reason == "abort"
    for i, seq in enumerate(done):
        if i != 2:
            assert seq.output_token_ids == plain_outputs[i]
    assert sum(s.num_preemptions for s in done) > 0, "24 pages of 4 must force preemption"
    assert all_pages_free(llm)


@pytest.mark.parametrize("args, needle", [
    ({}, "exactly one of"),
    ({"early_exit_layers": 2}, "early_exit_layers"),  # the tiny model has 2 layers
    ({"early_exit_layers": 1, "max_depth": 0}, "max_depth"),
])
def test_bad_arguments(tiny_llama, args, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(model=str(tiny_llama), drafter="draft_model", drafter_args=args)


def test_vocab_mismatch(tiny_llama, tmp_path):
    other = make_tiny_model(tmp_path / "v", vocab_size=64, eos_token_id=63)
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(model=str(tiny_llama), drafter="draft_model", drafter_args={"model": str(other)})


@pytest.mark.slow
def test_smollm2_early_exit_is_lossless(smollm2_dir):
    tok_prompts = ["List the days of the week.", "Count from one to ten in words."]
    plain = LLM(model=str(smollm2_dir), max_model_len=512)
    # 12 of 30 layers: some drafts are accepted within 24 tokens (6 here; 8 layers had 2), so
    # the accepted path's KV moves run on the real model too, not only rejections
    spec = LLM(model=str(smollm2_dir), max_model_len=512, drafter="draft_model",
               drafter_args={"early_exit_layers": 12}, controller="static",
               controller_args={"budget": 3})
    chats = [[{"role": "user", "content": p}] for p in tok_prompts]
    params = SamplingParams(temperature=0, max_tokens=24)
    a, b = plain.generate(chats, params), spec.generate(chats, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.metrics.draft_tokens_proposed for o in b) > 0
    assert sum(sum(o.metrics.accepted_by_depth) for o in b) > 0


def test_no_kv_in_the_draft_cache_drafts_nothing_and_says_so(tiny_llama):
    """The draft cache comes from the engine's budget (the drafter no longer sizes its own):
    when its runner's pages run out, the request gets no draft and is marked no_kv."""
    from specdec.controllers.base import DraftBudget
    from specdec.drafters.base import DraftRequest, TargetInfo, TokenView
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.engine.runner import ModelRunner
    from specdec.models.loader import load_model

    model = load_model(tiny_llama, torch.float64, "cpu", 64)[0]
    runners = []

    def new_runner(m, name="drafter", num_layers=None):
        runners.append(ModelRunner(m, name, "torch", 4, "cpu", num_layers))
        return runners[-1]

    target = TargetInfo(model, model.cfg, None, None, str(tiny_llama), torch.float64,
                        torch.device("cpu"), 4, 64, new_runner)
    drafter = DraftModelDrafter(target, early_exit_layers=1, max_depth=3)
    (runner,) = runners
    assert runner.num_layers == 1 and runner.kv is None  # the engine allocates it
    runner.allocate(3)  # 12 slots: one request of 7 tokens + 3 drafts
    params = SamplingParams(temperature=0)
    reqs = [DraftRequest(str(i), TokenView([3, 1, 4, 1, 5, 9, 2]), DraftBudget(3), params, None,
                         drafter.init_state(str(i), [3, 1, 4])) for i in range(2)]
    trees = drafter.propose(reqs)
    assert [t.num_nodes for t in trees] == [3, 0] and [r.no_kv for r in reqs] == [False, True]
    for r in reqs:
        drafter.release(r.state)
    assert runner.kv.pool.num_free == 3


@pytest.mark.parametrize("weights", ["auto", "dequantized"])
def test_a_gguf_draft_model_keeps_no_fp32_copy(weights, tmp_path, monkeypatch):
    """A draft model from a GGUF is loaded on the file's blocks (BlockWeight), as the target
    is: where the kernels run them it keeps them (every matrix has its panels, none fp32);
    where they do not (weights="dequantized", no kernels) they are dequantized once. Either
    way speculation gives plain decoding's tokens."""
    from specdec import native
    from specdec.models.gguf.block_weight import BlockWeight

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    write = write_tiny_gguf
    target = write(tmp_path / "target.gguf", kind="Q4_1", std=0.3)
    # the same random values in Q8_0: a different model, whose drafts are mostly accepted
    draft = write(tmp_path / "draft.gguf", kind="Q8_0", std=0.3)
    kw = dict(model=str(target), max_model_len=64, weights=weights)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["hello", "abc!", "xyz"]
    plain = [o.token_ids for o in LLM(**kw).generate(prompts, sp)]
    spec = LLM(drafter="draft_model", drafter_args={"model": str(draft), "max_depth": 3},
               controller="static", controller_args={"budget": 3}, **kw)
    out = spec.generate(prompts, sp)
    assert [o.token_ids for o in out] == plain
    assert sum(sum(o.metrics.accepted_by_depth) for o in out) > 0
    model = spec.engine.drafting.drafter.runner.model
    assert model is not spec.engine.parts.model
    lean = weights == "auto" and native.load() is not None
    assert all(isinstance(w, BlockWeight) == lean for w in [model.embed, *model.matrices()])
    if lean:  # every matrix runs from panels made of its blocks, none prepared from fp32
        kernels = spec.engine.parts.kernels
        n = kernels.num_prepared
        assert all(kernels.prepared(w).fmt not in native.FORMATS.values()
                   for w in model.matrices())
        assert kernels.num_prepared == n
