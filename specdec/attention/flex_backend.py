"""FlexAttention backend: every request's KV gathered back to back, one flex_attention call.

The GPU fallback when flashinfer cannot run; flex_attention runs eagerly by default, exact
but slow (the unfused path materialises every query row x KV slot score). The
paged cache is viewed as rows as in `kv_rows`: K of slot (page p, offset o) is row
p * 2 * page_size + o, its V page_size rows later. The plan gathers all requests' KV slots into
one packed sequence without padding and builds one BlockMask over [T query rows] x [S gathered
slots]; its mask_mod allows (q, kv) iff both belong to the same request and that request's mask
(causal, bottom-right aligned, or its custom mask) allows them.

Example, page_size 4: request 0 has 2 causal rows over 3 slots (pages [5]), request 1 is one
decode row over 2 slots (pages [1]); T = 3, S = 5:

    gathered slots = [20, 21, 22, 4, 5]     request 0's three slots, then request 1's two
    allowed:          1 1 0 | 0 0           row 0: request 0, position 1
                      1 1 1 | 0 0           row 1: request 0, position 2
                      0 0 0 | 1 1           row 2: request 1, position 1

Custom masks [qo_len, kv_len] are stored flattened back to back in one bool tensor on the
device; row q reads its request's block at a per-row offset. A host mask is copied there; a
``TreeRowsMask`` (a draft tree whose tree part is on the device) is made there (``dense()``):
nothing is read back.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from specdec.attention.kv_rows import kv_write_index, write_kv
from specdec.attention.metadata import AttentionMetadata, TreeRowsMask

# Sparse block size (query rows x KV slots) of the BlockMask: flex_attention's default, the one
# its GPU kernels are tuned for. The eager path ignores blocks and evaluates mask_mod everywhere.
BLOCK_SIZE = 128


class FlexAttentionBackend:
    name = "flex"
    supports_cuda_graphs = False  # its plan makes new index tensors and shapes every step

    def __init__(self, spec=None, compile: bool = False) -> None:
        """`spec` (AttentionSpec) is ignored: flex needs no shape up front. `compile`: run
        torch.compile'd flex_attention (opt-in: on the H200, torch 2.13's inductor found no
        kernel template for a bf16 step of 79 rows, [1, 8, 79, 64], and raised
        NoValidChoicesError; eager flex is exact on every device)."""
        self.compile = bool(compile)
        self._plan: _Plan | None = None
        self._compiled = None  # torch.compile(flex_attention), built on first compiled use

    def stage_arrays(self, md: AttentionMetadata) -> list[torch.Tensor]:
        """Nothing for the runner to stage: it plans from the host arrays."""
        return []

    def plan(self, metadata: AttentionMetadata, staged: list[torch.Tensor] | None = None) -> None:
        self._plan = _Plan(metadata)

    def run(self, q, k, v, kv_cache, scale: float) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() must be called before run()"
        assert q.shape[0] == k.shape[0] == v.shape[0] == plan.num_rows, (
            tuple(q.shape), tuple(k.shape), tuple(v.shape), plan.num_rows)
        rows = write_kv(kv_cache, plan.write_index, k, v)
        kv = rows.index_select(0, plan.read_index).view(2, plan.num_slots, *rows.shape[1:])
        attend = self._flex(self.compile)
        out = attend(_heads_first(q), _heads_first(kv[0]), _heads_first(kv[1]),
                     block_mask=plan.block_mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).to(q.dtype)

    def _flex(self, compiled: bool):
        """flex_attention, or its torch.compile'd form."""
        if not compiled:
            return flex_attention
        if self._compiled is None:
            # T and S change every step: the first recompile makes them dynamic (torch.compile's
            # automatic dynamic). On CPU (compile=True) only the first shape works: torch 2.13's
            # inductor emits C++ for dynamic shapes that does not build
            self._compiled = torch.compile(flex_attention, fullgraph=True)
        return self._compiled


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[N, heads, D] -> [1, heads, N, D], the layout flex_attention takes."""
    return x.transpose(0, 1).unsqueeze(0)


class _Plan:
    """Everything shared by all layers of one step: the write and read rows and the BlockMask.

    Per query row and per gathered slot it keeps what mask_mod looks up (all on the metadata's
    device, where create_block_mask and the kernel evaluate it).
    """

    def __init__(self, md: AttentionMetadata) -> None:
        device, page = md.slot_mapping.device, md.page_size
        qo_lens, kv_lens = md.qo_lens(), md.kv_lens()
        assert len(qo_lens) == len(kv_lens) == md.batch_size > 0, (qo_lens, kv_lens)
        assert all(0 < q <= n for q, n in zip(qo_lens, kv_lens)), (qo_lens, kv_lens)
        self.num_rows, self.num_slots = sum(qo_lens), sum(kv_lens)  # T, S
        assert tuple(md.slot_mapping.shape) == (self.num_rows,), (
            tuple(md.slot_mapping.shape), self.num_rows)
        self.write_index = md.kv_write_index()  # [2T] int64
        qo, kv = (torch.tensor(x, dtype=torch.int64, device=device) for x in (qo_lens, kv_lens))
        kv_start = kv.cumsum(0) - kv  # [B] int64: request b's first gathered slot
        self.kv_request = _owner(kv, self.num_slots)  # [S] int64
        kv_pos = torch.arange(self.num_slots, device=device) - kv_start[self.kv_request]
        # [2S] int64: the gathered slots' K rows, then their V rows
        self.read_index = kv_write_index(_gathered_slots(md, self.kv_request, kv_pos), page)
        self.q_request = b = _owner(qo, self.num_rows)  # [T] int64
        q_pos = torch.arange(self.num_rows, device=device) - (qo.cumsum(0) - qo)[b]
        # causal row q sees its request's slots up to its own, kv_len - qo_len + q_pos
        self.q_last = kv_start[b] + kv[b] - qo[b] + q_pos  # [T] int64, a gathered index
        self._custom_masks(md, qo_lens, kv_lens, kv, kv_start, q_pos)
        self.block_mask = self._block_mask(device)

    def _custom_masks(self, md, qo_lens, kv_lens, kv, kv_start, q_pos) -> None:
        """The flat custom masks and, per query row, whether it uses them and where its row
        of them starts."""
        device = md.slot_mapping.device
        flat, starts, offset = [], [], 0
        for mask, q, n in zip(md.custom_masks, qo_lens, kv_lens):
            starts.append(offset)
            if mask is None:
                continue
            assert tuple(mask.shape) == (q, n), (
                f"custom mask has shape {tuple(mask.shape)}, expected [qo_len, kv_len] = "
                f"{[q, n]}")
            if isinstance(mask, TreeRowsMask):  # made on the device: no copy, no read
                flat.append(mask.dense().reshape(-1))
                offset += q * n
                continue
            assert mask.dtype == torch.bool, f"custom mask must be bool, got {mask.dtype}"
            flat.append(mask.to(device).reshape(-1))
            offset += q * n
        # a causal-only batch gets one unused element, so the clamped lookup stays in range
        self.mask_flat = (torch.cat(flat) if flat else
                          torch.zeros(1, dtype=torch.bool, device=device))  # [M] bool
        b = self.q_request
        custom = torch.tensor([m is not None for m in md.custom_masks], device=device)
        self.q_custom = custom[b]  # [T] bool
        start = torch.tensor(starts, dtype=torch.int64, device=device)
        # (q, kv) of the same request is mask_flat[q_mask_base[q] + kv]
        self.q_mask_base = start[b] + q_pos * kv[b] - kv_start[b]  # [T] int64

    def _block_mask(self, device) -> BlockMask:
        q_request, kv_request, q_last = self.q_request, self.kv_request, self.q_last
        q_custom, q_mask_base, mask_flat = self.q_custom, self.q_mask_base, self.mask_flat
        last = mask_flat.numel() - 1

        def mask_mod(b, h, q_idx, kv_idx):
            same = q_request[q_idx] == kv_request[kv_idx]
            causal = kv_idx <= q_last[q_idx]
            # clamped: the lookup is evaluated for causal rows and other requests' slots too
            custom = mask_flat[(q_mask_base[q_idx] + kv_idx).clamp(0, last)]
            return same & torch.where(q_custom[q_idx], custom, causal)

        return create_block_mask(mask_mod, 1, 1, self.num_rows, self.num_slots, device=device,
                                 BLOCK_SIZE=BLOCK_SIZE)


def _owner(lens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] int64: b repeated lens[b] times (output_size given: no device sync)."""
    ids = torch.arange(lens.numel(), device=lens.device)
    return torch.repeat_interleave(ids, lens, output_size=total)


def _gathered_slots(md: AttentionMetadata, request: torch.Tensor,
                    pos: torch.Tensor) -> torch.Tensor:
    """[S] int64 slot ids: position pos[i] of request request[i], through its page table."""
    page = md.page_size
    pages = md.kv_indices.long()[md.kv_indptr.long()[request] + pos // page]
    return pages * page + pos % page
