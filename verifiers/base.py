"""Verifier protocol, its per-request result, and the padded batch form.

Row convention for one request with a tree of n nodes (V = vocab size)::

    logits[0]      target distribution of the first draft depth (row of the last committed token)
    logits[1 + i]  target distribution of node i's children (the token after node i)

``probs`` has the same rows after the caller's temperature / top-k / top-p / min-p processing,
or is None for greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specdec.tree import DraftTree


@dataclass
class VerifyResult:
    """What one request keeps from one verification.

    Example: a chain [7, 8, 9] whose first two nodes match and whose third is corrected to 4
    gives ``accepted = [0, 1]``, ``tokens = [7, 8, 4]``.
    """

    accepted: list[int]  # node indices of the accepted path, in depth order (may be empty)
    tokens: list[int]  # accepted nodes' tokens + one corrected/bonus token; len(accepted) + 1

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.accepted) + 1, (
            f"VerifyResult needs len(tokens) == len(accepted) + 1, got {self.tokens} for "
            f"{self.accepted}")


@runtime_checkable
class Verifier(Protocol):
    """Decides which draft nodes to keep; output must follow the target distribution exactly."""

    name: str

    def verify(self, tree: DraftTree, logits: torch.Tensor, probs: torch.Tensor | None,
               generator: torch.Generator | None) -> VerifyResult:
        """tree: n nodes; logits: [1 + n, V] target logits; probs: [1 + n, V] processed p or None."""
        ...


def check_verify_inputs(tree: DraftTree, logits: torch.Tensor,
                        probs: torch.Tensor | None) -> int:
    """Validate one request's verifier inputs; return the vocab size V."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor [1 + n, V], got {_shape(logits)}")
    if logits.shape[0] != tree.num_nodes + 1:
        raise ValueError(
            f"logits has {logits.shape[0]} rows but the tree has {tree.num_nodes} nodes; "
            "expected 1 + n rows (the last committed token, then one per node)")
    if probs is not None and (not isinstance(probs, torch.Tensor) or probs.shape != logits.shape):
        raise ValueError(
            f"probs must match logits' shape {tuple(logits.shape)} or be None, got {_shape(probs)}")
    vocab_size = int(logits.shape[1])
    tree.validate(vocab_size=vocab_size)
    return vocab_size


def batch_form(results: list[VerifyResult]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad per-request results into ``(accepted [B, Dmax], tokens [B, Dmax + 1])`` int64, -1 = pad.

    Example: accepted [[0, 2], []] -> [[0, 2], [-1, -1]]; tokens [[5, 6, 7], [9]] ->
    [[5, 6, 7], [9, -1, -1]].
    """
    dmax = max((len(r.accepted) for r in results), default=0)
    accepted = torch.full((len(results), dmax), -1, dtype=torch.int64)
    tokens = torch.full((len(results), dmax + 1), -1, dtype=torch.int64)
    for b, r in enumerate(results):
        accepted[b, : len(r.accepted)] = torch.tensor(r.accepted, dtype=torch.int64)
        tokens[b, : len(r.tokens)] = torch.tensor(r.tokens, dtype=torch.int64)
    return accepted, tokens


def _shape(x: object) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
