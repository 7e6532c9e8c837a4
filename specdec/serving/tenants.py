"""API keys and tenants. With keys configured every route but ``/health`` needs
``Authorization: Bearer <key>`` (401 otherwise), and each key is a tenant: its requests' prefix
cache pages are keyed with a salt derived from the key (a hash: the key itself is never part of
a page key, which the disk tier stores), so a tenant's prompts hit only its own cached pages and
``cached_tokens`` says nothing of another's. A request's own ``cache_salt`` narrows that further
(combined with the key's, never replacing it)."""

from __future__ import annotations

import hashlib
import secrets

from specdec.serving.errors import APIError

OPEN_PATHS = ("/health",)


def tenant_salt(key: str) -> str:
    return hashlib.sha256(b"specdec tenant\0" + key.encode()).hexdigest()[:32]


def cache_salt(tenant: str | None, requested: str | None) -> str | None:
    """The salt a request's pages are keyed with: the tenant's, narrowed by the request's own
    (the tenant's part has a fixed length, so no two pairs give one salt)."""
    if tenant is None:
        return requested
    return tenant if requested is None else f"{tenant}:{requested}"


class AuthMiddleware:
    """Pure ASGI (a BaseHTTPMiddleware would hide a client's disconnect from the routes):
    checks the key and puts its tenant salt in ``request.state.tenant``."""

    def __init__(self, app, keys: tuple[str, ...]) -> None:
        self.app = app
        self.salts = [(f"Bearer {k}".encode(), tenant_salt(k)) for k in keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.salts or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        tenant = None
        for expected, salt in self.salts:  # every key compared: the time says nothing
            if secrets.compare_digest(given, expected):
                tenant = salt
        if tenant is None:
            response = APIError(401, "missing or wrong API key (Authorization: Bearer <key>)"
                                ).response()
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
