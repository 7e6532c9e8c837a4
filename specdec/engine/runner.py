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
import time
from dataclasses import dataclass

import torch

from specdec.attention import create_backend
from specdec.attention.backend import AttentionSpec
from specdec.attention.metadata import AttentionMetadata, build_metadata, host_tensor
from specdec.engine.cuda_graphs import CudaGraphRunner
from specdec.kv.block_table import BlockTable
from specdec.kv.manager import KVManager


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata  # per request: its rows, pages and mask
    logits_indices: torch.Tensor  # [R] int64: rows of the batch whose logits are returned
    features: torch.Tensor | None = None  # [T, hidden] per-row input features (EAGLE heads)
    # [T] bool: rows whose features are context (block-diffusion drafters); None: no such rows
    context_rows: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class ForwardResult:
    logits: torch.Tensor | None  # [R, V] float32 (float64 for float64 models); None if R == 0
    final_hidden: torch.Tensor  # [T, hidden] after the final norm
    hidden: dict[int, torch.Tensor]  # layer -> [T, hidden]: that layer's output, every row
    seconds: float  # wall time of the forward (GPU work included: CUDA runners synchronize)
    graphed: bool = False  # replayed a CUDA graph (False: ran eagerly)


class ModelRunner:
    """Runs one model over packed batches and a paged KV cache it owns.

    ``num_layers`` < the model's layers runs only the first N (early-exit self-speculation); the
    cache then holds only those layers. The KV exists after ``allocate(num_pages)``.
    """

    def __init__(self, model, name: str, attention_backend: str, page_size: int, device,
                 num_layers: int | None = None) -> None:
        self.model = model
        self.name = name
        self.cfg = model.cfg
        self.num_layers = num_layers or self.cfg.num_layers
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = model.embed.dtype
        c = self.cfg
        self.backend = create_backend(attention_backend, AttentionSpec(
            c.num_heads, c.num_kv_heads, c.head_dim, self.dtype, self.device))
        self.kv: KVManager | None = None
        self.graphs: CudaGraphRunner | None = None

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

    def forward(self, batch: ForwardBatch, capture_layers: tuple[int, ...] = ()) -> ForwardResult:
        assert self.kv is not None, f"runner {self.name!r}: allocate() before forward()"
        t0 = time.perf_counter()
        with torch.inference_mode():
            graphed = None if self.graphs is None else self.graphs.forward(batch, capture_layers)
            if graphed is None:
                self.backend.plan(batch.metadata)
                out = self.run_model(_inputs(batch), capture_layers)
                hidden, layers = out.hidden, out.layer_hidden
            else:
                hidden, layers = graphed
            logits = None
            if batch.logits_indices.numel():
                logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))
        if self.device.type == "cuda":
            # the seconds must be the GPU's (the goodput controller's cost table learns from
            # them); the step syncs right after anyway, to read what verification accepted
            torch.cuda.synchronize(self.device)
        return ForwardResult(logits, hidden, layers, time.perf_counter() - t0,
                             graphed is not None)

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
        ``logits``: "last" (each request's last row), "all" or "none". ``features``: [T, hidden]
        per-row inputs for models that take them (EAGLE heads); ``context_rows`` [T] bool marks
        the rows whose features are context (block-diffusion drafters).
        """
        assert logits in ("last", "all", "none"), logits
        lens = [len(f) for f in feeds]
        ends = [s + n for s, n in zip(starts, lens)]
        md = build_metadata([t.pages for t in tables], ends, lens, self.page_size, masks,
                            self.device)
        if positions is None:
            pos = [p for s, e in zip(starts, ends) for p in range(s, e)]
        else:
            pos = [p for ps in positions for p in ps]
        if logits == "last":
            rows = list(itertools.accumulate(lens, initial=-1))[1:]
        else:
            rows = list(range(sum(lens))) if logits == "all" else []
        ids, pos, rows = (host_tensor(v) for v in ([t for f in feeds for t in f], pos, rows))
        if self.device.type != "cpu":
            ids, pos, rows = ids.to(self.device), pos.to(self.device), rows.to(self.device)
        return ForwardBatch(ids, pos, md, rows, features, context_rows)


def _inputs(batch: ForwardBatch) -> dict[str, torch.Tensor]:
    out = {"input_ids": batch.input_ids, "positions": batch.positions}
    for name in ("features", "context_rows"):
        if getattr(batch, name) is not None:
            out[name] = getattr(batch, name)
    return out
