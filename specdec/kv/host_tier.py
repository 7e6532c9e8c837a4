"""A second KV tier in host memory, below a GPU's KV: pinned pages, copied without blocking.

The same interface as the disk tier (``specdec.kv.tier.DiskTier``: ``put`` / ``get`` /
``in`` / ``worth_it`` and the counters), used by ``KVManager.attach_tier``. Every copy, device to
host at eviction and host to device at a hit, is queued on the device's current stream, the one
the forwards run on: a page is read back only after its write has completed, and the evicted
page is overwritten by a later forward only after its copy out has completed, while the host
goes on scheduling (the copies overlap host work; the forward that needs a page waits for it on
the stream). On a CPU engine the same code moves pages between two areas of RAM: useful to
rehearse it (tests/gpu), pointless to run (the disk tier is the CPU's).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch


class HostTier:
    """At most ``capacity_bytes // page_bytes`` pages of ``page_bytes`` bytes in host memory
    (pinned when the KV is on CUDA)."""

    write_through = False  # host memory ends with the process: evicted pages are enough

    def __init__(self, page_bytes: int, capacity_bytes: int, device: torch.device) -> None:
        self.page_bytes = page_bytes
        self.num_slots = capacity_bytes // page_bytes
        if self.num_slots < 1:
            raise ValueError(f"kv_host_tier_bytes={capacity_bytes} holds no page: one page of "
                             f"this model's KV takes {page_bytes} bytes")
        pinned = torch.device(device).type == "cuda"
        self.storage = torch.empty(self.num_slots, page_bytes, dtype=torch.uint8,
                                   pin_memory=pinned)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, oldest use first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.read_seconds: float | None = None  # host time to queue a read (not measured)
        self.hits = self.stores = self.torn = 0
        self.seconds = 0.0

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def put(self, key: bytes, page: torch.Tensor) -> None:
        """Queue the copy of one page's KV into a slot (the least recently used makes room)."""
        if key in self._index:
            self._index.move_to_end(key)
            return
        t0 = time.perf_counter()
        data = page.contiguous().view(-1).view(torch.uint8)
        if data.numel() != self.page_bytes:
            raise ValueError(f"a tier page holds {self.page_bytes} bytes, got {data.numel()}")
        slot = self._free.pop() if self._free else self._index.popitem(last=False)[1]
        self.storage[slot].copy_(data, non_blocking=True)
        self._index[key] = slot
        self.stores += 1
        self.seconds += time.perf_counter() - t0

    def get(self, key: bytes, out: torch.Tensor) -> bool:
        """Queue the copy of the page stored under ``key`` into ``out``; False if absent."""
        slot = self._index.get(key)
        if slot is None:
            return False
        t0 = time.perf_counter()
        out.copy_(self.storage[slot].view(out.dtype).view(out.shape), non_blocking=True)
        self._index.move_to_end(key)
        self.hits += 1
        self.seconds += time.perf_counter() - t0
        return True

    def worth_it(self, recompute_seconds_per_page: float | None) -> bool:
        """A page over PCIe (~0.03 ms for SmolLM2's 0.7 MB at 25 GB/s) costs far less than
        recomputing it; the queued copies are not timed, so the tier is always used."""
        return True

    def close(self) -> None:
        return None
