"""The request fields that change the logits or ask for log-probabilities, as ``SamplingParams``
options (specdec.logits): OpenAI's ``response_format``, penalties, ``logit_bias``, ``logprobs`` /
``top_logprobs`` (chat), ``logprobs`` and ``echo`` (completions), and vLLM's extensions
(``structured_outputs``, ``guided_*``, ``repetition_penalty``, ``min_tokens``, ``bad_words``,
``prompt_logprobs``). Each problem is a 400 naming the field; ``request_field`` names it for
what the engine refuses (a ``RequestError`` names the SamplingParams field)."""

from __future__ import annotations

from specdec.sampling_params import StructuredOutputs
from specdec.serving.errors import APIError
from specdec.serving.protocol import ChatRequest, CompletionRequest

GUIDED = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar")


def logit_options(req: ChatRequest | CompletionRequest) -> dict:
    """SamplingParams keyword arguments for the request's logit fields."""
    out = {"presence_penalty": float(req.presence_penalty),
           "frequency_penalty": float(req.frequency_penalty),
           "repetition_penalty": float(req.repetition_penalty),
           "min_tokens": req.min_tokens, "bad_words": list(req.bad_words or []),
           "logit_bias": _logit_bias(req.logit_bias), "prompt_logprobs": req.prompt_logprobs,
           "structured_outputs": constraint(req)[1]}
    if isinstance(req, ChatRequest):
        out["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    else:
        out["logprobs"] = req.logprobs
        if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
            out["prompt_logprobs"] = req.logprobs  # the echoed prompt's logprobs
    return out


def _logit_bias(bias: dict | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or len(key) > 12:
            raise APIError(400, f"logit_bias.{key}: keys are token ids (digits), got {key!r}",
                           param=f"logit_bias.{key}")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias.{key}: a bias is in [-100, 100], got {value}",
                           param=f"logit_bias.{key}")
        out[int(key)] = float(value)
    return out


def constraint(req) -> tuple[str | None, StructuredOutputs | None]:
    """(the field, the constraint) the request asks for ((None, None): none); 400 if it asks
    for several."""
    given = [name for name in GUIDED if _asks(req, name)]
    if len(given) > 1:
        raise APIError(400, f"{given[1]}: only one of {', '.join(GUIDED)} may constrain the "
                            f"output (also given: {given[0]})", param=given[1])
    if not given:
        return None, None
    name = given[0]
    try:
        return name, _spec(req, name)
    except ValueError as e:
        raise APIError(400, f"{name}: {e}", param=name) from None


def _spec(req, name: str) -> StructuredOutputs:
    if name == "response_format":
        fmt = req.response_format
        if fmt.type == "json_object":
            return StructuredOutputs(json_object=True)
        return StructuredOutputs(json=fmt.json_schema.schema_)
    if name == "structured_outputs":
        s = req.structured_outputs
        return StructuredOutputs(json=s.json_, regex=s.regex, choice=s.choice,
                                 grammar=s.grammar, json_object=bool(s.json_object),
                                 whitespace_flexible=s.whitespace_flexible)
    return StructuredOutputs(**{name.removeprefix("guided_"): getattr(req, name)})


def _asks(req, name: str) -> bool:
    value = getattr(req, name)
    if name == "response_format":
        return value is not None and value.type != "text"
    return value is not None


def request_field(req: ChatRequest | CompletionRequest, field: str, prompt: str) -> str | None:
    """The request field, as the client wrote it, behind ``field``, a SamplingParams field (or
    path into one) that the engine named in a ``RequestError``; ``prompt``: the field the
    prompt came in ("messages", "prompt", "prompt.1"). None for a field no request sets.

    >>> req = CompletionRequest(prompt="hi", logit_bias={"0500": 1})
    >>> request_field(req, "logit_bias.500", "prompt"), request_field(req, "prompt", "prompt")
    ('logit_bias.0500', 'prompt')
    """
    head, _, rest = field.partition(".")
    if head == "prompt":
        return prompt
    if head == "structured_outputs":  # whichever of GUIDED it came in (as parse names it)
        return constraint(req)[0]
    if head == "logit_bias" and rest:  # the key as written ("0500" for token 500)
        return next((f"{head}.{k}" for k in req.logit_bias or {} if int(k) == int(rest)),
                    field)
    if head == "max_tokens":
        return "max_completion_tokens" if req.max_completion_tokens else head
    if head == "logprobs" and isinstance(req, ChatRequest):
        return "top_logprobs" if req.top_logprobs is not None else head
    if head == "prompt_logprobs" and req.prompt_logprobs is None and getattr(req, "echo", False):
        return "logprobs"  # echo's default (logit_options)
    return field if head in type(req).model_fields else None
