"""Pack one step's records (prefill chunks, decode rows, draft trees) into the target's batch.

Request with n tokens, num_computed c, fed the q = n - c tokens up to its frontier plus a draft
tree of m nodes: rows are tokens[c:n] then the tree nodes; KV slots c .. n+m-1 (node i in slot
n + i); positions c .. n-1 then n + depth(i). Its logits rows are the last committed token's row
and every node's row (1 + m rows, the verifier's input), stored back to back in request order.
A chunk that stops short of the frontier needs no logits. The records get their row offsets.

A request asking for its prompt's log-probabilities also gets, after every frontier row of the
step (so the verifier's rows stay first), the rows of its chunk that decide prompt tokens:
position j's row decides token j + 1, for j + 1 < the prompt's length (``prompt_rows``).
"""

from __future__ import annotations

from specdec.attention.metadata import TreeRowsMask, build_metadata, host_tensor
from specdec.engine.cuda_graphs import CudaGraphRunner
from specdec.engine.runner import ForwardBatch
from specdec.engine.step import StepRequest
from specdec.tree import step_mask


def build_forward_batch(records: list[StepRequest], page_size: int, device,
                        graphs: CudaGraphRunner | None = None) -> ForwardBatch:
    """``graphs``: the target runner's CUDA graphs, if on: a batch that fits a graph shape is
    padded to it here, on the lists (``CudaGraphRunner.padding``), rather than by the runner
    joining arrays (``pad_batch``): the same arrays, made once."""
    ids, pos, logit_rows = [], [], []
    tables, kv_lens, qo_lens, masks, prompt_rows = [], [], [], [], []
    device_ids, device_positions = [], []  # (row, device tensor): written there after staging
    clamp = False  # host ids of drafts not checked yet (DraftTree.checked_late)
    offset = 0
    for rec in records:
        seq, c = rec.seq, rec.computed_before
        end = c + rec.num_new_tokens
        ids.extend(seq.token_ids[c:end])
        pos.extend(range(c, end))
        nodes, mask = rec.num_nodes, None  # (read once: properties of the record's tree)
        if nodes:
            tree = rec.tree
            if tree.tokens_on_host:
                ids.extend(tree.token_list)
                clamp = clamp or tree.checked_late
            else:  # drafts still on the device: written there over placeholders (no read)
                device_ids.append((len(ids), tree.tokens))
                ids.extend([0] * nodes)
            if tree.shape_on_host:
                pos.extend(tree.position_list(end))
            else:  # a shape on the device: its depths computed there
                device_positions.append((len(pos), tree.depths + end))
                pos.extend([0] * nodes)
            mask = _mask(tree, c, end)
        rows = rec.num_new_tokens + nodes  # (rec.num_rows)
        rec.row_start = offset
        if rec.at_frontier:
            rec.logits_start = len(logit_rows)
            logit_rows.extend(range(offset + rec.num_new_tokens - 1, offset + rows))
        tables.append(seq.block_table.pages)
        kv_lens.append(end + nodes)
        qo_lens.append(rows)
        masks.append(mask)
        if seq.needs_prompt_rows:
            last = min(end, seq.num_prompt_tokens - 1)  # rows c .. last - 1
            if last > c:
                prompt_rows.append((rec, offset, c, last - c))
        offset += rows
    for rec, row, first, n in prompt_rows:
        rec.prompt_rows = (len(logit_rows), first, n)
        logit_rows.extend(range(row, row + n))
    padded = None if graphs is None else graphs.padding(qo_lens, masks, offset)
    if padded is not None:  # dummy requests (token 0, position 0) over the scratch pages
        shape, rows = padded
        tables += [graphs.scratch] * len(rows)
        kv_lens += rows
        qo_lens += rows
        masks += [None] * len(rows)
        ids += [0] * (shape.num_rows - offset)
        pos += [0] * (shape.num_rows - offset)
    metadata = build_metadata(tables, kv_lens, qo_lens, page_size, masks, device)
    ids, pos, logit_rows = (host_tensor(v) for v in (ids, pos, logit_rows))
    # host arrays: the runner stages them
    return ForwardBatch(ids, pos, metadata, logit_rows,
                        graph_shape=None if padded is None else padded[0], num_real_rows=offset,
                        device_ids=tuple(device_ids), device_positions=tuple(device_positions),
                        clamp_ids=clamp)


def _mask(tree, c: int, end: int):
    """The attention mask of a request fed tokens c .. end - 1 and a draft tree: None for a
    chain (its rows attend as causal rows do), a host mask for a shape the host knows, else
    the tree's rows with their tree part on the device (``TreeRowsMask``: nothing read)."""
    if not tree.shape_on_host:
        return TreeRowsMask(end - c, end, tree.ancestor_mask)
    return None if tree.is_chain else step_mask(tree, c, end)
