"""flashinfer attention over the engine's paged KV cache (CUDA; bfloat16 or float16).

The same protocol and the same memory as the torch reference backend: one layer's cache is
[num_pages, 2, page_size, num_kv_heads, head_dim] (flashinfer's NHD layout, one 5-D tensor), the
metadata is flashinfer's (qo_indptr, kv_indptr, kv_indices, kv_last_page_len). ``plan()`` picks
one kernel for the step and plans it once; ``run()`` writes the layer's new K/V into their slots
and calls it. Which kernel:

- every request one causal row (plain decode): the batch decode kernel, or the batch prefill
  kernel with one row each (``decode_path="prefill"``; the GPU bench measures both);
- causal rows only (prefill chunks, decode rows): batch prefill, ``causal=True`` (flashinfer's
  causal mask is bottom-right aligned, as ours: row i of q rows over L slots sees slots
  0..L-q+i);
- any custom mask (draft trees that are not chains: a chain's mask is the causal one, and
  its rows come here unmasked): batch prefill with every request's mask, causal ones written
  out, each request's bits little-endian from a byte boundary, as flashinfer packs them. Host
  masks only: packed on the host (``packed_masks``), and plan() sends them. A batch with a
  ``TreeRowsMask`` (a draft tree whose tree part is on the device): the whole batch packed on
  the device by torch ops (``device_packed_masks``: its trees made there, causal rows made
  there, host masks copied there, the only copy) and handed to plan() as a device tensor.
  Either way the byte offsets follow from the shapes alone, on the host. flashinfer 0.6's
  ``plan()`` handed a packed mask keeps bit offsets where its kernel reads byte offsets
  (flashinfer PR #2201), so after the plan the wrapper's mask offsets are set to the byte
  offsets. Every plan is made from host arrays and device masks: no device -> host read.

CUDA graphs: ``add_graph_shape(B, T, max_pages, page_size, masked)`` creates wrappers in
flashinfer's CUDA-graph mode (fixed index buffers) for batches of exactly B requests and T
rows, masked or not, and a fixed K/V write index. ``plan()`` of such a batch copies into those
buffers, so a graph captured after one plan replays correctly after the next. A shape with one
row per request holds plain decode batches; others hold causal rows (prefill chunks, chains) or,
masked, draft trees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention.backend import AttentionSpec
from specdec.attention.kv_rows import write_kv
from specdec.attention.metadata import AttentionMetadata, TreeRowsMask, host_tensor
from specdec.tree import packed_masks

WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended split-k workspace, shared by all wrappers
DECODE_PATHS = ("decode", "prefill")
PREFILL_BACKENDS = ("auto", "fa2", "fa3")
HALF = (torch.bfloat16, torch.float16)


@dataclass
class _Step:
    wrapper: object  # the planned flashinfer wrapper
    write_index: torch.Tensor  # [2 * T] int64 cache rows of the new K then V rows


@dataclass
class _GraphShape:
    wrapper: object  # a wrapper in CUDA-graph mode
    kind: str  # "decode" (decode kernel), "causal" (prefill, one row each) or "masked"
    write_index: torch.Tensor  # [2 * T] int64, fixed buffer


class FlashInferAttentionBackend:
    name = "flashinfer"
    supports_cuda_graphs = True

    def __init__(self, spec: AttentionSpec, decode_path: str = "decode",
                 prefill_backend: str = "fa2", workspace_bytes: int = WORKSPACE_BYTES) -> None:
        """``prefill_backend``: flashinfer's kernel family for causal prefill ("auto": FA3 on
        Hopper; masked steps always get FA2, the one with custom masks). FA2 by default until
        FA3 is measured here: one family is one JIT compile on a fresh machine, not two."""
        check_supported(spec)
        self._packed = None  # this step's packed tree masks and their offsets (stage_arrays)
        if decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path must be one of {', '.join(DECODE_PATHS)}, "
                             f"got {decode_path!r}")
        if prefill_backend not in PREFILL_BACKENDS:
            raise ValueError(f"prefill_backend must be one of {', '.join(PREFILL_BACKENDS)}, "
                             f"got {prefill_backend!r}")
        import flashinfer

        self.spec = spec
        self.decode_path = decode_path
        self.prefill_backend = prefill_backend
        self._fi = flashinfer
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=spec.device)
        # the plain decode kernel is compiled for GQA group sizes 1, 2, 3, 4 and 8 only
        self._tensor_cores = spec.num_heads // spec.num_kv_heads not in (1, 2, 3, 4, 8)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self._tensor_cores)
        # one wrapper per kernel family: a wrapper fixes its family at its first plan()
        self._causal = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=prefill_backend)
        self._masked = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend="fa2")
        self._graph_shapes: dict[tuple[int, int], _GraphShape] = {}
        self._step: _Step | None = None

    # ---- CUDA graphs ----------------------------------------------------------------------

    def add_graph_shape(self, batch_size: int, num_rows: int, max_pages: int,
                        page_size: int, masked: bool = False) -> None:
        """Fixed-buffer wrappers for batches of ``batch_size`` requests and ``num_rows`` rows,
        each request over at most ``max_pages`` pages of ``page_size`` slots; ``masked``: for
        steps with a custom mask (draft trees)."""
        key = (batch_size, num_rows, masked)
        if key in self._graph_shapes:
            return
        dev = self.spec.device
        i32 = dict(dtype=torch.int32, device=dev)
        indptr = torch.zeros(batch_size + 1, **i32)
        indices = torch.zeros(batch_size * max_pages, **i32)
        last = torch.ones(batch_size, **i32)
        decode = num_rows == batch_size and not masked
        if decode and self.decode_path == "decode":
            kind = "decode"
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last)
        else:
            kind = "masked" if masked else "causal"
            masks = {}
            if kind == "masked":  # (a graph wrapper given a mask buffer always runs masked)
                # every request's mask bits, each request padded to a whole byte
                mask_bytes = (num_rows * max_pages * page_size + 7) // 8 + batch_size
                masks = dict(custom_mask_buf=torch.zeros(mask_bytes, dtype=torch.uint8,
                                                         device=dev),
                             mask_indptr_buf=torch.zeros(batch_size + 1, **i32))
            wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True,
                backend=self.prefill_backend if not masked else "fa2",
                qo_indptr_buf=torch.zeros(batch_size + 1, **i32), paged_kv_indptr_buf=indptr,
                paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last, **masks)
        write_index = torch.zeros(2 * num_rows, dtype=torch.int64, device=dev)
        self._graph_shapes[key] = _GraphShape(wrapper, kind, write_index)

    # ---- the protocol -----------------------------------------------------------------------

    def stage_arrays(self, md: AttentionMetadata) -> list[torch.Tensor]:
        """A step with a tree mask: its packed mask's byte offsets, which flashinfer 0.6 would
        take in bits (plan() then puts the staged ones in place: no copy of their own). Else
        nothing: it plans from the host arrays. Host masks are packed here, on the host; a
        batch with a TreeRowsMask is packed on the device by plan() (None here)."""
        if all(m is None for m in md.custom_masks):
            self._packed = None
            return []
        self._packed = _packed(md)
        return [self._packed[1]]

    def plan(self, metadata: AttentionMetadata, staged: list[torch.Tensor] | None = None) -> None:
        md = metadata
        qo_lens = md.qo_lens()
        b, t = len(qo_lens), sum(qo_lens)
        masked = any(m is not None for m in md.custom_masks)
        decode = t == b and not masked
        index = md.kv_write_index()
        shape = self._graph_shapes.get((b, t, masked))
        if shape is not None:
            shape.write_index.copy_(index)
            self._plan_kernel(shape.wrapper, shape.kind, md, qo_lens, staged)
            self._step = _Step(shape.wrapper, shape.write_index)
            return
        if decode and self.decode_path == "decode":
            kind, wrapper = "decode", self._decode
        elif masked:
            kind, wrapper = "masked", self._masked
        else:
            kind, wrapper = "causal", self._causal
        self._plan_kernel(wrapper, kind, md, qo_lens, staged)
        self._step = _Step(wrapper, index)

    def run(self, q, k, v, kv_cache, scale: float) -> torch.Tensor:
        step = self._step
        assert step is not None, "plan() must be called before run()"
        assert abs(scale - self.spec.scale) < 1e-12, (scale, self.spec.scale)
        write_kv(kv_cache, step.write_index, k, v)
        return step.wrapper.run(q, kv_cache)

    def _plan_kernel(self, wrapper, kind: str, md: AttentionMetadata, qo_lens: list[int],
                     staged: list[torch.Tensor] | None = None) -> None:
        s, h = self.spec, md.on_host()
        common = dict(q_data_type=s.dtype, kv_data_type=s.dtype, sm_scale=s.scale)
        if kind == "decode":
            wrapper.plan(h.kv_indptr, h.kv_indices, h.kv_last_page_len, s.num_heads,
                         s.num_kv_heads, s.head_dim, md.page_size, **common)
            return
        if kind == "causal":
            wrapper.plan(h.qo_indptr, h.kv_indptr, h.kv_indices, h.kv_last_page_len,
                         s.num_heads, s.num_kv_heads, s.head_dim, md.page_size, causal=True,
                         **common)
            return
        if staged:  # stage_arrays packed them for this step and staged the offsets
            (packed, _), indptr = self._packed, staged[0]
        else:
            packed, indptr = _packed(md)
        if packed is None:  # a TreeRowsMask among them: packed on the device
            packed = device_packed_masks(md.custom_masks, qo_lens, md.kv_lens(), s.device)
        wrapper.plan(h.qo_indptr, h.kv_indptr, h.kv_indices, h.kv_last_page_len,
                     s.num_heads, s.num_kv_heads, s.head_dim, md.page_size,
                     packed_custom_mask=packed, causal=False, **common)
        # (flashinfer 0.6 keeps the offsets of a packed mask in bits; its kernel reads bytes)
        # (staged: on the device already, a device copy; else a copy from the host)
        if wrapper.is_cuda_graph_enabled:
            wrapper._mask_indptr_buf.copy_(indptr, non_blocking=True)
        else:
            wrapper._mask_indptr_buf = indptr.to(s.device, torch.int32, non_blocking=True)


def _packed(md: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the packed masks, their byte offsets [B + 1] int32) on the host; the packed masks None
    when a TreeRowsMask is among them (``device_packed_masks`` packs them on the device)."""
    if not any(isinstance(m, TreeRowsMask) for m in md.custom_masks):
        return packed_masks(md.custom_masks, md.qo_lens(), md.kv_lens())
    offsets = [0]
    for qo, kv in zip(md.qo_lens(), md.kv_lens()):
        offsets.append(offsets[-1] + (qo * kv + 7) // 8)
    return None, host_tensor(offsets, torch.int32)


def device_packed_masks(masks: list[torch.Tensor | TreeRowsMask | None], qo_lens: list[int],
                        kv_lens: list[int], device: torch.device) -> torch.Tensor:
    """``packed_masks``' packed bytes (every request's [qo, kv] mask, causal where None,
    row-major, little-endian from a byte boundary), made on ``device`` by torch ops: a
    TreeRowsMask's dense form and the causal masks are made there (nothing read, nothing
    sent); a host mask is copied there (the only copy). Example, a TreeRowsMask with q 1,
    prefix 1 and one node (dense [[1, 0], [1, 1]]) then one causal row over 2 slots::

        bits 1011 0000 | 11 000000  ->  [0b1101, 0b11] (uint8, on the device)
    """
    dev = torch.device(device)
    causal = [(qo, kv) for m, qo, kv in zip(masks, qo_lens, kv_lens) if m is None]
    # the causal masks' parts, cut from two tensors: [qo, kv - qo] all seen, then [qo, qo]
    # lower-triangular (a decode row: one run of ones, a view)
    ones = torch.ones(max((q for q, _ in causal), default=0), max((k for _, k in causal),
                      default=0), dtype=torch.bool, device=dev)
    q_max = max((q for q, _ in causal if q > 1), default=0)
    tril = torch.ones(q_max, q_max, dtype=torch.bool, device=dev).tril() if q_max else None
    pad = torch.zeros(7, dtype=torch.bool, device=dev)
    parts = []
    for mask, qo, kv in zip(masks, qo_lens, kv_lens):
        if mask is None:
            bits = ones[0, :kv] if qo == 1 else torch.cat(
                [ones[:qo, :kv - qo], tril[:qo, :qo]], 1).reshape(-1)
        else:
            assert tuple(mask.shape) == (qo, kv), (tuple(mask.shape), qo, kv)
            dense = mask.dense() if isinstance(mask, TreeRowsMask) else mask.to(dev)
            bits = dense.reshape(-1)
        parts.append(bits)
        if (qo * kv) % 8:
            parts.append(pad[:8 - (qo * kv) % 8])
    if not parts:
        return torch.zeros(0, dtype=torch.uint8, device=dev)
    bits = torch.cat(parts).view(-1, 8).to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=dev)
    return (bits << shifts).sum(-1, dtype=torch.uint8)


def check_supported(spec: AttentionSpec) -> None:
    """ValueError naming what stands in the way of flashinfer for this model."""
    if torch.device(spec.device).type != "cuda":
        raise ValueError(f"attention_backend 'flashinfer' runs on CUDA devices only, got device "
                         f"{spec.device}; use 'torch' (or 'auto')")
    if spec.dtype not in HALF:
        raise ValueError(f"attention_backend 'flashinfer' needs dtype bfloat16 or float16, got "
                         f"{spec.dtype}; use 'torch' or 'flex' for float32")
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        raise ValueError("attention_backend 'flashinfer' needs the flashinfer-python package "
                         "(pip install 'specdec[gpu]'); 'torch' and 'flex' run without it") from e
