"""OpenAI's completions and chat completions requests as ``specdec serve`` reads them (pydantic
models): a known field of the wrong type or out of range is a 400 naming it, ``null`` means the
field's default, and nothing a client asks for is dropped in silence:

- ``REFUSED_*``: the fields of OpenAI's (and vLLM's) requests this server does not implement
  yet. A request that sets one to anything but its neutral value (``null``, ``false``, 0, an
  empty list, ...) is refused with a 400 naming it. Implementing one: declare it on the model
  below and delete its line here.
- ``NO_EFFECT``: fields that do not change what is generated (``user``, ``metadata``, ...):
  accepted and not used.
- Any other field: a 400 naming it (``extra="forbid"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from specdec.sampling_params import MAX_LOGPROBS, MAX_SAMPLES, MAX_SEED
from specdec.serving.errors import APIError


def _unset(v) -> bool:
    return v is None


def _false(v) -> bool:
    return v is None or v is False


def _zero(v) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


def _one(v) -> bool:
    return v is None or (type(v) in (int, float) and v == 1)


def _empty(v) -> bool:
    return v is None or v == [] or v == {}


def _one_of(*values) -> Callable[[Any], bool]:
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


# field -> is this value neutral (the same as not asking)? One place for what is not served.
REFUSED_COMMON: dict[str, Callable[[Any], bool]] = {}
REFUSED_CHAT = {
    **REFUSED_COMMON, "tools": _empty,
    "tool_choice": _one_of("none"), "functions": _empty, "function_call": _one_of("none"),
    "audio": _unset, "modalities": _one_of(["text"]), "prediction": _unset,
    "reasoning_effort": _unset, "web_search_options": _unset,
}
REFUSED_COMPLETION = {**REFUSED_COMMON, "best_of": _one_of(1), "suffix": _one_of("")}
REFUSED_MESSAGE = {"tool_calls": _empty, "function_call": _unset, "audio": _unset,
                   "refusal": _unset, "annotations": _empty}
NO_EFFECT = ("user", "metadata", "store", "service_tier", "parallel_tool_calls",
             "safety_identifier", "prompt_cache_key")


def accepted_fields(data: dict, refused: dict) -> dict:
    """``data`` without the fields that change nothing (neutral refused ones, ``NO_EFFECT``);
    a 400 naming the first refused field set to something else, or a non-text content part."""
    out = {}
    for name, value in data.items():
        if name in refused:
            if not refused[name](value):
                raise APIError(400, f"{name}: not supported by this server yet (got "
                                    f"{_short(value)})", param=name)
        elif name not in NO_EFFECT:
            out[name] = value
    if isinstance(out.get("messages"), list):
        out["messages"] = [_message_fields(m, i) for i, m in enumerate(out["messages"])]
    return out


def _message_fields(message, i: int):
    if not isinstance(message, dict):
        return message
    for name, neutral in REFUSED_MESSAGE.items():
        if name in message and not neutral(message[name]):
            raise APIError(400, f"messages.{i}.{name}: not supported by this server yet",
                           param=f"messages.{i}.{name}")
    content = message.get("content")
    for j, part in enumerate(content if isinstance(content, list) else ()):
        if isinstance(part, dict) and "type" in part and part["type"] != "text":
            param = f"messages.{i}.content.{j}.type"
            raise APIError(400, f"{param}: only text content parts are served (got "
                                f"{_short(part['type'])})", param=param)
    return {k: v for k, v in message.items() if k not in REFUSED_MESSAGE}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """``"temperature": null`` means the default, as OpenAI's API reads it."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].default is None}


class StreamOptions(_Request):
    include_usage: StrictBool = False  # a last chunk with the usage and no choices


class JsonSchemaFormat(_Request):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with "type": "json_schema", and only '
                             "then")
        return self


class GuidedOutputs(_Request):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    whitespace_flexible: StrictBool = False  # specdec's: JSON with any whitespace


class _Sampling(_Request):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | StrictInt = Field(1.0, ge=0)
    top_p: StrictFloat | StrictInt = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(-1, ge=-1, le=1 << 30)
    min_p: StrictFloat | StrictInt = Field(0.0, ge=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_SAMPLES)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    cache_salt: StrictStr | None = None  # as vLLM's: prefix-cache pages shared only within it
    # what changes the logits (specdec.logits): OpenAI's, then vLLM's extensions
    presence_penalty: StrictFloat | StrictInt = Field(0.0, ge=-2, le=2)
    frequency_penalty: StrictFloat | StrictInt = Field(0.0, ge=-2, le=2)
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None  # token id -> -100..100
    response_format: ResponseFormat | None = None
    repetition_penalty: StrictFloat | StrictInt = Field(1.0, gt=0)
    min_tokens: StrictInt = Field(0, ge=0)
    bad_words: list[StrictStr] | None = None
    structured_outputs: GuidedOutputs | None = None
    guided_json: dict | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    REFUSED: ClassVar = REFUSED_COMPLETION
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    echo: StrictBool = False  # the prompt before the completion (and its logprobs, if asked)
    # one prompt (text or token ids) or a list of them: each prompt its own n choices
    prompt: StrictStr | list[StrictStr | list[StrictInt] | StrictInt]

    def prompts(self) -> list[str | list[int]]:
        """The prompts; 400 for a list mixing token ids with prompts (naming the first)."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]
        for i, item in enumerate(p):
            if isinstance(item, int):
                raise APIError(400, f"prompt.{i}: a list of prompts holds texts or lists of "
                                    "token ids, not token ids among them", param=f"prompt.{i}")
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = Field(None, validate_default=True)
    name: StrictStr | None = None

    @field_validator("content")
    @classmethod
    def _null_only_for_the_assistant(cls, v, info: ValidationInfo):
        if v is None and info.data.get("role") not in ("assistant", None):
            raise ValueError("content may be null only in an assistant message")
        return v

    def for_template(self) -> dict:
        """As the chat template reads it: text parts joined by newlines, a null content empty,
        the developer role as the system role."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        out = {"role": "system" if self.role == "developer" else self.role,
               "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(_Sampling):
    REFUSED: ClassVar = REFUSED_CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError('top_logprobs needs "logprobs": true')
        return self
