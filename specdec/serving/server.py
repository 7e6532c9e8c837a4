"""``specdec serve``: an OpenAI-compatible HTTP server over the engine loop.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (whole responses, or server-sent
events with ``"stream": true``: specdec.serving.responses), ``GET /v1/models``, ``/health``,
``/metrics`` (Prometheus) and ``/openapi.json``. FastAPI + uvicorn; the engine steps in its own
thread (``specdec.serving.engine_loop``), every client's tokens stream out as they are
committed, and a client that disconnects has its request aborted and its pages freed before
the next step.

Safe by default: it binds 127.0.0.1 unless told otherwise; with API keys (``--api-key`` or
``$SPECDEC_API_KEY``) every route but ``/health`` needs ``Authorization: Bearer <key>``, and each
key's prefix cache is its own (specdec.serving.tenants); bodies, JSON depth, stop strings and
``max_tokens`` are capped (specdec.serving.limits); a full queue or a draining server answers
503; anything malformed or not served is a 400 naming the field, every error OpenAI-shaped
(specdec.serving.errors). Prompts are tokenized off the event loop. ``usage`` carries the
speculation figures of the request (``drafted_tokens``, ``accepted_tokens``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from specdec.models.tokenizer import chat_token_ids
from specdec.sampling_params import RequestError, SamplingParams
from specdec.serving.engine_loop import EngineLoop, QueueFullError, ShuttingDownError
from specdec.serving.errors import APIError, install_error_handlers, validation_error
from specdec.serving.limits import ServerLimits, check_stops, parse_json, read_body
from specdec.serving.metrics import Metrics
from specdec.serving.options import constraint, logit_options, request_field
from specdec.serving.protocol import ChatRequest, CompletionRequest, accepted_fields
from specdec.serving.responses import Job, collect, sse
from specdec.serving.tenants import AuthMiddleware, cache_salt

__all__ = ["ServerLimits", "ServerThread", "create_app"]


def create_app(loop: EngineLoop, model_name: str,
               api_key: str | Sequence[str] | None = None,
               limits: ServerLimits | None = None) -> FastAPI:
    """The app over ``loop``; ``api_key``: one key, several (each a tenant) or None (open)."""
    limits = limits or ServerLimits()
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    metrics = Metrics(loop)
    loop.on_finish.append(metrics.finished)  # every request, also those whose client left
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None)
    app.state.loop, app.state.metrics = loop, metrics
    install_error_handlers(app)
    app.add_middleware(AuthMiddleware, keys=keys)
    app.openapi = partial(_openapi, app)
    _add_status_routes(app, loop, model_name, metrics)
    routes = _Completions(loop, model_name, limits)
    app.post("/v1/completions", openapi_extra=_body("CompletionRequest"))(routes.completions)
    app.post("/v1/chat/completions", openapi_extra=_body("ChatRequest"))(routes.chat)
    return app


def _add_status_routes(app: FastAPI, loop: EngineLoop, model_name: str,
                       metrics: Metrics) -> None:
    """``/health``, ``/v1/models`` and ``/metrics``."""
    @app.get("/health")
    async def health():
        if loop.ended:
            return JSONResponse({"status": "error", "error": "the engine loop has stopped"},
                                status_code=503)
        if loop.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    started = int(time.time())  # the model's "created": when this server began serving it
    config = loop.engine.config
    # what the server runs, for clients that report it (specdec bench-serve): beyond OpenAI's
    # fields, which clients ignore
    speculation = {"drafter": config.drafter, "controller": config.controller_name,
                   "verifier": config.verifier}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": started, "owned_by": "specdec",
                                            "speculation": speculation}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


class _Completions:
    """The two generating routes: a body parsed and checked, its prompts tokenized off the
    event loop, submitted to the engine loop, answered whole or streamed."""

    def __init__(self, loop: EngineLoop, model_name: str, limits: ServerLimits) -> None:
        self.loop, self.model_name, self.limits = loop, model_name, limits
        self.engine = loop.engine
        self.max_model_len = self.engine.parts.max_model_len
        self.max_tokens_cap = min(limits.max_tokens or self.max_model_len, self.max_model_len)
        # one thread: a long prompt's tokenization never stalls the event loop (every stream)
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="specdec-tokenize")

    async def completions(self, request: Request):
        req = await self.parse(request, CompletionRequest)
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, "prompt: no prompt given", param="prompt")
        if len(prompts) > self.limits.max_prompts:
            raise APIError(400, f"prompt: {len(prompts)} prompts; at most "
                                f"{self.limits.max_prompts} in one request", param="prompt")
        tokenizer = self.engine.tokenizer
        if tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise APIError(400, "this model has no tokenizer: send the prompt as token "
                                "ids", param="prompt")
        ids = await self.off_loop(self.tokenize, prompts)
        echo = None
        if req.echo:  # each prompt's text as given (token ids decoded)
            echo = [p if isinstance(p, str) else "" if tokenizer is None else tokenizer.decode(p)
                    for p in prompts]
        return await self.respond(request, self.submit(request, req, ids, False, "prompt", echo),
                                  req.stream)

    async def chat(self, request: Request):
        req = await self.parse(request, ChatRequest)
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template",
                           param="messages")
        messages = [m.for_template() for m in req.messages]
        try:
            ids = await self.off_loop(chat_token_ids, self.engine.tokenizer, messages)
        except TemplateError as e:  # e.g. the template's own "roles must alternate"
            raise APIError(400, f"messages: the chat template refused them: {e}",
                           param="messages") from None
        except ValueError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        return await self.respond(request, self.submit(request, req, [ids], True, "messages"),
                                  req.stream)

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing,
                                                                partial(fn, *args))

    def tokenize(self, texts: list) -> list[list[int]]:
        return [p if isinstance(p, list) else self.engine.tokenizer(p).input_ids for p in texts]

    async def parse(self, request: Request, model):
        data = parse_json(await read_body(request, self.limits.max_body_bytes),
                          self.limits.max_json_depth)
        fields = accepted_fields(data, model.REFUSED)
        try:
            req = model.model_validate(fields)
        except ValidationError as e:
            raise validation_error(e, fields) from None
        if req.model not in (None, self.model_name):
            raise APIError(404, f"model {req.model!r} is not served here; this server serves "
                                f"{self.model_name!r}", param="model")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed with \"stream\": true",
                           param="stream_options")
        check_stops(req.stop, self.limits)
        await self.check_tokenizer_needs(req)
        return req

    async def check_tokenizer_needs(self, req) -> None:
        """Stop strings, bans and logprobs need a tokenizer; a grammar compiles (off the event
        loop: the engine then finds it checked)."""
        engine = self.engine
        if req.stop and engine.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none",
                           param="stop")
        field, spec = constraint(req)
        if spec is not None:
            try:
                await self.off_loop(engine.logits.grammars.check, spec)
            except ValueError as e:
                raise APIError(400, f"{field}: {e}", param=field) from None
        for name in ("bad_words", "logprobs", "prompt_logprobs"):
            if getattr(req, name, None) and engine.tokenizer is None:
                raise APIError(400, f"{name} needs a tokenizer; this model has none",
                               param=name)

    def sampling(self, req, prompt_len: int, salt: str | None, param: str) -> SamplingParams:
        """The request's SamplingParams (a RequestError naming the field: see ``submit``).
        Asked-for tokens beyond the context are a 400 naming the limits, as OpenAI's and
        vLLM's; unless asked, up to the rest of the context."""
        asked = req.max_completion_tokens or req.max_tokens
        name = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        if asked is not None and asked > self.max_tokens_cap:
            raise APIError(400, f"{name}={asked} exceeds this server's limit "
                                f"{self.max_tokens_cap}", param=name)
        if asked is not None and prompt_len < self.max_model_len < prompt_len + asked:
            raise context_length_error(self.max_model_len, prompt_len, asked, param, name)
        max_tokens = asked or max(1, min(self.max_tokens_cap, self.max_model_len - prompt_len))
        return SamplingParams(temperature=float(req.temperature), top_p=float(req.top_p),
                              top_k=req.top_k, min_p=float(req.min_p), n=req.n, seed=req.seed,
                              max_tokens=max_tokens, stop=req.stops(), ignore_eos=req.ignore_eos,
                              cache_salt=salt, **logit_options(req))

    def submit(self, request: Request, req, prompts: list[list[int]], chat: bool,
               param: str, echo: list[str] | None = None) -> Job:
        job = Job(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", chat, self.model_name,
                  int(time.time()), req.n, [], req.include_usage,
                  top_logprobs=(req.top_logprobs or 0) if chat and req.logprobs else
                  None if chat else req.logprobs, token_bytes=self.engine.logits.token_bytes,
                  echo=echo)
        try:
            self._submit_each(request, req, prompts, param, job)
        except QueueFullError as e:
            job.abort()
            raise APIError(503, f"the server is busy: {e}", kind="server_busy",
                           headers={"Retry-After": "1"}) from None
        except ShuttingDownError as e:
            job.abort()
            raise APIError(503, str(e)) from None
        except APIError:
            job.abort()
            raise
        return job

    def _submit_each(self, request: Request, req, prompts: list[list[int]], param: str,
                     job: Job) -> None:
        salt = cache_salt(getattr(request.state, "tenant", None), req.cache_salt)
        for i, ids in enumerate(prompts):
            name = param if len(prompts) == 1 else f"{param}.{i}"
            try:
                params = self.sampling(req, len(ids), salt, name)
                job.streams.append(self.loop.submit(
                    ids, params, job.id if len(prompts) == 1 else f"{job.id}-{i}"))
            except RequestError as e:  # SamplingParams' or the engine's: the field named
                field = request_field(req, e.field, name)
                raise APIError(400, f"{field or 'request'}: {e}", param=field) from None
            except ValueError as e:  # a check that names no field: still the client's
                raise APIError(400, str(e)) from None

    async def respond(self, request: Request, job: Job, stream: bool):
        if stream:
            return StreamingResponse(sse(job), media_type="text/event-stream")
        return await collect(request, job)


def context_length_error(max_model_len: int, prompt_len: int, asked: int, param: str,
                         name: str) -> APIError:
    """OpenAI's (and vLLM's) answer to a prompt plus ``max_tokens`` beyond the context."""
    where = "messages" if param == "messages" else "prompt"
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                         f"However, you requested {prompt_len + asked} tokens ({prompt_len} in "
                         f"the {where}, {asked} in the completion). Please reduce the length of "
                         f"the {where} or {name}.", param=name, code="context_length_exceeded")


def _body(model: str) -> dict:
    """The request body's schema in /openapi.json (the routes parse bodies themselves, to name
    fields as the client wrote them)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model}"}}}}}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (CompletionRequest, ChatRequest):
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        app.openapi_schema = schema
    return app.openapi_schema


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
