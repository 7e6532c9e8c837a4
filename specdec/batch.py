"""Pack one step's scheduled requests (prefill chunks, decode rows, draft trees) into model input.

Request with n tokens, num_computed c, fed the q = n - c tokens up to its frontier plus a draft
tree of m nodes: rows are tokens[c:n] then the tree nodes; KV slots c .. n+m-1 (node i in slot
n + i); positions c .. n-1 then n + depth(i). Its logits rows are the last committed token's row
and every node's row (1 + m rows, the verifier's input). A chunk that stops short of the
frontier needs no logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention.metadata import AttentionMetadata, build_metadata
from specdec.scheduler import ScheduledRequest
from specdec.tree import DraftTree, verify_mask


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_rows: torch.Tensor  # [R] int64: rows of the packed batch that need logits
    # per scheduled request: (start, end) into logits_rows, or None if it needs no logits
    logits_ranges: list[tuple[int, int] | None]
    row_starts: list[int]  # per scheduled request: its first row in the packed batch


def build_model_input(
    scheduled: list[ScheduledRequest],
    trees: list[DraftTree | None],
    page_size: int,
    device,
) -> ModelInput:
    ids, pos, rows, ranges, starts = [], [], [], [], []
    tables, kv_lens, qo_lens, masks = [], [], [], []
    offset = 0
    for req, tree in zip(scheduled, trees):
        seq, c = req.seq, req.seq.num_computed
        end = c + req.num_new_tokens
        m = tree.num_nodes if tree is not None else 0
        ids.extend(seq.token_ids[c:end])
        pos.extend(range(c, end))
        if m:
            ids.extend(tree.tokens.tolist())
            pos.extend(tree.positions(end).tolist())
        q = req.num_new_tokens + m
        starts.append(offset)
        if req.at_frontier:
            ranges.append((len(rows), len(rows) + 1 + m))
            rows.extend(range(offset + req.num_new_tokens - 1, offset + q))
        else:
            ranges.append(None)
        tables.append(seq.block_table.pages)
        kv_lens.append(end + m)
        qo_lens.append(q)
        masks.append(_tree_rows_mask(tree, c, end) if m else None)
        offset += q
    metadata = build_metadata(tables, kv_lens, qo_lens, page_size, masks, device)
    as_long = dict(dtype=torch.int64, device=device)
    return ModelInput(
        torch.tensor(ids, **as_long), torch.tensor(pos, **as_long), metadata,
        torch.tensor(rows, **as_long), ranges, starts,
    )


def _tree_rows_mask(tree: DraftTree, computed: int, n: int) -> torch.Tensor:
    """[q + m, n + m] bool: causal rows for tokens[computed:n-1], then the verification rows."""
    tree_rows = verify_mask(tree, n)
    q = n - computed
    if q == 1:
        return tree_rows
    m = tree.num_nodes
    cols = torch.arange(n + m)
    causal = cols[None, :] <= torch.arange(computed, n - 1)[:, None]
    return torch.cat([causal, tree_rows])
