"""One request's state as the engine runs it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from specdec.kv.block_table import BlockTable
from specdec.kv.prefix import extend_keys
from specdec.logits.processors import RequestLogits
from specdec.outputs import RequestMetrics, TokenLogprob
from specdec.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    emissions: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens emitted then)
    finished: float | None = None


@dataclass
class RequestDrafting:
    """The drafting side's bookkeeping of one request (specdec.engine.drafting): its drafter
    state and what was decided about drafting for it. Kept here, not in the drafter's state,
    which may be what went wrong; all of it starts afresh when the request is preempted."""

    state: Any = None  # owned by the drafter (init_state); lives and dies with the request
    ready: bool = False  # init_state ran (its state may legitimately be None)
    # its last propose call raised for several requests at once: it proposes alone next time
    suspect: bool = False
    # decoding on without drafter state (keep_drafting said no, or on_verified raised for
    # several requests at once) until it ends or is preempted: no budget asked, no drafter call
    undrafted: bool = False
    idle_steps: int = 0  # decode steps in a row at budget 0 (keep_drafting asked at 1, 32, ...)
    # the request's page keys as the tuple its DraftRequests carry, and the list it was made
    # of (Sequence.page_keys): made again only when that list grew (or was replaced)
    page_keys: tuple[bytes, ...] = field(default=(), repr=False)
    keys_of: list[bytes] | None = field(default=None, repr=False)


@dataclass(eq=False)  # identity, not field equality: sequences are looked up in queues
class Sequence:
    """Tokens, KV pages and stop state of one request.

    `token_ids` = prompt + generated. KV is in the cache for the first `num_computed` tokens;
    at the decode frontier that is every token but the last (the last is the next step's input).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int | None  # a sampled request's seed (specdec.randomness); None when greedy
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_table: BlockTable = field(default_factory=BlockTable)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    stop_text_len: int | None = None  # text is cut here when a stop string matched
    detokenizer: Any = None  # specdec.engine.detokenizer.IncrementalDetokenizer, made on first use
    drafting: RequestDrafting = field(default_factory=RequestDrafting)
    times: RequestTimes = field(default_factory=RequestTimes)
    num_preemptions: int = 0
    num_steps_decoding: int = 0  # target forwards that ended at this request's frontier
    draft_tokens_proposed: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)  # [d] times depth d was accepted
    last_proposed: int = 0  # draft nodes verified in the latest verification
    last_accepted: int = 0  # of which accepted
    # prefix caching (specdec.kv.prefix): the key chain's root (model namespace + cache_salt)
    # and the keys of the full pages of token_ids computed so far
    cache_root: bytes = b""
    page_keys: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the cache at admission
    num_reused_tokens: int = 0  # ... at every admission (re-admissions after preemption too)
    # n samples of one prompt: sample `sample_index` of the group whose first sample is
    # `leader` (None for the first); with prefix caching the others wait while the first
    # computes the prompt's full pages, then reuse them (the scheduler's in-flight pages)
    leader: Sequence | None = None
    sample_index: int = 0
    # what its sampling options do to its logits (specdec.logits; None: nothing), and the
    # log-probabilities of its output tokens when asked (SamplingParams.logprobs)
    logits: RequestLogits | None = None
    logprobs: list[TokenLogprob] | None = None
    # SamplingParams.prompt_logprobs: per prompt token so far (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.logprobs is None and self.params.logprobs is not None:
            self.logprobs = []
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_rows(self) -> bool:
        """Its prompt's log-probabilities are asked for and not all computed yet: every prompt
        row is computed (no prefix-cache hit), each one's logits kept."""
        return self.prompt_logprobs is not None \
            and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def text(self, tokenizer) -> str:
        """The output text so far (O(new tokens): specdec.engine.detokenizer); a finished request's
        is complete, incomplete characters included, and cut where a stop string matched."""
        if self.detokenizer is None:
            from specdec.engine.detokenizer import IncrementalDetokenizer

            self.detokenizer = IncrementalDetokenizer(tokenizer, self.num_prompt_tokens)
        if self.is_finished or self.finish_reason is not None:
            self.detokenizer.flush(self.token_ids)
        else:
            self.detokenizer.update(self.token_ids)
        text = self.detokenizer.text
        return text if self.stop_text_len is None else text[:self.stop_text_len]

    def keys(self, page_size: int, num_pages: int) -> list[bytes]:
        """Content keys of the first ``num_pages`` full pages (fewer if the tokens end
        earlier), computed once each."""
        extend_keys(self.page_keys, self.token_ids, page_size, self.cache_root, num_pages)
        return self.page_keys[:num_pages]

    def tokens_to_frontier(self) -> int:
        """How many tokens must go through the model before this request can emit one."""
        return self.num_tokens - self.num_computed

    def metrics(self) -> RequestMetrics:
        """What the API reports of this sequence (TTFT, ITLs, TPOT, e2e, speculation)."""
        t = self.times
        m = RequestMetrics(
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_target_forwards=self.num_steps_decoding,
            draft_tokens_proposed=self.draft_tokens_proposed,
            accepted_by_depth=list(self.accepted_by_depth),
            num_preemptions=self.num_preemptions,
            num_cached_tokens=self.num_cached_tokens,
        )
        if t.first_token is not None:
            m.ttft = t.first_token - t.arrival
            emit_times = [at for at, _ in t.emissions]
            m.itls = [b - a for a, b in zip(emit_times, emit_times[1:])]
        if t.finished is not None:
            m.e2e = t.finished - t.arrival
            if m.ttft is not None and self.num_output_tokens > 1:
                m.tpot = (m.e2e - m.ttft) / (self.num_output_tokens - 1)
        return m
