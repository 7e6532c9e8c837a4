"""EAGLE-3 training-time test (TTT): the head unrolled on its own outputs, as it drafts.

At inference a head row at tree level j sits at position p + j, reads its parent's output as its
feature and attends to the true-feature rows 0..p and to its own ancestors. Training reproduces
exactly that for every position p of a sequence at once: step 0 is the head over the target's
fused features (row p: feature of token p, embedding of token p + 1, position p); step j feeds
step j - 1's outputs back as features, the embeddings shifted by j, positions + j; a step-j row
attends to step 0's rows causally and to steps 1..j at its own row only (``TTTAttention``).

Row p at step j predicts token p + 2 + j, whose target distribution is the target's logits at
row p + 1 + j restricted to the draft vocabulary (renormalised); it counts when that token is a
trained (assistant) token and the target's argmax there is in the draft vocabulary (SpecForge's
position mask). Loss = sum_j 0.8^j * soft cross-entropy_j. Acceptance estimate per step:
sum(min(p, q)) over the draft vocabulary (the rejection-sampling acceptance probability).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.models.decoder.llama import LlamaDecoder
from specdec.models.heads.eagle3 import Eagle3Head
from specdec.training.target import TargetBatch, at_least_fp32, shift, soft_terms
from specdec.training.target import target_batch as _target_batch
from specdec.tree import causal_mask


class TTTAttention:
    """Dense attention across TTT steps; keeps every step's K/V (with their graph).

    Mask of step j over [step 0 | step 1 | ... | step j] keys (S rows each; B 1, S 3, j 1)::

        1 0 0 | 1 0 0
        1 1 0 | 0 1 0
        1 1 1 | 0 0 1
    """

    name = "ttt"

    def __init__(self, valid: torch.Tensor) -> None:
        """valid [B, S] bool: real tokens (padding keys are never attended, except by
        padding rows themselves, to keep rows finite)."""
        self.batch, self.seq = valid.shape
        s = self.seq
        eye = torch.eye(s, dtype=torch.bool, device=valid.device)
        self.first = (causal_mask(s, s, valid.device)[None] & valid[:, None, :]) | eye
        self.eye = eye.expand(self.batch, s, s)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def plan(self, metadata) -> None:
        return None

    def run(self, q, k, v, kv_layer, scale: float) -> torch.Tensor:
        b, s = self.batch, self.seq

        def heads(x):
            return x.view(b, s, x.shape[-2], x.shape[-1]).transpose(1, 2)

        self.keys.append(heads(k))
        self.values.append(heads(v))
        mask = torch.cat([self.first, *[self.eye] * (len(self.keys) - 1)], dim=-1)
        out = F.scaled_dot_product_attention(
            heads(q), torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2),
            attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * s, q.shape[-2], q.shape[-1])


def target_batch(target: LlamaDecoder, head: Eagle3Head, input_ids: torch.Tensor,
                 valid: torch.Tensor, loss_mask: torch.Tensor | None = None) -> TargetBatch:
    """The target's features and teacher for an EAGLE-3 head (its aux layers, its vocabulary);
    see ``specdec.training.target.target_batch``."""
    used = head.d2t + torch.arange(head.d2t.numel(), device=head.d2t.device)
    return _target_batch(target, head.config.capture_layers, used, input_ids, valid, loss_mask)


@dataclass
class TTTResult:
    loss: torch.Tensor  # scalar, with grad
    step_loss: list[float]  # per TTT step
    step_acceptance: list[float]  # per TTT step: mean sum(min(p, q)) over counted rows
    step_top1: list[float]  # per TTT step: draft argmax == teacher argmax
    num_rows: list[int]  # counted rows per step


def ttt_loss(head: Eagle3Head, input_ids: torch.Tensor, valid: torch.Tensor,
             loss_mask: torch.Tensor, tb: TargetBatch, steps: int,
             decay: float = 0.8) -> TTTResult:
    """The weighted soft cross-entropy over ``steps`` TTT steps (see the module docstring).

    input_ids, valid, loss_mask: [B, S]; positions count real tokens (right padding). The
    head's LM head runs only on the rows that count at each step.
    """
    b, s = input_ids.shape
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    backend = TTTAttention(valid)
    feat = head.fuse(tb.aux.reshape(b * s, -1).to(head.fc.dtype))
    total = feat.new_zeros(())
    res = TTTResult(total, [], [], [], [])
    for j in range(steps):
        ids = shift(input_ids, 1 + j, 0)
        pos = (positions + j).clamp(max=head.rope.cos.shape[0] - 1).reshape(-1)
        y = head(ids.reshape(-1), pos, backend, None, features=feat).hidden
        keep = (shift(loss_mask & valid, 2 + j, False) & shift(tb.in_vocab, 1 + j, False))
        bi, pi = keep.nonzero(as_tuple=True)
        logq = head.compute_logits(y.index_select(0, bi * s + pi))
        logq = logq.to(at_least_fp32(logq.dtype)).log_softmax(-1)
        step_loss, acc, top1 = soft_terms(logq, tb.teacher[bi, pi + 1 + j])
        total = total + decay**j * step_loss
        res.step_loss.append(float(step_loss.detach()))
        res.step_acceptance.append(acc)
        res.step_top1.append(top1)
        res.num_rows.append(int(bi.numel()))
        feat = y
    res.loss = total
    return res
