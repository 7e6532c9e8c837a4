"""The flex backend against the torch reference: same cache and inputs, same outputs and writes.

Layouts are random: requests on shuffled, non-shared pages of a cache full of random values
(a wrong gather reads garbage), mixing fresh prefills, prefill chunks, decode rows and decode
rows with draft trees (``step_mask``, as ``specdec/engine/batch.py`` builds them). flex_attention runs
eagerly here (the CPU path); the tiny shapes keep that fast.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import oracle_plugin
from torch.nn.attention.flex_attention import create_mask

from specdec.attention import flex_backend
from specdec.attention.flex_backend import FlexAttentionBackend
from specdec.attention.metadata import build_metadata
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.engine.llm import LLM
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree, causal_mask, step_mask

D = 8
SCALE = 0.3  # not flex_attention's default 1/sqrt(D), so a dropped scale shows
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
# eager flex_attention is this file's point (the CPU path): its one-time advice to compile is noise
pytestmark = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
              pytest.mark.usefixtures("one_torch_thread")]




def _random_tree(rng: random.Random, n: int) -> DraftTree:
    parents = [rng.randrange(-1, i) for i in range(n)]  # topological: parents[i] < i
    return DraftTree(torch.arange(n), torch.tensor(parents))


def _request(rng: random.Random, kind: str) -> tuple[int, int, torch.Tensor | None]:
    """(kv_len, qo_len, mask) of one request of `kind`."""
    if kind == "prefill":
        n = rng.randrange(1, 12)
        return n, n, None
    if kind == "chunk":
        qo = rng.randrange(2, 8)
        return qo + rng.randrange(1, 10), qo, None
    if kind == "decode":
        return rng.randrange(1, 20), 1, None
    # tree: fed tokens computed..end (1 or a few), then the tree's nodes in slots end..
    computed, fed, nodes = rng.randrange(0, 10), rng.choice([1, 1, 3]), rng.randrange(1, 7)
    end = computed + fed
    mask = step_mask(_random_tree(rng, nodes), computed, end)
    return end + nodes, fed + nodes, mask


def _layout(seed: int, kinds, page_size: int):
    """Metadata for requests of `kinds` on shuffled pages, and the number of pages used."""
    rng = random.Random(seed)
    reqs = [_request(rng, kind) for kind in kinds]
    need = [-(-kv // page_size) for kv, _, _ in reqs]
    pages = list(range(sum(need) + 3))  # a few spare pages stay untouched
    rng.shuffle(pages)
    tables, start = [], 0
    for n in need:
        tables.append(pages[start:start + n])
        start += n
    md = build_metadata(tables, [r[0] for r in reqs], [r[1] for r in reqs], page_size,
                        [r[2] for r in reqs])
    return md, len(pages)


def _inputs(md, num_pages: int, heads: tuple[int, int], dtype, seed: int):
    """Random q, k, v of the step's rows and a cache full of random values."""
    gen = torch.Generator().manual_seed(seed)
    h, hkv = heads
    t = md.slot_mapping.numel()

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    cache = randn(num_pages, 2, md.page_size, hkv, D)
    return randn(t, h, D), randn(t, hkv, D), randn(t, hkv, D), cache


def _run(backend, md, q, k, v, cache):
    backend.plan(md)
    with torch.inference_mode():  # as the runner calls it
        return backend.run(q, k, v, cache, SCALE)


def _both(md, inputs):
    """(flex output, flex cache, reference output, reference cache) on copies of one cache."""
    q, k, v, cache = inputs
    flex_cache, ref_cache = cache.clone(), cache.clone()
    flex = _run(FlexAttentionBackend(), md, q, k, v, flex_cache)
    ref = _run(TorchAttentionBackend(), md, q, k, v, ref_cache)
    return flex, flex_cache, ref, ref_cache


BATCHES = {
    "mixed": ("chunk", "decode", "tree", "prefill", "decode", "tree"),
    "one_fresh_prefill": ("prefill",),
    "decodes": ("decode",) * 5,
    "trees": ("tree",) * 3,
    "chunks_and_decodes": ("chunk", "decode", "chunk"),
}


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_equals_reference(batch, page_size, dtype, heads):
    seed = 100 * sorted(BATCHES).index(batch) + page_size
    md, num_pages = _layout(seed, BATCHES[batch], page_size)
    flex, flex_cache, ref, ref_cache = _both(md, _inputs(md, num_pages, heads, dtype, seed))
    assert flex.shape == ref.shape and flex.dtype == dtype
    torch.testing.assert_close(flex, ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(flex_cache, ref_cache), "flex wrote other slots or values"


def test_writes_change_the_cache():
    """Guard for the cache check above: both backends really write the step's rows."""
    md, num_pages = _layout(1, BATCHES["mixed"], 4)
    inputs = _inputs(md, num_pages, (4, 2), torch.float64, 1)
    _, flex_cache, _, _ = _both(md, inputs)
    changed = (flex_cache != inputs[3]).flatten(3).any(-1)  # [pages, 2 (K/V), page_size]
    assert changed.sum() == 2 * md.slot_mapping.numel()


def test_chain_tree_equals_causal():
    chain = DraftTree.chain([4, 5, 6])
    computed, end = 5, 7  # two fed tokens, then the three chain nodes
    mask = step_mask(chain, computed, end)
    assert torch.equal(mask, causal_mask(5, 10))
    tables = [[3, 0, 5], [1, 4]]
    plain = build_metadata(tables, [10, 6], [5, 1], 4, [None, None])
    as_tree = build_metadata(tables, [10, 6], [5, 1], 4, [mask, None])
    inputs = _inputs(plain, 6, (4, 2), torch.float64, 2)
    a = _run(FlexAttentionBackend(), plain, *inputs[:3], inputs[3].clone())
    b = _run(FlexAttentionBackend(), as_tree, *inputs[:3], inputs[3].clone())
    assert torch.equal(a, b)


def test_custom_mask_is_not_ignored():
    """Guard: one entry flipped in a tree mask changes exactly that row, as in the reference."""
    md, num_pages = _layout(3, ("decode", "tree"), 4)
    mask = md.custom_masks[1].clone()
    mask[-1, 0] = not mask[-1, 0]
    flipped = dataclasses.replace(md, custom_masks=[None, mask])
    inputs = _inputs(md, num_pages, (4, 2), torch.float64, 3)
    base = _both(md, inputs)[0]
    out, _, ref, _ = _both(flipped, inputs)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    assert torch.equal(out[:-1], base[:-1])
    assert not torch.allclose(out[-1], base[-1])


def _dense_expected(md) -> torch.Tensor:
    """[T, S] bool: the block-diagonal mask of all requests, S = their KV slots back to back."""
    qo, kv = md.qo_lens(), md.kv_lens()
    out = torch.zeros(sum(qo), sum(kv), dtype=torch.bool)
    r = c = 0
    for mask, q, n in zip(md.custom_masks, qo, kv):
        out[r:r + q, c:c + n] = causal_mask(q, n) if mask is None else mask
        r, c = r + q, c + n
    return out


def test_block_mask_is_the_block_diagonal_of_request_masks(monkeypatch):
    """The mask_mod exactly, and the sparse blocks the compiled kernels skip by (small blocks
    here, so that several are empty, full and partial)."""
    monkeypatch.setattr(flex_backend, "BLOCK_SIZE", 4)
    md, _ = _layout(4, BATCHES["mixed"], 4)
    backend = FlexAttentionBackend()
    backend.plan(md)
    bm = backend._plan.block_mask
    want = _dense_expected(md)
    t, s = want.shape
    got = create_mask(bm.mask_mod, 1, 1, t, s, device="cpu")[0, 0]
    assert torch.equal(got, want)
    padded = torch.zeros(-(-t // 4) * 4, -(-s // 4) * 4, dtype=torch.bool)
    padded[:t, :s] = want
    any_block = padded.view(-1, 4, padded.shape[1] // 4, 4).any(3).any(1)
    assert torch.equal(bm.to_dense()[0, 0].bool(), any_block)
    assert not any_block.all(), "the layout must leave some blocks empty"


def test_wrong_mask_shape_names_the_shapes():
    md = build_metadata([[0, 1]], [6], [3], 4, [torch.ones(3, 5, dtype=torch.bool)])
    with pytest.raises(AssertionError, match=r"\(3, 5\).*\[3, 6\]"):
        FlexAttentionBackend().plan(md)


def test_run_before_plan_and_wrong_row_count():
    backend = FlexAttentionBackend(spec=object(), compile=False)  # spec is ignored
    q, k = torch.zeros(2, 4, D), torch.zeros(2, 2, D)
    cache = torch.zeros(2, 2, 4, 2, D)
    with pytest.raises(AssertionError, match="plan"):
        backend.run(q, k, k, cache, 1.0)
    backend.plan(build_metadata([[0]], [3], [3], 4))
    with pytest.raises(AssertionError):
        backend.run(q, k, k, cache, 1.0)


# ---- the engine: flex gives the reference's tokens, plain and speculative -------------------

MOTIFS = [[7, 3, 9], [11, 40, 2, 8], [5, 60]]
PROMPTS = [(m * 6)[:n] for m, n in zip(MOTIFS, (5, 17, 9))]  # prompt lookup hits at once
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _accepted(outs) -> int:
    return sum(sum(o.metrics.accepted_by_depth) for o in outs)


def test_engine_greedy_and_speculative_equal_torch_backend(tiny_llama):
    kw = dict(model=str(tiny_llama), dtype="float64", page_size=4, linear_kernels="plain")
    want = LLM(**kw).generate(PROMPTS, GREEDY)
    flex = LLM(**kw, attention_backend="flex")
    assert isinstance(flex.engine.parts.runner.backend, FlexAttentionBackend)
    assert [o.token_ids for o in flex.generate(PROMPTS, GREEDY)] == [o.token_ids for o in want]
    ngram = LLM(**kw, attention_backend="flex", drafter="ngram", drafter_args={"max_matches": 2},
                controller="static", controller_args={"budget": 8})
    got = ngram.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert _accepted(got) > 0, "no draft was accepted: the test would pass vacuously"
    # the oracle puts a wrong sibling before the true path: with tree masks ignored (causal),
    # the accepted nodes would see it
    truth = PROMPTS[1] + want[1].token_ids
    oracle = LLM(**kw, attention_backend="flex", drafter="oracle", controller="static",
                 plugins=(oracle_plugin(truth),), controller_args={"budget": 4})
    got = oracle.generate([PROMPTS[1]], GREEDY)
    assert got[0].token_ids == want[1].token_ids
    assert _accepted(got) > 0


def test_compiled_flex_is_opt_in():
    """Eager by default on every device (compiled flex failed on the H200: no template for a
    79-row bf16 step); compile=True asks for it."""
    assert FlexAttentionBackend().compile is False
    assert FlexAttentionBackend(compile=True).compile is True
