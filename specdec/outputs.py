"""What the API returns: finished requests and streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability, its rank among the vocabulary (1 = the most likely; ties
    share the better rank), and the ``top`` alternatives as (token id, log-probability), most
    likely first (ties: lower id first)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestMetrics:
    """Latencies in seconds. ITLs are the gaps between successive emissions (a speculative step
    can emit several tokens at once; they share one emission)."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_target_forwards: int = 0  # forwards that ended at the frontier (decode/verify steps)
    draft_tokens_proposed: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def tau(self) -> float | None:
        """Mean tokens emitted per target forward (1.0 without speculation)."""
        if not self.num_target_forwards:
            return None
        return self.num_output_tokens / self.num_target_forwards


@dataclass
class CompletionOutput:
    """One sample of a prompt (``SamplingParams.n`` of them)."""

    index: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # one per token of token_ids when SamplingParams.logprobs was set (specdec.logits.logprobs)
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """A prompt's result. ``outputs`` holds its samples in order (one unless n > 1); the fields
    ``token_ids`` .. ``metrics`` repeat ``outputs[0]``. In a stream, a delta carries the one
    sample that changed in ``outputs`` (its ``index`` says which) and repeats it at the top."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (all of them, or the new ones in a stream delta)
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    outputs: list[CompletionOutput] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # outputs[0]'s
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing
    # decided it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
