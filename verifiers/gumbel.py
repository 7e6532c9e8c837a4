"""Lossless verification by per-position Gumbel-max: the default verifier.

A sampled token at position n is ``argmax p_n / E_n`` (the exponential race, i.e. the argmax of
log p_n plus Gumbel noise), with p_n the request's processed target distribution and E_n the Exp(1)
noise row of (seed, n) (``specdec.randomness``, stream SAMPLE). That is how plain sampling draws
its tokens, so verification only has to find, per logits row, the token that row would emit, and
keep the longest draft path that carries them: the greedy rule on perturbed argmaxes.

Why it is lossless, and more: the emitted tokens are exactly the tokens plain sampling with the
same seed emits, whatever the drafts were (a draft only decides how many of them one target
forward confirms), so a seed gives the same text with and without speculation, under any
controller, batch or drafter (bitwise where the logits are; in float32 up to near-ties of the
perturbed logits until kernels are row-invariant). Node x among the children of an accepted node
is accepted with probability p(x) (the children's tokens are distinct), i.e. Σ p(children): the
acceptance of the q = 1 multi-draft rule. Draft probabilities are not needed and not read.
A drafter that samples should draw its draft at position n with the same noise E_n
(``randomness.draw``): coupled drafts, accepted whenever draft and target race to the same token.
Where a drafter's q would be accepted more often by rejection sampling (1 - TV(p, q) per node
against roughly (1 - TV) / (1 + TV) for the coupled race), ``verifier="rejection"`` is the choice,
at the price of text that depends on the drafts (the distribution stays the target's).

Example: chain [7, 8]; rows emit (perturbed argmax) [7, 3, 5] -> accepted [0], tokens [7, 3].
"""

from __future__ import annotations

import torch

from specdec import randomness
from specdec.sampling import greedy
from specdec.verifiers.base import VerifyBatch, VerifyOutput
from specdec.verifiers.greedy import verify_targets


class GumbelVerifier:
    """Greedy requests take the argmax, sampled ones the argmax of p / E(seed, position)."""

    name = "gumbel"
    supports_sampling = True

    def verify(self, batch: VerifyBatch) -> VerifyOutput:
        return verify_targets(batch, row_targets(batch))


def row_targets(batch: VerifyBatch) -> torch.Tensor:
    """[cu_rows[-1]] int64: the token each logits row emits (argmax; for sampled requests the
    exponential race over their processed probabilities with their per-position noise)."""
    targets = greedy(batch.logits)
    sampled = [b for b, g in enumerate(batch.greedy) if not g]
    if not sampled:
        return targets
    rows, keys, key_of_row = [], {}, []
    positions = batch.row_positions()
    for b in sampled:
        for row in range(batch.cu_rows[b], batch.cu_rows[b + 1]):
            k = (batch.seeds[b], positions[row])
            rows.append(row)
            key_of_row.append(keys.setdefault(k, len(keys)))
    device = batch.logits.device
    noise = randomness.noise([randomness.key(s, n) for s, n in keys], batch.probs.shape[1],
                             device)
    index = torch.tensor(rows, device=device)
    p = batch.probs.index_select(0, index).to(torch.float64)
    e = noise.index_select(0, torch.tensor(key_of_row, device=device))
    targets[index] = greedy(p / e)
    return targets
