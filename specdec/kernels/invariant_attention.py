"""Row-invariant paged attention: one kernel for prefill-chunk rows, decode rows and draft-tree
rows, whose output for a row depends only on that row's query and the slots it sees.

Cache of one layer: ``kv_cache`` [num_pages, 2, page_size, Hkv, D] (K at [:, 0], V at [:, 1]).
Slot s of request b lives in page ``kv_indices[kv_indptr[b] + s // page_size]`` at offset
``s % page_size``. What row t sees is two numbers (``RowMetadata``):

    slot s is visible to row t  iff  s < row_limit[t]
                                     or bit (s - row_limit[t]) of row_tree[t] is set

A causal row at position p has limit p + 1 and tree 0. A draft-tree node sees the whole prefix
(all slots before its first non-ancestor) and, in its bitmask, the ancestors past it and itself.
Example, 3 committed slots, tree parents [-1, -1, 0] in slots 3, 4, 5 (``row_metadata``)::

    row (slot)      visible       limit  tree
    node 0 (3)      0 1 2 3       4      0b0
    node 1 (4)      0 1 2 . 4     3      0b10     (bit 1 = slot 3 + 1)
    node 2 (5)      0 1 2 3 . 5   4      0b10     (bit 1 = slot 4 + 1)

Why a row's output is bitwise the same in any call. One program per (row, KV head) walks the
slots from 0 in blocks of BLOCK_N, up to the row's last visible slot + 1 rounded up to a block,
with an fp32 online softmax (running max m, sum l, accumulator acc). Lane j of a block always
holds slot start + j, so the sequence of operations, and every operand of them, is a function
of the row's query and of the set of slots it sees: a slot it cannot see (past its KV, another
request's page, a sibling in its tree) gets the score -inf, hence p = exp(-inf - m) = 0 exactly
and V is loaded as 0, and a block of such lanes leaves m, l and acc bitwise unchanged
(``x * 1 + 0 == x``). A decode row at position p and a chain node at position p see the same
slots, so they walk the same blocks and compute the same values. q.k and p.v are elementwise
products reduced with tl.sum (no tl.dot: a tensor-core tile would mix rows of the call); the
block shapes are constexprs fixed per (head_dim, group size), never per row count.

Split-KV: a row's slots are cut at fixed multiples of ``split_slots`` (a constant of the
caller, the same for every call: SPLIT_SLOTS, a multiple of every BLOCK_N), and one program per
(row, KV head, split) runs the online softmax above over its split's blocks, leaving (m, l,
acc) in a workspace; a second kernel merges a row's splits in split order (0, 1, ...). A split
starts at a block boundary, so lane j still holds slot start + j, and what a split computes,
and the merge's operands and their order, are functions of the row's query and visible slots
alone: a decode row and a chain node at one position still agree bitwise. ``num_splits`` (the
grid's third axis) only bounds the splits; a row uses cdiv(its last visible slot + 1,
split_slots) of them, whatever the bound, so a graph captured with the bound of its longest
context replays any shorter one. At batch 1 this gives a 2,000-slot context 8 programs per KV
head instead of one walking all of it.

CUDA graphs: everything that changes per step comes as a tensor; the grid is (rows, Hkv,
num_splits) with rows the caller's padded row count. A padding row (limit 0, tree 0) reads no
KV, loads nothing through its ``row_request``, and writes zeros.

Limit: a row's visible slots past its ``row_limit`` must lie within 64 slots of it (the bits of
one int64): a draft tree of up to 64 nodes after any prefix is always within it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from specdec.kernels.invariant_matmul import interpreted

TREE_BITS = 64
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SPLIT_SLOTS = 256  # slots of a KV split: a multiple of every BLOCK_N (block_config: <= 64)
ROW_CHUNK = 128  # rows a launch takes at most: bounds the split workspace for long prefills


def block_config(group_pad: int, block_d: int) -> tuple[int, int]:
    """(BLOCK_N slots per block, num_warps) for a padded GQA group and head_dim: fixed per
    model, never a function of the rows. The q.k and p.v products are [group_pad, BLOCK_N,
    block_d] fp32 tiles in registers; BLOCK_N keeps them at 8K elements (64 per thread at 4
    warps: 32 slots for group 4 x head_dim 64, 16 for 4 x 128), at least 16 slots."""
    return max(16, min(64, 8192 // (group_pad * block_d))), 4


@dataclass
class RowMetadata:
    """What each query row sees (see the module docstring), built by ``row_metadata``."""

    row_request: torch.Tensor  # [T] int32: the request row t belongs to
    row_limit: torch.Tensor  # [T] int32: row t sees every slot s < row_limit[t]
    row_tree: torch.Tensor  # [T] int64: bit i set = row t also sees slot row_limit[t] + i

    def to(self, device) -> RowMetadata:
        return RowMetadata(*(t.to(device, non_blocking=True)
                             for t in (self.row_request, self.row_limit, self.row_tree)))


def row_metadata(qo_lens: Sequence[int], kv_lens: Sequence[int],
                 custom_masks: Sequence[torch.Tensor | None] | None = None) -> RowMetadata:
    """Per-row metadata (host int tensors) of requests whose ``qo_len`` new rows occupy the last
    ``qo_len`` of their ``kv_len`` slots; ``custom_masks[b]`` None = causal, else [qo, kv] bool,
    True = may attend (a draft tree's mask, e.g. ``specdec.tree.step_mask``), or a mask whose
    tree part is on the device (``specdec.attention.metadata.TreeRowsMask``: ``shape``, host
    ``limits()``, device ``tree_bits()``): its rows get its limits and tree 0, a placeholder
    the caller overwrites on the device with its ``tree_bits()`` (nothing read here). Its tree
    rows' limit is the prefix even where a row also sees the slot after it (its node 0): the
    same visible set as the leading run, so the same walk and the same result.

    Example: request 0 a 2-row prefill chunk after 3 cached slots; request 1 the tree of the
    module docstring behind its last committed token (slot 2, the decode row)::

        mask1 = [[1, 1, 1, 0, 0, 0],     row_request = [0, 0, 1, 1, 1, 1]
                 [1, 1, 1, 1, 0, 0],     row_limit   = [4, 5, 3, 4, 3, 4]
                 [1, 1, 1, 0, 1, 0],     row_tree    = [0, 0, 0, 0, 2, 2]
                 [1, 1, 1, 1, 0, 1]]
        row_metadata([2, 4], [5, 6], [None, mask1])
    """
    masks = list(custom_masks) if custom_masks is not None else [None] * len(qo_lens)
    if not len(qo_lens) == len(kv_lens) == len(masks):
        raise ValueError(f"qo_lens, kv_lens and custom_masks need one entry per request, got "
                         f"{len(qo_lens)}, {len(kv_lens)} and {len(masks)}")
    requests: list[int] = []
    limits: list[int] = []
    trees: list[int] = []
    for b, (qo, kv, mask) in enumerate(zip(qo_lens, kv_lens, masks)):
        if not 0 <= qo <= kv:
            raise ValueError(f"request {b}: need 0 <= qo_len <= kv_len, got {qo} and {kv}")
        requests += [b] * qo
        if mask is None:
            limits += range(kv - qo + 1, kv + 1)
            trees += [0] * qo
        elif not isinstance(mask, torch.Tensor):  # a TreeRowsMask: its tree bits to come
            if tuple(mask.shape) != (qo, kv):
                raise ValueError(f"request {b}: custom mask must be [{qo}, {kv}], got "
                                 f"{tuple(mask.shape)}")
            limits += mask.limits()
            trees += [0] * qo
        else:
            limit, tree = _mask_rows(b, mask, qo, kv)
            limits += limit
            trees += tree
    # host tensors through numpy (a fraction of torch.tensor(list)'s cost; the kernels import
    # nothing of the attention package, which imports them)
    return RowMetadata(*(torch.from_numpy(np.array(v, dtype=t)) for v, t in (
        (requests, np.int32), (limits, np.int32), (trees, np.int64))))


def _mask_rows(b: int, mask: torch.Tensor, qo: int, kv: int) -> tuple[list[int], list[int]]:
    """(limits, trees) of one request's custom-mask rows: limit = the row's leading run of
    True, tree = the columns after it as bits. A row need not see all the context (an EAGLE-3
    head's rows see the prefix and only their ancestors among the rows it fed before): what it
    sees past its leading run must lie within TREE_BITS slots. One packbits per mask, then per
    row a Python int made from its bits."""
    if tuple(mask.shape) != (qo, kv) or mask.dtype != torch.bool:
        raise ValueError(f"request {b}: custom mask must be bool [{qo}, {kv}], got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    width = -(-kv // 8)
    packed = np.packbits(mask.cpu().numpy(), axis=1, bitorder="little").tobytes()
    limits, trees = [], []
    for i in range(qo):
        seen = int.from_bytes(packed[i * width:(i + 1) * width], "little")  # bit j: slot j
        run = (~seen & (seen + 1)).bit_length() - 1  # trailing ones: the leading visible run
        tree = seen >> run
        if tree >> TREE_BITS:
            raise ValueError(f"request {b}: row {i} of its custom mask sees a slot more than "
                             f"{TREE_BITS} slots past its first hidden one (slot {run}); the "
                             f"invariant kernel takes at most {TREE_BITS} such slots a row")
        limits.append(run)
        trees.append(tree - (1 << TREE_BITS) if tree >> (TREE_BITS - 1) else tree)  # as int64
    return limits, trees


@triton.jit
def _highest_bit(x):
    """Index of the highest set bit of an int64 scalar (63 when negative), -1 for 0: a binary
    search over 32, 16, ... 1-bit shifts, written out (a constexpr cannot be reassigned in a
    loop when compiled for a GPU, though the interpreter allows it)."""
    y = tl.where(x < 0, 0, x)
    big = (y >> 32) != 0
    n = tl.where(big, 32, 0)
    y = tl.where(big, y >> 32, y)
    big = (y >> 16) != 0
    n += tl.where(big, 16, 0)
    y = tl.where(big, y >> 16, y)
    big = (y >> 8) != 0
    n += tl.where(big, 8, 0)
    y = tl.where(big, y >> 8, y)
    big = (y >> 4) != 0
    n += tl.where(big, 4, 0)
    y = tl.where(big, y >> 4, y)
    big = (y >> 2) != 0
    n += tl.where(big, 2, 0)
    y = tl.where(big, y >> 2, y)
    n += tl.where((y >> 1) != 0, 1, 0)
    return tl.where(x < 0, 63, tl.where(x == 0, -1, n))


@triton.jit
def _row_end(row_limit, row_tree, t):
    """(limit, tree, end) of row t: end = its last visible slot + 1, a function of the visible
    set alone (0 for a padding row)."""
    limit = tl.load(row_limit + t)
    tree = tl.load(row_tree + t)
    return limit, tree, tl.maximum(limit, limit + _highest_bit(tree) + 1)


@triton.jit
def _attention_kernel(q_ptr, cache_ptr, ws_acc, ws_m, ws_l, row_request, row_limit, row_tree,
                      kv_indptr, kv_indices, scale, split_slots, num_splits, stride_qt,
                      stride_qh, stride_page, stride_kv, stride_slot, stride_head,
                      PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (row, KV head, split): the online softmax over the split's visible slots, left
    unnormalised as (m, l, acc) in the workspace [rows, H, num_splits(, D)]."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    limit, tree, end = _row_end(row_limit, row_tree, t)
    lo = sp * split_slots
    hi = tl.minimum(end, lo + split_slots)
    if lo < end:  # a split past the row's last slot: nothing to do, never merged
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        q = q * scale  # once here rather than on every score: cheaper, and the same in every call
        # a padding row (end 0) loads nothing through row_request, which may then be anything
        first_page = tl.load(kv_indptr + tl.load(row_request + t, mask=end > 0, other=0),
                             mask=end > 0, other=0)
        m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l = tl.zeros((GROUP_PAD,), tl.float32)  # noqa: E741
        acc = tl.zeros((GROUP_PAD, BLOCK_D), tl.float32)
        lane = tl.arange(0, BLOCK_N)
        head_off = kvh.to(tl.int64) * stride_head + d[None, :]
        for start in range(lo, hi, BLOCK_N):
            s = start + lane
            rel = s - limit
            in_tree = (rel >= 0) & (rel < 64)
            bit = (tree >> tl.where(in_tree, rel, 0).to(tl.int64)) & 1
            visible = (s < limit) | (in_tree & (bit != 0))
            page = tl.load(kv_indices + first_page + s // PAGE_SIZE, mask=visible, other=0)
            base = page.to(tl.int64) * stride_page + (s % PAGE_SIZE).to(tl.int64) * stride_slot
            kv_mask = visible[:, None] & d_ok[None, :]
            k = tl.load(cache_ptr + base[:, None] + head_off, mask=kv_mask, other=0.0)
            v = tl.load(cache_ptr + stride_kv + base[:, None] + head_off, mask=kv_mask, other=0.0)
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G, N]
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            # before the first visible slot m_new is -inf: subtract 0 instead (exp(-inf) = 0, no NaN)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            p = tl.exp(scores - m_use[:, None])
            l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            m = m_new
        cell = (t.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * num_splits + sp  # [G]
        tl.store(ws_m + cell, m, mask=g_ok)
        tl.store(ws_l + cell, l, mask=g_ok)
        tl.store(ws_acc + cell[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kernel(ws_acc, ws_m, ws_l, out_ptr, row_limit, row_tree, split_slots, num_splits,
                  stride_ot, stride_oh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (row, KV head): the row's splits merged in split order, normalised, stored."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    _, _, end = _row_end(row_limit, row_tree, t)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    row = (t.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * num_splits  # [G]
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((GROUP_PAD,), tl.float32)  # noqa: E741
    acc = tl.zeros((GROUP_PAD, BLOCK_D), tl.float32)
    for sp in range(0, tl.cdiv(end, split_slots)):
        m_s = tl.load(ws_m + row + sp, mask=g_ok, other=float("-inf"))
        l_s = tl.load(ws_l + row + sp, mask=g_ok, other=0.0)
        acc_s = tl.load(ws_acc + (row + sp)[:, None] * HEAD_DIM + d[None, :],
                        mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        m_new = tl.maximum(m, m_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_use)
        b = tl.exp(m_s - m_use)
        l = l * a + l_s * b  # noqa: E741
        acc = acc * a[:, None] + acc_s * b[:, None]
        m = m_new
    # a row that sees nothing (padding) has l == 0: write zeros, not 0/0
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o = out_ptr + t.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def invariant_attention(q: torch.Tensor, kv_cache: torch.Tensor, rows: RowMetadata,
                        kv_indptr: torch.Tensor, kv_indices: torch.Tensor, scale: float,
                        out: torch.Tensor | None = None, max_slots: int | None = None,
                        split_slots: int = SPLIT_SLOTS) -> torch.Tensor:
    """Attention of q [T, H, D] over the paged ``kv_cache`` [P, 2, page_size, Hkv, D] -> [T, H, D]
    in q's dtype (into ``out`` when given, e.g. a CUDA graph's buffer). ``rows`` on q's device
    ([T] each; padding rows: limit 0 and tree 0, output 0); ``kv_indptr`` [B+1] and
    ``kv_indices`` int32 as in AttentionMetadata. H must be a multiple of Hkv.

    ``max_slots``: a bound on every row's last visible slot + 1 (the grid's splits: a CUDA
    graph's is its longest context); None: the pages the cache holds. It does not change the
    result. ``split_slots``: the KV split, fixed for every call whose rows must agree."""
    _check(q, kv_cache, rows, kv_indptr, kv_indices, out)
    t, h, d = q.shape
    hkv, page_size = kv_cache.shape[3], kv_cache.shape[2]
    if t == 0:
        return out if out is not None else q.new_empty(0, h, d)
    group = h // hkv
    group_pad, block_d = triton.next_power_of_2(group), triton.next_power_of_2(d)
    block_n, num_warps = block_config(group_pad, block_d)
    if split_slots <= 0 or split_slots % block_n:
        raise ValueError(f"split_slots must be a positive multiple of {block_n}, got "
                         f"{split_slots}")
    bound = kv_cache.shape[0] * page_size if max_slots is None else max_slots
    num_splits = max(1, triton.cdiv(bound, split_slots))
    emulate = q.dtype == torch.bfloat16 and interpreted(_attention_kernel)
    result = out if out is not None and not emulate else torch.empty(
        t, h, d, dtype=torch.float32 if emulate else q.dtype, device=q.device)
    chunk = min(t, ROW_CHUNK)
    ws_acc = torch.empty(chunk, h, num_splits, d, dtype=torch.float32, device=q.device)
    ws_m = torch.empty(chunk, h, num_splits, dtype=torch.float32, device=q.device)
    ws_l = torch.empty_like(ws_m)
    for t0 in range(0, t, chunk):  # a row's result does not depend on its launch's other rows
        n = min(chunk, t - t0)
        part = RowMetadata(*(x[t0:t0 + n] for x in (rows.row_request, rows.row_limit,
                                                     rows.row_tree)))
        _attention_kernel[(n, hkv, num_splits)](
            q[t0:], kv_cache, ws_acc, ws_m, ws_l, part.row_request, part.row_limit,
            part.row_tree, kv_indptr, kv_indices, float(scale), split_slots, num_splits,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            kv_cache.stride(2), kv_cache.stride(3), PAGE_SIZE=page_size, GROUP=group,
            GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_N=block_n,
            num_warps=num_warps)
        _merge_kernel[(n, hkv)](
            ws_acc, ws_m, ws_l, result[t0:], part.row_limit, part.row_tree, split_slots,
            num_splits, result.stride(0), result.stride(1), GROUP=group, GROUP_PAD=group_pad,
            HEAD_DIM=d, BLOCK_D=block_d, num_warps=num_warps)
    if emulate:  # the interpreter truncates fp32 -> bf16; torch rounds as the GPU does (RTNE)
        result = result.to(q.dtype) if out is None else out.copy_(result)
    return result


def invariant_attention_reference(q: torch.Tensor, kv_cache: torch.Tensor, rows: RowMetadata,
                                  kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                                  scale: float) -> torch.Tensor:
    """What invariant_attention computes, in plain torch on the host, one row at a time: gather
    the slots the row sees in slot order, softmax in fp32. Slow; for tests."""
    t, h, d = q.shape
    hkv, page_size = kv_cache.shape[3], kv_cache.shape[2]
    cache = kv_cache.float().cpu()
    indptr, indices = kv_indptr.cpu().tolist(), kv_indices.cpu().tolist()
    out = torch.zeros(t, h, d)
    for i, (b, limit, tree) in enumerate(zip(rows.row_request.tolist(),
                                             rows.row_limit.tolist(), rows.row_tree.tolist())):
        slots = list(range(limit)) + [limit + j for j in range(TREE_BITS) if (tree >> j) & 1]
        if not slots:
            continue
        pages = [indices[indptr[b] + s // page_size] for s in slots]
        offsets = [s % page_size for s in slots]
        k = cache[pages, 0, offsets].repeat_interleave(h // hkv, dim=1)  # [S, H, D]
        v = cache[pages, 1, offsets].repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("hd,shd->hs", q[i].float().cpu(), k) * scale
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(dim=-1), v)
    return out.to(device=q.device, dtype=q.dtype)


def _check(q, kv_cache, rows: RowMetadata, kv_indptr, kv_indices, out) -> None:
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(f"need q [T, H, D] and kv_cache [pages, 2, page_size, Hkv, D], got "
                         f"{tuple(q.shape)} and {tuple(kv_cache.shape)}")
    t, h, d = q.shape
    hkv = kv_cache.shape[3]
    if kv_cache.shape[4] != d or h % hkv:
        raise ValueError(f"q [T, H={h}, D={d}] does not fit kv_cache heads Hkv={hkv}, D="
                         f"{kv_cache.shape[4]} (H must be a multiple of Hkv, D equal)")
    if q.dtype not in DTYPES or kv_cache.dtype != q.dtype:
        raise ValueError(f"q and kv_cache need one dtype of {DTYPES}, got {q.dtype} and "
                         f"{kv_cache.dtype}")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("q and kv_cache need a contiguous last (head_dim) dimension")
    ints = (torch.int32, torch.int64)  # (int64: as the engine stages them, in one copy)
    want = {"row_request": ints, "row_limit": ints, "row_tree": (torch.int64,)}
    for name, dtypes in want.items():
        x = getattr(rows, name)
        if x.dtype not in dtypes or tuple(x.shape) != (t,) or x.device != q.device:
            raise ValueError(f"rows.{name} must be {' or '.join(map(str, dtypes))} [{t}] on "
                             f"{q.device}, got {x.dtype} {tuple(x.shape)} on {x.device}")
    for name, x in (("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        if x.dtype not in ints or x.dim() != 1 or x.device != q.device:
            raise ValueError(f"{name} must be a 1-d int32 or int64 tensor on {q.device}, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device or out.stride(2) != 1):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device} with a "
                         f"contiguous last dimension, got {out.dtype} {tuple(out.shape)} on "
                         f"{out.device}")
