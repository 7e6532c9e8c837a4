"""The drafter protocol: what the engine asks of every drafter, built-in or plugin.

A drafter is created once per engine by its factory, `factory(target: TargetInfo, **drafter_args)`,
registered under a name through the `specdec_drafters` hook. Per-request state lives with the
request (`init_state` returns it; the engine hands it back in every payload), never in the
drafter object or in globals. Each step:

    propose(list[DraftRequest]) -> one DraftTree per request (within request.budget)
    on_verified(VerifiedBatch)  -> once, for every request the step touched (prefill chunks too)

A drafter that runs a model asks the engine for a runner (``target.new_runner(model)``): its KV
comes out of the engine's memory budget. When it has no KV for a request it drafts nothing for
it and calls ``request.mark_no_kv()`` so that the step stats count it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from specdec.controllers.base import DraftBudget
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from specdec.models.config import ModelConfig
    from specdec.models.llama import LlamaDecoder
    from specdec.runner import ModelRunner


class TokenView(SequenceABC):
    """A read-only view of a request's token list (prompt + generated), O(1) to make.

    Indexing and slicing read the live list (a slice is a new list); there is no way to append.
    """

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def __getitem__(self, i):
        return self._tokens[i]

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)

    def __eq__(self, other) -> bool:
        return list(self._tokens) == list(other) if isinstance(other, SequenceABC) else NotImplemented

    def __repr__(self) -> str:
        return f"TokenView({self._tokens!r})"

    def tolist(self) -> list[int]:
        """A copy as a plain list."""
        return list(self._tokens)


@dataclass(frozen=True)
class TargetInfo:
    """What a drafter may know about (and ask of) the target and the engine."""

    model: LlamaDecoder  # the target's decoder (self-speculation reuses its layers); read-only
    model_config: ModelConfig
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None for tokenizer-less test models
    model_path: str
    dtype: torch.dtype
    device: torch.device
    page_size: int
    max_model_len: int
    # new_runner(model, name=..., num_layers=None) -> ModelRunner: a runner over the engine's
    # attention backend whose KV the engine allocates from its memory budget before step one
    new_runner: Callable[..., ModelRunner]

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size


@dataclass
class DraftRequest:
    """One request's drafting job for this step."""

    request_id: str
    token_ids: TokenView  # prompt + generated (read-only); the last one has no KV yet
    budget: DraftBudget  # at most budget.max_nodes nodes (>= 1), at most budget.max_depth deep
    params: SamplingParams
    generator: torch.Generator | None  # the request's own RNG (for sampled drafts)
    state: Any  # this drafter's per-request state (from init_state)
    no_kv: bool = False  # set by mark_no_kv()

    def mark_no_kv(self) -> None:
        """Say that this request gets no draft this step because the drafter had no KV for it."""
        self.no_kv = True


@dataclass
class VerifiedRequest:
    """What one step did to one request, as its drafter hears it.

    The step committed the target KV of ``token_ids[num_computed - num_committed:num_computed]``:
    a prefill chunk's tokens, or the tokens fed up to the frontier plus the accepted draft nodes.
    Their target hidden states are rows ``hidden_start:hidden_start + num_committed`` of
    ``VerifiedBatch.hidden``.
    """

    request_id: str
    state: Any
    token_ids: TokenView  # the request's tokens now (prompt + generated)
    num_computed: int  # tokens whose KV is in the target cache now
    num_committed: int  # how many of them this step added
    num_proposed: int  # draft nodes proposed this step (0: no draft, or a prefill chunk)
    # accepted node indices (a root path, in depth order) of the tree the drafter proposed; a
    # controller may have verified only part of it (pruning), never anything else
    accepted: list[int]
    hidden_start: int  # first row of this request in VerifiedBatch.hidden

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


@dataclass
class VerifiedBatch:
    """Every request of one step (``on_verified`` is called once per step with this)."""

    requests: list[VerifiedRequest]
    # layer -> [sum num_committed, hidden_size]: the target's hidden states (layer outputs) of
    # the committed tokens, request after request, for the layers in `Drafter.hidden_layers`
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    def hidden_of(self, i: int) -> dict[int, torch.Tensor]:
        """{layer: [num_committed, hidden]} of request i (views, no copy)."""
        r = self.requests[i]
        return {layer: h[r.hidden_start:r.hidden_start + r.num_committed]
                for layer, h in self.hidden.items()}

    def select(self, index: list[int]) -> VerifiedBatch:
        """The sub-batch of requests ``index`` with their hidden rows (for failure isolation)."""
        reqs, chunks, start = [], {layer: [] for layer in self.hidden}, 0
        for i in index:
            r = self.requests[i]
            for layer, rows in self.hidden_of(i).items():
                chunks[layer].append(rows)
            reqs.append(VerifiedRequest(r.request_id, r.state, r.token_ids, r.num_computed,
                                        r.num_committed, r.num_proposed, r.accepted, start))
            start += r.num_committed
        return VerifiedBatch(reqs, {layer: torch.cat(c) for layer, c in chunks.items() if c})


@runtime_checkable
class Drafter(Protocol):
    name: str
    # target layers whose hidden states (layer outputs) the drafter needs; () for none
    hidden_layers: tuple[int, ...]

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> Any:
        """Per-request state, created at the request's first step (and after a preemption)."""

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """One tree per request, within ``request.budget`` (may be empty)."""

    def on_verified(self, batch: VerifiedBatch) -> None:
        """After every step, for every request the step touched (prefill chunks too). If it
        raises, the engine retries request by request to find the failing one, so updating a
        request's state should be idempotent (or validated before mutating)."""

    def release(self, state: Any) -> None:
        """Free per-request resources (finish, abort, preemption, error)."""


class BaseDrafter:
    """Defaults for the optional parts of the protocol."""

    name = "base"
    hidden_layers: tuple[int, ...] = ()

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> Any:
        return None

    def on_verified(self, batch: VerifiedBatch) -> None:
        return None

    def release(self, state: Any) -> None:
        return None
