"""The attention backend protocol: plan once per step on the host, run once per layer."""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def plan(self, metadata: AttentionMetadata) -> None:
        """Precompute everything that is the same for every layer of this step."""

    def run(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_pages, 2, page_size, num_kv_heads, head_dim]
        scale: float,
    ) -> torch.Tensor:
        """Write k/v into their slots, then attend; returns [T, num_heads, head_dim]."""
