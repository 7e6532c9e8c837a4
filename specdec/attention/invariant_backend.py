"""Row-invariant attention on the GPU: one Triton kernel for every row, over the paged cache.

A row's output depends only on its query and the slots it sees (causal, or its draft tree's
ancestors), never on the other rows of the step (``specdec.kernels.invariant_attention`` says
why): a plain decode row and the same position verified as a chain node get bitwise the same
result, which, with the row-invariant matmul (``specdec.kernels.invariant_matmul``), makes
greedy speculation on a GPU equal plain decoding token for token. It is what ``auto`` picks on
CUDA with ``linear_kernels="invariant"`` (the default); ``flashinfer`` is the faster family
whose decode and prefill kernels reduce in different orders.

Per step the plan is per-row metadata (``row_metadata``: the request, how many leading slots
it sees, a bitmask of tree slots past them) and the pages: host arrays the runner stages to the
device with the step's other inputs in one copy (``stage_arrays``), at addresses that stay put
for a CUDA graph of the step's shape. Example, two decode rows and a 2-node chain::

    row_request [0, 1, 1, 1]   row_limit [9, 5, 6, 7]   row_tree [0, 0, 0, 0]

A draft tree whose tree part is on the device comes as a ``TreeRowsMask``: its rows' limits
are host-known (``limits()``) and staged with the rest, its tree rows' bits staged as 0; plan()
writes ``tree_bits()`` over them on the device (a device copy: nothing read, nothing sent).
"""

from __future__ import annotations

import torch

from specdec.attention.backend import AttentionSpec
from specdec.attention.kv_rows import write_kv
from specdec.attention.metadata import AttentionMetadata, TreeRowsMask

HALF_OR_FLOAT = (torch.bfloat16, torch.float16, torch.float32)


class InvariantAttentionBackend:
    name = "invariant"
    supports_cuda_graphs = True  # the kernel reads only staged tensors; its grid is the shape's

    def __init__(self, spec: AttentionSpec) -> None:
        check_supported(spec)
        from specdec.kernels import invariant_attention

        self.spec = spec
        self._kernels = invariant_attention
        self._md: AttentionMetadata | None = None
        self._rows = None  # RowMetadata on the device
        self._pages: tuple[torch.Tensor, torch.Tensor] | None = None  # kv_indptr, kv_indices
        # the KV splits' bound: a graph's is the longest context it may replay (its grid is
        # captured); an eager step's, its own longest. It never changes a row's result.
        self._graph_slots = 0
        self._max_slots = 0

    def stage_arrays(self, md: AttentionMetadata) -> list[torch.Tensor]:
        """The step's plan as host int arrays for the runner's one staged copy, which widens
        them to int64: row_request [T], row_limit [T], row_tree [T], kv_indptr [B+1],
        kv_indices [pages] (the one of variable length last, so the others sit at fixed offsets
        for a graph). A TreeRowsMask's tree rows have row_tree 0 here: plan() fills them in."""
        rows = self._kernels.row_metadata(md.qo_lens(), md.kv_lens(), md.custom_masks)
        h = md.host
        return [rows.row_request, rows.row_limit, rows.row_tree, h.kv_indptr, h.kv_indices]

    def add_graph_shape(self, batch_size: int, num_rows: int, max_pages: int, page_size: int,
                        masked: bool = False) -> None:
        """A graph keeps the staged arrays' addresses; its KV splits cover its longest
        context (``max_pages`` pages a request)."""
        self._graph_slots = max(self._graph_slots, max_pages * page_size)

    def plan(self, metadata: AttentionMetadata, staged: list[torch.Tensor] | None = None) -> None:
        """``staged``: the device views of ``stage_arrays(metadata)`` (the runner's); without
        them the arrays are copied here."""
        if staged is None:
            staged = [a.to(self.spec.device, torch.int64) for a in self.stage_arrays(metadata)]
        request, limit, tree, indptr, indices = staged
        if any(isinstance(m, TreeRowsMask) for m in metadata.custom_masks):
            _write_tree_bits(tree, metadata)
        self._md = metadata
        self._max_slots = self._graph_slots or max(metadata.kv_lens(), default=1)
        self._rows = self._kernels.RowMetadata(request, limit, tree)
        self._pages = (indptr, indices)

    def run(self, q, k, v, kv_cache, scale: float) -> torch.Tensor:
        assert self._md is not None, "plan() must be called before run()"
        write_kv(kv_cache, self._md.kv_write_index(), k, v)
        return self._kernels.invariant_attention(q, kv_cache, self._rows, *self._pages, scale,
                                                 max_slots=self._max_slots)


def _write_tree_bits(row_tree: torch.Tensor, md: AttentionMetadata) -> None:
    """Each TreeRowsMask's tree bits over its tree rows' placeholders in the staged row_tree
    (on the device: its q fed rows first, then its n tree rows)."""
    starts = md.lists.qo_indptr
    for b, m in enumerate(md.custom_masks):
        if isinstance(m, TreeRowsMask) and m.n:
            first = starts[b] + m.q
            row_tree[first:first + m.n].copy_(m.tree_bits())


def check_supported(spec: AttentionSpec) -> None:
    """ValueError naming what stands in the way of the invariant kernel for this model."""
    from specdec.kernels import triton_available

    if not triton_available():
        raise ValueError("attention_backend 'invariant' needs triton (it comes with torch's CUDA "
                         "builds); use 'flashinfer' or 'torch'")
    if torch.device(spec.device).type != "cuda" and not triton_interpreted():
        raise ValueError(f"attention_backend 'invariant' runs on CUDA devices (or under "
                         f"TRITON_INTERPRET=1, for tests), got device {spec.device}; use "
                         "'torch' on the CPU")
    if spec.dtype not in HALF_OR_FLOAT:
        raise ValueError(f"attention_backend 'invariant' takes bfloat16, float16 or float32, "
                         f"got {spec.dtype}")
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"attention_backend 'invariant' needs the heads ({spec.num_heads}) a "
                         f"multiple of the KV heads ({spec.num_kv_heads})")


def triton_interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
