"""Reference attention backend: gather pages into padded groups of requests and call SDPA.

It runs on any device torch runs on and is the oracle the flashinfer backend is tested against.
The paged cache of one layer, [num_pages, 2, page_size, H, D], is viewed as [num_pages*2*page_size,
H, D] rows: K of slot (page p, offset o) is row p*2*page_size + o, its V is page_size rows later.

Padding every request to the batch's longest query and KV length wastes most of the work when
lengths differ (a 1,000-token prompt beside 15 short ones made a batch-16 decode step 3x slower).
So the plan splits the requests into groups of similar shape (`_groups`: an exact partition of
the requests sorted by shape, minimising padded work plus a per-call cost) and runs one SDPA call
per group; a batch of equal shapes stays one call.

On a CPU with the compiled kernels (specdec/native/attention.c) every row instead goes
through one row-invariant kernel: the plan lists, per query row, the cache rows of the keys it
may see (causal or its tree mask) in position order, and the kernel reduces over exactly those,
in that order. A decode row, the same position as a tree row, or as a row of a prefill chunk,
sees the same keys in the same order and gets bitwise the same output, whatever else is in the
step; SDPA's paths (decode vs masked, batch padding) do not promise that.

A draft tree's mask may come as a ``TreeRowsMask`` (its tree part on the device): the SDPA
path writes its ``dense()`` form, made on the device, into the group's mask (no read); the
compiled kernels take it only when it is on the host (a CPU step), as its dense form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec import native
from specdec.attention.kv_rows import kv_write_index, write_kv
from specdec.attention.metadata import AttentionMetadata, TreeRowsMask

# Per-call cost of one extra SDPA call, in padded (query row x KV slot) cells: measured on CPU,
# a call costs about as much as 500 cells of work.
CALL_CELLS = 512


class TorchAttentionBackend:
    name = "torch"
    supports_cuda_graphs = False  # its plan makes new index tensors and shapes every step

    def __init__(self, spec=None, kernels="auto") -> None:
        self._plan: _Plan | _KeyLists | None = None
        # the compiled kernels ("auto": if they load here), or None: SDPA only
        self.kernels = native.load() if kernels == "auto" else kernels

    def stage_arrays(self, md: AttentionMetadata) -> list[torch.Tensor]:
        """Nothing for the runner to stage: it plans from the host arrays."""
        return []

    def plan(self, metadata: AttentionMetadata, staged: list[torch.Tensor] | None = None) -> None:
        if self.kernels is not None and metadata.slot_mapping.is_cpu and all(
                m.ancestors.is_cpu for m in metadata.custom_masks if isinstance(m, TreeRowsMask)):
            self._plan = _KeyLists(metadata, self.kernels)
        else:
            self._plan = _Plan(metadata)

    def key_lists(self) -> _KeyLists | None:
        """This step's per-row key lists when it runs on the compiled kernels, else None (a
        fused layer, specdec.models.matmul.fused, then writes K/V and attends itself)."""
        return self._plan if isinstance(self._plan, _KeyLists) else None

    def run(self, q, k, v, kv_cache, scale: float) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() must be called before run()"
        rows = write_kv(kv_cache, plan.write_index, k, v)
        if isinstance(plan, _KeyLists) and q.dtype in native.FORMATS \
                and kv_cache.dtype in native.FORMATS:
            out = self.kernels.attention(q.float().contiguous(), rows, plan.page_size,
                                         plan.indptr, plan.index, plan.max_keys, scale)
            return out if q.dtype == torch.float32 else out.to(q.dtype)
        if isinstance(plan, _KeyLists):  # float64: SDPA
            plan = self._plan = _Plan(plan.metadata)
        if plan.fresh_causal:
            # one request whose KV is all new: attend to k/v directly, no gather
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True,
            )
            return out.squeeze(0).transpose(0, 1)
        if len(plan.groups) == 1:
            return plan.groups[0].attend(q, rows, scale)
        out = q.new_empty(q.shape)
        for group in plan.groups:
            out.index_copy_(0, group.rows, group.attend(q, rows, scale))
        return out


class _Group:
    """Requests attended in one padded SDPA call: [n, qmax] queries over [n, lmax] slots."""

    def __init__(self, md: AttentionMetadata, members: list[int], qo_lens: list[int],
                 kv_lens: list[int], single: bool) -> None:
        device, page = md.slot_mapping.device, md.page_size
        qo = [qo_lens[b] for b in members]
        kv = [kv_lens[b] for b in members]
        self.n, self.qmax, self.lmax = len(members), max(qo), max(kv)
        starts = md.on_host().qo_indptr[members].long().tolist()
        # packed query rows of the group's requests, in group order
        self.rows = None if single else _ranges(starts, qo, device)
        uniform = all(n == self.qmax for n in qo)
        # where each of those rows sits in the padded [n * qmax] layout
        self.padded = None if uniform else _ranges(
            [i * self.qmax for i in range(len(qo))], qo, device)
        slots = _gather_slots(md, members, kv, self.lmax)
        self.read_index = kv_write_index(slots, page)
        self.mask = _mask(md, members, qo, kv, self.qmax, self.lmax)

    def attend(self, q: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention output of the group's packed query rows, [rows, H, D]."""
        q = q if self.rows is None else q.index_select(0, self.rows)
        kv = rows.index_select(0, self.read_index)
        kv = kv.view(2, self.n, self.lmax, kv.shape[-2], kv.shape[-1]).transpose(2, 3)
        if self.padded is None:
            qp = q
        else:
            qp = q.new_zeros(self.n * self.qmax, q.shape[1], q.shape[2])
            qp.index_copy_(0, self.padded, q)
        qp = qp.view(self.n, self.qmax, q.shape[1], q.shape[2]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            qp, kv[0], kv[1], attn_mask=self.mask, scale=scale, enable_gqa=True
        )
        out = out.transpose(1, 2).reshape(self.n * self.qmax, q.shape[1], q.shape[2])
        return out if self.padded is None else out.index_select(0, self.padded)


class _KeyLists:
    """Per query row, the cache rows (K rows; V rows are page_size later) of the keys it sees,
    in position order: index[indptr[t]:indptr[t + 1]] for packed row t (shared by all layers).

    Example, one request with 3 cached tokens and a 2-node chain (rows 0, 1: its tree mask is
    causal): row 0 sees positions 0..3, row 1 positions 0..4."""

    def __init__(self, md: AttentionMetadata, kernels: native.Kernels) -> None:
        self.metadata, self.page_size = md, md.page_size
        self.write_index = kernels.write_index(md.slot_mapping, md.page_size)
        host = md.on_host()
        self.indptr, self.index, self.max_keys = kernels.key_lists_max(
            md.qo_lens(), md.kv_lens(), host.kv_indptr, host.kv_indices, md.page_size,
            [m.dense() if isinstance(m, TreeRowsMask) else m for m in md.custom_masks])


class _Plan:
    """Everything shared by all layers of one step (indices, groups and masks)."""

    def __init__(self, md: AttentionMetadata) -> None:
        qo_lens, kv_lens = md.qo_lens(), md.kv_lens()
        self.write_index = md.kv_write_index()
        self.fresh_causal = (
            len(qo_lens) == 1 and qo_lens[0] == kv_lens[0] and md.custom_masks[0] is None
        )
        if self.fresh_causal:
            return
        parts = _groups(qo_lens, kv_lens)
        self.groups = [_Group(md, members, qo_lens, kv_lens, single=len(parts) == 1)
                       for members in parts]


GROUP_WINDOW = 64  # a run spans at most this many distinct (query rows, KV length) shapes


def _groups(qo_lens: list[int], kv_lens: list[int]) -> list[list[int]]:
    """Requests split into groups (each in batch order) minimising padded cells + call costs.

    The requests sorted by (query rows, KV length) are cut into consecutive runs by dynamic
    programming; a run's cost is n * max(qo) * max(kv) + CALL_CELLS. Requests of one shape are
    never split (an optimal cut never needs to: the cost is linear in how many of them each side
    takes), so the program runs over distinct shapes, each run spanning at most GROUP_WINDOW of
    them: O(shapes * window), exact for that order within the window (over requests it was
    O(batch^2): 0.1 s a step at batch 512).
    """
    shapes: dict[tuple[int, int], list[int]] = {}
    for b in sorted(range(len(qo_lens)), key=lambda b: (qo_lens[b], kv_lens[b])):
        shapes.setdefault((qo_lens[b], kv_lens[b]), []).append(b)
    keys = list(shapes)
    n = len(keys)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j shapes
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        qmax = lmax = count = 0
        for i in range(j, max(0, j - GROUP_WINDOW), -1):  # run = keys[i-1 : j]
            q, kv = keys[i - 1]
            qmax, lmax, count = max(qmax, q), max(lmax, kv), count + len(shapes[keys[i - 1]])
            cost = best[i - 1] + count * qmax * lmax + CALL_CELLS
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    parts, j = [], n
    while j > 0:
        parts.append(sorted(b for k in keys[cut[j]:j] for b in shapes[k]))
        j = cut[j]
    return parts[::-1]


def _gather_slots(md: AttentionMetadata, members: list[int], kv_lens: list[int],
                  lmax: int) -> torch.Tensor:
    """[n * lmax] int64 slot ids of the members' KV, padded with each one's last slot."""
    device, page = md.slot_mapping.device, md.page_size
    indptr = md.on_host().kv_indptr
    first_page = indptr[members].to(device)[:, None]  # [n, 1]
    last = torch.tensor(kv_lens, device=device)[:, None] - 1
    idx = torch.arange(lmax, device=device)[None, :].minimum(last)  # [n, lmax]
    pages = md.kv_indices.long()[first_page + idx // page]
    return (pages * page + idx % page).reshape(-1)


def _ranges(starts: list[int], lens: list[int], device) -> torch.Tensor:
    """[sum(lens)] int64: start, start + 1, ... of each (start, len), concatenated (one host
    list, one tensor: cheaper than an op per request at any batch)."""
    return torch.tensor([s + j for s, n in zip(starts, lens) for j in range(n)],
                        dtype=torch.int64, device=device)


def _mask(md, members, qo_lens, kv_lens, qmax, lmax) -> torch.Tensor | None:
    """[n, 1, qmax, lmax] bool, or None when every row may see every (unpadded) slot. A
    TreeRowsMask goes in as its dense form, made on the device (nothing read)."""
    customs = [md.custom_masks[b] for b in members]
    all_decode = qmax == 1 and all(n == lmax for n in kv_lens)
    if all_decode and all(m is None for m in customs):
        return None
    device = md.slot_mapping.device
    qo = torch.tensor(qo_lens, device=device)[:, None, None]
    r = torch.arange(qmax, device=device)[None, :, None]
    c = torch.arange(lmax, device=device)[None, None, :]
    # padding rows see slot 0 only: any finite row avoids NaNs, and they are dropped
    if all(m is not None for m in customs):
        mask = (r >= qo) & (c == 0)
    else:  # causal rows: the qo new rows are the last qo of kv slots
        kv = torch.tensor(kv_lens, device=device)[:, None, None]
        mask = torch.where(r < qo, c <= kv - qo + r, c == 0)
    for i, (q, k, custom) in enumerate(zip(qo_lens, kv_lens, customs)):
        if custom is not None:
            assert tuple(custom.shape) == (q, k), (custom.shape, q, k)
            mask[i, :q, :k] = custom.dense() if isinstance(custom, TreeRowsMask) else custom
    return mask.unsqueeze(1)
