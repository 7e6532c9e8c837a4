"""The engine's verify stage with plugin verifiers: a verifier that raises, or returns something
that is not a root path of the tree (or a token outside the vocab), fails only the request
concerned, naming the plugin; a greedy-only verifier refuses sampled requests when they are
added."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.drafters.base import BaseDrafter
from specdec.hookspecs import hookimpl
from specdec.tree import DraftTree
from specdec.verifiers.rejection import RejectionVerifier

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
MARK = 13  # requests whose prompt starts with MARK get draft chains [MARK, MARK]
PROMPTS = [[1, 2, 3], [MARK, 2, 3], [4, 5, 6, 4]]


class Marking(BaseDrafter):
    name = "marking"

    def __init__(self, target, **kwargs):
        pass

    def propose(self, requests):
        return [DraftTree.chain(([MARK, MARK] if r.token_ids[0] == MARK
                                 else [r.token_ids[-1]] * 2)[: r.budget.max_nodes])
                for r in requests]


def marked(batch) -> list[int]:
    return [b for b, t in enumerate(batch.trees) if t.num_nodes and int(t.tokens[0]) == MARK]


class Raising(RejectionVerifier):
    name = "raising"

    def verify(self, batch):
        if marked(batch):
            raise RuntimeError("verifier bug")
        return super().verify(batch)


class OffPath(RejectionVerifier):
    """For marked requests: accepts node 1 without node 0 (not a root path)."""

    name = "off_path"

    def verify(self, batch):
        out = super().verify(batch)
        for b in marked(batch):
            out.accepted[b] = -1
            out.accepted[b, 0] = 1
            out.tokens[b] = -1
            out.tokens[b, :2] = torch.tensor([MARK, 5])
            out.num_accepted[b] = 1
        return out


class OutOfVocab(RejectionVerifier):
    name = "out_of_vocab"

    def verify(self, batch):
        out = super().verify(batch)
        for b in marked(batch):
            out.tokens[b, int(out.num_accepted[b])] = 1000
        return out


class WrongType(RejectionVerifier):
    name = "wrong_type"

    def verify(self, batch):
        return super().verify(batch).to_results()


class BatchBug(RejectionVerifier):
    """Raises only for several requests at once: verified one by one, every output is right."""

    name = "batch_bug"

    def verify(self, batch):
        if batch.batch_size > 1:
            raise IndexError("batched path bug")
        return super().verify(batch)


class Plugin:
    @hookimpl
    def specdec_drafters(self):
        return {"marking": Marking}

    @hookimpl
    def specdec_verifiers(self):
        return {c.name: c for c in (Raising, OffPath, OutOfVocab, WrongType, BatchBug)}


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float64").generate(PROMPTS, GREEDY)


def run(tiny_llama, verifier: str):
    llm = LLM(model=str(tiny_llama), dtype="float64", controller="static", drafter="marking", verifier=verifier,
              plugins=(Plugin(),), controller_args={"budget": 2})
    outs = llm.generate(PROMPTS, GREEDY)
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_pages and not llm.engine.has_unfinished()
    return outs


@pytest.mark.parametrize("verifier, needle", [
    ("raising", "failed: RuntimeError('verifier bug')"),
    ("off_path", "returned accepted nodes [1] with tokens [13, 5], which are not a root path"),
    ("out_of_vocab", "emitted token 1000 outside the vocab [0, 96)"),
])
def test_a_bad_verification_fails_only_its_request(tiny_llama, plain, verifier, needle):
    outs = run(tiny_llama, verifier)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert f"verifier '{verifier}' (plugin 'Plugin')" in outs[1].error and needle in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [plain[0].token_ids, plain[2].token_ids]
    assert outs[0].metrics.draft_tokens_proposed > 0


def test_a_verifier_returning_the_wrong_type_fails_every_request(tiny_llama):
    outs = run(tiny_llama, "wrong_type")
    assert [o.finish_reason for o in outs] == ["error"] * 3
    assert all("not a VerifyOutput" in o.error for o in outs)


def test_greedy_verifier_refuses_sampled_requests_when_added(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", verifier="greedy")
    eng = llm.engine
    sampled = SamplingParams(temperature=0.8, max_tokens=4)
    with pytest.raises(ValueError, match="verifier 'greedy'.*greedy requests only.*0.8"):
        eng.add_request([1, 2, 3], sampled)
    with pytest.raises(ValueError, match="prompt 1: verifier 'greedy'"):
        llm.generate([[1, 2], [3, 4]], [GREEDY, sampled])
    assert not eng.has_unfinished() and eng.requests == {}
    out = llm.generate([[1, 2, 3]], GREEDY)[0]  # greedy requests still run
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_unknown_verifier_is_a_value_error(tiny_llama):
    with pytest.raises(ValueError, match="unknown verifier 'nope'; registered: greedy, gumbel, rejection"):
        LLM(model=str(tiny_llama), verifier="nope")


class Hearing(Marking):
    """Marking, recording what on_verified hears: (request id, tokens committed)."""

    name = "hearing"
    heard: list = []

    def on_verified(self, batch):
        type(self).heard += [(r.request_id, r.num_committed) for r in batch.requests]


class HearingPlugin(Plugin):
    @hookimpl
    def specdec_drafters(self):
        return {"hearing": Hearing}


def test_a_request_whose_verification_failed_is_not_fed_back_to_the_drafter(tiny_llama,
                                                                            monkeypatch):
    monkeypatch.setattr(Hearing, "heard", [])
    llm = LLM(model=str(tiny_llama), dtype="float64", controller="static", drafter="hearing",
              verifier="raising", plugins=(HearingPlugin(),), controller_args={"budget": 2})
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    # the marked request: its prefill only (its first verification failed)
    assert [n for rid, n in Hearing.heard if rid == outs[1].request_id] == [len(PROMPTS[1])]


def test_a_verifier_saved_by_the_retry_is_still_reported(tiny_llama, plain):
    """Outputs right (each request verified alone), and the bug seen: a warning, the engine's
    plugin_errors, its fault counts by plugin (what /metrics exports)."""
    llm = LLM(model=str(tiny_llama), dtype="float64", controller="static", drafter="marking",
              verifier="batch_bug", plugins=(Plugin(),), controller_args={"budget": 2})
    with pytest.warns(RuntimeWarning, match="verifier 'batch_bug'.*at once.*batched path bug"):
        outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert any("batched path bug" in e for e in llm.engine.plugin_errors)
    assert llm.engine.faults.counts.get("Plugin", 0) > 0


# ---- drafts left on the device (DraftTree.on_device): read with the verification -------------


class OnDevice(BaseDrafter):
    """Trees whose tokens the engine must not read before verifying: the previous token twice
    as a tree (two children of the root, then one grandchild), MARK requests a token past the
    vocab in the grandchild."""

    name = "on_device"

    def __init__(self, target, **kwargs):
        pass

    bad_parents = False  # MARK requests' trees: a parent after its child instead
    on_host = False  # the same trees as host tensors (the engine's host path)

    def propose(self, requests):
        trees = []
        for r in requests:
            last = r.token_ids[-1]
            marked = r.token_ids[0] == MARK
            deep = 1000 if marked and not self.bad_parents else last
            tokens, parents = [last, (last + 1) % 96, deep], [-1, -1, 0]
            if marked and self.bad_parents:
                parents = [-1, 2, 0]
            n = min(3, r.budget.max_nodes)
            make = DraftTree if self.on_host else DraftTree.on_device
            trees.append(make(torch.tensor(tokens[:n]), torch.tensor(parents[:n]),
                              path_probs=torch.tensor([0.5, 0.25, 0.125][:n])))
        return trees


class DevicePlugin:
    @hookimpl
    def specdec_drafters(self):
        return {"on_device": OnDevice}


@pytest.mark.parametrize("controller, bad_parents", [("static", False), ("static", True),
                                                     ("goodput", False)])
def test_drafts_on_the_device_come_with_the_one_read_and_a_bad_one_fails_its_request(
        tiny_llama, plain, controller, bad_parents, monkeypatch):
    """Trees shaped on the device (parents not read: positions and mask made there) verified
    as host trees are, read with the step's read (by the goodput controller's prune, in one
    read for the batch, when it prunes); a token outside the vocab or parents that are not
    topological fail only their request, once read."""
    monkeypatch.setattr(OnDevice, "bad_parents", bad_parents)
    args = {"budget": 3} if controller == "static" else {}
    llm = LLM(model=str(tiny_llama), dtype="float64", controller=controller,
              drafter="on_device", plugins=(DevicePlugin(),), controller_args=args)
    made = []
    drafter = llm.engine.drafting.drafter
    propose = drafter.propose
    drafter.propose = lambda requests: [made.append((t, t.path_probs)) or t
                                        for t in propose(requests)]
    outs = llm.generate(PROMPTS, GREEDY)
    # each tree's tokens and path probabilities came with the verification's read
    assert made and all("token_list" in t.__dict__ and t.path_probs is not given
                        and torch.equal(t.path_probs, given) for t, given in made
                        if t.num_nodes)
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert ("are not topological" if bad_parents
            else "DraftTree.tokens[2] = 1000 is outside the vocab") in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [plain[0].token_ids, plain[2].token_ids]
    assert outs[0].metrics.draft_tokens_proposed > 0
    pool = llm.engine.kv.pool
    assert pool.num_free == pool.num_pages and not llm.engine.has_unfinished()


@pytest.mark.parametrize("verifier", ["gumbel", "rejection"])
def test_sampled_requests_with_drafts_on_the_device_draw_what_the_host_path_draws(
        tiny_llama, verifier, monkeypatch):
    """Seeded sampled requests draw the same tokens with trees left on the device as with the
    same trees on the host (each verifier's read brings them: the gumbel walk along with its
    targets, the rejection layout in a read of its own); with gumbel, also plain decoding's."""
    prompts = [PROMPTS[0], PROMPTS[2]]  # (no MARK request: every tree is well formed)
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=10, ignore_eos=True)
              for s in (3, 4)]

    def run(on_host: bool) -> list[list[int]]:
        monkeypatch.setattr(OnDevice, "on_host", on_host)
        outs = LLM(model=str(tiny_llama), dtype="float64", controller="static",
                   drafter="on_device", plugins=(DevicePlugin(),), verifier=verifier,
                   controller_args={"budget": 3}).generate(prompts, params)
        assert sum(o.metrics.draft_tokens_proposed for o in outs) > 0
        return [o.token_ids for o in outs]

    device = run(False)
    assert device == run(True)
    if verifier == "gumbel":  # (rejection sampling keeps the distribution, not the draws)
        plain = LLM(model=str(tiny_llama), dtype="float64").generate(prompts, params)
        assert device == [o.token_ids for o in plain]
