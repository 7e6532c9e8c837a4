"""The MTP (Medusa-style) heads' loss: soft cross-entropy per head, weights decaying with distance.

Row p's head i predicts token p + 2 + i. Its label is the target's distribution at row p + 1 + i
over the draft vocabulary (renormalised), counted when token p + 2 + i is trained (assistant) and
the target's greedy token there is in the draft vocabulary. Loss = sum_i decay^i * CE_i.

Calibration (after training, on held-out sequences): for each head and rank r, how often the
head's rank-r draft is the target's greedy token (the token need not be in the draft
vocabulary), unconditionally and given that every head before it had the target's token among
its top ranks (the node's parent was right: what a tree node needs, since heads err together)
— the tables the drafter's tree shape is built from.
"""

from __future__ import annotations

import torch

from specdec.models.heads.mtp import MTPHeads
from specdec.training.target import (
    TargetBatch,
    at_least_fp32,
    conditional_rank_hits,
    label_ranks,
    shift,
    soft_terms,
)

RANKS = 8  # ranks calibrated per head (the widest a node's children get)


def mtp_loss(heads: MTPHeads, tb: TargetBatch, valid: torch.Tensor, loss_mask: torch.Tensor,
             decay: float) -> tuple[torch.Tensor, dict]:
    """(loss with grad, metrics: loss_i, acceptance_i, top1_i per head)."""
    x = tb.final.to(heads.lm_head.dtype)
    total = x.new_zeros(())
    metrics: dict = {}
    for i in range(heads.config.num_heads):
        keep = shift(loss_mask & valid, 2 + i, False) & shift(tb.in_vocab, 1 + i, False)
        bi, pi = keep.nonzero(as_tuple=True)
        logq = heads.compute_logits(heads.head(i, x[bi, pi]))
        logq = logq.to(at_least_fp32(logq.dtype)).log_softmax(-1)
        loss, acc, top1 = soft_terms(logq, tb.teacher[bi, pi + 1 + i])
        total = total + decay**i * loss
        metrics.update({f"loss_{i}": float(loss.detach()), f"acceptance_{i}": acc,
                        f"top1_{i}": top1})
    return total, metrics


@torch.no_grad()
def mtp_rank_hits(heads: MTPHeads, tb: TargetBatch, valid: torch.Tensor,
                  loss_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(hits [num_heads, RANKS], rows [num_heads], conditional hits, conditional rows) of one
    batch: the target's greedy token at rank r of head i's draft, over all rows and over the
    rows where heads 0..i-1 had theirs in their top RANKS (``conditional_rank_hits``)."""
    n = heads.config.num_heads
    x = tb.final.to(heads.lm_head.dtype)
    ranks = torch.full((n, *valid.shape), -1, dtype=torch.int64)
    kept = torch.zeros(n, *valid.shape, dtype=torch.bool)
    for i in range(n):
        keep = shift(loss_mask & valid, 2 + i, False)
        bi, pi = keep.nonzero(as_tuple=True)
        logits = heads.compute_logits(heads.head(i, x[bi, pi]))
        labels = heads.draft_index[tb.argmax[bi, pi + 1 + i].clamp_min(0)]
        ranks[i, bi.cpu(), pi.cpu()] = label_ranks(logits, labels, RANKS).cpu()
        kept[i] = keep.cpu()
    return conditional_rank_hits(ranks.flatten(1), kept.flatten(1), RANKS)
