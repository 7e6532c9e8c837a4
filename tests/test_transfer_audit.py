"""The transfer audit (tests/transfer_audit.py) and, per drafter, every host <-> device transfer
of a speculative step pinned: a read or copy added anywhere in a step fails here, naming its
call site (issue #53 item 1). The engines run as on CUDA without triton: bfloat16, flashinfer
(its API model: the kernels are opaque, each plan() one copy), torch matmuls."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transfer_audit import TransferAudit, audit_engine

from specdec import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent / "drafters"))  # drafter_helpers
from drafter_helpers import random_block_diffusion, random_head  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the audit itself ------------------------------------------------------------------------


def test_a_device_tensors_read_counts_and_a_host_ones_does_not():
    dev, host = torch.arange(4), torch.arange(4)
    with TransferAudit() as audit:
        audit.mark(dev)
        host.tolist()
        int(host[0])
        assert audit.d2h == 0
        dev.tolist()
        assert audit.d2h == 1
        assert audit.events[0].site.startswith("tests/test_transfer_audit.py:")


def test_reads_through_ops_views_and_syncs_count():
    dev = torch.arange(6, dtype=torch.float32)
    with TransferAudit() as audit:
        audit.mark(dev)
        y = (dev * 2).softmax(-1)[1:3]  # propagated through an op and a view
        top = y.topk(1)
        top.indices.tolist()  # 1
        float(y[0])  # 2
        bool((y > 0).any())  # 3
        y.cpu()  # 4
        torch.nonzero(dev)  # 5: its size is the device's answer
        dev[dev > 2]  # 6: a boolean-mask index likewise
        assert audit.d2h == 6, audit.sites()
        back = y.cpu()
        back.tolist()  # a read result is host data: no second read
        assert audit.d2h == 7


def test_host_to_device_copies_count_and_tag():
    target = torch.device("cpu")  # a torch.device: the engine's spelling of its device
    dev = torch.zeros(4)
    with TransferAudit() as audit:
        audit.mark(dev)
        sent = torch.tensor([1, 2], device=target)  # 1
        assert audit.h2d == 1 and audit.on_device(sent)
        torch.zeros(3, device=target)  # allocated on the device: no copy
        torch.tensor([1, 2], device="cpu")  # the host, spelled as a string: no copy
        moved = torch.ones(2).to(target)  # 2
        assert audit.on_device(moved)
        dev.copy_(torch.ones(4))  # 3
        dev[torch.tensor([0, 1])] = 5.0  # 4: the host index goes first
        dev[1:] = 0.0  # a scalar fill: no copy
        host = torch.ones(2)
        host.to(host.device)  # a host tensor's own device is the host: no copy
        assert audit.h2d == 4, audit.sites()
        assert audit.d2h == 0


def test_in_place_ops_make_their_destination_device_data():
    dev, host = torch.ones(3), torch.zeros(3)
    with TransferAudit() as audit:
        audit.mark(dev)
        host.add_(dev)  # (on a GPU: an error or a copy; here the destination is device data)
        assert audit.on_device(host)
        host.tolist()
        assert audit.d2h == 1


def test_is_cpu_answers_as_on_a_gpu():
    dev, host = torch.ones(2), torch.ones(2)
    with TransferAudit() as audit:
        audit.mark(dev)
        assert not dev.is_cpu and host.is_cpu


# ---- every drafter's step, pinned ------------------------------------------------------------

# (h2d copies, d2h reads) of each speculative (decode) step in order, batch 1, static budget 4,
# 6 new tokens (the last steps' budgets shrink with the tokens left); file:line at the commit
# that pinned them. Every step has the target's part: its staged inputs (engine/runner.py
# ModelRunner.forward: Staging.stage, a tree mask's byte offsets included), flashinfer's plan
# (attention/flashinfer_backend.py _plan_kernel), and the verify read (VerifyStage.to_host:
# verifiers/base.py host_copy), which brings along the drafts still on the device
# (DraftTree.on_device). The target: <= 2 h2d and <= 1 d2h a step.
PINNED = {
    # host drafters (chains): the staging, the plan, the verify read
    "ngram": [(2, 1)],
    "oracle": [(2, 1)],
    "suffix": [(2, 1)],
    # EAGLE-3 (depth 3, topk 2): per forward of its head (the catch-up, then one a level, as
    # deep as the request's depth limit: 2, 2, 1, 0 levels here) its runner's staging and plan;
    # one read of the selected trees (drafters/eagle3.py _select); then the target's
    "eagle3": [(8, 1), (8, 1), (6, 1), (4, 1)],
    # MTP: its trees' tokens stay on the device (drafters/rank_tree.py DeviceTrees): only the
    # target's; the first step also sends the gather index of its tree shape (made once a shape)
    "mtp": [(3, 1), (2, 1), (2, 1), (2, 1)],
    # block diffusion: its runner's staging (context flags and block rows included) and plan,
    # its trees' tokens on the device as MTP's (the first step: the shape's index); the target's
    "block_diffusion": [(5, 1), (4, 1), (4, 1), (4, 1)],
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from conftest import make_tiny_model

    from specdec.models.loader import load_model

    folder = make_tiny_model(tmp_path_factory.mktemp("audit") / "m", num_hidden_layers=4)
    return (folder, *load_model(folder, torch.bfloat16, "cpu", 512))


def _drafter(name: str, target, prompt) -> dict:
    folder, model, cfg, hf = target
    if name == "eagle3":
        head = random_head(model, cfg, hf, aux_layer_ids=(1, 2, 3))
        return dict(drafter="eagle3", drafter_args={"head": head, "depth": 3, "topk": 2})
    if name == "mtp":
        from specdec.models.heads.mtp import MTPConfig, MTPHeads

        torch.manual_seed(0)
        heads = MTPHeads(MTPConfig.for_target(cfg, 64, 3), torch.bfloat16)
        heads.init_from_target(model.head_weight, torch.randperm(cfg.vocab_size)[:64].sort().values)
        return dict(drafter="mtp", drafter_args={"heads": heads})
    if name == "block_diffusion":
        return dict(drafter="block_diffusion",
                    drafter_args={"model": random_block_diffusion(model, cfg, hf)})
    if name == "oracle":  # the target's own continuation: every draft accepted
        from specdec.drafters.oracle import oracle_plugin

        truth = {tuple(prompt): _plain(folder, prompt)}
        return dict(drafter="oracle", plugins=(oracle_plugin(truth, 0.0, depth=4),))
    return dict(drafter=name)


def _plain(folder, prompt, tokens: int = 16) -> list[int]:
    llm = LLM(model=str(folder), dtype="bfloat16", linear_kernels="plain", max_model_len=256)
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens,
                                                 ignore_eos=True))[0].token_ids


def _prompt(name: str, folder) -> list[int]:
    """PROMPT; for the drafters that look their drafts up in the context, PROMPT and the
    target's continuation of it, twice (the second time cut short: what follows is there)."""
    if name not in ("ngram", "suffix"):
        return PROMPT
    text = PROMPT + _plain(folder, PROMPT)
    return text + text[:len(PROMPT) + 4]


def audited_steps(folder, prompt, tokens: int = 6, **kw):
    """The audit of a greedy batch-1 run (static budget 4), bfloat16 as on CUDA."""
    llm = LLM(model=str(folder), dtype="bfloat16", linear_kernels="plain",
              attention_backend="flashinfer", max_model_len=256,
              controller="static", controller_args={"budget": 4}, **kw)
    with audit_engine(llm.engine) as audit:
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return audit.steps


PROMPT = [5, 6, 7, 8, 5, 6, 9, 5, 6, 7, 8, 5, 6]


@pytest.mark.parametrize("name", list(PINNED))
def test_each_drafters_step_makes_the_pinned_transfers(name, target, flashinfer_api_model):
    prompt = _prompt(name, target[0])
    steps = audited_steps(target[0], prompt, **_drafter(name, target, prompt))
    spec = [s for s in steps if s.kind == "speculative"]
    got = [(s.h2d, s.d2h) for s in spec]
    assert got == PINNED[name], (got, [[f"{e.kind} {e.op} {e.site}" for e in s.events]
                                       for s in spec])


def test_a_plain_step_makes_one_copy_a_plan_and_one_read(target, flashinfer_api_model):
    steps = audited_steps(target[0], PROMPT)
    plain = [s for s in steps if s.kind == "plain"]
    assert plain and all((s.h2d, s.d2h) == (2, 1) for s in plain), [
        [f"{e.kind} {e.op} {e.site}" for e in s.events] for s in plain]


def test_an_added_transfer_fails_naming_its_site(target, flashinfer_api_model, monkeypatch):
    """The point of the pins: a copy or a read slipped into a step shows up, with where."""
    from specdec.drafters.ngram import NgramDrafter

    original = NgramDrafter.propose

    def with_a_round_trip(self, requests):
        torch.tensor([1, 2], device=torch.device("cpu")).tolist()  # one copy, one read
        return original(self, requests)

    monkeypatch.setattr(NgramDrafter, "propose", with_a_round_trip)
    steps = audited_steps(target[0], _prompt("ngram", target[0]), drafter="ngram")
    spec = [s for s in steps if s.kind == "speculative"]
    assert [(s.h2d, s.d2h) for s in spec] == [(h + 1, d + 1) for h, d in PINNED["ngram"]]
    assert sum("with_a_round_trip" in e.site for e in spec[0].events) == 2
