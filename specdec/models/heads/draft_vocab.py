"""What every learned drafter shares with its target: the check that it was made for this
target, and a reduced draft vocabulary given as target ids (``token_map``, vLLM's Medusa name)."""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.decoder.config import ModelConfig


def check_made_for(what: str, hidden_size: int, vocab_size: int, num_layers: int,
                   target: ModelConfig) -> None:
    """ValueError naming both values when a drafter (``what``: "this EAGLE-3 head") was made
    for a target of another hidden size, vocabulary size or layer count."""
    pairs = (("hidden size", hidden_size, target.hidden_size),
             ("vocabulary size", vocab_size, target.vocab_size),
             ("layer count", num_layers, target.num_layers))
    for name, ours, theirs in pairs:
        if ours != theirs:
            raise ValueError(f"{what} was made for a target with {name} {ours}, but the target "
                             f"has {name} {theirs}")


class TokenMap(nn.Module):
    """Buffers ``token_map`` [Vd] (draft id -> target id, ascending) and ``draft_index`` [V]
    (target id -> draft id, -1 outside), for drafter modules to inherit."""

    def register_vocab(self, draft_vocab_size: int, vocab_size: int, device=None) -> None:
        self.register_buffer("token_map", torch.zeros(draft_vocab_size, dtype=torch.int64,
                                                      device=device))
        self.register_buffer("draft_index", torch.full((vocab_size,), -1, dtype=torch.int64,
                                                       device=device))

    def set_vocab(self, used_ids: torch.Tensor) -> None:
        """``used_ids`` [draft_vocab_size]: ascending target ids."""
        ids = torch.as_tensor(used_ids, dtype=torch.int64, device=self.token_map.device)
        assert ids.numel() == self.token_map.numel() and bool((ids[1:] > ids[:-1]).all())
        self.token_map.copy_(ids)
        self.draft_index.fill_(-1)
        self.draft_index[ids] = torch.arange(ids.numel(), device=ids.device)
