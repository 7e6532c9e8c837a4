"""A model of the two flashinfer 0.6 wrappers the flashinfer backend drives, for CPU tests.

It implements what flashinfer documents for them (and what its ``plan()`` checks in CUDA-graph
mode), naively in torch, so that the backend's use of the API (which wrapper, which index
arrays, the mask layout, the causal flag, the fixed buffers' sizes) is tested on a machine
without a GPU against the torch reference backend. It is not flashinfer: the kernels themselves
are checked against the same reference on a GPU (tests/gpu).

Semantics modelled (flashinfer/prefill.py, decode.py of 0.6.0):
- request b's queries are q[qo_indptr[b]:qo_indptr[b+1]] (decode: q[b]); its KV is the pages
  kv_indices[kv_indptr[b]:kv_indptr[b+1]] of the NHD cache [P, 2, page, Hkv, D], the last page
  filled to kv_last_page_len[b];
- ``custom_mask``: every request's [qo_len, kv_len] mask flattened row-major, back to back;
  ``packed_custom_mask``: the same bits packed little-endian, each request from a byte
  boundary; run() reads them at the offsets in ``_mask_indptr_buf`` as BYTES, where 0.6's
  plan() stores offsets in BITS for a packed mask (flashinfer PR #2201: the backend corrects
  them after the plan; a model that read what plan stores would hide the bug);
  ``causal``: bottom-right aligned (row i of q rows over L slots sees slots 0..L-q+i);
- CUDA-graph mode: the batch size is fixed by the buffers, the total rows by the first plan, and
  the indices and the packed mask (each request's bits padded to a byte) must fit their buffers;
  a wrapper made with a mask buffer always runs in custom-mask mode (run() decides by the
  buffer, not by the plan).
"""

from __future__ import annotations

import types

import torch


class _Wrapper:
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, **kwargs):
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        self.kwargs = kwargs
        self.plans = 0
        self.fixed_rows = None
        self._mask_indptr_buf = kwargs.get("mask_indptr_buf")

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self.graph

    def _check_graph_buffers(self, qo_indptr, indices, mask, masks_bits: list[int]):
        if not self.graph:
            return
        kw = self.kwargs
        indptr_buf = kw.get("paged_kv_indptr_buf", kw.get("paged_kv_indptr_buffer"))
        indices_buf = kw.get("paged_kv_indices_buf", kw.get("paged_kv_indices_buffer"))
        batch = len(qo_indptr) - 1
        assert len(indptr_buf) == batch + 1, "batch size differs from the graph buffers'"
        assert len(indices) <= len(indices_buf), "kv_indices exceed their buffer"
        rows = int(qo_indptr[-1])
        self.fixed_rows = self.fixed_rows or rows
        assert rows <= self.fixed_rows, "more rows than at the first plan"
        if mask is not None:
            packed = sum((n + 7) // 8 for n in masks_bits)
            assert packed <= len(kw["custom_mask_buf"]), "packed mask exceeds its buffer"
            assert len(kw["mask_indptr_buf"]) == batch + 1


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, custom_mask=None,
             packed_custom_mask=None, causal=False, q_data_type=None, kv_data_type=None,
             sm_scale=None, **_):
        self.qo_indptr = qo_indptr.cpu().long()
        self.kv_indptr = paged_kv_indptr.cpu().long()
        self.kv_indices = paged_kv_indices.cpu().long()
        self.last = paged_kv_last_page_len.cpu().long()
        self.page, self.scale, self.causal = page_size, sm_scale, causal
        qo, kv = _lens(self.qo_indptr), _kv_lens(self.kv_indptr, self.last, page_size)
        bits = [a * b for a, b in zip(qo, kv)]
        self.packed = None
        if packed_custom_mask is not None:  # offsets kept in bits (the 0.6 bug, see above)
            # (a host tensor, or one on the device: plan() copies it into its buffer either way)
            assert packed_custom_mask.dtype == torch.uint8 and packed_custom_mask.dim() == 1
            assert packed_custom_mask.numel() == sum((n + 7) // 8 for n in bits), \
                "packed_custom_mask is not every request's bits, each from a byte boundary"
            self.packed = packed_custom_mask.cpu()
            self._mask_indptr_buf = torch.tensor([0, *bits]).cumsum(0)
            self.mask = True
        else:
            self.mask = None if custom_mask is None else custom_mask.cpu().bool()
        # flashinfer's run() takes a graph wrapper's mask buffer as "custom mask mode"
        assert not (self.graph and "custom_mask_buf" in self.kwargs and self.mask is None), \
            "a graph-mode wrapper with a mask buffer runs masked: its plan needs the mask"
        if custom_mask is not None:
            assert self.mask.numel() == sum(bits), "custom_mask is not every request's mask"
        self._check_graph_buffers(self.qo_indptr, self.kv_indices, self.mask, bits)
        self.plans += 1

    def _request_mask(self, b: int, n: int, m: int, off: int) -> torch.Tensor:
        """Request b's [n, m] mask as run() reads it (``off``: its flat bit offset)."""
        if self.packed is None:
            return self.mask[off:off + n * m].view(n, m)
        start = int(self._mask_indptr_buf[b])  # read as a byte offset
        raw = self.packed[start:start + (n * m + 7) // 8]
        bits = ((raw[:, None].long() >> torch.arange(8)) & 1).reshape(-1)[:n * m]
        return bits.bool().view(n, m)

    def run(self, q, paged_kv_cache):
        qo, kv = _lens(self.qo_indptr), _kv_lens(self.kv_indptr, self.last, self.page)
        out, off = [], 0
        for b, (n, m) in enumerate(zip(qo, kv)):
            if self.mask is not None:
                mask = self._request_mask(b, n, m, off)
                off += n * m
            elif self.causal:
                mask = torch.arange(m)[None, :] <= torch.arange(m - n, m)[:, None]
            else:
                mask = torch.ones(n, m, dtype=torch.bool)
            rows = q[self.qo_indptr[b]:self.qo_indptr[b + 1]]
            out.append(_attend(rows, paged_kv_cache, self._pages(b), m, mask, self.scale))
        return torch.cat(out)

    def _pages(self, b):
        return self.kv_indices[self.kv_indptr[b]:self.kv_indptr[b + 1]]


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 **kwargs):
        super().__init__(workspace, kv_layout, use_cuda_graph, **kwargs)
        self.use_tensor_cores = use_tensor_cores

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, q_data_type=None, kv_data_type=None, sm_scale=None, **_):
        self.kv_indptr, self.kv_indices = indptr.cpu().long(), indices.cpu().long()
        self.last, self.page, self.scale = last_page_len.cpu().long(), page_size, sm_scale
        batch = len(self.last)
        self._check_graph_buffers(torch.arange(batch + 1), self.kv_indices, None, [])
        self.plans += 1

    def run(self, q, paged_kv_cache):
        kv = _kv_lens(self.kv_indptr, self.last, self.page)
        assert q.shape[0] == len(kv), "decode runs one query row per request"
        out = []
        for b, m in enumerate(kv):
            pages = self.kv_indices[self.kv_indptr[b]:self.kv_indptr[b + 1]]
            out.append(_attend(q[b:b + 1], paged_kv_cache, pages, m,
                               torch.ones(1, m, dtype=torch.bool), self.scale))
        return torch.cat(out)


def _lens(indptr) -> list[int]:
    return (indptr[1:] - indptr[:-1]).tolist()


def _kv_lens(kv_indptr, last, page) -> list[int]:
    return ((kv_indptr[1:] - kv_indptr[:-1] - 1) * page + last).tolist()


def _attend(q, cache, pages, kv_len, mask, scale):
    """q [n, H, D] over the first kv_len slots of ``pages``; mask [n, kv_len]."""
    k = cache[pages, 0].reshape(-1, *cache.shape[-2:])[:kv_len]  # [kv_len, Hkv, D]
    v = cache[pages, 1].reshape(-1, *cache.shape[-2:])[:kv_len]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def module() -> types.ModuleType:
    """A stand-in ``flashinfer`` module with the two wrappers."""
    m = types.ModuleType("flashinfer")
    m.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    m.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    m.__version__ = "model"
    return m
