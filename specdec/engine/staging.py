"""A forward's inputs moved to the device in one copy, at addresses CUDA graphs can keep.

A forward of T rows needs on the device its token ids [T], positions [T], the cache rows its new
K/V go to [2T] and the rows whose logits are asked for [R]: int64 arrays built on the host.
``Staging.stage`` writes them back to back into a pinned host buffer and copies that into a
device buffer the runner keeps, in one asynchronous copy; the forward reads views of it. The
views of a T-row step sit at the same addresses every time (the ids first, then the positions,
the write rows, what the attention backend plans from, the logits rows), so a graph captured
for T rows reads each later T-row step's inputs where they land: no copy of its own. Example,
T = 2, R = 1 (``.`` padding)::

    device buffer  [ id0 id1 . . | pos0 pos1 . . | k0 k1 v0 v1 . | row0 . . | ... ]

Each array starts at a multiple of ALIGN entries (128 bytes): Triton compiles a kernel once per
alignment of its pointer arguments, and arrays at offsets that depend on T would have made
every shape's graph capture compile the attention kernel again (seconds each).

The copy out of a pinned buffer runs after the host has moved on, so the pinned buffers are a
ring, and one is written again only once its last copy finished (an event each). Arrays larger
than the buffers get a copy of their own (long prefill chunks: never graphed). On a CPU the
"device" buffer is host memory, written directly (the same addresses per shape, which graph
stand-ins rely on); ``copies`` counts one per staging there too, what a GPU moves, so that a
CPU rehearsal counts the GPU path's copies.
"""

from __future__ import annotations

import numpy as np
import torch

RING = 4  # pinned buffers in flight (one forward's staging each)
ALIGN = 16  # int64 entries: every array starts 128-byte aligned
VIEWS = 4096  # device views a Staging keeps


class Staging:
    def __init__(self, device: torch.device, capacity: int) -> None:
        """``capacity``: int64 entries the persistent buffers hold (at least 4T + R of the
        largest graphed step)."""
        self.device = torch.device(device)
        self.capacity = capacity
        self.copies = 0  # stagings so far (one host -> device copy each on a GPU)
        self._on_gpu = self.device.type == "cuda"
        self._device_buf = torch.empty(capacity, dtype=torch.int64, device=self.device)
        # the device buffer's views by (start, size): a graphed shape stages its arrays at the
        # same places every step, so each view is made once (bounded: VIEWS kept, then anew)
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        if self._on_gpu:
            self._pinned = [torch.empty(capacity, dtype=torch.int64, pin_memory=True)
                            for _ in range(RING)]
            self._pinned_np = [p.numpy() for p in self._pinned]  # (the same memory)
        else:
            self._device_np = self._device_buf.numpy()
            self._done = [None] * RING  # each pinned buffer's last copy (a CUDA event)
            self._next = 0

    def stage(self, arrays: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device int64 views of ``arrays`` (1-D host int tensors, int32 ones widened), back to
        back in order from offset 0 of the device buffer."""
        self.copies += 1
        sizes = [a.numel() for a in arrays]
        starts, total = [], 0
        for n in sizes:
            starts.append(total)
            total += -(-n // ALIGN) * ALIGN
        if total > self.capacity:  # too large to keep: a buffer of its own, not graphed
            buf = torch.empty(total, dtype=torch.int64)
            _fill(buf.numpy(), arrays, starts)
            if self._on_gpu:
                buf = buf.pin_memory().to(self.device, non_blocking=True)
            return _views(buf, starts, sizes)
        if not self._on_gpu:
            _fill(self._device_np, arrays, starts)
            return self._device_views(starts, sizes)
        i = self._next
        self._next = (i + 1) % RING
        if self._done[i] is not None:
            self._done[i].synchronize()  # its previous copy has left the pinned buffer
        host = self._pinned[i]
        _fill(self._pinned_np[i], arrays, starts)
        self._device_buf[:total].copy_(host[:total], non_blocking=True)
        event = self._done[i] = self._done[i] or torch.cuda.Event()
        event.record()
        return self._device_views(starts, sizes)

    def _device_views(self, starts: list[int], sizes: list[int]) -> list[torch.Tensor]:
        got = self._views
        if len(got) > VIEWS:
            got.clear()
        out = []
        for key in zip(starts, sizes):
            view = got.get(key)
            if view is None:
                view = got[key] = self._device_buf[key[0]:key[0] + key[1]]
            out.append(view)
        return out

def _fill(buf: np.ndarray, arrays: list[torch.Tensor], starts: list[int]) -> None:
    """Through numpy: a slice assignment costs a fraction of torch's slice and copy_ (two ops
    an array, every step)."""
    for a, start in zip(arrays, starts):
        values = a.numpy()
        buf[start:start + values.size] = values


def _views(buf: torch.Tensor, starts: list[int], sizes: list[int]) -> list[torch.Tensor]:
    return [buf[start:start + n] for start, n in zip(starts, sizes)]
