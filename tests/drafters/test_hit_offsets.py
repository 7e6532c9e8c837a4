"""Prefix hits ending at every offset from the prompt's end, for every drafter and composition.

A hit maps the longest cached run of a request's full pages, capped at the page before its last
token, so with page size P it ends P * k tokens in: at ``n - 1`` (the target computes only the
last token, in the step that drafts), ``n - 2`` … ``n - P``, at a page boundary where the next
token differs, or nowhere. Per drafter one engine with the cache and one without run the same
sequence of prompts (each sharing a head with the first); tokens, accepted-by-depth and drafted
counts must be equal, every request must end without error, and no page may leak. The plain
engine's ``num_cached_tokens`` shows that each hit has the length the case names.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from drafter_helpers import random_block_diffusion, random_head
from test_mtp import random_heads

from specdec import LLM, SamplingParams
from specdec.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = [17, 3, 44, 9, 61, 2, 30, 5, 12, 70, 8, 23, 51, 6, 40]  # vocab 96  # 15 tokens


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("offsets"), seed=5, num_hidden_layers=4)
    model, cfg, hf = load_model(folder, torch.float64, "cpu", 512)
    return folder, model, cfg, hf


def _drafters(model, cfg, hf) -> dict[str, tuple[str | None, dict]]:
    head = {"head": random_head(model, cfg, hf), "depth": 3, "topk": 2}
    bd = {"model": random_block_diffusion(model, cfg, hf)}
    return {
        "plain": (None, {}),
        "ngram": ("ngram", {"min_ngram": 1}),
        "draft_model": ("draft_model", {"early_exit_layers": 1, "max_depth": 3}),
        "eagle3": ("eagle3", head),
        "mtp": ("mtp", {"heads": random_heads(model, cfg)}),
        "block_diffusion": ("block_diffusion", bd),
        "eagle3+ngram": ("eagle3+ngram", {"eagle3": head, "ngram": {"min_ngram": 1}}),
        "block_diffusion+draft_model": ("block_diffusion+draft_model", {
            "block_diffusion": bd, "draft_model": {"early_exit_layers": 1, "max_depth": 3}}),
    }


def _cases(page: int) -> list[tuple[list[int], int]]:
    """(prompt, samples): the base, then every prefix length that leaves a page to hit, the base
    plus one token, a prompt diverging right after two pages, an unrelated one, and n = 3
    samples of a prompt whose siblings hit at n - 1."""
    cases = [(BASE, 1)]
    cases += [(BASE[:n], 1) for n in range(page + 1, len(BASE) + 1)]
    cases += [(BASE + [77], 1), (BASE[:2 * page] + [88, 89, 90], 1), ([91, 92, 93], 1)]
    cases += [(BASE[:2 * page] + [95], 3)]
    return cases


def _run(folder, drafter, args, page: int, caching: bool):
    llm = LLM(model=str(folder), dtype="float64", drafter=drafter, drafter_args=args,
              controller="static", controller_args={"budget": 4}, page_size=page,
              enable_prefix_caching=caching)
    outs = []
    for prompt, n in _cases(page):
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=n)
        out = llm.generate([prompt], params)[0]
        outs += out.outputs
    assert [o.error for o in outs] == [None] * len(outs)
    assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages, "pages leaked"
    for r in llm.engine.parts.drafter_runners:
        assert r.kv.num_free_pages == r.kv.num_pages, f"drafter {r.name} leaked pages"
    return outs


def _lengths(page: int) -> list[int]:
    """The prompt length of each output of ``_run``."""
    return [len(p) for p, n in _cases(page) for _ in range(n)]


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("name", ["plain", "ngram", "draft_model", "eagle3", "mtp",
                                  "block_diffusion", "eagle3+ngram",
                                  "block_diffusion+draft_model"])
def test_every_hit_offset_keeps_tokens_and_drafts(target, name, page):
    """Tokens always equal; drafts equal wherever the schedule is: a hit at n - 1 leaves the
    last prompt token to a step that already drafts (without the cache, the prompt's last chunk
    computes it in a step of its own), so there only tokens are compared, and a drafter must
    still draft (block diffusion first hears the features it conditions on, then drafts)."""
    folder, model, cfg, hf = target
    drafter, args = _drafters(model, cfg, hf)[name]
    want = _run(folder, drafter, args, page, caching=False)
    got = _run(folder, drafter, args, page, caching=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    lengths = _lengths(page)
    hits = [o.metrics.num_cached_tokens for o in got]
    same = [i for i, (n, h) in enumerate(zip(lengths, hits)) if h != n - 1]
    assert [got[i].metrics.accepted_by_depth for i in same] == [
        want[i].metrics.accepted_by_depth for i in same]
    assert [got[i].metrics.draft_tokens_proposed for i in same] == [
        want[i].metrics.draft_tokens_proposed for i in same]
    at_end = [i for i, (n, h) in enumerate(zip(lengths, hits)) if h == n - 1]
    if drafter is not None and name != "ngram":
        assert at_end and all(got[i].metrics.draft_tokens_proposed > 0 for i in at_end)
    if name == "plain":  # every offset really is hit: n - 1 .. n - page, a boundary, none
        offsets = {n - h for n, h in zip(lengths, hits) if h}
        assert set(range(1, page + 1)) <= offsets, (hits, lengths)
        assert 0 in hits  # the unrelated prompt
        assert hits[-2:] == [2 * page] * 2  # the n = 3 request's siblings, at n - 1
