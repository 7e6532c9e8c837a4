"""Serving: the OpenAI-compatible protocol (protocol.py) and HTTP server (server.py) over the
engine stepping in one thread (engine_loop.py), streaming deltas per request
(specdec.engine.streaming, shared with ``LLM.stream``)."""
