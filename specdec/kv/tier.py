"""A second KV tier: evicted cached pages kept in a memory-mapped file on local disk.

When the pool hands out an evictable cached page for new content, its KV (every layer of the
page) is first copied into a slot of this file under the page's content key; a later request
whose prefix continues past the pages still in memory brings it back instead of recomputing it,
when the measured transfer is cheaper than the measured recompute (``worth_it``).

File layout: a 4 KiB header (magic, version, page bytes, slot count, a hash of the cache
namespace), then ``num_slots`` slots of ``stride`` bytes (4 KiB aligned), each a 32-byte slot
header and one page::

    slot header: state u32 (0 empty/being written, 1 valid) | crc32 u32 of the data |
                 key 16 bytes | 8 bytes unused
    a write:     state := 0, data, then key + crc, then state := 1 (last)
    a read:      state 1, same key, crc32(data) matches -> served; anything else -> dropped, and
                 the page is recomputed (a torn or corrupted slot is never served)

The file outlives the engine: an engine started on an existing file of the same geometry and
namespace indexes its valid slots (each still checked against its crc32 when read); any other
file at that path is replaced. Transfers here are synchronous (a CPU engine has no copy engine to
overlap them with); a GPU engine would put pinned host memory in this place (not built yet).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

MAGIC = b"SPECDEC-KV-TIER\x00"
VERSION = 1
FILE_HEADER = 4096
SLOT_HEADER = struct.Struct("<II16s8x")  # state, crc32, key
VALID = 1


class DiskTier:
    """Pages of ``page_bytes`` each, at most ``num_slots`` of them, in the file at ``path``."""

    def __init__(self, path: str | os.PathLike, page_bytes: int, capacity_bytes: int,
                 namespace: str) -> None:
        self.path = Path(path)
        self.page_bytes = page_bytes
        self.stride = self.stride_for(page_bytes)
        self.num_slots = capacity_bytes // self.stride
        if self.num_slots < 1:
            raise ValueError(f"kv_tier_bytes={capacity_bytes} holds no page: one page of this "
                             f"model's KV takes {self.stride} bytes in the tier file")
        self.namespace = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, oldest use first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._open()
        # measured seconds per page (None until measured), and counters for the step stats
        self.read_seconds: float | None = None
        self.hits = self.stores = self.torn = 0
        self.seconds = 0.0

    @staticmethod
    def stride_for(page_bytes: int) -> int:
        """Bytes one page takes in the file (its slot header included, 4 KiB aligned)."""
        return -(-(SLOT_HEADER.size + page_bytes) // 4096) * 4096

    def _open(self) -> None:
        size = FILE_HEADER + self.num_slots * self.stride
        header = struct.pack("<16sIQQ16s", MAGIC, VERSION, self.page_bytes, self.num_slots,
                             self.namespace)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            reuse = self.path.is_file() and self.path.stat().st_size == size
            if reuse:
                with open(self.path, "rb") as f:
                    reuse = f.read(len(header)) == header
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ValueError(f"kv_tier_path {str(self.path)!r} is not a writable file: "
                             f"{e.strerror or e}") from e
        try:
            if not reuse:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)  # sparse: zeros, i.e. every slot empty
            self._mm = mmap.mmap(fd, size)
        except OSError as e:
            raise ValueError(f"kv_tier_path {str(self.path)!r}: cannot map {size} bytes: "
                             f"{e.strerror or e}") from e
        finally:
            os.close(fd)
        if reuse:
            self._index_valid_slots()
        else:
            self._mm[:len(header)] = header

    def _index_valid_slots(self) -> None:
        used = set()
        for slot in range(self.num_slots):
            state, _, key = SLOT_HEADER.unpack_from(self._mm, self._offset(slot))
            if state == VALID and key not in self._index:
                self._index[key] = slot
                used.add(slot)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]

    def _offset(self, slot: int) -> int:
        return FILE_HEADER + slot * self.stride

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def put(self, key: bytes, page: torch.Tensor) -> None:
        """Store one page's KV (any shape, ``page_bytes`` bytes) under ``key``; the least
        recently used slot makes room when the file is full."""
        if key in self._index:
            self._index.move_to_end(key)
            return
        t0 = time.perf_counter()
        data = page.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        if data.nbytes != self.page_bytes:
            raise ValueError(f"a tier page holds {self.page_bytes} bytes, got {data.nbytes}")
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._index.popitem(last=False)
        off = self._offset(slot)
        mm = self._mm
        SLOT_HEADER.pack_into(mm, off, 0, 0, b"\x00" * 16)  # not valid while written
        start = off + SLOT_HEADER.size
        mm[start:start + self.page_bytes] = data.tobytes()
        SLOT_HEADER.pack_into(mm, off, 0, zlib.crc32(data), key)
        struct.pack_into("<I", mm, off, VALID)  # last: the slot is complete
        self._index[key] = slot
        self.stores += 1
        self.seconds += time.perf_counter() - t0

    def get(self, key: bytes, out: torch.Tensor) -> bool:
        """Copy the page stored under ``key`` into ``out``; False (and the slot dropped) when it
        is missing, torn or corrupted: the caller recomputes it."""
        slot = self._index.get(key)
        if slot is None:
            return False
        t0 = time.perf_counter()
        off = self._offset(slot)
        state, crc, stored = SLOT_HEADER.unpack_from(self._mm, off)
        start = off + SLOT_HEADER.size
        view = memoryview(self._mm)[start:start + self.page_bytes]
        try:
            if state != VALID or stored != key or zlib.crc32(view) != crc:
                self.torn += 1
                self._drop(key, slot)
                return False
            data = torch.frombuffer(view, dtype=torch.uint8)
            out.copy_(data.view(out.dtype).view(out.shape))
        finally:
            del view
        self._index.move_to_end(key)
        seconds = time.perf_counter() - t0
        self.read_seconds = seconds if self.read_seconds is None else (
            0.8 * self.read_seconds + 0.2 * seconds)
        self.hits += 1
        self.seconds += seconds
        return True

    def worth_it(self, recompute_seconds_per_page: float | None) -> bool:
        """Bring pages back only while a measured read is cheaper than a measured recompute
        (unmeasured: try the tier, which measures it)."""
        if self.read_seconds is None or recompute_seconds_per_page is None:
            return True
        return self.read_seconds < recompute_seconds_per_page

    def _drop(self, key: bytes, slot: int) -> None:
        del self._index[key]
        struct.pack_into("<I", self._mm, self._offset(slot), 0)
        self._free.append(slot)

    def close(self) -> None:
        if not self._mm.closed:
            self._mm.flush()
            self._mm.close()
