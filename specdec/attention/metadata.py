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

import numpy as np
import torch

from specdec.attention.kv_rows import kv_write_index


@dataclass(eq=False)
class AttentionMetadata:
    """A step's attention metadata, built on the host (``build_metadata``).

    The index arrays live on the host (``host``); each one's device copy is made on first use
    (the reference backends gather with them). The GPU path never asks for those: flashinfer
    plans from the host arrays, and the runner stages the K/V write index with the step's
    other inputs in one copy (``write_index``, ``specdec.engine.staging``).
    """

    host: HostIndices  # the four int32 index arrays (qo_indptr, kv_indptr, ...) on the host
    slots: torch.Tensor  # [T] int64 on the host: slot (page * page_size + offset) of row t
    page_size: int
    # Per request: None for causal attention, else [qo_len, kv_len] bool, True = may attend.
    custom_masks: list[torch.Tensor | None]
    # (qo_lens, kv_lens) as the arrays above were built from (build_metadata), or None: derived
    # from the arrays. Planning reads them instead of taking the arrays apart every step
    lens: tuple[list[int], list[int]] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # [2T] int64 K then V cache rows of the new rows (kv_rows.kv_write_index) on the device,
    # when the runner staged it; else made from ``slot_mapping`` on first use
    write_index: torch.Tensor | None = None

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


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if device.type == "cpu" else t.to(device)


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
    host = HostIndices(*(host_tensor(x, torch.int32)
                         for x in (qo_indptr, kv_indptr, pages, last_page_len)))
    return AttentionMetadata(
        host, host_tensor(slots), page_size,
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
    """``a``'s requests, then ``b``'s (same page size), on ``a``'s device (host work only)."""
    assert a.page_size == b.page_size, (a.page_size, b.page_size)
    ha, hb = a.host, b.host
    host = HostIndices(_cat(ha.qo_indptr, hb.qo_indptr, True),
                       _cat(ha.kv_indptr, hb.kv_indptr, True), _cat(ha.kv_indices, hb.kv_indices),
                       _cat(ha.kv_last_page_len, hb.kv_last_page_len))
    return AttentionMetadata(
        host, _cat(a.slots, b.slots), a.page_size, [*a.custom_masks, *b.custom_masks],
        (a.qo_lens() + b.qo_lens(), a.kv_lens() + b.kv_lens()), a.device)


def _cat(x: torch.Tensor, y: torch.Tensor, indptr: bool = False) -> torch.Tensor:
    """Host arrays back to back, through numpy (a fraction of torch's per-op cost on arrays of
    a few entries); ``indptr``: ``y`` is an offsets array continuing ``x``'s (its leading 0
    dropped, the rest shifted by ``x``'s last)."""
    xa, ya = x.numpy(), y.numpy()
    if indptr:
        ya = ya[1:] + xa[-1]
    return torch.from_numpy(np.concatenate([xa, ya]))
