"""Token sequences one after another in one int32 array, with the positions of every token.

The suffix drafter's store (drafters/suffix.py): one corpus per request (its prompt and output)
and one per ``cache_salt`` for the history of finished requests. Documents are separated by
``SEP`` and a removed document's tokens become ``DEAD``: neither equals a token, so a match or a
continuation never crosses a document's end. Example, documents [5, 6, 7] and [6, 8]::

    buf       = [5, 6, 7, -1, 6, 8, -1]
    positions(6) = [1, 4]                     (most recent last)
    continuations([1, 4], 3) = [[7, -1, -1], [8, -1, -1]]

Lookups. Positions below ``n_sorted`` are found by binary search in ``order`` (every position
sorted by token, then position); the tail after it by a vectorised scan. The sort is redone when
the tail outgrows a quarter of the sorted part, so appending costs amortised O(log n) per token
and a lookup O(log n + tail), never a Python loop over the corpus.
"""

from __future__ import annotations

import numpy as np

SEP = -1  # after every finished document
DEAD = -2  # the tokens of a removed document, until the next compaction
MIN_TAIL = 2048  # tokens scanned linearly before the first sort


class TokenCorpus:
    """Documents of token ids, appended at the end; removed ones are blanked (``remove``)."""

    def __init__(self, capacity: int = 256) -> None:
        self.buf = np.empty(capacity, dtype=np.int32)  # [capacity] int32; buf[:n] is live
        self.n = 0
        self.order = np.empty(0, dtype=np.int32)  # [m] int32 positions sorted by (token, pos)
        self.keys = np.empty(0, dtype=np.int32)  # [m] int32 = buf[order] when sorted
        self.n_sorted = 0  # positions < n_sorted are in `order`
        self.dead = 0  # blanked tokens (removed documents) still in buf
        self._addresses: tuple[int, int, int] | None = None  # of buf, order, keys (addresses())

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes + self.order.nbytes + self.keys.nbytes

    def addresses(self) -> tuple[int, int, int]:
        """The data addresses of ``buf``, ``order`` and ``keys`` (for the compiled speculation,
        drafters/suffix_native.py), kept until one of them is replaced."""
        if self._addresses is None:
            self._addresses = (self.buf.ctypes.data, self.order.ctypes.data,
                               self.keys.ctypes.data)
        return self._addresses

    def append(self, tokens) -> None:
        """Append token ids (a list or an int array) to the last document."""
        k = len(tokens)
        if self.n + k > self.buf.size:
            grown = np.empty(max(2 * self.buf.size, self.n + k), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf, self._addresses = grown, None
        self.buf[self.n : self.n + k] = tokens
        self.n += k
        if self.n - self.n_sorted > max(MIN_TAIL, self.n_sorted // 4):
            self._sort()

    def end_document(self) -> None:
        self.append([SEP])

    def remove(self, start: int, length: int) -> None:
        """Blank the document at ``buf[start:start + length]`` (its separator stays)."""
        self.buf[start : start + length] = DEAD
        self.dead += length

    def compacted(self, spans: list[tuple[int, int]]) -> tuple[TokenCorpus, list[int]]:
        """A new corpus with only the documents ``spans`` ((start, length), in order) and their
        new starts."""
        out = TokenCorpus(max(256, sum(n + 1 for _, n in spans)))
        starts = []
        for start, length in spans:
            starts.append(out.n)
            out.append(self.buf[start : start + length])
            out.end_document()
        out._sort()
        return out, starts

    def positions(self, token: int, cap: int) -> np.ndarray:
        """[k] int64: the latest ``cap`` positions holding ``token``, in increasing order."""
        key = np.int32(token)  # a Python int would cast all of `keys` to int64 first
        lo = int(np.searchsorted(self.keys, key, "left"))
        hi = int(np.searchsorted(self.keys, key, "right"))
        tail = np.flatnonzero(self.buf[self.n_sorted : self.n] == token) + self.n_sorted
        if len(tail) >= cap:
            return tail[len(tail) - cap :]
        head = self.order[max(lo, hi - (cap - len(tail))) : hi].astype(np.int64)
        if self.dead:  # blanked documents stay in `order` until the next sort
            head = head[self.buf[head] == token]
        return np.concatenate([head, tail]) if len(tail) else head

    def match_lengths(self, ends: np.ndarray, pattern: np.ndarray) -> np.ndarray:
        """[k] int64: for each position in ``ends`` (where ``pattern[-1]`` occurs), how many of
        the pattern's last tokens end there (>= 1). Example: buf [3, 4, 5, 4, 5], pattern
        [3, 4, 5], ends [2, 4] -> [3, 2]."""
        lengths = np.ones(len(ends), dtype=np.int64)
        alive = np.arange(len(ends))
        for j in range(1, len(pattern)):
            at = ends[alive] - j
            ok = at >= 0
            ok[ok] = self.buf[at[ok]] == pattern[-1 - j]
            alive = alive[ok]
            if not len(alive):
                break
            lengths[alive] += 1
        return lengths

    def continuations(self, ends: np.ndarray, depth: int) -> np.ndarray:
        """[k, depth] int64: the tokens after each position in ``ends``, -1 from the first
        separator, blanked token or the corpus end on."""
        at = ends[:, None] + 1 + np.arange(depth)
        inside = at < self.n
        out = np.where(inside, self.buf[np.minimum(at, self.n - 1)], SEP).astype(np.int64)
        out[np.cumsum(out < 0, axis=1) > 0] = SEP
        return out

    def _sort(self) -> None:
        order = np.argsort(self.buf[: self.n], kind="stable").astype(np.int32)
        keys = self.buf[order]
        first = int(np.searchsorted(keys, 0, "left"))  # separators and blanks sort first
        self.order, self.keys, self.n_sorted = order[first:], keys[first:], self.n
        self._addresses = None
