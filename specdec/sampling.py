"""Turning logits into a sampling distribution, and drawing tokens from it.

Filtering follows vLLM / HF order: temperature, then top-k, then top-p (computed on the
distribution renormalised after top-k), then min-p, then renormalise. Drawing from the result is
``specdec.randomness.draw``: the exponential race with noise that is a function of the request's
seed and the token's position, so a seeded request gives the same tokens whatever batch it is in.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.sampling_params import SamplingParams

ParamTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def params_to_tensors(params: list[SamplingParams], device: torch.device | str) -> ParamTensors:
    """Per-row filter tensors for ``logits_to_probs``.

    Returns (temperature [N] float64, top_k [N] int64, top_p [N] float64, min_p [N] float64).
    Greedy rows get temperature 1.0: callers take their argmax separately, but the row must
    still be a valid input. float64 so that e.g. T=0.7 rounds exactly as the logits' dtype would.
    """
    temperature = [1.0 if p.greedy else float(p.temperature) for p in params]
    return (
        torch.tensor(temperature, dtype=torch.float64, device=device),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        torch.tensor([float(p.top_p) for p in params], dtype=torch.float64, device=device),
        torch.tensor([float(p.min_p) for p in params], dtype=torch.float64, device=device),
    )


def logits_to_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Filtered sampling distribution per row.

    logits [N, V] float (any dtype); temperature [N] float > 0; top_k [N] int (<= 0 = off);
    top_p [N] float in (0, 1] (1 = off); min_p [N] float in [0, 1] (0 = off).
    Returns probs [N, V]: float64 if logits are float64, else float32. Rows sum to 1.

    The sort is skipped when no row uses top-k or top-p, and min-p when no row uses it; deciding
    that costs one host sync, shared with the argument checks.
    """
    _check_filter_args(logits, temperature, top_k, top_p, min_p)
    use_k, use_p, use_min_p, bad = torch.stack([
        (top_k > 0).any(),
        (top_p < 1).any(),
        (min_p > 0).any(),
        # Written as "not in range" so NaN counts as bad.
        ~((temperature > 0).all() & (top_p > 0).all() & (top_p <= 1).all()
          & (min_p >= 0).all() & (min_p <= 1).all()),
    ]).tolist()
    if bad:
        raise ValueError("need temperature > 0, top_p in (0, 1] and min_p in [0, 1] for every row")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(dtype) / temperature.to(dtype).unsqueeze(-1)
    if use_k or use_p:
        x = x.masked_fill(_top_k_top_p_mask(x, top_k, top_p if use_p else None), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if use_min_p:
        probs = _apply_min_p(probs, min_p)
    return probs


def _check_filter_args(logits: torch.Tensor, *per_row: torch.Tensor) -> None:
    """ValueError unless logits is [N, V] floating point and every per-row tensor is [N]."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a [N, V] float tensor, got shape {tuple(logits.shape)} {logits.dtype}")
    n = logits.shape[0]
    for name, t in zip(("temperature", "top_k", "top_p", "min_p"), per_row):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape [{n}] (one per logits row), got {tuple(t.shape)}")


def _top_k_top_p_mask(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Boolean mask [N, V], True where a token is dropped by top-k and then top-p.

    x [N, V] tempered logits. Works in sorted order (descending, stable so that among equal
    logits the lower token id ranks first), so top-k keeps exactly k tokens even with ties.
    top-p keeps the smallest prefix whose probability (renormalised after top-k) reaches top_p,
    i.e. a token stays if the mass strictly before it is < top_p; the top token always stays.
    """
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    rank = torch.arange(x.shape[-1], device=x.device)
    k = torch.where(top_k > 0, top_k, x.shape[-1]).unsqueeze(-1)
    drop = rank >= k  # [N, V] in sorted order
    if top_p is not None:
        sorted_p = torch.softmax(sorted_x.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        # top_p == 1 must keep everything even if rounding pushes mass_before up to 1.
        p = top_p.to(x.dtype).unsqueeze(-1)
        drop |= (mass_before >= p) & (p < 1)
        drop[:, 0] = False  # a tiny top_p can round to 0 in float32
    return torch.empty_like(drop).scatter_(-1, order, drop)


def _apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens with prob < min_p * (row max prob) and renormalise. probs [N, V], min_p [N].

    The max token always survives since min_p <= 1.
    """
    threshold = min_p.to(probs.dtype).unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim: logits [..., V] -> [...] int64 (ties: lowest token id; a row
    with NaN: its first NaN, as torch.argmax).

    On the CPU numpy's argmax runs it (its SIMD loop: ~4 us a 49k-token row against torch's
    ~65 us, and torch's several-row CPU argmax is slower still, ~0.1-0.3 ms for a 5-row
    verification): a step of a small model pays it for every row it verifies."""
    if (logits.is_cpu and logits.dim() >= 1 and logits.shape[-1] > 0
            and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad):
        return torch.from_numpy(np.asarray(logits.numpy().argmax(axis=-1))).to(torch.int64)
    return logits.argmax(dim=-1)
