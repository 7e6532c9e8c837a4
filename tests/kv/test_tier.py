"""The disk tier: pages round-trip, slots are reused least recently used first, a torn or
corrupted slot is detected and never served, a valid file is reopened, a bad path is an error
naming it; and end to end, an engine whose KV is too small for its prompts serves evicted pages
from the tier with exactly the tokens it computes without one."""

from __future__ import annotations

import random

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.kv.host_tier import HostTier
from specdec.kv.tier import FILE_HEADER, SLOT_HEADER, DiskTier

SHAPE = (2, 2, 4, 3, 8)  # layers, K/V, page size, heads, head dim
PAGE_BYTES = torch.zeros(SHAPE).numel() * 4


def _page(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _tier(path, slots: int = 3, namespace: str = "m") -> DiskTier:
    return DiskTier(path, PAGE_BYTES, slots * DiskTier.stride_for(PAGE_BYTES), namespace)


def test_round_trip_and_least_recently_used_slot_reused(tmp_path):
    tier = _tier(tmp_path / "kv.tier")
    for i in range(3):
        tier.put(bytes([i]) * 16, _page(i))
    out = torch.empty(SHAPE)
    assert tier.get(b"\x00" * 16, out) and torch.equal(out, _page(0))  # 0 used: 1 is oldest
    tier.put(b"\x03" * 16, _page(3))
    assert b"\x01" * 16 not in tier and len(tier) == 3
    for i in (0, 2, 3):
        assert tier.get(bytes([i]) * 16, out) and torch.equal(out, _page(i))
    assert not tier.get(b"\x09" * 16, out)
    assert (tier.hits, tier.stores, tier.torn) == (4, 4, 0)


@pytest.mark.parametrize("where", ["data", "state", "key"])
def test_a_torn_or_corrupted_slot_is_dropped_never_served(tmp_path, where):
    tier = _tier(tmp_path / "kv.tier")
    key = b"\x05" * 16
    tier.put(key, _page(5))
    slot = tier._index[key]
    off = FILE_HEADER + slot * tier.stride
    if where == "data":  # a flipped byte in the page
        tier._mm[off + SLOT_HEADER.size + 100] ^= 0xFF
    elif where == "state":  # a write that never finished
        tier._mm[off] = 0
    else:
        tier._mm[off + 8] ^= 0xFF
    out = torch.zeros(SHAPE)
    assert not tier.get(key, out)
    assert torch.equal(out, torch.zeros(SHAPE)), "a rejected page must not be copied out"
    assert tier.torn == 1 and key not in tier


def test_reopened_file_keeps_valid_pages_and_another_namespace_replaces_it(tmp_path):
    path = tmp_path / "kv.tier"
    tier = _tier(path)
    tier.put(b"\x01" * 16, _page(1))
    tier.put(b"\x02" * 16, _page(2))
    off = FILE_HEADER + tier._index[b"\x02" * 16] * tier.stride
    tier._mm[off] = 0  # torn
    tier.close()
    again = _tier(path)
    out = torch.empty(SHAPE)
    assert len(again) == 1 and again.get(b"\x01" * 16, out) and torch.equal(out, _page(1))
    again.close()
    other = _tier(path, namespace="another model")
    assert len(other) == 0


def test_unwritable_path_is_an_error_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    bad = blocker / "kv.tier"  # a file cannot be a folder
    with pytest.raises(ValueError, match="kv_tier_path .*a_file/kv.tier"):
        DiskTier(bad, PAGE_BYTES, 1 << 20, "m")
    with pytest.raises(ValueError, match="holds no page"):
        DiskTier(tmp_path / "small", PAGE_BYTES, 100, "m")


def test_engine_rejects_an_unwritable_tier_path_at_start(tiny_llama, tmp_path):
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="kv_tier_path"):
        LLM(model=str(tiny_llama), kv_tier_path=str(blocker / "t"))
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(model=str(tiny_llama), kv_tier_path=str(tmp_path / "t"), enable_prefix_caching=False)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(90) for _ in range(length)] for _ in range(n)]


def test_pages_evicted_to_the_tier_come_back_with_the_same_tokens(tiny_llama, tmp_path):
    """12 pages of 4 slots: each 40-token prompt fills most of them, so every later prompt
    evicts the earlier ones' pages; the second pass finds them in the tier."""
    prompts = _prompts(3, 40, 0)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    common = dict(model=str(tiny_llama), dtype="float64", page_size=4, num_pages=12,
                  max_model_len=48)

    def two_passes(llm):
        first = llm.generate(prompts, params)  # one at a time would be the same: 12 pages
        return [o.token_ids for o in first] + [o.token_ids for o in
                                                [llm.generate(p, params)[0] for p in prompts]]

    want = two_passes(LLM(enable_prefix_caching=False, **common))
    llm = LLM(kv_tier_path=str(tmp_path / "kv.tier"), **common)
    assert two_passes(llm) == want
    tier = llm.engine.tier
    assert tier.stores > 0 and tier.hits > 0 and llm.engine.totals.tier_hits == tier.hits
    assert llm.engine.kv.num_free_pages == 12

    # corrupt every stored page: the third pass detects it, recomputes, same tokens
    for slot in tier._index.values():
        tier._mm[FILE_HEADER + slot * tier.stride + SLOT_HEADER.size + 7] ^= 0x55
    hits = tier.hits
    again = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert again == want[3:]
    assert tier.torn > 0 and tier.hits == hits


def test_host_tier_round_trip_and_least_recently_used_slot_reused():
    tier = HostTier(PAGE_BYTES, 2 * PAGE_BYTES, torch.device("cpu"))
    tier.put(b"a" * 16, _page(0))
    tier.put(b"b" * 16, _page(1))
    out = torch.empty(SHAPE)
    assert tier.get(b"a" * 16, out) and torch.equal(out, _page(0))
    tier.put(b"c" * 16, _page(2))  # b was the least recently used
    assert b"b" * 16 not in tier and not tier.get(b"b" * 16, out)
    assert tier.get(b"c" * 16, out) and torch.equal(out, _page(2))
    with pytest.raises(ValueError, match="holds no page"):
        HostTier(PAGE_BYTES, PAGE_BYTES - 1, torch.device("cpu"))


def test_one_second_tier_at_a_time(tmp_path):
    from specdec.config import EngineConfig

    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_tier_path=str(tmp_path / "t"), kv_host_tier_bytes=1 << 20)
    with pytest.raises(ValueError, match="kv_host_tier_bytes must be an int >= 1"):
        EngineConfig(kv_host_tier_bytes=0)
