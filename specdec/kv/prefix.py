"""Content keys of full KV pages: what a page holds, named by everything that determines it.

The KV of slot i depends on tokens 0..i (and the model, its weights and numerics); a full page p
(slots p * page_size .. (p + 1) * page_size - 1) is therefore named by its parent page's key and
its own token ids::

    key(p) = H(key(p - 1) || tokens of page p)          key(-1) = root = H(namespace, salt)

``namespace`` names the model and everything that changes its KV (dtype, weights, activations);
``salt`` (``SamplingParams.cache_salt``) keeps tenants apart: different salts never share a page.
H is BLAKE2b-128. Two requests share page p exactly when they agree on every token up to the end
of page p, the namespace and the salt.

Example (page_size 4)::

    keys = []
    extend_keys(keys, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, root)   # 2 full pages -> 2 keys
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def root_key(namespace: str, salt: str | None = None) -> bytes:
    """The key every page chain starts from."""
    h = hashlib.blake2b(digest_size=16)
    h.update(namespace.encode())
    h.update(b"\x00salt\x00" if salt is None else b"\x01salt\x00" + salt.encode())
    return h.digest()


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def extend_keys(keys: list[bytes], tokens: Sequence[int], page_size: int, root: bytes,
                num_pages: int | None = None) -> list[bytes]:
    """Append the keys of the full pages of ``tokens`` not yet in ``keys`` (up to ``num_pages``
    pages); returns ``keys``."""
    full = len(tokens) // page_size
    if num_pages is not None:
        full = min(full, num_pages)
    for p in range(len(keys), full):
        keys.append(page_key(keys[p - 1] if p else root, tokens[p * page_size:(p + 1) * page_size]))
    return keys


def next_token_key(key: bytes, token: int) -> bytes:
    """The key of a page whose KV also depends on the token right after it (an EAGLE head's
    slot i is computed from token i + 1's embedding)."""
    return page_key(key, [token])
