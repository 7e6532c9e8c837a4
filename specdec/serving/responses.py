"""A request's answer in OpenAI's shapes, whole or as server-sent events, from the engine
loop's streams of its prompts (one per prompt: completions take a list; choice ``i * n + j`` is
prompt i's sample j, as OpenAI numbers them).

Streams: the role first (chat), then a chunk per step with new text, the finish reason in each
choice's last chunk; a usage chunk (``choices: []``) only with
``stream_options.include_usage``; a failure as an error event (``data: {"error": ...}``), then
``data: [DONE]``. A client that goes away, streaming or not, has its request aborted."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from specdec.serving.engine_loop import RequestStream, StreamEvent
from specdec.serving.errors import APIError, error_body
from specdec.serving.logprobs import CompletionLogprobs, TokenBytes, chat_logprobs, merge


@dataclass
class Job:
    id: str  # chatcmpl-<uuid hex> or cmpl-<uuid hex>
    chat: bool
    model: str
    created: int
    n: int  # samples per prompt
    streams: list[RequestStream]  # one per prompt
    include_usage: bool = False
    # log-probabilities asked for (specdec.serving.logprobs): None, or how many alternatives
    top_logprobs: int | None = None
    token_bytes: TokenBytes | None = None
    echo: list[str] | None = None  # completions' echo: each prompt's text
    _completion_lps: dict = field(default_factory=dict)  # choice -> CompletionLogprobs

    def logprobs(self, index: int, ev: StreamEvent):
        """The event's logprobs in the response's shape (None when not asked)."""
        if self.top_logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(ev.logprobs or [], self.token_bytes)
        lps = self._completion_lps.setdefault(
            index, CompletionLogprobs(self.token_bytes, self.top_logprobs))
        parts = []
        if self.echo is not None and ev.prompt_token_ids is not None:
            prompt_lps = ev.prompt_logprobs or [None] * len(ev.prompt_token_ids)
            parts.append(lps.add(ev.prompt_token_ids, prompt_lps))
        parts.append(lps.add(ev.token_ids, ev.logprobs or [None] * len(ev.token_ids)))
        return merge(parts)

    def text(self, index: int, ev: StreamEvent) -> str:
        """The event's text; with echo, a choice's first event starts with its prompt."""
        if self.echo is not None and ev.prompt_token_ids is not None:
            return self.echo[index // self.n] + ev.text
        return ev.text

    @property
    def num_choices(self) -> int:
        return self.n * len(self.streams)

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    async def events(self) -> AsyncIterator[tuple[int, StreamEvent]]:
        """(choice index, event) of every prompt's stream, as they come."""
        if len(self.streams) == 1:
            async for ev in self.streams[0]:
                yield ev.index, ev
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            async for ev in stream:
                await merged.put((i * self.n + ev.index, ev))
            await merged.put(None)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            left = len(tasks)
            while left:
                item = await merged.get()
                if item is None:
                    left -= 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    def chunk(self, choices: list) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else
               "text_completion", "created": self.created, "model": self.model,
               "choices": choices}
        if self.include_usage:
            out["usage"] = None  # as OpenAI's: null but in the last chunk
        return out


async def collect(request: Request, job: Job) -> dict:
    """The whole response; the request is aborted if the client hangs up first."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, job))
    try:
        texts = [""] * job.num_choices
        finals: dict[int, StreamEvent] = {}
        logprobs: dict[int, list] = {}
        async for index, ev in job.events():
            texts[index] += job.text(index, ev)
            logprobs.setdefault(index, []).append(job.logprobs(index, ev))
            if ev.finished:
                finals[index] = ev
    finally:
        watcher.cancel()
    errors = [ev.error for ev in finals.values() if ev.finish_reason == "error"]
    if errors:
        raise APIError(500, f"generation failed: {errors[0]}")
    choices = []
    for i in range(job.num_choices):
        choice = {"index": i, "finish_reason": finals[i].finish_reason,
                  "logprobs": _whole(job, logprobs.get(i, []))}
        if job.chat:
            choice["message"] = {"role": "assistant", "content": texts[i]}
        else:
            choice["text"] = texts[i]
        choices.append(choice)
    return {"id": job.id, "object": "chat.completion" if job.chat else "text_completion",
            "created": job.created, "model": job.model, "choices": choices,
            "usage": usage(finals, job.n)}


async def sse(job: Job) -> AsyncIterator[str]:
    """The response as server-sent events."""
    done = False
    try:
        if job.chat:  # the role first, as OpenAI's streams do
            for i in range(job.num_choices):
                yield _line(job.chunk([{"index": i, "delta": {"role": "assistant",
                                                                "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
        finals: dict[int, StreamEvent] = {}
        async for index, ev in job.events():
            if ev.finish_reason == "error":  # the others are aborted (finally)
                yield _line(error_body(f"generation failed: {ev.error}", "server_error"))
                yield "data: [DONE]\n\n"
                return
            if ev.finished:
                finals[index] = ev
            if ev.text or ev.token_ids or ev.finished or ev.prompt_token_ids is not None:
                yield _line(job.chunk([_delta(job, index, ev)]))
        if job.include_usage:
            last = job.chunk([])
            last["usage"] = usage(finals, job.n)
            yield _line(last)
        yield "data: [DONE]\n\n"
        done = True
    finally:
        if not done:  # the client went away, the response was cancelled, or a sample failed
            job.abort()


def _delta(job: Job, index: int, ev: StreamEvent) -> dict:
    choice = {"index": index, "logprobs": job.logprobs(index, ev),
              "finish_reason": ev.finish_reason}
    text = job.text(index, ev)
    if job.chat:
        choice["delta"] = {"content": text} if text else {}
    else:
        choice["text"] = text
    return choice


def _whole(job: Job, parts: list):
    """A whole response's logprobs from its events' pieces."""
    if job.top_logprobs is None:
        return None
    if job.chat:
        return {"content": [c for p in parts for c in p["content"]], "refusal": None}
    return merge(parts)


def usage(finals: dict[int, StreamEvent], n: int) -> dict:
    """Token counts (each prompt once, however many samples), prompt tokens served from the
    prefix cache (a prompt's first sample: the others reuse its pages) and the speculation
    figures (drafted and accepted tokens)."""
    firsts: dict[int, StreamEvent] = {}
    for index in sorted(finals):
        firsts.setdefault(index // n, finals[index])
    prompt = sum(ev.num_prompt_tokens for ev in firsts.values())
    cached = sum(ev.metrics.num_cached_tokens for ev in firsts.values() if ev.metrics)
    ms = [ev.metrics for ev in finals.values() if ev.metrics is not None]
    completion = sum(m.num_output_tokens for m in ms)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "drafted_tokens": sum(m.draft_tokens_proposed for m in ms),
            "accepted_tokens": sum(sum(m.accepted_by_depth) for m in ms)}


async def _abort_on_disconnect(request: Request, job: Job) -> None:
    """Waits for the client's hang-up (the body is read: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.abort()


def _line(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"
