"""Log-probabilities in OpenAI's shapes, from the engine's ``TokenLogprob`` (the target's raw
log-softmax: specdec.logits.logprobs).

Chat (``logprobs: true``, ``top_logprobs: k``)::

    {"content": [{"token": "Hi", "logprob": -0.3, "bytes": [72, 105],
                  "top_logprobs": [{"token": "Hi", "logprob": -0.3, "bytes": [72, 105]}, ...]}],
     "refusal": null}

Completions (``logprobs: k``; with ``echo`` the prompt's tokens come first, the very first with
no figures)::

    {"tokens": ["Hi"], "token_logprobs": [-0.3], "top_logprobs": [{"Hi": -0.3, ...}],
     "text_offset": [0]}

A token's text is its bytes decoded as UTF-8 (a byte-level token holding part of a character
reads as U+FFFD; ``bytes`` has it exactly)."""

from __future__ import annotations

from collections.abc import Callable

from specdec.outputs import TokenLogprob

TokenBytes = Callable[[list[int]], list[bytes]]


def chat_logprobs(entries: list[TokenLogprob], token_bytes: TokenBytes) -> dict:
    content = []
    for lp in entries:
        ids = [lp.token_id, *(i for i, _ in lp.top)]
        raw = token_bytes(ids)
        content.append({"token": _text(raw[0]), "logprob": lp.logprob, "bytes": list(raw[0]),
                        "top_logprobs": [{"token": _text(b), "logprob": v, "bytes": list(b)}
                                         for b, (_, v) in zip(raw[1:], lp.top)]})
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """A choice's logprobs, grown token by token (``text_offset`` runs on across calls)."""

    def __init__(self, token_bytes: TokenBytes, k: int) -> None:
        self.token_bytes, self.k = token_bytes, k
        self.offset = 0

    def add(self, ids: list[int], entries: list[TokenLogprob | None]) -> dict:
        """The figures of ``ids`` (``entries[i]`` None: a prompt's first token)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in zip(ids, entries):
            text = _text(self.token_bytes([token])[0])
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(lp.logprob)
            top = {}
            for b, (_, v) in zip(self.token_bytes([i for i, _ in lp.top]), lp.top):
                top.setdefault(_text(b), v)
            out["top_logprobs"].append(top)
        return out


def merge(parts: list[dict]) -> dict:
    """Completion logprobs of consecutive pieces as one."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key].extend(part[key])
    return out


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")
