"""Errors as OpenAI's API writes them: ``{"error": {"message", "type", "param", "code"}}`` with
``param`` the field as the client wrote it (``"temperature"``, ``"messages.0.content"``), for
every status the server answers with (400, 401, 404, 405, 413, 422, 500, 503), raised by the
routes (``APIError``) or by the framework (unknown route, wrong method, an unexpected
exception)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

# OpenAI's error types by status (the rest are invalid_request_error)
KINDS = {401: "authentication_error", 404: "not_found_error", 500: "server_error",
         503: "server_error"}

log = logging.getLogger("specdec.serving")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str | None = None, headers: dict | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or KINDS.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def field_param(loc: tuple, data, missing: bool = False) -> str | None:
    """The field a pydantic error location names, as the client wrote it: the location walked
    through the request's own JSON, dropping what pydantic adds (union members such as "float"
    or "list[int]"). ``missing``: the error is a missing field (its name is not in the data).

    >>> field_param(("stop", "list[str]", 1), {"stop": ["a", 2]})
    'stop.1'
    """
    path, node = [], data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(str(part))
            node = node[part]
        elif missing and isinstance(node, dict) and i == len(loc) - 1:
            path.append(str(part))
    return ".".join(path) or None


def validation_error(e: ValidationError, data) -> APIError:
    """pydantic's most specific error (the deepest field: a union's member error names the
    item, e.g. "stop.1", where its first error says only "stop") as a 400 naming its field."""
    # missing, or a left-out field whose default failed (its input None): not in the data
    named = [(field_param(err["loc"], data, missing=err["type"] == "missing"
                          or err.get("input", 0) is None), err) for err in e.errors()]
    param, err = max(named, key=lambda pe: len((pe[0] or "").split(".")))
    if err["type"] == "extra_forbidden":
        return APIError(400, f"{param}: unknown field (this server does not read it)",
                        param=param)
    got = "" if err["type"] == "missing" else f" (got {_short(err.get('input'))})"
    return APIError(400, f"{param or 'request'}: {err['msg']}{got}", param=param)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app answers with, OpenAI-shaped."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
                       exc.status_code, str(exc.detail))
        return APIError(exc.status_code, message, headers=exc.headers).response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError):
        err = (exc.errors() or [{}])[0]
        param = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
        return APIError(422, f"{param or 'request'}: {err.get('msg', 'invalid')}",
                        param=param).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.error("unexpected error serving %s %s", request.method, request.url.path,
                  exc_info=exc)
        return APIError(500, f"internal server error ({type(exc).__name__}); the server log "
                             "has the details").response()
