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
# Most alternatives per position in logprobs / prompt_logprobs (OpenAI's top_logprobs: 20).
MAX_LOGPROBS = 20
# logit_bias values (OpenAI: -100 .. 100)
MAX_LOGIT_BIAS = 100.0


class RequestError(ValueError):
    """A request the engine cannot run, naming what was wrong: ``field`` is a SamplingParams
    field ("temperature"), a path into one ("logit_bias.500": that key of it;
    "structured_outputs.json") or "prompt" (its token ids). A server maps it to the field its
    client wrote (specdec.serving.options.request_field)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class StructuredOutputs:
    """Constrain the output to a language; exactly one of:

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object (OpenAI's
    ``response_format: {"type": "json_object"}``); regex: a regular expression; grammar: a Lark
    grammar (llguidance's dialect); choice: one of these strings.

    The constraint masks the target's logits at every step (and every draft-tree node, along
    its path), so the output is what unspeculated constrained decoding gives. It is compiled
    (llguidance) when the request is added: a malformed schema, regex or grammar is a
    ValueError then. ``whitespace_flexible``: JSON may have any whitespace between tokens
    (default: the compact form llguidance prefers, one space after ``:`` and ``,``)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "grammar", "choice")
                 if getattr(self, k) is not None] + (["json_object"] if self.json_object else [])
        _check(len(given) == 1, "structured_outputs",
               "structured_outputs needs exactly one of json, json_object, regex, grammar, "
               f"choice; got {given or 'none'}")
        _check(self.json is None or isinstance(self.json, (dict, str)), "structured_outputs.json",
               "structured_outputs.json must be a JSON schema (dict or JSON text), got "
               f"{type(self.json).__name__}")
        for key in ("regex", "grammar"):
            value = getattr(self, key)
            _check(value is None or (isinstance(value, str) and value),
                   f"structured_outputs.{key}",
                   f"structured_outputs.{key} must be a non-empty string, got {value!r}")
        _check(self.choice is None or (isinstance(self.choice, (list, tuple)) and self.choice
                                       and all(isinstance(c, str) and c for c in self.choice)),
               "structured_outputs.choice", "structured_outputs.choice must be a non-empty list "
               f"of non-empty strings, got {self.choice!r}")
        _check(isinstance(self.json_object, bool) and isinstance(self.whitespace_flexible, bool),
               "structured_outputs",
               "structured_outputs.json_object and whitespace_flexible must be bools")


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature 0 means greedy (argmax); so does any temperature below
    GREEDY_TEMPERATURE_EPS (1e-5), where float32 sampling would produce NaN probabilities.
    top_k -1 (or 0) disables top-k; top_p 1.0 and min_p 0.0 disable nucleus and min-p
    filtering. seed is None (a fresh random seed) or an int in [0, MAX_SEED] = [0, 2**63 - 1];
    the same seed gives the same output. Numbers must be finite and never bools.

    What changes the target's logits before sampling (``specdec.logits``; the same at every
    draft-tree node as in plain decoding, computed along the node's path, so speculation stays
    lossless), in this order: logit_bias ({token id: -100 .. 100} added); repetition_penalty
    (> 0, 1 = off: over prompt and output tokens, positive logits divided by it, negative ones
    multiplied, as HF and vLLM); frequency_penalty and presence_penalty (-2 .. 2: subtract
    penalty x count, and penalty once, for each token already in the output, as OpenAI);
    then bans (-inf): EOS and stop_token_ids while fewer than min_tokens are out, the last token
    of a bad_words sequence after its first tokens, what structured_outputs forbids.

    logprobs: None, or how many alternatives (0 .. 20) to return beside each output token's
    log-probability; prompt_logprobs the same for prompt tokens (the first has none). They are
    the target's own log-softmax, before temperature, penalties and constraints (vLLM's
    default "raw" logprobs), from the verification forward: the same with and without a
    drafter.

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: list[str] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(_is_real(self.temperature) and self.temperature >= 0, "temperature",
               f"temperature must be a finite number >= 0 (0 = greedy), {_got(self.temperature)}")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k",
               f"top_k must be an int >= -1 (-1 or 0 = disabled), {_got(self.top_k)}")
        _check(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"top_p must be a number in (0, 1], {_got(self.top_p)}")
        _check(_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"min_p must be a number in [0, 1], {_got(self.min_p)}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be an int >= 1, {_got(self.max_tokens)}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED), "seed",
               f"seed must be None or an int in [0, 2**63 - 1], {_got(self.seed)}")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_SAMPLES, "n",
               f"n must be an int in [1, {MAX_SAMPLES}] (samples of the prompt), {_got(self.n)}")
        _check(self.cache_salt is None or isinstance(self.cache_salt, str), "cache_salt",
               f"cache_salt must be None or a string, got {type(self.cache_salt).__name__} "
               f"{self.cache_salt!r}")
        _check(isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s
                                                            for s in self.stop),
               "stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        _check(isinstance(self.stop_token_ids, (list, tuple))
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids",
               f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")

        for key in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, key)
            _check(_is_real(value) and -2.0 <= value <= 2.0, key,
                   f"{key} must be a number in [-2, 2], {_got(value)}")
        _check(_is_real(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", f"repetition_penalty must be a number > 0 (1 = off), "
               f"{_got(self.repetition_penalty)}")
        _check(self.logit_bias is None or (
            isinstance(self.logit_bias, dict)
            and all(_is_int(k) and k >= 0 and _is_real(v) and abs(v) <= MAX_LOGIT_BIAS
                    for k, v in self.logit_bias.items())),
            "logit_bias", "logit_bias must be a dict of token id (int >= 0) to a number in "
            f"[-100, 100], got {self.logit_bias!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
               f"{_got(self.min_tokens)}")
        _check(isinstance(self.bad_words, (list, tuple))
               and all(isinstance(w, str) and w.strip() for w in self.bad_words),
               "bad_words",
               f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        for key in ("logprobs", "prompt_logprobs"):
            value = getattr(self, key)
            _check(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), key,
                   f"{key} must be None or an int in [0, {MAX_LOGPROBS}], {_got(value)}")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputs), "structured_outputs",
               "structured_outputs must be None or a StructuredOutputs, got "
               f"{type(self.structured_outputs).__name__}")

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the target's logits before sampling (specdec.logits)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens
                    or self.bad_words or self.structured_outputs is not None)

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


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise RequestError(field, message)
