"""A forward's inputs moved to the device in one copy, at addresses CUDA graphs can keep.

A forward of T rows needs on the device its token ids [T], positions [T], the cache rows its new
K/V go to [2T] and the rows whose logits are asked for [R]: int64 arrays built on the host.
``Staging.stage`` writes them back to back into a pinned host buffer and copies that into a
device buffer the runner keeps, in one asynchronous copy; the forward reads views of it. The
views of a T-row step sit at the same addresses every time (ids at [0, T), positions [T, 2T),
write rows [2T, 4T), then the logits rows), so a graph captured for T rows reads each later
T-row step's inputs where they land: no copy of its own. Example, T = 2, R = 1::

    device buffer  [ id0 id1 | pos0 pos1 | k0 k1 v0 v1 | row0 | ... ]

The copy out of a pinned buffer runs after the host has moved on, so the pinned buffers are a
ring, and one is written again only once its last copy finished (an event each). Arrays larger
than the buffers get a copy of their own (long prefill chunks: never graphed). On a CPU the
"device" buffer is host memory, written directly (the same addresses per shape, which graph
stand-ins rely on); ``copies`` counts one per staging there too, what a GPU moves, so that a
CPU rehearsal counts the GPU path's copies.
"""

from __future__ import annotations

import torch

RING = 4  # pinned buffers in flight (one forward's staging each)


class Staging:
    def __init__(self, device: torch.device, capacity: int) -> None:
        """``capacity``: int64 entries the persistent buffers hold (at least 4T + R of the
        largest graphed step)."""
        self.device = torch.device(device)
        self.capacity = capacity
        self.copies = 0  # stagings so far (one host -> device copy each on a GPU)
        self._on_gpu = self.device.type == "cuda"
        self._device_buf = torch.empty(capacity, dtype=torch.int64, device=self.device)
        if self._on_gpu:
            self._pinned = [torch.empty(capacity, dtype=torch.int64, pin_memory=True)
                            for _ in range(RING)]
            self._done = [None] * RING  # each pinned buffer's last copy (a CUDA event)
            self._next = 0

    def stage(self, arrays: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device int64 views of ``arrays`` (1-D host int64 tensors), back to back in order
        from offset 0 of the device buffer."""
        self.copies += 1
        sizes = [a.numel() for a in arrays]
        total = sum(sizes)
        if total > self.capacity:  # too large to keep: a buffer of its own, not graphed
            flat = torch.cat(arrays)
            if self._on_gpu:
                flat = flat.pin_memory().to(self.device, non_blocking=True)
            return list(flat.split(sizes))
        if not self._on_gpu:
            return list(torch.cat(arrays, out=self._device_buf[:total]).split(sizes))
        i = self._next
        self._next = (i + 1) % RING
        if self._done[i] is not None:
            self._done[i].synchronize()  # its previous copy has left the pinned buffer
        host = self._pinned[i][:total]
        torch.cat(arrays, out=host)
        dev = self._device_buf[:total]
        dev.copy_(host, non_blocking=True)
        event = self._done[i] = self._done[i] or torch.cuda.Event()
        event.record()
        return list(dev.split(sizes))
