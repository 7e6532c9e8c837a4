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
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # [B+1] int32: query rows of request b are qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: torch.Tensor  # [B+1] int32: pages of request b are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [sum pages] int32: page ids
    kv_last_page_len: torch.Tensor  # [B] int32: valid slots in each request's last page (1..page_size)
    slot_mapping: torch.Tensor  # [T] int64: slot (page * page_size + offset) where row t's K/V goes
    page_size: int
    # Per request: None for causal attention, else [qo_len, kv_len] bool, True = may attend.
    custom_masks: list[torch.Tensor | None]
    # the four int32 index arrays above on the host (the same tensors when the device is the
    # CPU): GPU backends plan from these without a device -> host copy
    host: HostIndices | None = None
    # (qo_lens, kv_lens) as the arrays above were built from (build_metadata), or None: derived
    # from the arrays. Planning reads them instead of taking the arrays apart every step
    lens: tuple[list[int], list[int]] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.custom_masks)

    def on_host(self) -> HostIndices:
        if self.host is not None:
            return self.host
        cpu = [t.cpu() for t in (self.qo_indptr, self.kv_indptr, self.kv_indices,
                                 self.kv_last_page_len)]
        return HostIndices(*cpu)

    def qo_lens(self) -> list[int]:
        if self.lens is not None:
            return list(self.lens[0])
        qo_indptr = self.on_host().qo_indptr
        return (qo_indptr[1:] - qo_indptr[:-1]).tolist()

    def kv_lens(self) -> list[int]:
        if self.lens is not None:
            return list(self.lens[1])
        h = self.on_host()
        num_pages = (h.kv_indptr[1:] - h.kv_indptr[:-1]).long()
        return ((num_pages - 1) * self.page_size + h.kv_last_page_len.long()).tolist()


@dataclass
class HostIndices:
    """AttentionMetadata's index arrays on the host (CPU int32 tensors)."""

    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32
    kv_indices: torch.Tensor  # [sum pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32

    def to(self, device) -> list[torch.Tensor]:
        """The four arrays on ``device`` (the same tensors on the CPU), in field order."""
        arrays = [self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len]
        if torch.device(device).type == "cpu" and all(t.is_cpu for t in arrays):
            return arrays
        return [t.to(device, non_blocking=True) for t in arrays]


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
        *host.to(device), slot_mapping=host_tensor(slots).to(device),
        page_size=page_size,
        custom_masks=list(custom_masks) if custom_masks is not None else [None] * len(qo_lens),
        host=host,
        lens=(list(qo_lens), list(kv_lens)),
    )


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
    """``a``'s requests, then ``b``'s (same page size), on ``a``'s device."""
    assert a.page_size == b.page_size, (a.page_size, b.page_size)
    ha, hb = a.on_host(), b.on_host()
    host = HostIndices(torch.cat([ha.qo_indptr, hb.qo_indptr[1:] + ha.qo_indptr[-1]]),
                       torch.cat([ha.kv_indptr, hb.kv_indptr[1:] + ha.kv_indptr[-1]]),
                       torch.cat([ha.kv_indices, hb.kv_indices]),
                       torch.cat([ha.kv_last_page_len, hb.kv_last_page_len]))
    device = a.slot_mapping.device
    return AttentionMetadata(
        *host.to(device), slot_mapping=torch.cat([a.slot_mapping, b.slot_mapping.to(device)]),
        page_size=a.page_size, custom_masks=[*a.custom_masks, *b.custom_masks], host=host,
        lens=(a.qo_lens() + b.qo_lens(), a.kv_lens() + b.kv_lens()))
