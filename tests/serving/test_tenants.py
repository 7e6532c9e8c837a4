"""Tenants: with API keys each key's prompts hit only its own cached pages (a salt derived from
the key, which a request's own cache_salt narrows), so cached_tokens says nothing of another
tenant's prompts; a wrong or missing key is a 401."""

from __future__ import annotations

import httpx
import pytest
import serving_helpers
from serving_helpers import error_of

from specdec.serving.tenants import cache_salt, tenant_salt

chat_model_dir, make_server = serving_helpers.chat_model_dir, serving_helpers.make_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = list(range(5, 30))  # 25 tokens: six full pages of 4


def _cached(s, key: str, **extra) -> int:
    r = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, **extra}, key=key)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_count_only_hits_within_the_tenant(make_server):
    s = make_server(keys=("key-a", "key-b"))
    assert _cached(s, "key-a") == 0
    assert _cached(s, "key-b") == 0, "tenant b was told what tenant a's prompt cached"
    assert _cached(s, "key-a") == 24 and _cached(s, "key-b") == 24  # each its own pages
    # a request's own salt narrows its tenant's namespace; it never joins another tenant's
    assert _cached(s, "key-a", cache_salt="x") == 0
    assert _cached(s, "key-b", cache_salt="x") == 0
    assert _cached(s, "key-a", cache_salt="x") == 24


def test_keys_are_checked_and_health_is_open(make_server):
    s = make_server(keys=("key-a", "key-b"))
    for headers in ({}, {"Authorization": "Bearer key-c"}, {"Authorization": "key-a"}):
        r = httpx.get(s.url + "/v1/models", headers=headers, timeout=10)
        assert error_of(r, 401)["type"] == "authentication_error"
    for key in ("key-a", "key-b"):
        assert httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=10).status_code == 200
    assert httpx.get(s.url + "/health", timeout=10).json() == {"status": "ok"}


def test_salts_hide_the_key_and_never_collide():
    a, b = tenant_salt("key-a"), tenant_salt("key-b")
    assert a != b and "key-a" not in a and len(a) == len(b)
    assert cache_salt(None, None) is None and cache_salt(None, "x") == "x"
    assert cache_salt(a, None) == a and cache_salt(a, "x") not in (a, "x", cache_salt(b, "x"))
