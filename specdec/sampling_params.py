"""Per-request sampling parameters (validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Temperatures in (0, GREEDY_TEMPERATURE_EPS) are decoded greedily: dividing float32 logits by
# e.g. 1e-39 overflows to inf and the softmax turns into NaN, while the distribution such a
# temperature describes is already the argmax to within rounding.
GREEDY_TEMPERATURE_EPS = 1e-5
# Largest accepted seed. torch.Generator.manual_seed takes up to 2**64 - 1; we stay within the
# signed 64-bit range so a seed round-trips through int64 tensors, numpy and JSON consumers.
MAX_SEED = 2**63 - 1
# Most samples of one prompt (SamplingParams.n): they run as that many requests at once.
MAX_SAMPLES = 64


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature 0 means greedy (argmax); so does any temperature below
    GREEDY_TEMPERATURE_EPS (1e-5), where float32 sampling would produce NaN probabilities.
    top_k -1 (or 0) disables top-k; top_p 1.0 and min_p 0.0 disable nucleus and min-p
    filtering. seed is None (a fresh random seed) or an int in [0, MAX_SEED] = [0, 2**63 - 1];
    the same seed gives the same output. Numbers must be finite and never bools.

    n: samples of the prompt, 1 .. MAX_SAMPLES (64); they share the prompt's cached pages
    (prefix caching) and each draws from its own seed stream (sample 0 from ``seed``, sample i
    from a seed derived from it), so a seeded request is reproducible as a whole. n > 1 with
    greedy decoding is allowed and gives n identical samples. cache_salt: None or a string; the
    KV of a request with a salt is shared only with requests carrying the same salt (tenants
    that must not see each other's cache timing use different salts).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(_is_real(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0 (0 = greedy), {_got(self.temperature)}")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be an int >= -1 (-1 or 0 = disabled), {_got(self.top_k)}")
        _check(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be a number in (0, 1], {_got(self.top_p)}")
        _check(_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be a number in [0, 1], {_got(self.min_p)}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an int >= 1, {_got(self.max_tokens)}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
               f"seed must be None or an int in [0, 2**63 - 1], {_got(self.seed)}")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_SAMPLES,
               f"n must be an int in [1, {MAX_SAMPLES}] (samples of the prompt), {_got(self.n)}")
        _check(self.cache_salt is None or isinstance(self.cache_salt, str),
               f"cache_salt must be None or a string, got {type(self.cache_salt).__name__} "
               f"{self.cache_salt!r}")
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s
                                                            for s in self.stop),
               f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        _check(isinstance(self.stop_token_ids, (list, tuple))
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """An int or float that is finite as a float; not a bool (bool is an int subclass)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float range
        return False


def _got(value) -> str:
    return f"got {value!r}" + (" (a bool)" if isinstance(value, bool) else "")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
