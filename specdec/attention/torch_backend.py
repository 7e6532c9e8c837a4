"""Reference attention backend: gather pages into a padded batch and call SDPA.

It runs on any device torch runs on and is the oracle the flashinfer backend is tested against.
The paged cache of one layer, [num_pages, 2, page_size, H, D], is viewed as [num_pages*2*page_size,
H, D] rows: K of slot (page p, offset o) is row p*2*page_size + o, its V is page_size rows later.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.attention.metadata import AttentionMetadata
from specdec.tree import causal_mask


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self._plan: _Plan | None = None

    def plan(self, metadata: AttentionMetadata) -> None:
        self._plan = _Plan(metadata)

    def run(self, q, k, v, kv_cache, scale: float) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() must be called before run()"
        rows = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])
        rows.index_copy_(0, plan.write_index, torch.cat([k, v]))
        if plan.fresh_causal:
            # one request whose KV is all new: attend to k/v directly, no gather
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True,
            )
            return out.squeeze(0).transpose(0, 1)
        kv = rows.index_select(0, plan.read_index)
        kv = kv.view(2, plan.batch, plan.lmax, kv.shape[-2], kv.shape[-1]).transpose(2, 3)
        qp = _pad_queries(q, plan)
        out = F.scaled_dot_product_attention(
            qp, kv[0], kv[1], attn_mask=plan.mask, scale=scale, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(plan.batch * plan.qmax, q.shape[1], q.shape[2])
        return out if plan.q_rows is None else out.index_select(0, plan.q_rows)


def _pad_queries(q: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[T, H, D] -> [B, H, qmax, D] with request b's rows first in its slice."""
    if plan.q_rows is None:
        padded = q
    else:
        padded = q.new_zeros(plan.batch * plan.qmax, q.shape[1], q.shape[2])
        padded.index_copy_(0, plan.q_rows, q)
    return padded.view(plan.batch, plan.qmax, q.shape[1], q.shape[2]).transpose(1, 2)


class _Plan:
    """Everything shared by all layers of one step (indices and the mask)."""

    def __init__(self, md: AttentionMetadata) -> None:
        qo_lens, kv_lens = md.qo_lens(), md.kv_lens()
        self.batch, self.qmax, self.lmax = len(qo_lens), max(qo_lens), max(kv_lens)
        device, page = md.slot_mapping.device, md.page_size
        self.write_index = torch.cat(_k_and_v_rows(md.slot_mapping, page))
        self.fresh_causal = (
            self.batch == 1 and qo_lens[0] == kv_lens[0] and md.custom_masks[0] is None
        )
        if self.fresh_causal:
            return
        self.read_index = torch.cat(_k_and_v_rows(_gather_slots(md, kv_lens, self.lmax), page))
        uniform = all(n == self.qmax for n in qo_lens)
        self.q_rows = None if uniform else _query_rows(qo_lens, self.qmax, device)
        self.mask = _mask(md, qo_lens, kv_lens, self.qmax, self.lmax)


def _k_and_v_rows(slots: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    page, offset = slots // page_size, slots % page_size
    k_rows = page * (2 * page_size) + offset
    return k_rows, k_rows + page_size


def _gather_slots(md: AttentionMetadata, kv_lens: list[int], lmax: int) -> torch.Tensor:
    """[B * lmax] int64 slot ids of every request's KV, padded with slot 0."""
    device, page = md.slot_mapping.device, md.page_size
    pos = torch.arange(lmax, device=device)
    out = []
    for b, kv_len in enumerate(kv_lens):
        pages = md.kv_indices[md.kv_indptr[b] : md.kv_indptr[b + 1]].long()
        idx = pos.clamp(max=kv_len - 1)
        slots = pages[idx // page] * page + idx % page
        out.append(slots)
    return torch.cat(out)


def _query_rows(qo_lens: list[int], qmax: int, device) -> torch.Tensor:
    """[T] int64: the padded row (b * qmax + i) of each packed query row."""
    return torch.cat(
        [torch.arange(n, device=device) + b * qmax for b, n in enumerate(qo_lens)]
    )


def _mask(md, qo_lens, kv_lens, qmax, lmax) -> torch.Tensor | None:
    """[B, 1, qmax, lmax] bool, or None when every row may see every (unpadded) slot."""
    all_decode = qmax == 1 and all(n == lmax for n in kv_lens)
    if all_decode and all(m is None for m in md.custom_masks):
        return None
    device = md.slot_mapping.device
    mask = torch.zeros(len(qo_lens), qmax, lmax, dtype=torch.bool, device=device)
    for b, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        custom = md.custom_masks[b]
        if custom is not None:
            assert custom.shape == (qo, kv), (custom.shape, qo, kv)
            mask[b, :qo, :kv] = custom
        else:
            mask[b, :qo, :kv] = causal_mask(qo, kv, device)
        mask[b, qo:, 0] = True  # padding rows: any finite row avoids NaNs; they are dropped
    return mask.unsqueeze(1)
