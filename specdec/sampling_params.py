"""Per-request sampling parameters (validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature 0 means greedy (argmax). top_k -1 (or 0) disables top-k; top_p 1.0 and
    min_p 0.0 disable nucleus and min-p filtering. The same seed gives the same output.
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               f"temperature must be a number >= 0 (0 = greedy), got {self.temperature!r}")
        _check(isinstance(self.top_k, int) and self.top_k >= -1,
               f"top_k must be an int >= -1 (-1 or 0 = disabled), got {self.top_k!r}")
        _check(isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        _check(self.seed is None or isinstance(self.seed, int),
               f"seed must be an int or None, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
