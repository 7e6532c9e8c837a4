"""The block-diffusion drafter's loss (DFlash's recipe) and its calibration.

Per sequence, ``num_anchors`` random anchor positions t (t >= 1, token t + 1 trained). The block
of anchor t is ``[token t, MASK_1 .. MASK_{B-1}]`` at positions t .. t+B-1, each row's input
plus the fused state of position t - 1; its context is the fused target features of positions
< t (strictly before the anchor, as at inference, where the anchor is the last committed token
and has no features yet); block row k (1 .. B-1) is labelled with
the data token t + k (the target's own answer under self-distillation), counted when it is a
trained token in the draft vocabulary. All anchors of a batch run in one forward with the dense
mask ``tree.anchor_blocks_mask``. Loss = sum_k exp(-(k-1)/gamma) * CE_k (mean over the counted
rows of position k).

Metrics: top-1 accuracy by position and ``tau_chain`` = 1 + the mean number of leading block
positions a chain of top-1 drafts gets right (what greedy verification would accept).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdec.attention.block_masks import anchor_blocks_mask
from specdec.attention.dense import DenseAttention
from specdec.models.heads.block_diffusion import BlockDiffusionModel
from specdec.training.target import TargetBatch, conditional_rank_hits, label_ranks

RANKS = 8  # ranks calibrated per block position


def sample_anchors(valid: torch.Tensor, loss_mask: torch.Tensor,
                   num_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, A] int64 sorted, ok [B, A] bool): up to A distinct positions t per sequence
    with t >= 1 and token t + 1 trained, drawn uniformly (torch's RNG); missing ones are 0 and
    not ok."""
    b, s = valid.shape
    eligible = torch.zeros_like(valid)
    eligible[:, 1:s - 1] = valid[:, 1:s - 1] & loss_mask[:, 2:] & valid[:, 2:]
    anchors = torch.zeros(b, num_anchors, dtype=torch.int64, device=valid.device)
    ok = torch.zeros(b, num_anchors, dtype=torch.bool, device=valid.device)
    for i in range(b):
        pos = eligible[i].nonzero().squeeze(1)
        pick = pos[torch.randperm(pos.numel())[:num_anchors].to(pos.device)].sort().values
        anchors[i, :pick.numel()] = pick
        ok[i, :pick.numel()] = True
    return anchors, ok


def block_forward(model: BlockDiffusionModel, tb: TargetBatch, input_ids: torch.Tensor,
                  anchors: torch.Tensor) -> torch.Tensor:
    """Final-normed states of every block row: [B, A, K, H] (K = block size)."""
    c = model.config
    b, s = input_ids.shape
    a, k, h = anchors.shape[1], c.block_size, c.hidden_size
    dev = input_ids.device
    ctx = model.fuse(tb.aux.reshape(b * s, -1).to(model.fc.dtype)).view(b, s, h)
    block_ids = torch.tensor([0] + [c.mask_id(j) for j in range(1, k)], device=dev)
    block_ids = block_ids.repeat(b, a, 1)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    ids = torch.cat([torch.zeros(b, s, dtype=torch.int64, device=dev),
                     block_ids.view(b, a * k)], dim=1)
    positions = torch.cat([torch.arange(s, device=dev).expand(b, s),
                           (anchors[:, :, None] + torch.arange(k, device=dev)).view(b, a * k)],
                          dim=1).clamp(max=model.rope.cos.shape[0] - 1)
    # block rows carry the fused state of the anchor's predecessor (position anchor - 1)
    last = ctx.gather(1, (anchors - 1).clamp_min(0)[:, :, None].expand(b, a, h))
    features = torch.cat([ctx, last.repeat_interleave(k, dim=1)], dim=1)
    context_rows = torch.zeros(b, s + a * k, dtype=torch.bool, device=dev)
    context_rows[:, :s] = True
    backend = DenseAttention(anchor_blocks_mask(s, anchors, k))
    out = model(ids.reshape(-1), positions.reshape(-1), backend, None,
                features=features.reshape(b * (s + a * k), h),
                context_rows=context_rows.reshape(-1))
    return out.hidden.view(b, s + a * k, h)[:, s:].view(b, a, k, h)


def _labels(input_ids, valid, loss_mask, anchors, ok, k: int) -> torch.Tensor:
    """[B, A, K-1] target ids of block positions 1 .. K-1 (-1: not a trained token)."""
    s = input_ids.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, k, device=anchors.device)  # [B, A, K-1]
    inside = pos < s
    pos = pos.clamp(max=s - 1)
    label = input_ids.gather(1, pos.flatten(1)).view_as(pos)
    counted = (inside & ok[:, :, None] & valid.gather(1, pos.flatten(1)).view_as(pos)
               & loss_mask.gather(1, pos.flatten(1)).view_as(pos))
    return torch.where(counted, label, torch.full_like(label, -1))


def block_loss(model: BlockDiffusionModel, tb: TargetBatch, input_ids: torch.Tensor,
               valid: torch.Tensor, loss_mask: torch.Tensor, num_anchors: int,
               gamma: float) -> tuple[torch.Tensor, dict]:
    """(loss with grad, metrics) of one batch; see the module docstring."""
    k = model.config.block_size
    anchors, ok = sample_anchors(valid, loss_mask, num_anchors)
    hidden = block_forward(model, tb, input_ids, anchors)[:, :, 1:]  # [B, A, K-1, H]
    labels = _labels(input_ids, valid, loss_mask, anchors, ok, k)
    draft = torch.where(labels >= 0, model.draft_index[labels.clamp_min(0)], -1)
    seen = labels >= 0
    rows = seen.nonzero(as_tuple=True)
    logits = model.compute_logits(hidden[rows])  # [n, Vd]
    target = draft[rows]
    depth = rows[2]
    ce = F.cross_entropy(logits, target.clamp_min(0), reduction="none")
    in_vocab = target >= 0
    total = logits.new_zeros(())
    metrics: dict = {}
    correct = torch.zeros_like(seen)
    with torch.no_grad():
        hit = (logits.argmax(-1) == target) & in_vocab
        correct[rows] = hit
    for j in range(k - 1):
        sel = (depth == j) & in_vocab
        if sel.any():
            total = total + math.exp(-j / gamma) * ce[sel].mean()
        metrics[f"top1_{j}"] = float(hit[depth == j].float().mean()) if (depth == j).any() else 0.0
    # leading correct positions of each anchor whose first label counts
    lead = correct.long().cumprod(-1).sum(-1)
    first = seen[:, :, 0]
    metrics["tau_chain"] = 1.0 + (float(lead[first].float().mean()) if first.any() else 0.0)
    return total, metrics


@torch.no_grad()
def block_rank_hits(model: BlockDiffusionModel, tb: TargetBatch, input_ids: torch.Tensor,
                    valid: torch.Tensor, loss_mask: torch.Tensor,
                    num_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits [K-1, RANKS], rows [K-1], conditional hits, conditional rows): the target's
    greedy token at block position k found at rank r of the drafter's distribution there (the
    verifier's acceptance criterion), over all anchors and over those whose earlier positions
    all had theirs in the top RANKS."""
    k = model.config.block_size
    anchors, ok = sample_anchors(valid, loss_mask, num_anchors)
    hidden = block_forward(model, tb, input_ids, anchors)[:, :, 1:]
    labels = _labels(input_ids, valid, loss_mask, anchors, ok, k)
    # the target's greedy token for position t + j is its argmax at row t + j - 1
    pos = (anchors[:, :, None] + torch.arange(k - 1, device=anchors.device)).clamp(
        max=input_ids.shape[1] - 1)
    greedy = tb.argmax.gather(1, pos.flatten(1)).view_as(pos)
    ranks = torch.full((k - 1, *anchors.shape), -1, dtype=torch.int64)
    kept = torch.zeros(k - 1, *anchors.shape, dtype=torch.bool)
    for j in range(k - 1):
        sel = (labels[:, :, j] >= 0) & (greedy[:, :, j] >= 0)
        logits = model.compute_logits(hidden[:, :, j][sel])
        target = model.draft_index[greedy[:, :, j][sel]]
        ranks[j][sel.cpu()] = label_ranks(logits, target, RANKS).cpu()
        kept[j] = sel.cpu()
    return conditional_rank_hits(ranks.flatten(1), kept.flatten(1), RANKS)
