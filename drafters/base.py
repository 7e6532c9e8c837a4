"""The drafter protocol: what the engine asks of every drafter, built-in or plugin.

A drafter is created once per engine by its factory, `factory(target: TargetInfo, **drafter_args)`,
registered under a name through the `specdec_drafters` hook. Per-request state lives with the
request (`init_state` returns it; the engine hands it back in every payload), never in the
drafter object or in globals. Each step:

    propose(list[DraftRequest]) -> one DraftTree per request (within request.budget)
    on_verified(VerifiedBatch)  -> once, for every request the step touched (prefill chunks too)

A tree computed on a GPU may stay there (``DraftTree.on_device``): the engine reads it only in
the step's one read, the verification's, and checks it then.

A drafter that runs a model asks the engine for a runner (``target.new_runner(model)``): its KV
comes out of the engine's memory budget. When it has no KV for a request it drafts nothing for
it and calls ``request.mark_no_kv()`` so that the step stats count it.

Failures. A drafter that knows which request went wrong says so with ``request.fail(error)``
(in propose, with an empty tree for it; in on_verified, leaving it out of the update): that
request fails (finish_reason "error", the message names the plugin) and every other request of
the call keeps its tree and its update. A call that raises (or returns the wrong number of trees)
says neither which request it was about nor how far it got, so the engine calls the drafter again
on the same requests only if it declares ``replay_safe = True``: calling propose or on_verified
a second time for a request in one step, after a call that completed or stopped anywhere, returns
the same and leaves the same state as one call (e.g. it only reads the state, or its updates skip
what is already done). Then a raising call is retried request by request and only the requests
whose own call raises fail. Otherwise (the default) nothing is replayed:

- propose raised: no request of that call gets a draft this step (its draft slots go back); the
  next step each of them drafts it proposes in a call of its own, where one that raises again
  fails. So propose must leave every request's state valid for the ``on_verified`` that follows
  when it raises anywhere (that on_verified hears ``num_proposed == 0``): e.g. draft_model records
  the chain it starts in the state and resolves it in on_verified, whatever came of it.
- on_verified raised: the step's update of those requests can be neither replayed (part of it
  may be done) nor redone later (the step's hidden states are gone), so they stop drafting: their
  drafter state is released and they decode on without drafts (output unchanged, only slower;
  a preemption rebuilds the state from scratch, and drafting with it).

A call for a single request that raises fails that request; one for several, whose requests the
engine cannot blame, is reported as a RuntimeWarning (and in ``engine.plugin_errors``).
There is no rollback hook: on_verified is where a step's proposal is resolved, failed or not.

Prefix caching. A request admitted while the target has KV cached for the leading full pages of
its tokens reuses them instead of computing them, so on_verified never hears of those tokens.
Before that, ``restore(state, token_ids, page_keys)`` (after ``init_state``) is asked to bring
the drafter's state up to as many of those pages as it can and to return how many; the target
then reuses that many pages and computes the rest (heard in on_verified as usual). A drafter
whose state is per-position KV caches its own full pages under the content keys the engine gives
(``page_keys[p]`` names tokens 0 .. (p + 1) * page_size - 1: ``specdec.kv.prefix``; its runner's
``kv.register_full`` / ``kv.cached_prefix`` / ``kv.adopt``), so a restore is a lookup and its
drafts after a hit are exactly those without the cache. A drafter that keeps nothing per
position (it reads ``token_ids`` and the hidden states of the tokens it hears about: ngram, mtp)
declares ``prefix_cache_safe = True`` and needs no hook: ``BaseDrafter.restore`` then covers every
page. Without either (the hook absent or returning 0) the target recomputes the cached prefix for
that drafter's requests: outputs are the same, only every hit is lost (every second chat turn,
shared system prompt, preempted request and n > 1 sample), and the engine says so once in the log.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from specdec.controllers.base import DraftBudget
from specdec.sampling_params import SamplingParams
from specdec.tree import DraftTree

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from specdec.engine.runner import ModelRunner
    from specdec.models.decoder.config import ModelConfig
    from specdec.models.decoder.llama import LlamaDecoder


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
    # a sampled request's seed (None when greedy): a drafter that samples draws the token at
    # position n with ``specdec.randomness.draw(q, [key(seed, n)])``, the noise the verifier
    # races the target with (coupled drafts), never from a generator
    seed: int | None
    state: Any  # this drafter's per-request state (from init_state)
    no_kv: bool = False  # set by mark_no_kv()
    error: str | None = None  # set by fail()
    # with prefix caching: content keys of the request's full pages computed so far (key p names
    # tokens 0 .. (p + 1) * page_size - 1; see "Prefix caching"); empty without it
    page_keys: tuple[bytes, ...] = ()

    def mark_no_kv(self) -> None:
        """Say that this request gets no draft this step because the drafter had no KV for it."""
        self.no_kv = True

    def fail(self, error: str | BaseException) -> None:
        """Fail this request alone (return an empty tree for it); the others keep their trees."""
        self.error = error if isinstance(error, str) else repr(error)


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
    error: str | None = None  # set by fail()

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    def fail(self, error: str | BaseException) -> None:
        """Fail this request alone (leave its state as it is); the others' updates stand."""
        self.error = error if isinstance(error, str) else repr(error)


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
    """What the engine asks of a drafter. ``name`` and ``propose`` are required; the rest is
    optional, with ``BaseDrafter``'s defaults (a plugin that does not subclass it gets them through
    ``specdec.drafters.adapter``, once at start-up)."""

    name: str
    plugin_name: str  # set by the registry: the plugin that registered it
    # target layers whose hidden states (layer outputs) the drafter needs; default ()
    hidden_layers: tuple[int, ...]
    # a repeat call of propose / on_verified for a request in one step is harmless, so the
    # engine may retry a raising call request by request ("Failures"); default False
    replay_safe: bool
    # it keeps nothing per position: any prefix hit is reused as is ("Prefix caching"); default
    # False
    prefix_cache_safe: bool
    # models it computes with outside its runners (e.g. MTP heads): the engine installs its
    # linear kernels on them; default ()
    matmul_models: tuple[torch.nn.Module, ...]
    # a composition's member names, what DraftBudget.sources may name; default ()
    sources: tuple[str, ...]
    # a composition's members' propose seconds in the latest step, by name; default empty
    last_source_seconds: Mapping[str, float]

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """One tree per request, within ``request.budget`` (may be empty). A request that cannot
        be drafted for: ``request.fail(error)``. Raising: see "Failures" (the state must stay
        valid for the next on_verified; no replay unless ``replay_safe``)."""

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> Any:
        """Per-request state, created at the request's first step (and after a preemption).
        Default: None."""

    def on_verified(self, batch: VerifiedBatch) -> None:
        """After every step, for every request the step touched (prefill chunks too), also one
        whose propose raised (it hears ``num_proposed == 0``). A request whose update fails:
        ``batch.requests[i].fail(error)``. Raising: see "Failures" (replayed only when
        ``replay_safe``; otherwise the call's requests stop drafting). Default: nothing."""

    def release(self, state: Any) -> None:
        """Free per-request resources (finish, abort, preemption, error). Default: nothing."""

    def restore(self, state: Any, token_ids: TokenView, page_keys: list[bytes]) -> int:
        """Pages of cached target KV the state now covers ("Prefix caching"). Default: all of
        them when ``prefix_cache_safe``, else 0."""

    @property
    def restores_prefix(self) -> bool:
        """Whether any prefix-cache hit can be reused for its requests (derived: a ``restore``
        of its own, or ``prefix_cache_safe``); not written by a drafter."""


class BaseDrafter:
    """Defaults for the optional parts of the protocol (a drafter subclasses this and writes
    ``propose``, and what else it needs)."""

    name = "base"
    plugin_name = "?"
    hidden_layers: tuple[int, ...] = ()
    replay_safe = False  # declare True only when it holds ("Failures" above)
    # declare True when the drafter keeps nothing per position ("Prefix caching" above): any
    # prefix hit is then reused as is, with no restore to write
    prefix_cache_safe = False
    matmul_models: tuple[torch.nn.Module, ...] = ()
    sources: tuple[str, ...] = ()
    last_source_seconds: Mapping[str, float] = MappingProxyType({})  # read-only: assign your own

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> Any:
        return None

    def on_verified(self, batch: VerifiedBatch) -> None:
        return None

    def release(self, state: Any) -> None:
        return None

    def restore(self, state: Any, token_ids: TokenView, page_keys: list[bytes]) -> int:
        """Pages of a cached prefix this drafter's state covers ("Prefix caching"): all of them
        for a drafter that declares ``prefix_cache_safe``; else none, which is right for every
        drafter (the target then computes the prefix and the drafter hears of it) but loses
        the hit. One with per-position KV overrides this and restores it from its own cache."""
        return len(page_keys) if self.prefix_cache_safe else 0

    @property
    def restores_prefix(self) -> bool:
        """Whether a prefix-cache hit can be reused for its requests at all (it overrides
        ``restore`` or declares ``prefix_cache_safe``); the engine says once in the log when not."""
        return self.prefix_cache_safe or type(self).restore is not BaseDrafter.restore
