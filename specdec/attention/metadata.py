"""Per-step attention metadata, named as flashinfer names it.

A batch of B requests; request b has `qo_len[b]` new query rows (a prefill chunk, a decode row,
or a decode row plus draft-tree nodes) and `kv_len[b]` KV slots (old + new) spread over pages.

Example, page_size 4, two requests:
    request 0: prefill of 5 tokens, pages [7, 2]     -> kv_len 5
    request 1: 1 decode row over 3 cached tokens, pages [4] -> kv_len 4
    qo_indptr        = [0, 5, 6]
    kv_indptr        = [0, 2, 3]
    kv_indices       = [7, 2, 4]
    kv_last_page_len = [1, 4]
    slot_mapping     = [28, 29, 30, 31, 8, 19]   (page * page_size + offset of each new row)
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from functools import cached_property

import torch

from specdec.attention.kv_rows import kv_write_index


@dataclass(eq=False)
class AttentionMetadata:
    """A step's attention metadata, built on the host (``build_metadata``).

    The index arrays are kept as the Python lists they were built from (``lists``); their host
    tensors are made on first use (``host``, ``slots``), so that a batch padded to a CUDA graph's
    shape (``concat_metadata``) makes them once, for the padded batch, by joining lists. Each
    one's device copy is made on first use too (the reference backends gather with them). The
    GPU path never asks for those: flashinfer plans from the host arrays, and the runner stages
    the K/V write index with the step's other inputs in one copy (``write_index``,
    ``specdec.engine.staging``).
    """

    lists: HostLists  # the index arrays as Python lists (qo_indptr, kv_indptr, ..., slots)
    page_size: int
    # Per request: None for causal attention, else [qo_len, kv_len] bool, True = may attend
    # (a host tensor), or a TreeRowsMask (a draft tree's rows, their tree part on the device)
    custom_masks: list[torch.Tensor | TreeRowsMask | None]
    # (qo_lens, kv_lens) as the arrays above were built from (build_metadata), or None: derived
    # from the arrays. Planning reads them instead of taking the arrays apart every step
    lens: tuple[list[int], list[int]] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # [2T] int64 K then V cache rows of the new rows (kv_rows.kv_write_index) on the device,
    # when the runner staged it; else made from ``slot_mapping`` on first use
    write_index: torch.Tensor | None = None
    # the host tensors, once made (a plain attribute test: functools.cached_property takes a
    # lock on every first read in Python 3.11, a microsecond a step on this path)
    _host: HostIndices | None = field(default=None, repr=False)
    _slots: torch.Tensor | None = field(default=None, repr=False)

    @property
    def host(self) -> HostIndices:  # the four int32 index arrays as host tensors
        if self._host is None:
            h = self.lists
            self._host = HostIndices(*(host_tensor(x, torch.int32) for x in (
                h.qo_indptr, h.kv_indptr, h.kv_indices, h.kv_last_page_len)))
        return self._host

    @property
    def slots(self) -> torch.Tensor:  # [T] int64 on the host: slot (page * page_size + offset)
        if self._slots is None:
            self._slots = host_tensor(self.lists.slots)
        return self._slots

    @property
    def batch_size(self) -> int:
        return len(self.custom_masks)

    # the device copies (on the CPU: the host tensors themselves)
    @cached_property
    def qo_indptr(self) -> torch.Tensor:  # [B+1] int32: rows of request b: qo_indptr[b]:[b+1]
        return _on(self.host.qo_indptr, self.device)

    @cached_property
    def kv_indptr(self) -> torch.Tensor:  # [B+1] int32: pages of b: kv_indices[kv_indptr[b]:..]
        return _on(self.host.kv_indptr, self.device)

    @cached_property
    def kv_indices(self) -> torch.Tensor:  # [sum pages] int32: page ids
        return _on(self.host.kv_indices, self.device)

    @cached_property
    def kv_last_page_len(self) -> torch.Tensor:  # [B] int32: valid slots in each last page
        return _on(self.host.kv_last_page_len, self.device)

    @cached_property
    def slot_mapping(self) -> torch.Tensor:  # [T] int64: where row t's K/V goes
        return _on(self.slots, self.device)

    def kv_write_index(self) -> torch.Tensor:
        """[2T] int64 cache rows the new rows' K then V go to, on the device."""
        if self.write_index is None:
            self.write_index = kv_write_index(self.slot_mapping, self.page_size)
        return self.write_index

    def on_host(self) -> HostIndices:
        return self.host

    def qo_lens(self) -> list[int]:
        if self.lens is not None:
            return list(self.lens[0])
        qo_indptr = self.host.qo_indptr
        return (qo_indptr[1:] - qo_indptr[:-1]).tolist()

    def kv_lens(self) -> list[int]:
        if self.lens is not None:
            return list(self.lens[1])
        h = self.host
        num_pages = (h.kv_indptr[1:] - h.kv_indptr[:-1]).long()
        return ((num_pages - 1) * self.page_size + h.kv_last_page_len.long()).tolist()


@dataclass(eq=False)
class TreeRowsMask:
    """A request's custom mask whose tree part the host has not read (a draft tree shaped on
    the device: ``DraftTree.on_device`` with device parents). Its ``q`` fed rows are causal
    (the last is the draft tree's root, the last committed token), then ``n`` tree rows, each
    seeing the ``prefix`` slots before the tree (every committed token) and its ancestors-or-self
    among the ``n`` tree slots after them: ``ancestors`` [n, n] bool on the device. kv_len is
    ``prefix + n``. Example, q 2, prefix 4, parents [-1, -1, 0]::

        row  kv: 0 1 2 3 | 4 5 6
        fed   0: 1 1 1 0 | 0 0 0     (causal: limit 3)
        root  1: 1 1 1 1 | 0 0 0     (limit 4)
        node  0: 1 1 1 1 | 1 0 0     (limit 4, tree bits 0b001)
        node  1: 1 1 1 1 | 0 1 0     (limit 4, tree bits 0b010)
        node  2: 1 1 1 1 | 1 0 1     (limit 4, tree bits 0b101)

    A backend takes it without a device -> host read: the whole mask made on the device
    (``dense``), or the rows' host-known limits (``limits``: the leading visible run, causal rows
    then ``prefix``) and the tree rows' bits on the device (``tree_bits``)."""

    q: int
    prefix: int
    ancestors: torch.Tensor  # [n, n] bool, on the device

    @property
    def n(self) -> int:
        return int(self.ancestors.shape[0])

    @property
    def shape(self) -> tuple[int, int]:  # (qo_len, kv_len), as a dense mask's
        return (self.q + self.n, self.prefix + self.n)

    def limits(self) -> list[int]:
        """Per row, host ints: how many leading slots it sees at least (all of them for a
        causal row; the prefix for a tree row, which sees tree slots past it by its bits)."""
        first = self.prefix - self.q + 1
        return [*range(first, first + self.q), *[self.prefix] * self.n]

    def tree_bits(self) -> torch.Tensor:
        """[n] int64 on the device: bit j of row i set iff tree slot j (``prefix + j``) is an
        ancestor-or-self of node i (n <= 63)."""
        n = self.n
        assert n <= 63, n
        weights = torch.ones(n, dtype=torch.int64, device=self.ancestors.device).cumsum(0) - 1
        return (self.ancestors.to(torch.int64) << weights).sum(-1)

    def dense(self) -> torch.Tensor:
        """[q + n, prefix + n] bool on the ancestors' device (factories and ops there: no copy)."""
        q, p, n = self.q, self.prefix, self.n
        dev = self.ancestors.device
        cols = torch.arange(p + n, device=dev)
        causal = cols[None, :] <= torch.arange(p - q, p, device=dev)[:, None]
        tree = torch.cat([torch.ones(n, p, dtype=torch.bool, device=dev), self.ancestors], 1)
        return torch.cat([causal, tree])


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if device.type == "cpu" else t.to(device)


@dataclass
class HostLists:
    """AttentionMetadata's index arrays as the Python lists ``build_metadata`` makes."""

    qo_indptr: list[int]  # [B+1]
    kv_indptr: list[int]  # [B+1]
    kv_indices: list[int]  # [sum pages]
    kv_last_page_len: list[int]  # [B]
    slots: list[int]  # [T]


@dataclass
class HostIndices:
    """AttentionMetadata's index arrays on the host (CPU int32 tensors)."""

    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [sum pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32


def build_metadata(
    block_tables: list[list[int]],
    kv_lens: list[int],
    qo_lens: list[int],
    page_size: int,
    custom_masks: list[torch.Tensor | None] | None = None,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for requests whose new rows occupy the last `qo_len` of their `kv_len` slots.

    block_tables[b] must hold at least ceil(kv_lens[b] / page_size) pages.
    """
    qo_indptr, kv_indptr, pages, last_page_len, slots = [0], [0], [], [], []
    for table, kv_len, qo_len in zip(block_tables, kv_lens, qo_lens):
        assert 0 < qo_len <= kv_len, (qo_len, kv_len)
        n_pages = -(-kv_len // page_size)
        assert len(table) >= n_pages, (len(table), kv_len)
        pages += table[:n_pages]
        qo_indptr.append(qo_indptr[-1] + qo_len)
        kv_indptr.append(len(pages))
        last_page_len.append(kv_len - (n_pages - 1) * page_size)
        _add_slots(slots, table, kv_len - qo_len, kv_len, page_size)
    return AttentionMetadata(
        HostLists(qo_indptr, kv_indptr, pages, last_page_len, slots), page_size,
        list(custom_masks) if custom_masks is not None else [None] * len(qo_lens),
        (list(qo_lens), list(kv_lens)), torch.device(device))


def _add_slots(slots: list[int], table: list[int], start: int, end: int, page_size: int) -> None:
    """Append the slot ids of a sequence's slots start .. end - 1 (a range per page)."""
    while start < end:
        page, offset = divmod(start, page_size)
        n = min(end - start, page_size - offset)
        first = table[page] * page_size + offset
        slots += range(first, first + n)
        start += n


_CODES = {torch.int32: "i", torch.int64: "q"}  # array.array's type codes of these dtypes


def host_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-d CPU tensor of Python ints (int32 / int64), made through a buffer: a third of
    torch.tensor(values)'s cost on a short list, which every step pays several times."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_CODES[dtype], values), dtype=dtype)


def concat_metadata(a: AttentionMetadata, b: AttentionMetadata) -> AttentionMetadata:
    """``a``'s requests, then ``b``'s (same page size), on ``a``'s device (host work only: the
    lists joined; the tensors are made when the result's are first asked for)."""
    assert a.page_size == b.page_size, (a.page_size, b.page_size)
    la, lb = a.lists, b.lists
    q, k = la.qo_indptr[-1], la.kv_indptr[-1]  # (b's offsets continue a's)
    lists = HostLists(la.qo_indptr + [x + q for x in lb.qo_indptr[1:]],
                      la.kv_indptr + [x + k for x in lb.kv_indptr[1:]],
                      la.kv_indices + lb.kv_indices, la.kv_last_page_len + lb.kv_last_page_len,
                      la.slots + lb.slots)
    return AttentionMetadata(
        lists, a.page_size, [*a.custom_masks, *b.custom_masks],
        (a.qo_lens() + b.qo_lens(), a.kv_lens() + b.kv_lens()), a.device)
