"""Verifier protocol and its batch-flat payloads (in the manner of vLLM's SpecDecodeMetadata).

One call per step verifies every request at its decode frontier. Request b has a tree of n_b
nodes (0 for a plain decode row) and 1 + n_b logits rows, stored back to back::

    cu_rows = [0, 1 + n_0, 1 + n_0 + 1 + n_1, ...]                     # [B + 1]
    logits[cu_rows[b]]          target distribution of request b's first draft depth
    logits[cu_rows[b] + 1 + i]  target distribution of the token after node i

``probs`` has the same rows after the request's temperature / top-k / top-p / min-p (None when
every request is greedy; rows of greedy requests are then unused). Draft probabilities travel
with each tree (``DraftTree.draft_probs``, None for deterministic drafts).

Randomness is per position (``specdec.randomness``): request b's first logits row decides the
token at position ``positions[b]`` (its index in prompt + output), the row after node i the token
at ``positions[b] + depth(i) + 1``; a verifier draws what it needs from (``seeds[b]``, position,
stream), never from a stream whose consumption depends on the tree or the batch.

The output is padded with -1: ``accepted[b, :k_b]`` are the accepted node indices (a root-to-leaf
path prefix, in depth order) and ``tokens[b, :k_b + 1]`` the emitted tokens (the accepted nodes'
tokens, then one corrected or bonus token). Example, B = 2: request 0 chain [7, 8, 9] with target
argmax [7, 8, 4, 2], request 1 plain with argmax [5]::

    accepted = [[0, 1], [-1, -1]]       tokens = [[7, 8, 4], [5, -1, -1]]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from specdec.tree import DraftTree


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host (itself if it is there)."""
    return t if t.is_cpu else t.cpu()


@dataclass
class VerifyBatch:
    trees: list[DraftTree]  # one per request; num_nodes 0 for plain rows
    cu_rows: list[int]  # [B + 1] cumulative 1 + n_b (host ints: the layout is known on the host)
    logits: torch.Tensor  # [cu_rows[-1], V] float target logits
    probs: torch.Tensor | None  # [cu_rows[-1], V] float processed target probs, or None
    greedy: list[bool]  # [B] request decodes greedily
    seeds: list[int | None]  # [B] each sampled request's seed (None for greedy requests)
    positions: list[int]  # [B] position of the first token each request emits this step
    # how a verifier reads a device tensor to the host: the engine counts these reads (one a
    # step is the aim: the rows' target tokens); a plain copy by default
    to_host: Callable[[torch.Tensor], torch.Tensor] = field(default=host_copy, repr=False)

    @property
    def batch_size(self) -> int:
        return len(self.trees)

    def select(self, index: list[int]) -> VerifyBatch:
        """The sub-batch of requests ``index`` (in that order)."""
        rows = torch.cat([torch.arange(self.cu_rows[b], self.cu_rows[b + 1]) for b in index])
        rows = rows.to(self.logits.device)
        cu = [0]
        for b in index:
            cu.append(cu[-1] + self.cu_rows[b + 1] - self.cu_rows[b])
        return VerifyBatch(
            [self.trees[b] for b in index], cu, self.logits.index_select(0, rows),
            None if self.probs is None else self.probs.index_select(0, rows),
            [self.greedy[b] for b in index], [self.seeds[b] for b in index],
            [self.positions[b] for b in index], self.to_host)

    def row_positions(self) -> list[int]:
        """[cu_rows[-1]] the position of the token each logits row decides (host ints)."""
        out = []
        for tree, start in zip(self.trees, self.positions):
            out.append(start)
            out.extend(start + 1 + d for d in tree.depths.tolist())
        return out


@dataclass
class VerifyOutput:
    accepted: torch.Tensor  # [B, D] int64 accepted node indices, -1 padded (D >= max k_b)
    tokens: torch.Tensor  # [B, D + 1] int64 emitted tokens, -1 padded
    num_accepted: torch.Tensor  # [B] int64 k_b

    @classmethod
    def from_results(cls, results: list[VerifyResult], depth: int) -> VerifyOutput:
        """The output of host results (D = ``depth``, at least every result's accepted
        length): a VerifyOutput whose padded tensors are made from the results the first time
        a field is read or set (``_HostResults``); until then ``to_results`` hands the results
        back. A verifier that walks its trees on the host (``greedy.host_walk``) and the
        engine, which wants host results, skip the round trip through tensors: a tensor, its
        view and three column slices made and read back with three ``tolist`` every step,
        ~8 us of a batch-1 step on the host (~14 us within a step, cold: 2026-12-06 host
        overhead results)."""
        return _HostResults(list(results), depth)

    def to_results(self, to_host: Callable[[torch.Tensor], torch.Tensor] = None
                   ) -> list[VerifyResult]:
        """Per-request host lists (on a device: one copy, through ``to_host``)."""
        acc, tok, k = self.accepted, self.tokens, self.num_accepted
        if not acc.is_cpu:
            b, d = acc.shape
            flat = (to_host or host_copy)(torch.cat([acc, tok, k[:, None]], dim=1))
            acc, tok, k = flat[:, :d], flat[:, d:2 * d + 1], flat[:, -1]
        acc, tok, k = acc.tolist(), tok.tolist(), k.tolist()
        return [VerifyResult(a[:n], t[:n + 1]) for a, t, n in zip(acc, tok, k)]

    @staticmethod
    def merge(parts: list[tuple[list[int], VerifyOutput]], batch_size: int) -> VerifyOutput:
        """Outputs of sub-batches (each with the request indices it covers) as one output."""
        d = max((p.accepted.shape[1] for _, p in parts), default=0)
        device = parts[0][1].accepted.device if parts else "cpu"
        accepted = torch.full((batch_size, d), -1, dtype=torch.int64, device=device)
        tokens = torch.full((batch_size, d + 1), -1, dtype=torch.int64, device=device)
        num = torch.zeros(batch_size, dtype=torch.int64, device=device)
        for index, p in parts:
            idx = torch.tensor(index, device=device)
            accepted[idx, :p.accepted.shape[1]] = p.accepted
            tokens[idx, :p.tokens.shape[1]] = p.tokens
            num[idx] = p.num_accepted
        return VerifyOutput(accepted, tokens, num)


def _padded_tensors(results: list[VerifyResult], d: int) -> list[torch.Tensor]:
    """[accepted [B, d], tokens [B, d + 1], num_accepted [B]] of host results, -1 padded, made
    in one tensor op."""
    rows = [r.accepted + [-1] * (d - len(r.accepted)) + r.tokens
            + [-1] * (d + 1 - len(r.tokens)) + [len(r.accepted)] for r in results]
    flat = torch.tensor(rows, dtype=torch.int64).view(len(results), 2 * d + 2)
    return [flat[:, :d], flat[:, d:2 * d + 1], flat[:, -1]]


def _tensor_field(i: int, doc: str) -> property:
    """Field ``i`` of a ``_HostResults``: its tensors are made on first use, read or set."""
    def get(self) -> torch.Tensor:
        return self._made()[i]

    def set_(self, value: torch.Tensor) -> None:
        self._made()[i] = value

    return property(get, set_, doc=doc)


class _HostResults(VerifyOutput):
    """``VerifyOutput.from_results``: a VerifyOutput like any other (the same fields, equal to
    the eager tensors, settable), whose tensors are made on first use. Until a field is used,
    the results are the output and ``to_results`` returns them (the same VerifyResult objects,
    in a new list); once one is, the tensors are the output, as for any VerifyOutput, and
    ``to_results`` reads them (a verifier that edits them after ``from_results`` gets its
    edits verified)."""

    def __init__(self, results: list[VerifyResult], depth: int) -> None:
        # (not the dataclass __init__: the fields are the properties below)
        self._results, self._depth = results, depth
        self._tensors: list[torch.Tensor] | None = None

    accepted = _tensor_field(0, "[B, D] int64 accepted node indices, -1 padded")
    tokens = _tensor_field(1, "[B, D + 1] int64 emitted tokens, -1 padded")
    num_accepted = _tensor_field(2, "[B] int64 k_b")

    def _made(self) -> list[torch.Tensor]:
        if self._tensors is None:
            self._tensors = _padded_tensors(self._results, self._depth)
        return self._tensors

    def to_results(self, to_host: Callable[[torch.Tensor], torch.Tensor] = None
                   ) -> list[VerifyResult]:
        if self._tensors is None:  # no field used: the results are the output (host lists)
            return list(self._results)
        return super().to_results(to_host)


@dataclass
class VerifyResult:
    """What one request keeps from one verification (host form).

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
    supports_sampling: bool  # False: the engine refuses sampled requests with this verifier

    def verify(self, batch: VerifyBatch) -> VerifyOutput:
        """Verify every request of the step at once (see the module docstring)."""
        ...


def check_batch(batch: VerifyBatch) -> None:
    """Validate a batch's layout (for direct callers and tests; the engine builds it right)."""
    b = batch.batch_size
    if len(batch.cu_rows) != b + 1 or any(len(x) != b for x in (batch.greedy, batch.seeds,
                                                                 batch.positions)):
        raise ValueError(f"cu_rows needs B + 1 = {b + 1} entries and greedy/seeds/positions B")
    for i, tree in enumerate(batch.trees):
        if batch.cu_rows[i + 1] - batch.cu_rows[i] != tree.num_nodes + 1:
            raise ValueError(
                f"request {i}: {batch.cu_rows[i + 1] - batch.cu_rows[i]} logits rows but its "
                f"tree has {tree.num_nodes} nodes; expected 1 + n rows")
    if batch.logits.dim() != 2 or batch.logits.shape[0] != batch.cu_rows[-1]:
        raise ValueError(f"logits must be [{batch.cu_rows[-1]}, V], got "
                         f"{tuple(batch.logits.shape)}")
    if batch.probs is not None and batch.probs.shape != batch.logits.shape:
        raise ValueError(f"probs must match logits' shape {tuple(batch.logits.shape)}")
    if batch.probs is None and not all(batch.greedy):
        raise ValueError("probs are required when a request samples (greedy False)")
    for i, (g, seed) in enumerate(zip(batch.greedy, batch.seeds)):
        if not g and not (isinstance(seed, int) and 0 <= seed < 2**63):
            raise ValueError(f"request {i} samples but its seed is {seed!r}: sampled requests "
                             "need an int seed in [0, 2^63)")


def single(tree: DraftTree, logits: torch.Tensor, probs: torch.Tensor | None = None,
           seed: int | None = None, position: int = 0) -> VerifyBatch:
    """A batch of one request (tests, and callers verifying one tree); sampled iff probs."""
    return VerifyBatch([tree], [0, tree.num_nodes + 1], logits, probs, [probs is None],
                       [seed], [position])
