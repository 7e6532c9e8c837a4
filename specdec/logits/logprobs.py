"""Log-probabilities returned with tokens (``SamplingParams.logprobs`` / ``prompt_logprobs``): the
target's own log-softmax of the raw logits row that decided each token, before temperature,
penalties and constraints (vLLM's default "raw" logprobs).

Each row is reduced on its own (torch's ``log_softmax`` over the last dim), so a token's figures
do not depend on how many rows the step verified: with the row-invariant kernels a token gets the same
bits whether a drafter proposed it or plain decoding did.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.outputs import TokenLogprob


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """rows [N, V] raw logits; tokens [N] the token each row decided; k alternatives each.
    (The log-softmax runs over the rows at once: torch reduces each row alone, bitwise the
    same as one row at a time — tests/logits.)"""
    dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(rows.to(dtype), dim=-1)
    host = logp.cpu().numpy()
    out = []
    for i, token in enumerate(tokens):
        value = host[i, token]
        rank = int(np.count_nonzero(host[i] > value)) + 1
        top: tuple[tuple[int, float], ...] = ()
        if k:
            values, ids = torch.topk(logp[i], k)
            top = tuple(sorted(((int(j), float(v)) for j, v in zip(ids.tolist(),
                                                                  values.tolist())),
                               key=lambda x: (-x[1], x[0])))
        out.append(TokenLogprob(int(token), float(value), rank, top))
    return out
