"""Log-probabilities returned with tokens (``SamplingParams.logprobs`` / ``prompt_logprobs``): the
target's own log-softmax of the raw logits row that decided each token, before temperature,
penalties and constraints (vLLM's default "raw" logprobs).

Each row is reduced on its own (``log_softmax`` over one row), so a token's figures do not
depend on how many rows the step verified: with the row-invariant kernels a token gets the same
bits whether a drafter proposed it or plain decoding did.
"""

from __future__ import annotations

import torch

from specdec.outputs import TokenLogprob


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """rows [N, V] raw logits; tokens [N] the token each row decided; k alternatives each."""
    out = []
    for row, token in zip(rows, tokens):
        logp = torch.log_softmax(row.unsqueeze(0).to(torch.float64 if row.dtype == torch.float64
                                                      else torch.float32), dim=-1)[0]
        value = logp[token]
        rank = int((logp > value).sum()) + 1
        top: tuple[tuple[int, float], ...] = ()
        if k:
            values, ids = torch.topk(logp, k)
            top = tuple(sorted(((int(i), float(v)) for i, v in zip(ids.tolist(),
                                                                  values.tolist())),
                               key=lambda x: (-x[1], x[0])))
        out.append(TokenLogprob(int(token), float(value), rank, top))
    return out
