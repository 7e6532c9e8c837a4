"""The drafter protocol: what the engine asks of every drafter, built-in or plugin.

A drafter is created once per engine by its factory, `factory(target: TargetInfo, **drafter_args)`,
registered under a name through the `specdec_drafters` hook. Per-request state lives with the
request (`Sequence.drafter_state`), never in the drafter object or in globals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may know about the target model."""

    model: Any  # specdec.models.llama.LlamaDecoder (for self-speculation); read-only
    model_config: Any  # specdec.models.config.ModelConfig
    hf_config: Any
    tokenizer: Any  # may be None for tokenizer-less test models
    model_path: str
    dtype: torch.dtype
    device: torch.device

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size


@dataclass
class DraftRequest:
    """One request's drafting job for this step."""

    request_id: str
    token_ids: list[int]  # prompt + generated; the last one is committed but has no KV yet
    budget: int  # at most this many tree nodes (>= 1)
    params: SamplingParams
    generator: torch.Generator | None  # the request's own RNG (for sampled drafts)
    state: Any  # this drafter's per-request state (from init_state)


@dataclass
class VerifiedStep:
    """What one engine step did to a request, as its drafter hears it (`on_verified`).

    The step committed the KV of `token_ids[num_computed - num_committed : num_computed]`: a
    prefill chunk's tokens, or the tokens fed up to the frontier plus the accepted draft nodes.
    """

    token_ids: list[int]  # the request's full token list now (prompt + generated)
    num_computed: int  # tokens whose KV is in the target cache now
    num_committed: int  # how many of them this step added
    num_proposed: int  # draft nodes verified this step (0: no draft, or a prefill chunk)
    num_accepted: int  # of which accepted (a root-to-leaf path prefix)
    # layer -> [num_committed, hidden_size]: the target's hidden states (layer outputs) of the
    # committed tokens, for the layers in `Drafter.hidden_layers` (empty dict when none)
    hidden: dict[int, torch.Tensor]


@runtime_checkable
class Drafter(Protocol):
    name: str
    # target layers whose hidden states the drafter needs (EAGLE-style); () for none
    hidden_layers: tuple[int, ...]

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> Any:
        """Per-request state, created when the request starts (and after a preemption)."""

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """One tree per request, each with at most `request.budget` nodes (may be empty)."""

    def on_verified(self, state: Any, step: VerifiedStep) -> None:
        """After every step the request took part in (prefill chunks too)."""

    def release(self, state: Any) -> None:
        """Free per-request resources (finish, abort, preemption, error)."""


class BaseDrafter:
    """Defaults for the optional parts of the protocol."""

    name = "base"
    hidden_layers: tuple[int, ...] = ()

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> Any:
        return None

    def on_verified(self, state: Any, step: VerifiedStep) -> None:
        return None

    def release(self, state: Any) -> None:
        return None
