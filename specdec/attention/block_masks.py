"""Attention masks of block-diffusion drafters: a block of rows that sees the context strictly
before it and itself non-causally (inference: ``block_mask``; training, many blocks per
sequence: ``anchor_blocks_mask``). Tree masks stay in ``specdec/tree.py``."""

from __future__ import annotations

import torch

from specdec.tree import causal_mask


def block_mask(prefix_len: int, num_context: int, block_size: int) -> torch.Tensor:
    """[num_context + block_size, prefix_len + num_context + block_size] bool: one request's
    rows in a block-diffusion step, over ``prefix_len`` cached slots, then its new context rows,
    then its block rows. Context rows are causal; block rows see every context slot (all of
    them are strictly before the block) and every block row (non-causal). Example, prefix 1,
    1 context row, block 2::

        1 1 | 0 0        context row
        1 1 | 1 1        block row 0 (the last committed token)
        1 1 | 1 1        block row 1 (MASK)
    """
    kv = prefix_len + num_context + block_size
    mask = torch.ones(num_context + block_size, kv, dtype=torch.bool)
    mask[:num_context] = False
    mask[:num_context, :prefix_len + num_context] = causal_mask(num_context,
                                                                prefix_len + num_context)
    return mask


def anchor_blocks_mask(seq_len: int, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, S + A*K, S + A*K] bool (K = block_size): the training layout of block diffusion.

    Per sequence: S context rows (row j: position j), then A blocks of K rows, block a anchored
    at position ``anchors[b, a]`` (its rows are positions anchor .. anchor + K - 1). A context
    row sees only itself (its output is unused); a block row sees the context rows strictly
    before its anchor and every row of its own block — exactly what ``block_mask`` gives the
    block at inference, where the anchor is the last committed token. ``anchors`` [B, A] int64
    (an anchor of 0 sees no context). Example, S 3, one anchor at 2, K 2::

        1 0 0 | 0 0
        0 1 0 | 0 0
        0 0 1 | 0 0
        1 1 0 | 1 1
        1 1 0 | 1 1
    """
    b, a = anchors.shape
    k = block_size
    n = seq_len + a * k
    dev = anchors.device
    mask = torch.zeros(b, n, n, dtype=torch.bool, device=dev)
    mask[:, :seq_len, :seq_len] = torch.eye(seq_len, dtype=torch.bool, device=dev)
    cols = torch.arange(seq_len, device=dev)
    ctx = cols[None, None, :] < anchors[:, :, None]  # [B, A, S]
    mask[:, seq_len:, :seq_len] = ctx.repeat_interleave(k, dim=1)
    block = torch.arange(a, device=dev).repeat_interleave(k)
    mask[:, seq_len:, seq_len:] = block[:, None] == block[None, :]
    return mask
