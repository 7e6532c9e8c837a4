"""The draft vocabulary, as EAGLE-3 builds it: the most frequent loss-masked target tokens of the
training data, and the maps between draft and target ids.

Example (target vocab 6, draft vocab 3, masked tokens 4 4 4 1 1 5):
    used = [1, 4, 5]                        ascending target ids
    d2t  = [1, 3, 3]                        offsets: target_id = i + d2t[i]
    t2d  = [F, T, F, F, T, T]               target id j is in the draft vocab
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch


def _masked_tokens(data: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The loss-masked ids of each example; an example is a mapping with input_ids and loss_mask
    (a row of `tokenize_all`'s dataset) or a pair (input_ids, loss_mask)."""
    for example in data:
        if isinstance(example, Mapping):
            ids, mask = example["input_ids"], example["loss_mask"]
        else:
            ids, mask = example
        ids = torch.as_tensor(ids, dtype=torch.int64)
        mask = torch.as_tensor(mask, dtype=torch.bool)
        if ids.shape != mask.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)} and loss_mask {tuple(mask.shape)} "
                             "must have the same shape")
        yield ids[mask]


def token_counts(data: Iterable[Any], target_vocab_size: int) -> torch.Tensor:
    """[target_vocab_size] int64: how often each target id is a loss-masked token."""
    counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    for ids in _masked_tokens(data):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size):
            raise ValueError(f"token id {int(ids.min())}..{int(ids.max())} is outside the target "
                             f"vocabulary 0..{target_vocab_size - 1} (target_vocab_size)")
        counts += torch.bincount(ids, minlength=target_vocab_size)
    return counts


def draft_vocab(data: Iterable[Any], draft_vocab_size: int, target_vocab_size: int) -> torch.Tensor:
    """[draft_vocab_size] int64, ascending: the target ids of the most frequent loss-masked tokens.
    Ties go to the lower id; with fewer distinct tokens, the smallest unused ids fill up (count 0).
    """
    if target_vocab_size < 1:
        raise ValueError(f"target_vocab_size must be positive, got {target_vocab_size}")
    if not 1 <= draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size must be in 1..target_vocab_size={target_vocab_size}, "
                         f"got {draft_vocab_size}")
    counts = token_counts(data, target_vocab_size)
    # ids are ascending, so a stable sort by descending count breaks ties by the lower id
    order = torch.sort(counts, descending=True, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def _check_used(used_ids: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    used = torch.as_tensor(used_ids, dtype=torch.int64)
    if used.dim() != 1 or used.numel() == 0:
        raise ValueError(f"used_ids must be a non-empty 1-D tensor, got shape {tuple(used.shape)}")
    if used.numel() > 1 and not bool((used[1:] > used[:-1]).all()):
        raise ValueError("used_ids must be strictly ascending target ids (as draft_vocab returns)")
    if int(used[0]) < 0 or int(used[-1]) >= target_vocab_size:
        raise ValueError(f"used_ids must lie in 0..{target_vocab_size - 1} (target_vocab_size), "
                         f"got {int(used[0])}..{int(used[-1])}")
    return used


def d2t_t2d(used_ids: torch.Tensor, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [N] int64 offsets with target_id = i + d2t[i], t2d [target_vocab_size] bool)."""
    used = _check_used(used_ids, target_vocab_size)
    d2t = used - torch.arange(used.numel(), dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def coverage(used_ids: torch.Tensor, data: Iterable[Any]) -> float:
    """The fraction of the data's loss-masked tokens that are in the draft vocabulary."""
    used = torch.as_tensor(used_ids, dtype=torch.int64)
    inside = total = 0
    for ids in _masked_tokens(data):
        inside += int(torch.isin(ids, used).sum())
        total += ids.numel()
    if total == 0:
        raise ValueError("the data has no loss-masked tokens, so coverage is undefined")
    return inside / total
