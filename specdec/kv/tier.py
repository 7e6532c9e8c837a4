"""A second KV tier: cached pages kept in a memory-mapped file on local disk, across runs.

Every full page a request computed is written to this file under its content key when the
request ends (``KVManager.release``: write-through, so a later engine on the same file finds
them), and an evictable cached page not yet there is copied in before the pool hands it out for
new content. A later request whose prefix continues past the pages still in memory (in this
engine, or in one started later on the same file) brings them back instead of recomputing them,
when the measured transfer is cheaper than the measured recompute (``worth_it``).

File layout: a 4 KiB header (magic, format version, page bytes, slot limit, a hash of the cache
namespace), then up to ``num_slots`` slots of ``stride`` bytes (4 KiB aligned), each a 32-byte
slot header and one page. The file holds only the slots written so far: it grows by
``GROW_BYTES`` at a time as pages are stored, up to ``kv_tier_bytes``, and then reuses its
least recently used slot::

    file header: MAGIC 16 bytes | version u32 | page bytes u64 | slots u64 | namespace 16 bytes
    slot header: state u32 (0 empty/being written, 1 valid) | crc32 u32 of the data |
                 key 16 bytes | 8 bytes unused
    a write:     state := 0, data, then key + crc, then state := 1 (last)
    a read:      state 1, same key, crc32(data) matches -> served; anything else -> dropped, and
                 the page is recomputed (a torn or corrupted slot is never served)

The namespace is the engine's ``cache_namespace``: the model folder, a fingerprint of its
weights (specdec.kv.fingerprint), dtype, weight and kernel modes and the KV layout of a page, so
a file written with other weights is never read as this model's KV.

The file outlives the engine, and the path is the user's, so opening it is careful:

- the tier writes only files it made, in a folder that exists (it makes no folders: a mistyped
  path is a ValueError, not a new tree): a missing or empty (0-byte) file is made a tier; a
  non-empty one must start with ``MAGIC``, else ValueError (a user's file is never touched); a
  tier file of another version, geometry or namespace is re-initialised (said in the log), one of
  the same is kept and its valid slots indexed (each still checked against its crc32 when read);
- an exclusive ``flock`` on the file, taken before anything is read, is held until ``close()``:
  a second engine on the same path (this process or another) gets a ValueError naming it, never
  a file truncated under its mapping (SIGBUS);
- every byte is reserved (``posix_fallocate``) before it is mapped: the header when the file is
  made (a disk that cannot hold it is a ValueError at start-up, the file removed if this call
  made it), each step of growth before a page is written into it. A disk that fills up stops the
  growth: the tier keeps the slots it has (said once in the log), never a SIGBUS when a page is
  written through the mapping. Where the filesystem has no fallocate (glibc emulates it, other
  libcs may answer EOPNOTSUPP) the new bytes are written as zeros instead, the same reservation.
  On a copy-on-write filesystem (btrfs, ZFS) no reservation covers later overwrites: keep the
  tier on a conventional one (ext4, xfs).

Crash safety: a process killed at any point leaves every slot either valid or dropped at the
next open (the write order above and the crc32); a process killed while a file is being made
leaves an empty file or one that starts with ``MAGIC`` (the header is written first), which the
next engine re-initialises or keeps; one killed while the file grows leaves zeroed (empty) slots
or a partial one at the end, which the next open cuts off. Transfers here are synchronous (a CPU
engine has no copy engine to overlap them with); a GPU engine puts pinned host memory in this
place (specdec.kv.host_tier).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import stat
import struct
import time
import weakref
import zlib
from collections import OrderedDict
from pathlib import Path

import torch

logger = logging.getLogger("specdec")

MAGIC = b"SPECDEC-KV-TIER\x00"
VERSION = 3  # 3: files grow with their pages (2: allocated in full at start, 1: sparse)
FILE_HEADER = 4096
HEADER = struct.Struct("<16sIQQ16s")  # magic, version, page bytes, slots, namespace
SLOT_HEADER = struct.Struct("<II16s8x")  # state, crc32, key
VALID = 1
NO_FALLOCATE = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
GROW_BYTES = 16 << 20  # the file grows by this much (at least one slot) when a page needs room


class DiskTier:
    """Pages of ``page_bytes`` each, at most ``num_slots`` of them, in the file at ``path``
    (locked by this tier until ``close()``); the file holds ``allocated`` slots, growing as
    pages are stored."""

    write_through = True  # KVManager.release stores a finished request's pages: they outlive us

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
        self._free: list[int] = []  # allocated slots holding nothing, the lowest last
        self.allocated = 0  # slots the file holds now (<= num_slots)
        self._limit = self.num_slots  # lowered to ``allocated`` when the disk is full
        self._open()
        # measured seconds per page (None until measured), and counters for the step stats
        self.read_seconds: float | None = None
        self.hits = self.stores = self.torn = 0
        self.seconds = 0.0

    @staticmethod
    def stride_for(page_bytes: int) -> int:
        """Bytes one page takes in the file (its slot header included, 4 KiB aligned)."""
        return -(-(SLOT_HEADER.size + page_bytes) // 4096) * 4096

    def _where(self) -> str:
        return f"kv_tier_path {str(self.path)!r}"

    def _size(self, slots: int) -> int:
        return FILE_HEADER + slots * self.stride

    def _open(self) -> None:
        header = HEADER.pack(MAGIC, VERSION, self.page_bytes, self.num_slots, self.namespace)
        created = self._lock()
        try:
            kept = self._reusable(header)
        except BaseException:
            self._release()
            raise
        try:
            if kept is None:
                # the header first: a file this leaves behind (killed here) is empty or ours
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, header.ljust(FILE_HEADER, b"\x00"), 0)
                self._reserve(0, FILE_HEADER)
                kept = 0
            elif os.fstat(self._fd).st_size != self._size(kept):
                os.ftruncate(self._fd, self._size(kept))  # a growth cut short: its partial slot
            self._mm = mmap.mmap(self._fd, self._size(kept))
        except BaseException as e:
            if created:
                self.path.unlink(missing_ok=True)
            elif kept is None:  # it was empty or a stale tier of ours: leave it empty
                os.ftruncate(self._fd, 0)
            self._release()
            if isinstance(e, OSError):
                raise ValueError(f"{self._where()}: cannot reserve {FILE_HEADER} bytes for the "
                                 f"tier's header on its disk: {e.strerror or e}") from e
            raise
        self.allocated = kept
        self._index_valid_slots()

    def _lock(self) -> bool:
        """Open the file (made, empty, if missing) and hold an exclusive lock on it until
        ``close()``; nothing is read or written before the lock is held. True when this call
        made the file. Its folder must exist: a mistyped path makes no folders."""
        if not self.path.parent.is_dir():
            raise ValueError(f"{self._where()}: the folder {str(self.path.parent)!r} does not "
                             f"exist (the tier makes no folders: create it, or fix the path)")
        try:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                created = True
            except FileExistsError:
                fd = os.open(self.path, os.O_RDWR)
                created = False
        except OSError as e:
            raise ValueError(f"{self._where()} is not a writable file: "
                             f"{e.strerror or e}") from e
        # closes the descriptor (and so drops the lock) also when the tier is never closed
        self._fd = fd
        self._release = weakref.finalize(self, os.close, fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{self._where()} is not a regular file: a tier file is one")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise ValueError(f"{self._where()} cannot be locked: "
                                     f"{e.strerror or e}") from e
                raise ValueError(f"{self._where()} is in use by another specdec engine (another "
                                 f"open tier holds its lock): give each engine its own "
                                 f"kv_tier_path, or close the other first (LLM.close(), or "
                                 f"'with LLM(...) as llm:')") from e
        except BaseException:
            self._release()
            raise
        return created

    def _reusable(self, header: bytes) -> int | None:
        """How many whole slots the locked file holds, when it is a tier of this version,
        geometry and namespace to keep; None when it is to be made one (empty, or a stale tier
        of ours). A non-empty file that does not start with MAGIC is someone else's:
        ValueError, and nothing written to it."""
        actual = os.fstat(self._fd).st_size
        if actual == 0:
            return None
        head = os.pread(self._fd, HEADER.size, 0)
        if not head.startswith(MAGIC):
            raise ValueError(f"{self._where()} exists and is not a specdec KV tier file (it "
                             f"does not start with {MAGIC!r}): it will not be overwritten; "
                             f"remove it or choose another path")
        slots = (actual - FILE_HEADER) // self.stride
        if head == header and 0 <= slots <= self.num_slots:
            return slots
        if len(head) < HEADER.size:
            why = "an incomplete header"
        elif head == header:
            why = f"this geometry but {actual} bytes"
        else:
            _, version, page_bytes, slots, namespace = HEADER.unpack(head)
            why = (f"format version {version}" if version != VERSION else
                   "another namespace (model, weights, dtype, modes or KV layout)"
                   if namespace != self.namespace else
                   f"another geometry ({slots} slots of {page_bytes} page bytes)")
        logger.info("kv tier %s: re-initialised (it held a tier of %s)", self.path, why)
        return None

    def _reserve(self, start: int, end: int) -> None:
        """Allocate the file's blocks in [start, end) now (growing it to ``end``), so that a
        full disk is an OSError here and not a SIGBUS when a page is later written through the
        mapping."""
        try:
            os.posix_fallocate(self._fd, start, end - start)
        except OSError as e:
            if e.errno not in NO_FALLOCATE:
                raise
            zeros = bytes(1 << 20)  # the bytes past the file's end are new: write them
            off = max(start, os.fstat(self._fd).st_size)
            while off < end:
                off += os.pwrite(self._fd, zeros[:end - off], off)

    def _grow(self) -> bool:
        """Add a step of empty slots to the file (reserved first, then mapped); False, the file
        as it was, when the limit is reached or the disk is full (then the limit is what the
        file holds, said once in the log)."""
        if self.allocated >= self._limit:
            return False
        step = max(1, GROW_BYTES // self.stride)
        new = min(self._limit, self.allocated + step)
        old_size, size = self._size(self.allocated), self._size(new)
        try:
            self._reserve(old_size, size)
        except OSError as e:
            os.ftruncate(self._fd, old_size)
            if e.errno not in DISK_FULL:
                raise ValueError(f"{self._where()}: cannot grow the tier file to {size} bytes: "
                                 f"{e.strerror or e}") from e
            self._limit = self.allocated
            logger.warning("kv tier %s: the disk is full: the tier stays at %d pages (%d bytes; "
                           "kv_tier_bytes allows %d pages): %s", self.path, self.allocated,
                           old_size, self.num_slots, e.strerror or e)
            return False
        self._mm.close()
        self._mm = mmap.mmap(self._fd, size)
        self._free[:0] = range(new - 1, self.allocated - 1, -1)  # the lowest slot popped first
        self.allocated = new
        return True

    def _index_valid_slots(self) -> None:
        used = set()
        for slot in range(self.allocated):
            state, _, key = SLOT_HEADER.unpack_from(self._mm, self._offset(slot))
            if state == VALID and key not in self._index:
                self._index[key] = slot
                used.add(slot)
        self._free = [s for s in range(self.allocated - 1, -1, -1) if s not in used]

    def _offset(self, slot: int) -> int:
        return FILE_HEADER + slot * self.stride

    def _slot(self) -> int | None:
        """A slot to write: a free one, a new one (the file grows), else the least recently
        used (None only when the disk held not even one slot)."""
        if self._free or self._grow():
            return self._free.pop()
        if self._index:
            return self._index.popitem(last=False)[1]
        return None

    def __contains__(self, key: bytes) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def put(self, key: bytes, page: torch.Tensor) -> None:
        """Store one page's KV (any shape, ``page_bytes`` bytes) under ``key`` (already there:
        only marked used); the file grows for it, or the least recently used slot makes room
        when the file is at its limit."""
        self._check_open()
        if key in self._index:
            self._index.move_to_end(key)
            return
        t0 = time.perf_counter()
        data = page.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        if data.nbytes != self.page_bytes:
            raise ValueError(f"a tier page holds {self.page_bytes} bytes, got {data.nbytes}")
        slot = self._slot()
        if slot is None:  # a full disk left no slot: the page is recomputed when needed
            return
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
        self._check_open()
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

    def _check_open(self) -> None:
        if self._mm.closed:
            raise ValueError(f"{self._where()} was closed: a closed tier stores and serves "
                             f"nothing (open a new one)")

    def close(self) -> None:
        """Unmap the file and release its lock (another engine may open it then); twice is
        fine, and a closed tier refuses ``put`` / ``get`` with a ValueError."""
        if not self._mm.closed:
            self._mm.flush()
            self._mm.close()
        self._release()
