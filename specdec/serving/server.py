"""``specdec serve``: an OpenAI-compatible HTTP server over the engine loop.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (whole responses, or server-sent
events with ``"stream": true``), ``GET /v1/models``, ``/health`` and ``/metrics`` (Prometheus).
FastAPI + uvicorn; the engine steps in its own thread (``specdec.serving.engine_loop``), every client's
tokens stream out as they are committed, and a client that disconnects has its request aborted
and its pages freed before the next step.

Safe by default: it binds 127.0.0.1 unless told otherwise; with an API key (``--api-key`` or
``$SPECDEC_API_KEY``) every route but ``/health`` needs ``Authorization: Bearer <key>``; request
bodies and ``max_tokens`` are capped; a full queue answers 503 with ``Retry-After``; malformed
JSON, a known field of the wrong type or out of range, a prompt over ``max_model_len``: 400 with
an OpenAI-style error body naming the field. ``usage`` carries the speculation figures of the
request (``drafted_tokens``, ``accepted_tokens``) beside the token counts.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import ValidationError

from specdec.models.tokenizer import chat_token_ids
from specdec.sampling_params import SamplingParams
from specdec.serving.engine_loop import EngineLoop, QueueFullError, StreamEvent
from specdec.serving.protocol import ChatRequest, CompletionRequest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int | None = None  # None: up to max_model_len
    default_max_tokens: int = 256


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (no global state); finished
    requests are counted by the engine thread (``finished``), gauges read at scrape time."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.registry = r = CollectorRegistry()
        self.running = Gauge("specdec_requests_running", "requests in the engine's batch",
                             registry=r)
        self.waiting = Gauge("specdec_requests_waiting", "requests not admitted yet", registry=r)
        self.kv_usage = Gauge("specdec_kv_cache_usage", "share of the target's KV pages in use",
                              registry=r)
        self.prefix_hit = Gauge("specdec_prefix_cache_hit_rate",
                                "share of admitted tokens served from the prefix cache",
                                registry=r)
        self.draft_share = Gauge("specdec_draft_time_share",
                                 "share of step time spent scheduling and drafting", registry=r)
        self.tau = Gauge("specdec_tokens_per_target_forward",
                         "tokens emitted per target forward of finished requests (tau)",
                         registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "TTFT",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "TPOT",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "gaps between emissions",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("specdec_requests_finished", "finished requests by reason",
                                ["finish_reason"], registry=r)
        self.tokens = Counter("specdec_generation_tokens", "tokens generated", registry=r)
        self.drafted = Counter("specdec_draft_tokens", "draft tokens verified", registry=r)
        self.accepted = Counter("specdec_accepted_tokens_by_depth",
                                "draft tokens accepted, by tree depth", ["depth"], registry=r)
        self.controller = Gauge("specdec_controller_figure",
                                "the draft controller's latest decision figures (list figures: "
                                "their mean)", ["figure"], registry=r)
        self._generated = self._forwards = 0

    def finished(self, event: StreamEvent) -> None:
        m = event.metrics
        self.requests.labels(event.finish_reason or "unknown").inc()
        if m is None:
            return
        for value, hist in ((m.ttft, self.ttft), (m.tpot, self.tpot)):
            if value is not None:
                hist.observe(value)
        for gap in m.itls:
            self.itl.observe(gap)
        self.tokens.inc(m.num_output_tokens)
        self._generated += m.num_output_tokens
        self.drafted.inc(m.draft_tokens_proposed)
        for depth, n in enumerate(m.accepted_by_depth, 1):
            self.accepted.labels(str(depth)).inc(n)
        self._forwards += m.num_target_forwards

    def render(self) -> bytes:
        engine = self.loop.engine
        self.running.set(self.loop.num_running)
        self.waiting.set(self.loop.num_waiting)
        kv = engine.kv
        self.kv_usage.set(1 - kv.num_free_pages / kv.num_pages)
        rate = engine.totals.prefix_hit_rate["tokens"]
        self.prefix_hit.set(rate or 0.0)
        t = engine.totals
        self.draft_share.set(t.draft_seconds / t.step_seconds if t.step_seconds else 0.0)
        self.tau.set(self._generated / self._forwards if self._forwards else 0.0)
        stats = self.loop.last_stats
        for name, value in ((stats.controller or {}) if stats is not None else {}).items():
            if isinstance(value, list) and value and all(isinstance(v, (int, float))
                                                         for v in value):
                name, value = f"{name}_mean", sum(value) / len(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.controller.labels(name).set(value)
        return generate_latest(self.registry)


def create_app(loop: EngineLoop, model_name: str, api_key: str | None = None,
               limits: ServerLimits | None = None) -> FastAPI:
    limits = limits or ServerLimits()
    engine = loop.engine
    max_tokens_cap = min(limits.max_tokens or engine.max_model_len, engine.max_model_len)
    metrics = Metrics(loop)
    loop.on_finish.append(metrics.finished)  # every request, also those whose client left
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.loop, app.state.metrics = loop, metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return APIError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                kind="authentication_error").response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        if loop.error is not None:
            return JSONResponse({"status": "error", "error": loop.error}, status_code=500)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": 0, "owned_by": "specdec"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def _parse(request: Request, model):
        body = await request.body()
        if len(body) > limits.max_body_bytes:
            raise APIError(413, f"request body of {len(body)} bytes exceeds the limit of "
                                f"{limits.max_body_bytes}")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"malformed JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err["loc"]) or None
            raise APIError(400, f"{field}: {err['msg']} (got {err.get('input')!r})",
                           param=field) from None
        if req.model not in (None, model_name):
            raise APIError(404, f"model {req.model!r} is not served here; this server serves "
                                f"{model_name!r}", param="model", kind="not_found_error")
        if req.logprobs:
            raise APIError(400, "logprobs are not served by specdec yet", param="logprobs")
        return req

    def _params(req) -> SamplingParams:
        max_tokens = req.max_completion_tokens or req.max_tokens or limits.default_max_tokens
        if max_tokens > max_tokens_cap:
            raise APIError(400, f"max_tokens={max_tokens} exceeds this server's limit "
                                f"{max_tokens_cap}", param="max_tokens")
        try:
            return SamplingParams(temperature=float(req.temperature), top_p=float(req.top_p),
                                  top_k=req.top_k, min_p=float(req.min_p), n=req.n,
                                  seed=req.seed, max_tokens=max_tokens, stop=req.stops(),
                                  ignore_eos=req.ignore_eos, cache_salt=req.cache_salt)
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def _submit(ids: list[int], params: SamplingParams, param: str):
        if params.stop and engine.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none",
                           param="stop")
        try:
            return loop.submit(ids, params)
        except QueueFullError as e:
            raise APIError(503, f"the server is busy: {e}", kind="server_busy",
                           headers={"Retry-After": "1"}) from None
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        params = _params(req)
        if isinstance(req.prompt, str):
            if engine.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token "
                                    "ids", param="prompt")
            ids = engine.tokenizer(req.prompt).input_ids
        else:
            ids = list(req.prompt)
        stream = _submit(ids, params, "prompt")
        return await _respond(request, stream, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(request, ChatRequest)
        params = _params(req)
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template",
                           param="messages")
        try:
            ids = chat_token_ids(engine.tokenizer, [m.model_dump() for m in req.messages])
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        stream = _submit(ids, params, "messages")
        return await _respond(request, stream, req, chat=True)

    async def _respond(request: Request, stream, req, chat: bool):
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_sse(request, stream, chat, created),
                                     media_type="text/event-stream")
        watcher = asyncio.create_task(_abort_on_disconnect(request, stream))
        try:
            texts = [""] * stream.num_samples
            finals: dict[int, StreamEvent] = {}
            async for ev in stream:
                texts[ev.index] += ev.text
                if ev.finished:
                    finals[ev.index] = ev
        finally:
            watcher.cancel()
        errors = [ev.error for ev in finals.values() if ev.finish_reason == "error"]
        if errors:
            raise APIError(500, f"generation failed: {errors[0]}", kind="server_error")
        choices = []
        for i in range(stream.num_samples):
            ev = finals[i]
            choice = {"index": i, "finish_reason": ev.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": texts[i]}
            else:
                choice.update(text=texts[i], logprobs=None)
            choices.append(choice)
        return {"id": stream.request_id, "created": created, "model": model_name,
                "object": "chat.completion" if chat else "text_completion",
                "choices": choices, "usage": _usage(finals.values())}

    async def _sse(request: Request, stream, chat: bool, created: int) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        done = False
        try:
            if chat:  # the role first, as OpenAI's streams do
                for i in range(stream.num_samples):
                    yield _sse_line(_chunk(stream.request_id, kind, created, model_name,
                                           [{"index": i, "delta": {"role": "assistant"},
                                             "finish_reason": None}]))
            finals = []
            async for ev in stream:
                if ev.finished:
                    finals.append(ev)
                if not ev.text and not ev.finished:
                    continue
                choice = {"index": ev.index, "finish_reason": ev.finish_reason}
                if chat:
                    choice["delta"] = {"content": ev.text} if ev.text else {}
                else:
                    choice.update(text=ev.text, logprobs=None)
                if ev.finish_reason == "error":
                    choice["error"] = ev.error
                yield _sse_line(_chunk(stream.request_id, kind, created, model_name, [choice]))
            done = True
            last = _chunk(stream.request_id, kind, created, model_name, [])
            last["usage"] = _usage(finals)  # as with OpenAI's stream_options.include_usage
            yield _sse_line(last)
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (or the response was cancelled)
                stream.abort()

    return app


class ServerThread:
    """uvicorn serving ``app`` from a thread (the engine loop keeps the main thread: see
    ``EngineLoop.run``); port 0 takes a free one (``url`` says which)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import threading

        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                    log_level=log_level))
        self.thread = threading.Thread(target=self.server.run, name="specdec-http", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the HTTP server could not start on {host}:{port} (see the "
                                   "log above)")
            time.sleep(0.02)
        bound = self.server.servers[0].sockets[0].getsockname()
        self.url = f"http://{bound[0]}:{bound[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


async def _abort_on_disconnect(request: Request, stream) -> None:
    while True:
        if await request.is_disconnected():
            stream.abort()
            return
        await asyncio.sleep(0.1)


def _chunk(rid: str, kind: str, created: int, model: str, choices: list) -> dict:
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}


def _sse_line(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


def _usage(finals) -> dict:
    finals = list(finals)
    prompt = finals[0].num_prompt_tokens if finals else 0
    ms = [ev.metrics for ev in finals if ev.metrics is not None]
    completion = sum(m.num_output_tokens for m in ms)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m.num_cached_tokens for m in ms[:1])},
            "drafted_tokens": sum(m.draft_tokens_proposed for m in ms),
            "accepted_tokens": sum(sum(m.accepted_by_depth) for m in ms)}
