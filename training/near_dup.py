"""Near-duplicate prompts: word-shingle Jaccard similarity, found with MinHash LSH.

A prompt is normalised (NFKC, lower case, words = runs of letters and digits) and cut into word
``n``-grams (shingles; a text shorter than ``n`` words is one shingle). Two prompts are near
duplicates when the Jaccard similarity of their shingle sets, |A ∩ B| / |A ∪ B|, is at least the
threshold. Candidates come from MinHash signatures (``num_perm`` multiply-shift hashes) split into
``bands`` bands: two prompts whose signatures agree on a whole band are compared exactly, so
every reported pair's similarity is exact; a pair at the threshold is missed with probability
(1 - J^r)^b (r = num_perm / bands rows a band: with the defaults 128 / 32 and J = 0.5, 0.13 %).

    near_duplicates(queries, corpus, threshold)   pairs between two lists of prompts
    near_duplicates(texts, None, threshold)       pairs within one list
    ngram_overlap(queries, corpus, n=13)          shared long n-grams: contamination check

Pure Python and numpy; ~25k prompts take seconds on one core.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

WORD = re.compile(r"\w+")
SHINGLE = 3  # words per shingle
NUM_PERM = 128
BANDS = 32
DEFAULT_THRESHOLD = 0.5  # Jaccard of word 3-grams (see docs/training.md, "Held-out split")


def words(text: str) -> list[str]:
    return WORD.findall(unicodedata.normalize("NFKC", text).lower())


def _h64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little")


def shingles(text: str, n: int = SHINGLE) -> frozenset[int]:
    """64-bit hashes of the text's word n-grams (one shingle when it has fewer than n words;
    none when it has no word)."""
    w = words(text)
    if not w:
        return frozenset()
    if len(w) <= n:
        return frozenset((_h64(" ".join(w)),))
    return frozenset(_h64(" ".join(w[i:i + n])) for i in range(len(w) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    if not a and not b:
        return 0.0
    inter = len(a & b)
    return inter / (len(a) + len(b) - inter)


class MinHasher:
    """``num_perm`` multiply-shift hashes of 64-bit shingles (the top 32 bits of a * x + b mod
    2^64, a odd); a set's signature is each hash's minimum over it."""

    def __init__(self, num_perm: int = NUM_PERM, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.a = rng.integers(0, 2**63, num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self.b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
        self.num_perm = num_perm

    def signatures(self, sets: Sequence[frozenset]) -> np.ndarray:
        """[len(sets), num_perm] uint32; an empty set's row is all 2^32 - 1 (matches nothing
        but other empty sets, which are never reported)."""
        out = np.full((len(sets), self.num_perm), np.iinfo(np.uint32).max, dtype=np.uint32)
        with np.errstate(over="ignore"):
            for i, s in enumerate(sets):
                if s:
                    x = np.fromiter(s, dtype=np.uint64, count=len(s))
                    h = (x[:, None] * self.a[None, :] + self.b[None, :]) >> np.uint64(32)
                    out[i] = h.min(axis=0).astype(np.uint32)
        return out


@dataclass(frozen=True)
class Match:
    query: int  # index in the queries
    other: int  # index in the corpus (or in the same list, other > query)
    jaccard: float
    containment: float  # share of the query's shingles found in the other: |A ∩ B| / |A|


def _buckets(sig: np.ndarray, bands: int, live: np.ndarray):
    rows = sig.shape[1] // bands
    for band in range(bands):
        part = np.ascontiguousarray(sig[:, band * rows:(band + 1) * rows])
        table: dict[bytes, list[int]] = defaultdict(list)
        for i in np.flatnonzero(live):
            table[part[i].tobytes()].append(int(i))
        yield band, table, part


def near_duplicates(queries: Sequence[str], corpus: Sequence[str] | None = None,
                    threshold: float = DEFAULT_THRESHOLD, *, n: int = SHINGLE,
                    num_perm: int = NUM_PERM, bands: int = BANDS, seed: int = 0) -> list[Match]:
    """Every (query, corpus text) pair with shingle Jaccard >= threshold, sorted by query then
    other; with ``corpus`` None, the pairs within ``queries`` (query < other)."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    if num_perm % bands:
        raise ValueError(f"bands ({bands}) must divide num_perm ({num_perm})")
    hasher = MinHasher(num_perm, seed)
    qsets = [shingles(t, n) for t in queries]
    qsig = hasher.signatures(qsets)
    within = corpus is None
    csets = qsets if within else [shingles(t, n) for t in corpus]
    csig = qsig if within else hasher.signatures(csets)
    qlive = np.array([bool(s) for s in qsets], dtype=bool)
    clive = qlive if within else np.array([bool(s) for s in csets], dtype=bool)
    candidates: set[tuple[int, int]] = set()
    rows = num_perm // bands
    for band, table, _ in _buckets(csig, bands, clive):
        qpart = qsig[:, band * rows:(band + 1) * rows]
        for i in np.flatnonzero(qlive):
            for j in table.get(qpart[i].tobytes(), ()):
                if not within or j > i:
                    candidates.add((int(i), j))
    out = []
    for i, j in sorted(candidates):
        a, b = qsets[i], csets[j]
        inter = len(a & b)
        sim = inter / (len(a) + len(b) - inter)
        if sim >= threshold:
            out.append(Match(i, j, sim, inter / len(a)))
    return out


def ngram_overlap(queries: Sequence[str], corpus: Sequence[str], n: int = 13) -> list[float]:
    """Per query, the share of its word n-grams found anywhere in the corpus (a query shorter
    than n words counts as one n-gram: found if the corpus has it as a whole text's n-gram or
    as a whole short text). 13 words is the usual contamination test's window."""
    seen: set[int] = set()
    for text in corpus:
        seen.update(shingles(text, n))
    out = []
    for text in queries:
        s = shingles(text, n)
        out.append(sum(h in seen for h in s) / len(s) if s else 0.0)
    return out


def prompt_text(messages: Sequence[dict]) -> str:
    """The text a near-duplicate test compares: a chat's user and system turns."""
    return "\n".join(m["content"] for m in messages if m["role"] != "assistant")


def drop_near_duplicates(train_texts: Sequence[str], held_texts: Sequence[str],
                         threshold: float = DEFAULT_THRESHOLD) -> list[int]:
    """Indices of the training texts near-duplicate (Jaccard >= threshold) to any held-out
    text, ascending: what a split removes from its training side."""
    if not train_texts or not held_texts:
        return []
    return sorted({m.query for m in near_duplicates(train_texts, held_texts, threshold)})
