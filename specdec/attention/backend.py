"""The attention backend protocol: plan once per step on the host, run once per layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """The attention shape of the model a backend serves (GPU kernels are planned for it)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class AttentionBackend(Protocol):
    name: str
    # True: plan() for a registered graph shape (add_graph_shape) writes only into buffers that
    # stay put, so run() can be captured in a CUDA graph and replayed after each plan()
    supports_cuda_graphs: bool

    def stage_arrays(self, metadata: AttentionMetadata) -> list[torch.Tensor]:
        """Host int arrays the plan needs on the device: the runner sends them with the step's
        inputs in one copy, as int64, and hands their device views to ``plan`` (none: [])."""

    def plan(self, metadata: AttentionMetadata, staged: list[torch.Tensor] | None = None) -> None:
        """Precompute everything that is the same for every layer of this step (``staged``:
        the device views of ``stage_arrays``; None: the backend copies them itself)."""

    def run(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        scale: float,
    ) -> torch.Tensor:
        """Write k/v into their slots, then attend; returns [T, num_heads, head_dim]."""
