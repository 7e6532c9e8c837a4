"""What the frozen target gives a training batch, and the loss terms every drafter kind shares.

One teacher-forced target forward (no grad) per batch gives the captured layers' states, the
final-normed states, and, on the rows whose next token is trained, the target's distribution over
the draft vocabulary (renormalised) and its greedy token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.models.decoder.llama import LlamaDecoder

METRIC_STRIDE = 4  # acceptance / top-1 are estimated on every 4th counted row (they cost)


@dataclass
class TargetBatch:
    """What the frozen target gives a batch (computed without grad)."""

    aux: torch.Tensor | None  # [B, S, n * H] the captured layers' states, in capture order
    final: torch.Tensor  # [B, S, H] final-normed states (what the LM head reads)
    teacher: torch.Tensor | None  # [B, S, Vd] probabilities over the draft vocab; 0 off rows
    in_vocab: torch.Tensor  # [B, S] bool: the target's argmax at that row is a draft token
    argmax: torch.Tensor  # [B, S] int64 target ids: its greedy token (-1 off rows)


@torch.no_grad()
def target_batch(target: LlamaDecoder, capture: tuple[int, ...], used: torch.Tensor,
                 input_ids: torch.Tensor, valid: torch.Tensor,
                 loss_mask: torch.Tensor | None = None, teacher: bool = True,
                 chunk: int = 1024) -> TargetBatch:
    """Teacher-forced target features; ``used`` [Vd]: the draft vocabulary's target ids.

    The teacher at row r is a label only when token r + 1 is trained (``loss_mask``), so the
    target's LM head (a fifth of its work, at the full vocabulary) runs on those rows only;
    elsewhere ``teacher`` is 0, ``in_vocab`` False and ``argmax`` -1. Without ``loss_mask``:
    every valid row. ``teacher=False`` skips the distribution (argmax and in_vocab stay)."""
    out = target.forward_dense(input_ids, valid, capture_layers=capture)
    aux = torch.cat([out.layer_hidden[c] for c in capture], dim=-1) if capture else None
    b, s = input_ids.shape
    in_draft = torch.zeros(target.cfg.vocab_size, dtype=torch.bool, device=input_ids.device)
    in_draft[used] = True
    need = shift(loss_mask & valid, 1, False) if loss_mask is not None else valid
    rows = need.reshape(-1).nonzero().squeeze(1)
    flat = out.hidden.reshape(-1, out.hidden.shape[-1]).index_select(0, rows)
    probs = (torch.zeros(b * s, used.numel(), dtype=at_least_fp32(out.hidden.dtype),
                         device=input_ids.device) if teacher else None)
    argmax = torch.full((b * s,), -1, dtype=torch.int64, device=input_ids.device)
    for part, hidden in zip(rows.split(chunk), flat.split(chunk)):
        logits = target.compute_logits(hidden)  # full vocabulary, one chunk at a time
        argmax[part] = logits.argmax(-1)
        if probs is not None:
            probs[part] = logits.index_select(-1, used).to(probs.dtype).softmax(-1)
    in_vocab = (argmax >= 0) & in_draft[argmax.clamp_min(0)]
    return TargetBatch(aux, out.hidden, None if probs is None else probs.view(b, s, -1),
                       in_vocab.view(b, s), argmax.view(b, s))


def soft_terms(logq: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """(soft cross-entropy, acceptance estimate sum(min(p, q)), top-1 agreement) of rows with
    draft log-probs ``logq`` and teacher probabilities ``p``."""
    if logq.shape[0] == 0:
        return logq.sum() * 0.0, 0.0, 0.0
    loss = -(p * logq).sum(-1).mean()
    with torch.no_grad():
        lq, pp = logq[::METRIC_STRIDE], p[::METRIC_STRIDE]
        acc = float(torch.minimum(pp, lq.exp()).sum(-1).mean())
        top1 = float((lq.argmax(-1) == pp.argmax(-1)).float().mean())
    return loss, acc, top1


def label_ranks(logits: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """[R] int64: the rank of each row's label among its top k logits, -1 if not there (or a
    -1 label)."""
    top = logits.topk(min(k, logits.shape[-1]), dim=-1).indices
    hit = (top == labels[:, None]) & (labels[:, None] >= 0)
    return torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(labels, -1))


def conditional_rank_hits(ranks: torch.Tensor, kept: torch.Tensor,
                          k: int) -> tuple[torch.Tensor, ...]:
    """ranks [D, N] (depth d's rank of the target's token at row n, -1: not in the top k),
    kept [D, N] (row n counts at depth d) -> (hits [D, k], rows [D]) over the kept rows,
    and the same over the kept rows whose depths 0..d-1 all had the token (rank >= 0)."""
    d = ranks.shape[0]
    hits = torch.zeros(d, k, dtype=torch.int64)
    rows = kept.sum(1).to(torch.int64)
    cond_hits = torch.zeros(d, k, dtype=torch.int64)
    cond_rows = torch.zeros(d, dtype=torch.int64)
    right_above = torch.ones(ranks.shape[1], dtype=torch.bool)
    for i in range(d):
        given = kept[i] & right_above
        for r in range(k):
            hits[i, r] = int((kept[i] & (ranks[i] == r)).sum())
            cond_hits[i, r] = int((given & (ranks[i] == r)).sum())
        cond_rows[i] = int(given.sum())
        right_above = right_above & (ranks[i] >= 0)
    return hits, rows, cond_hits, cond_rows


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def shift(x: torch.Tensor, k: int, fill) -> torch.Tensor:
    """x [B, S, ...] shifted left by k along S (row p gets row p + k), padded with ``fill``."""
    out = torch.full_like(x, fill)
    if k < x.shape[1]:
        out[:, :x.shape[1] - k] = x[:, k:]
    return out
