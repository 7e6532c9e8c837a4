"""Shared by the serving tests: a served tiny chat model (word-level tokenizer, chat template,
random weights), servers made per test or module and stopped after, helpers to post raw bodies
and to check OpenAI-shaped errors."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

from specdec import LLM
from specdec.serving.engine_loop import EngineLoop
from specdec.serving.server import ServerLimits, ServerThread, create_app

USER = [{"role": "user", "content": "write a short poem about the sea"}]


@dataclass
class Served:
    llm: LLM
    loop: EngineLoop
    server: ServerThread
    keys: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return self.server.url

    def headers(self, key: str | None = None) -> dict:
        key = key or (self.keys[0] if self.keys else None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def post(self, path: str, body=None, key: str | None = None, **kw) -> httpx.Response:
        """``body``: a dict (as JSON) or bytes (as they are)."""
        headers = {**self.headers(key), "Content-Type": "application/json"}
        content = body if isinstance(body, bytes) else None
        kw.setdefault("timeout", 60)
        return httpx.post(self.url + path, json=None if content else body, content=content,
                          headers=headers, **kw)

    def openai(self, key: str | None = None):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0)

    def pages_back(self, timeout: float = 10.0) -> bool:
        import time

        engine, deadline = self.llm.engine, time.time() + timeout
        while time.time() < deadline:
            if not engine.requests and engine.kv.num_free_pages == engine.kv.num_pages:
                return True
            time.sleep(0.05)
        return False


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    from cli_helpers import make_tokenizer_model

    return make_tokenizer_model(tmp_path_factory.mktemp("serving_chat_model"))


def serve(model_dir, keys=(), limits=None, start=True, max_queued=256, **llm_kwargs) -> Served:
    llm = LLM(model=str(model_dir), dtype="float64", page_size=4, **llm_kwargs)
    loop = EngineLoop(llm.engine, max_queued=max_queued)
    if start:
        loop.start()
    server = ServerThread(create_app(loop, "tiny", list(keys) or None,
                                     limits or ServerLimits()))
    return Served(llm, loop, server, tuple(keys))


@pytest.fixture
def make_server(chat_model_dir):
    """make_server(keys=(), limits=None, start=True, **LLM kwargs) -> Served; stopped after."""
    made: list[Served] = []

    def make(**kwargs) -> Served:
        made.append(serve(chat_model_dir, **kwargs))
        return made[-1]

    yield make
    for s in made:
        s.server.stop()
        s.loop.shutdown()


@pytest.fixture(scope="module")
def served(chat_model_dir):
    """One server for a module's tests that leave it as they found it."""
    s = serve(chat_model_dir)
    yield s
    s.server.stop()
    s.loop.shutdown()


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of a response, checked for its status and shape."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def slow_steps(monkeypatch, engine, seconds: float = 0.02) -> None:
    """Each engine step takes at least ``seconds``: a request lasts long enough to act on it."""
    import time

    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    monkeypatch.setattr(engine, "step", step)
