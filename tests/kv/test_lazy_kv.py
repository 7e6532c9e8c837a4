"""The KV budget costs nothing until used (issue 51): a CPU engine's KV tensor is an anonymous
mapping whose pages the OS zero-fills at their first touch, not a torch.zeros of the whole
budget (1 GiB by default: ~0.5-0.9 s of every start, all of it resident at once)."""

from __future__ import annotations

import torch

from specdec.kv.cache import LAZY_BYTES, KVCache, lazy_zeros


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_large_kv_is_zeros_and_not_resident_until_touched():
    before = _rss()
    cache = KVCache(4, 1024, 16, 4, 64, torch.float32, "cpu")  # 128 MiB
    grown = _rss() - before
    assert grown < 16 << 20, f"{grown >> 20} MiB resident right after allocation"
    t = cache.tensor
    assert t.shape == (4, 1024, 2, 16, 4, 64) and t.is_contiguous()
    assert not t[:, ::97].any() and not t[-1, -1].any()  # zeros, as torch.zeros gave
    t[1, 5] = 1.0
    assert t.sum().item() == 2 * 16 * 4 * 64 and not t[1, 6].any()


def test_small_or_other_dtypes():
    small = lazy_zeros((4, 4), torch.float32, "cpu")
    assert small.nbytes < LAZY_BYTES and not small.any()
    bf16 = lazy_zeros((1 << 20,), torch.bfloat16, "cpu")
    assert bf16.dtype == torch.bfloat16 and not bf16.any()
