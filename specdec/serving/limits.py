"""What one request may cost the server before the engine sees it: the body's size (checked
against Content-Length before a byte is read, and counted while a chunked body arrives), its
JSON's nesting depth, text that is not text (lone UTF-16 surrogates), the number and length of
stop strings (each costs the engine thread work at every token) and of prompts in one
completions request. Each beyond its limit is a 400 (413 for the body) naming the field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from starlette.requests import Request

from specdec.serving.errors import APIError

# a JSON escape of a UTF-16 surrogate (\uD800..\uDFFF): the only way a lone one gets in
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int | None = None  # the largest max_tokens asked; None: up to max_model_len
    max_json_depth: int = 32  # objects and arrays nested
    max_stops: int = 16  # stop strings of one request
    max_stop_chars: int = 256  # characters of one stop string
    max_prompts: int = 64  # prompts of one completions request

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_stops", "max_stop_chars",
                     "max_prompts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be None or an int >= 1, got {self.max_tokens}")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed ``limit`` bytes: from its
    Content-Length before reading, or while reading a chunked one."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {int(declared)} bytes exceeds the limit of "
                            f"{limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes")
    return bytes(body)


def parse_json(body: bytes, max_depth: int) -> dict:
    """The body as a JSON object; 400 for malformed JSON, nesting beyond ``max_depth`` or a
    lone surrogate in a string (naming the field it is in)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON: {e}") from None
    except RecursionError:
        raise APIError(400, f"the JSON nests deeper than {max_depth} levels") from None
    # cheap first: fewer brackets than the limit cannot nest beyond it
    if body.count(b"[") + body.count(b"{") > max_depth and _depth(data) > max_depth:
        raise APIError(400, f"the JSON nests deeper than {max_depth} levels")
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body):
        path = _lone_surrogate(data, ())
        if path is not None:
            param = ".".join(path) or None
            raise APIError(400, f"{param}: a lone UTF-16 surrogate is not text (a character "
                                "outside the BMP is a pair: \\ud83d\\ude00)", param=param)
    return data


def _depth(data) -> int:
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            values = node.values() if isinstance(node, dict) else node
            stack.extend((v, depth + 1) for v in values if isinstance(v, (dict, list)))
    return deepest


def _lone_surrogate(node, path: tuple) -> tuple | None:
    """The path of the first string (or key) holding a lone surrogate; the depth is bounded."""
    if isinstance(node, str):
        return None if _is_text(node) else path
    if isinstance(node, dict):
        for key, value in node.items():
            if not _is_text(key):
                return (*path, key.encode("utf-8", "backslashreplace").decode())
            found = _lone_surrogate(value, (*path, key))
            if found is not None:
                return found
    if isinstance(node, list):
        for i, value in enumerate(node):
            found = _lone_surrogate(value, (*path, str(i)))
            if found is not None:
                return found
    return None


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_stops(stop, limits: ServerLimits) -> None:
    """400 for more stop strings than ``max_stops`` or one longer than ``max_stop_chars``."""
    if stop is None:
        return
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > limits.max_stops:
        raise APIError(400, f"stop: {len(stops)} stop strings; at most {limits.max_stops} are "
                            "allowed", param="stop")
    for i, s in enumerate(stops):
        if len(s) > limits.max_stop_chars:
            param = "stop" if isinstance(stop, str) else f"stop.{i}"
            raise APIError(400, f"{param}: a stop string of {len(s)} characters; at most "
                                f"{limits.max_stop_chars} are allowed", param=param)
