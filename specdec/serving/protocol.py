"""The parts of OpenAI's completions and chat completions requests that ``specdec serve`` reads,
as pydantic models: a known field of the wrong type or out of range is a 400 naming it; fields
this server does not use are ignored, as OpenAI's clients send many of them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from specdec.sampling_params import MAX_SAMPLES, MAX_SEED


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | StrictInt = Field(1.0, ge=0)
    top_p: StrictFloat | StrictInt = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(-1, ge=-1)
    min_p: StrictFloat | StrictInt = Field(0.0, ge=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_SAMPLES)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    stream: StrictBool = False
    ignore_eos: StrictBool = False
    logprobs: StrictBool | StrictInt | None = None  # not served: a 400 when asked for
    cache_salt: StrictStr | None = None  # as vLLM's: prefix-cache pages shared only within it

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
