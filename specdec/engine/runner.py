"""ModelRunner: one model, its paged KV cache and its attention backend.

The engine's target forward and every drafter that runs a model go through a runner. A drafter
gets its runner from the engine (``TargetInfo.new_runner``), so its KV comes out of the engine's
one memory budget and uses the target's attention backend. Runners are created first and
allocated once the split is known (``allocate``; see ``specdec.engine.memory``).

One forward runs one packed batch (``ForwardBatch``): B requests' rows back to back, T rows in
all; it returns the logits of the rows asked for and, batch-flat, the hidden states of the
layers asked for (``[T, hidden]``; request b's rows are ``qo_indptr[b]:qo_indptr[b + 1]``).
With CUDA graphs on (``enable_cuda_graphs``: a CUDA device and a backend that supports them),
a batch that fits a graph shape is padded and replayed (``specdec.engine.cuda_graphs``); the LM head
always runs outside the graph, on the rows asked for.

Example, two requests feeding 3 and 1 tokens::

    batch = runner.pack([[5, 6, 7], [9]], starts=[0, 12], tables=[t0, t1], logits="last")
    out = runner.forward(batch)      # out.logits [2, V] (rows 2 and 3), out.final_hidden [4, H]
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from specdec.attention import create_backend
from specdec.attention.backend import AttentionSpec
from specdec.attention.kv_rows import host_kv_write_index
from specdec.attention.metadata import AttentionMetadata, build_metadata, host_tensor
from specdec.engine.cuda_graphs import CudaGraphRunner, Shape, pad_batch
from specdec.engine.staging import ALIGN, Staging
from specdec.kv.block_table import BlockTable
from specdec.kv.manager import KVManager

logger = logging.getLogger("specdec")


@dataclass
class ForwardBatch:
    """One forward's inputs as the host built them (``ModelRunner.forward`` stages the index
    arrays to the device in one copy); features are the drafters' device tensors."""

    input_ids: torch.Tensor  # [T] int64, host
    positions: torch.Tensor  # [T] int64, host
    metadata: AttentionMetadata  # per request: its rows, pages and mask (host arrays)
    logits_indices: torch.Tensor  # [R] int64, host: rows of the batch whose logits are returned
    features: torch.Tensor | None = None  # [T, hidden] per-row input features (EAGLE heads)
    # [T] bool: rows whose features are context (block-diffusion drafters); None: no such rows
    context_rows: torch.Tensor | None = None
    # already padded to this CUDA graph shape (build_forward_batch): the arrays above hold the
    # dummies after the first ``num_real_rows`` rows; None: not padded (the runner pads it)
    graph_shape: Shape | None = None
    num_real_rows: int | None = None
    # (row, ids): rows row .. row + len(ids) - 1 take their token ids from ``ids``, a device
    # int64 tensor (drafts the host has not read: ``DraftTree.tokens_on_host``), written over
    # the staged placeholders on the device; ids outside the vocabulary are clamped into it
    # there (the verifier then rejects the node: its token is not the one the forward saw)
    device_ids: tuple[tuple[int, torch.Tensor], ...] = ()
    # (row, positions) likewise: the positions of a draft tree shaped on the device
    device_positions: tuple[tuple[int, torch.Tensor], ...] = ()
    # the staged ids hold drafts not checked yet: clamped into the vocabulary on the device
    clamp_ids: bool = False

    @property
    def num_rows(self) -> int:
        """Rows of the batch (a padded one's real rows: its dummies are not counted)."""
        if self.graph_shape is not None:
            return self.num_real_rows
        return int(self.input_ids.numel())


@dataclass
class ForwardResult:
    logits: torch.Tensor | None  # [R, V] float32 (float64 for float64 models); None if R == 0
    final_hidden: torch.Tensor  # [T, hidden] after the final norm
    hidden: dict[int, torch.Tensor]  # layer -> [T, hidden]: that layer's output, every row
    # seconds the forward took: on a CPU the wall time, measured; on CUDA the device's time
    # between two events, read (and waited for) only when asked: see ``seconds``
    elapsed: float | _Timer
    graphed: bool = False  # replayed a CUDA graph (False: ran eagerly)
    logits_hidden: torch.Tensor | None = None  # [R, hidden]: the rows the logits came from
    # a mixture-of-experts model: per layer run, the distinct experts the rows routed to (host
    # ints the layers read anyway, or one device tensor of them where the experts ran gathered:
    # ``LlamaDecoder.experts_woken``; ``woken_counts`` reads either); None for a dense model
    experts_woken: tuple[int, ...] | torch.Tensor | None = None

    def woken_counts(self) -> list[int] | None:
        """``experts_woken`` as host ints (a gathered forward's counts: one read, made here,
        after the step, when someone asks)."""
        w = self.experts_woken
        if isinstance(w, torch.Tensor):
            self.experts_woken = w = tuple(w.tolist())
        return None if w is None else list(w)

    @property
    def seconds(self) -> float:
        """The forward's seconds (on CUDA: waits until the device has run it)."""
        if isinstance(self.elapsed, _Timer):
            self.elapsed = self.elapsed.seconds()
        return self.elapsed


class _Timer:
    """A forward's time: CUDA events around its launches on a GPU (read once the device got
    there, so timing adds no wait of its own), perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.events = None
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True))
            self.events[0].record()
        self.t0 = time.perf_counter()

    def stop(self) -> float | _Timer:
        if self.events is None:
            return time.perf_counter() - self.t0
        self.events[1].record()
        return self

    def seconds(self) -> float:
        start, end = self.events
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class ModelRunner:
    """Runs one model over packed batches and a paged KV cache it owns.

    ``num_layers`` < the model's layers runs only the first N (early-exit self-speculation); the
    cache then holds only those layers. The KV exists after ``allocate(num_pages)``.
    """

    def __init__(self, model, name: str, attention_backend: str, page_size: int, device,
                 num_layers: int | None = None, invariant: bool = False) -> None:
        """``invariant``: the engine computes row-invariantly (``attention_backend`` "auto"
        then picks the row-invariant attention where it runs)."""
        self.model = model
        self.name = name
        self.cfg = model.cfg
        self.num_layers = num_layers or self.cfg.num_layers
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = model.embed.dtype
        c = self.cfg
        self.backend = create_backend(attention_backend, AttentionSpec(
            c.num_heads, c.num_kv_heads, c.head_dim, self.dtype, self.device), invariant)
        self.kv: KVManager | None = None
        self.graphs: CudaGraphRunner | None = None
        # the inputs of steps up to max_rows rows go to the device in one copy (enable_cuda_graphs
        # sizes it for the graphed steps)
        self.staging = Staging(self.device, 5 * 512)
        # called with each batch before its forward runs (tensor parallelism's rank 0 sends it
        # to the other ranks: specdec.distributed.engine_tp); None: nothing
        self.before_forward: Callable[[ForwardBatch], None] | None = None

    @property
    def bytes_per_page(self) -> int:
        """K and V of one page in every layer of this runner's cache."""
        c = self.cfg
        return (self.num_layers * 2 * self.page_size * c.num_kv_heads * c.head_dim
                * self.dtype.itemsize)

    def allocate(self, num_pages: int) -> None:
        assert self.kv is None, f"runner {self.name!r} is already allocated"
        c = self.cfg
        self.kv = KVManager(self.num_layers, num_pages, self.page_size, c.num_kv_heads,
                            c.head_dim, self.dtype, self.device)

    def enable_cuda_graphs(self, max_batch: int, max_rows: int, max_kv_len: int) -> None:
        """Replay CUDA graphs for steps of at most ``max_batch`` requests and ``max_rows`` rows
        (``specdec.engine.cuda_graphs``); needs CUDA, allocated KV and a backend that supports them."""
        assert self.kv is not None, f"runner {self.name!r}: allocate() before CUDA graphs"
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, runner {self.name!r} is on "
                             f"{self.device}")
        self.graphs = CudaGraphRunner(self, max_batch, max_rows, max_kv_len)
        # a graphed step's inputs: ids, positions, 2T write rows, logits rows (<= T), and what
        # the backend plans from (the invariant backend: 3T row arrays, B + 1 + B pages each)
        b = max(s.batch_size for s in self.graphs.shapes)
        self.staging = Staging(self.device, 8 * max_rows + (b + 1) * (self.graphs.max_pages + 1)
                               + 10 * ALIGN)  # (each of the <= 10 arrays aligned)

    def forward(self, batch: ForwardBatch, capture_layers: tuple[int, ...] = ()) -> ForwardResult:
        """Run ``batch`` (host inputs: padded to a graph shape if one holds it, staged to the
        device in one copy, then replayed or run eagerly); the logits of its rows asked for.
        On CUDA nothing here waits for the device: ``ForwardResult.seconds`` does, if read."""
        assert self.kv is not None, f"runner {self.name!r}: allocate() before forward()"
        if self.before_forward is not None:
            self.before_forward(batch)
        timer = _Timer(self.device)
        with torch.inference_mode():
            shape, run = batch.graph_shape, batch
            if shape is None and self.graphs is not None:
                shape = self.graphs.shape_for(batch)
                if shape is not None:
                    run = pad_batch(batch, shape, self.graphs.scratch, self.graphs.dummies)
            assert shape is None or self.graphs is not None, "a batch padded for no graphs"
            md = run.metadata
            # context rows the host marked (block diffusion) go in the same copy
            context = run.context_rows is not None and run.context_rows.is_cpu
            staged = self.staging.stage([
                run.input_ids, run.positions, host_kv_write_index(md.slots, md.page_size),
                *self.backend.stage_arrays(md),
                *([run.context_rows.to(torch.int64)] if context else []), batch.logits_indices])
            ids, pos, md.write_index, *planned, rows = staged
            if context:
                run = replace(run, context_rows=planned.pop() != 0)
            if batch.clamp_ids:
                ids.clamp_(0, self.model.embed.shape[0] - 1)
            if batch.device_ids:
                vocab = self.model.embed.shape[0]
                for row, tokens in batch.device_ids:
                    torch.clamp(tokens, 0, vocab - 1, out=ids[row:row + tokens.numel()])
            for row, positions in batch.device_positions:
                pos[row:row + positions.numel()].copy_(positions)
            if shape is None:
                if self.graphs is not None and not self.graphs.eager_said:
                    self.graphs.eager_said = True  # (counted per step: StepStats.graphed)
                    logger.info("runner %s: a step of %d requests and %d rows fits no CUDA "
                                "graph shape: it and its like run eagerly", self.name,
                                md.batch_size, batch.num_rows)
                self.backend.plan(md, planned)
                out = self.run_model(_inputs(run, ids, pos), capture_layers)
                hidden, layers = out.hidden, out.layer_hidden
            else:
                hidden, layers = self.graphs.replay(shape, run, ids, pos, planned,
                                                    capture_layers, batch.num_rows)
            logits = logits_hidden = None
            if rows.numel():
                logits_hidden = hidden.index_select(0, rows)
                logits = self.model.compute_logits(logits_hidden)
        woken = getattr(self.model, "experts_woken", None)
        return ForwardResult(logits, hidden, layers, timer.stop(), shape is not None,
                             logits_hidden,
                             None if woken is None else woken(self.num_layers))

    def capture_graphs(self, capture_layers: tuple[int, ...] = ()) -> int:
        """Capture now the graph of every shape, for forwards that capture ``capture_layers``
        and take no features (the target's), so that no step pays a capture later (each is a
        few warm-up forwards and a capture: ~40 ms at the SmolLM2-135M shape on an H200, which
        a first prefill of a new row count paid in the middle of a run when shapes were
        captured at first use). The graphs replay steps of any content: each is captured over
        dummy requests. Returns how many the runner has."""
        assert self.graphs is not None, f"runner {self.name!r}: no CUDA graphs enabled"
        empty = self.pack([], [], [], logits="none")
        with torch.inference_mode():
            for shape in self.graphs.shapes:
                run = pad_batch(empty, shape, self.graphs.scratch)
                md = run.metadata
                ids, pos, md.write_index, *planned = self.staging.stage([
                    run.input_ids, run.positions, host_kv_write_index(md.slots, md.page_size),
                    *self.backend.stage_arrays(md)])
                self.graphs.replay(shape, run, ids, pos, planned, capture_layers, 0)
        return self.graphs.num_graphs

    def run_model(self, inputs: dict[str, torch.Tensor], capture_layers: tuple[int, ...]):
        """The model over one planned batch's inputs (``input_ids``, ``positions``, and
        ``features`` / ``context_rows`` for models that take them): its ForwardOutput."""
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "positions")}
        return self.model(inputs["input_ids"], inputs["positions"], self.backend, self.kv.cache,
                          capture_layers=capture_layers, num_layers=self.num_layers, **extra)

    def pack(self, feeds: list[list[int]], starts: list[int], tables: list[BlockTable],
             logits: str = "last", positions: list[list[int]] | None = None,
             masks: list[torch.Tensor | None] | None = None,
             features: torch.Tensor | None = None,
             context_rows: torch.Tensor | None = None) -> ForwardBatch:
        """A batch where request b feeds ``feeds[b]`` into slots ``starts[b]`` onwards.

        Positions default to the slots (``starts[b] + i``); give ``positions`` (and a custom
        ``masks[b]`` of shape [len(feeds[b]), starts[b] + len(feeds[b])]) for tree rows.
        ``logits``: "last" (each request's last row), "all", "none" or a list of rows (of the
        batch). ``features``: [T, hidden] per-row inputs for models that take them (EAGLE
        heads); ``context_rows`` [T] bool marks the rows whose features are context
        (block-diffusion drafters; a host tensor is staged with the batch's other arrays).
        """
        assert isinstance(logits, list) or logits in ("last", "all", "none"), logits
        lens = [len(f) for f in feeds]
        ends = [s + n for s, n in zip(starts, lens)]
        md = build_metadata([t.pages for t in tables], ends, lens, self.page_size, masks,
                            self.device)
        if positions is None:
            pos = [p for s, e in zip(starts, ends) for p in range(s, e)]
        else:
            pos = [p for ps in positions for p in ps]
        if isinstance(logits, list):
            rows = logits
        elif logits == "last":
            rows = list(itertools.accumulate(lens, initial=-1))[1:]
        else:
            rows = list(range(sum(lens))) if logits == "all" else []
        ids, pos, rows = (host_tensor(v) for v in ([t for f in feeds for t in f], pos, rows))
        return ForwardBatch(ids, pos, md, rows, features, context_rows)


def _inputs(batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's inputs: the staged ids and positions, the batch's per-row features."""
    out = {"input_ids": ids, "positions": pos}
    for name in ("features", "context_rows"):
        if getattr(batch, name) is not None:
            out[name] = getattr(batch, name)
    return out
