"""CUDA graphs for a runner's small steps (decode and verify): bucketed shapes, padded inputs.

A graph replays one fixed launch sequence, so it serves batches of one shape: B requests, T rows.
A step of b requests and t rows is padded to the smallest captured-or-capturable shape (``Shape``)
that holds it: dummy requests are appended, each with at least one row, the last taking every
row left over. Dummies attend causally over scratch pages the runner keeps for them (their
outputs are dropped; real requests never see those pages). Logits are computed outside the graph
on the real rows asked for, so one graph serves any choice of logits rows.

Shapes: for b in ``batch_sizes``, ``Shape(b, b)`` (decode: every request one causal row, the
decode kernel) and ``Shape(b + 1, b * r)`` for r in ``rows_per_request`` (any rows: prefill
chunks, draft trees; the masked prefill kernel; the extra seat is the padding dummy's, so a
full batch of b requests still fits), ``T <= max_rows``. Example, batch_sizes (1, 2, 4), rows
(2, 4)::

    3 decode rows            -> Shape(4, 4): one dummy of 1 row
    1 request, 1 + 4 nodes   -> Shape(2, 8): one dummy of 3 rows
    1 decode row             -> Shape(1, 1): no padding

Steps that fit no shape (long prefill chunks) run eagerly. Graphs are captured on first use of a
(shape, captured layers, input kind) and replayed after the backend's plan() of the padded batch;
outputs are copied out of the graph's buffers before the next replay can overwrite them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from specdec.attention.metadata import AttentionMetadata, build_metadata, concat_metadata

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ROWS_PER_REQUEST = (2, 4, 8, 16, 32, 64)
_PADDINGS = 4096  # CudaGraphRunner.padding's answers kept (by requests, rows, decode)


@dataclass(frozen=True)
class Shape:
    batch_size: int  # B: requests, dummies included
    num_rows: int  # T: rows, dummies' included

    @property
    def decode(self) -> bool:
        return self.num_rows == self.batch_size


def graph_shapes(max_batch: int, max_rows: int, batch_sizes=BATCH_SIZES,
                 rows_per_request=ROWS_PER_REQUEST) -> list[Shape]:
    """Every shape a runner may capture: B up to the first size >= max_batch, T <= max_rows."""
    sizes = [b for b in batch_sizes if b < max_batch]
    sizes.append(next((b for b in batch_sizes if b >= max_batch), max_batch))
    shapes = [Shape(b, b) for b in sizes if b <= max_rows]
    # any-rows shapes hold one seat more than their B: the dummy that takes the spare rows of
    # a step of B requests (a full batch) needs a seat of its own, not a request's
    # (Shape(2, 2) of one request's 2 rows would be the decode shape of 2 requests: left out)
    shapes += [Shape(b + 1, b * r) for b in sizes for r in rows_per_request
               if b * r <= max_rows and b * r != b + 1]
    return sorted(dict.fromkeys(shapes), key=lambda s: (s.num_rows, s.batch_size))


def choose_shape(num_requests: int, num_rows: int, decode: bool,
                 shapes: list[Shape]) -> Shape | None:
    """The smallest shape (fewest rows, then requests) that holds the step, or None.

    ``decode``: every request has one causal row; only decode shapes hold such steps, and only
    such steps go into decode shapes. Padding needs a dummy request for any leftover rows, and
    every dummy needs a row: so either the step fills the shape exactly, or the shape has more
    requests and at least as many spare rows as spare requests.
    """
    for s in shapes:  # sorted by (rows, requests)
        if s.decode != decode or s.batch_size < num_requests or s.num_rows < num_rows:
            continue
        spare_requests, spare_rows = s.batch_size - num_requests, s.num_rows - num_rows
        if spare_requests == 0 and spare_rows == 0 or 0 < spare_requests <= spare_rows:
            return s
    return None


def scratch_pages(max_rows: int, page_size: int) -> int:
    """Pages the dummies of a runner whose shapes have at most ``max_rows`` rows attend over
    (allocated beside the requests' pages: ``specdec.engine.build``)."""
    return -(-max_rows // page_size)


def dummy_rows(shape: Shape, num_requests: int, num_rows: int) -> list[int]:
    """Rows of each dummy request: 1 each, the last takes what is left."""
    n = shape.batch_size - num_requests
    if n == 0:
        return []
    return [1] * (n - 1) + [shape.num_rows - num_rows - (n - 1)]


def pad_metadata(md: AttentionMetadata, rows: list[int], scratch: list[int],
                 dummies: dict | None = None) -> AttentionMetadata:
    """``md`` with dummy requests of ``rows[i]`` causal rows each over the pages ``scratch``
    (all dummies share them: what they write is never read by a real request). ``dummies``:
    a cache of the dummies' metadata by ``rows`` (the same every step of a shape and size)."""
    if not rows:
        return md
    key = tuple(rows)
    pad = None if dummies is None else dummies.get(key)
    if pad is None:
        assert max(rows) <= len(scratch) * md.page_size, (rows, len(scratch), md.page_size)
        pad = build_metadata([scratch] * len(rows), rows, rows, md.page_size)
        if dummies is not None:
            dummies[key] = pad
    return concat_metadata(md, pad)


def pad_batch(batch, shape: Shape, scratch: list[int], dummies: dict | None = None):
    """The ForwardBatch padded to ``shape`` (dummy rows: token 0, position 0, no logits):
    host work, before the inputs are staged (features, on the device, padded with zeros). A
    dummy's rows attend causally by its metadata, not by position; position 0 keeps every row
    inside the RoPE table whatever ``max_model_len`` (a dummy may get up to max_rows rows).
    ``dummies``: the runner's cache of dummy metadata (``pad_metadata``)."""
    b, t = batch.metadata.batch_size, batch.num_rows
    rows = dummy_rows(shape, b, t)
    extra = shape.num_rows - t
    if not rows:
        return batch
    features = batch.features
    if features is not None:
        features = torch.cat([features, features.new_zeros(extra, features.shape[1])])
    context = batch.context_rows
    if context is not None:
        context = torch.cat([context, context.new_zeros(extra)])
    return replace(
        batch, input_ids=_zero_padded(batch.input_ids, extra),
        positions=_zero_padded(batch.positions, extra),
        metadata=pad_metadata(batch.metadata, rows, scratch, dummies), features=features,
        context_rows=context)


def _zero_padded(host: torch.Tensor, extra: int) -> torch.Tensor:
    """A host array with ``extra`` zeros after it, through numpy (a fraction of the cost of
    torch's cat and zeros on arrays of a few entries, which every padded step pays)."""
    out = np.zeros(host.numel() + extra, dtype=host.numpy().dtype)
    out[:host.numel()] = host.numpy()
    return torch.from_numpy(out)


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # fixed input buffers: input_ids, positions, features...
    hidden: torch.Tensor  # [T, hidden] fixed output buffer
    layers: dict[int, torch.Tensor]  # fixed output buffers of the captured layers


class CudaCapture:
    """Records ``fn()`` into a CUDA graph: two warm-up calls on a side stream (JIT kernels,
    cuBLAS workspaces), then the capture; all graphs share one memory pool. Returns the graph
    (``replay()`` reruns it over the same memory) and ``fn``'s output, whose memory replays
    overwrite."""

    def __init__(self) -> None:
        self.pool = None

    def __call__(self, fn):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out


class CudaGraphRunner:
    """Captures and replays one ModelRunner's forward for small shapes (see the module doc).
    ``capture``: how graphs are recorded (``CudaCapture``; tests on a CPU pass a stand-in)."""

    def __init__(self, runner, max_batch: int, max_rows: int, max_kv_len: int,
                 capture=None) -> None:
        backend = runner.backend
        if not getattr(backend, "supports_cuda_graphs", False):
            raise ValueError(f"attention backend {backend.name!r} cannot run in CUDA graphs; "
                             "use 'flashinfer', or turn CUDA graphs off")
        self.runner = runner
        self.shapes = graph_shapes(max_batch, max_rows)
        page = runner.page_size
        # a request's KV: up to max_kv_len slots plus the rows drafted past them this step
        self.max_pages = -(-(max_kv_len + max_rows) // page) + 1
        # scratch pages for the dummies: enough for the most rows a dummy can get
        self.scratch = runner.kv.pool.allocate(scratch_pages(max_rows, page))
        self.dummies: dict = {}  # the dummies' metadata by their rows (pad_metadata)
        self._padding: dict = {}  # padding()'s answers by (requests, rows, decode)
        self._graphs: dict[tuple, _Graph] = {}
        self._capture_fn = capture or CudaCapture()
        self.capture_seconds = 0.0
        self.eager_said = False  # a step that fits no shape was logged (once per runner)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def shape_for(self, batch) -> Shape | None:
        md = batch.metadata
        qo = md.qo_lens()
        decode = all(n == 1 for n in qo) and all(m is None for m in md.custom_masks)
        return choose_shape(len(qo), batch.num_rows, decode, self.shapes)

    def padding(self, qo_lens: list[int], masks: list, num_rows: int
                ) -> tuple[Shape, tuple[int, ...]] | None:
        """The shape a batch of these requests' rows (``qo_lens``, ``num_rows`` in all) and
        masks replays, and its dummies' rows (``dummy_rows``); None: it runs eagerly."""
        decode = all(n == 1 for n in qo_lens) and all(m is None for m in masks)
        # the shapes are fixed: a step's (requests, rows, decode) is looked up, not the shapes
        # scanned every step (~1 us of a speculative step at batch 1); at most _PADDINGS kept
        key = (len(qo_lens), num_rows, decode)
        if key not in self._padding:
            if len(self._padding) >= _PADDINGS:
                self._padding.clear()
            shape = choose_shape(len(qo_lens), num_rows, decode, self.shapes)
            self._padding[key] = None if shape is None else (
                shape, tuple(dummy_rows(shape, len(qo_lens), num_rows)))
        return self._padding[key]

    def replay(self, shape: Shape, padded, ids: torch.Tensor, pos: torch.Tensor,
               planned: list[torch.Tensor], capture_layers: tuple[int, ...], num_rows: int):
        """(final_hidden [t, H], {layer: [t, H]}) of the first ``num_rows`` (the real) rows of
        ``padded``, a batch of ``shape`` whose ids and positions were staged as ``ids`` and
        ``pos``, and the backend's plan arrays as ``planned`` (specdec.engine.staging: the
        same addresses for every step of this shape)."""
        masked = any(m is not None for m in padded.metadata.custom_masks)
        key = (shape, masked, tuple(capture_layers), padded.features is not None,
               padded.context_rows is not None)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key, shape, padded, ids, pos, planned, capture_layers)
        else:
            assert ids.data_ptr() == graph.inputs["input_ids"].data_ptr(), \
                "the staged inputs moved: the graph would read stale ones"
            self.runner.backend.plan(padded.metadata, planned)
            for name in ("features", "context_rows"):
                if name in graph.inputs:
                    graph.inputs[name].copy_(getattr(padded, name))
        graph.graph.replay()
        t = num_rows
        return graph.hidden[:t].clone(), {i: h[:t].clone() for i, h in graph.layers.items()}

    def _capture(self, key, shape: Shape, padded, ids, pos, planned, capture_layers) -> _Graph:
        t0 = time.perf_counter()
        runner = self.runner
        runner.backend.add_graph_shape(shape.batch_size, shape.num_rows, self.max_pages,
                                       runner.page_size, masked=key[1])
        runner.backend.plan(padded.metadata, planned)  # now into the shape's fixed buffers
        inputs = {"input_ids": ids, "positions": pos}  # staged: fixed addresses per shape
        for name in ("features", "context_rows"):
            if getattr(padded, name) is not None:
                inputs[name] = getattr(padded, name).clone()
        graph, out = self._capture_fn(lambda: runner.run_model(inputs, capture_layers))
        self._graphs[key] = g = _Graph(graph, inputs, out.hidden, out.layer_hidden)
        self.capture_seconds += time.perf_counter() - t0
        return g
