"""Prompt lookup decoding: draft what followed earlier occurrences of the sequence's suffix.

Per request an index maps every n-gram (``min_ngram <= n <= max_ngram``) to the positions where
it ended, most recent last. It is extended only over tokens appended since the last call, so a
step costs O(new tokens), never a rescan of the prompt. Example, tokens [5, 6, 7, 5, 6] and
n in [1, 2]::

    index[(5,)] = [0, 3]    index[(6,)] = [1, 4]    index[(7,)] = [2]
    index[(5, 6)] = [1, 4]  index[(6, 7)] = [2]     index[(7, 5)] = [3]

    suffix (5, 6) ended before at 1 -> continuation tokens[2 : 2 + max_depth] = [7, 5, 6]

The continuations of up to ``max_matches`` most recent occurrences (those of the longest matching
n-gram first, then shorter ones while the budget is not used up) are merged into one trie; the
most recent match comes first, so it gets the budget. Drafts are deterministic (no draft_probs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.drafters.base import BaseDrafter, DraftRequest, TargetInfo, VerifiedBatch
from specdec.tree import DraftTree


@dataclass
class NgramState:
    """One request's n-gram index; it lives on the request (``Sequence.drafter_state``)."""

    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> end positions
    num_indexed: int = 0  # every n-gram ending before this position is in the index


class NgramDrafter(BaseDrafter):
    """Prompt lookup drafter; the arguments come from the user's ``drafter_args``.

    ``max_ngram``/``min_ngram``: suffix lengths tried, longest first. ``max_depth``: tokens per
    continuation. ``max_matches``: continuations merged into the tree (1 = always a chain).
    Defaults (min_ngram 2, one chain) were the fastest on MT-Bench with SmolLM2 on CPU: 1-gram
    matches are accepted too rarely to pay for their verification rows (docs/benchmarks.md).
    """

    name = "ngram"
    # propose and on_verified only extend the index past num_indexed (a repeat finds nothing
    # new) and read it: calling them twice for a request is as calling them once
    replay_safe = True
    prefix_cache_safe = True  # the index is built from token_ids, cached or not

    def __init__(self, target: TargetInfo, max_ngram: int = 4, min_ngram: int = 2,
                 max_depth: int = 8, max_matches: int = 1) -> None:
        _check_int("min_ngram", min_ngram, 1)
        _check_int("max_ngram", max_ngram, min_ngram, "min_ngram")
        _check_int("max_depth", max_depth, 1)
        _check_int("max_matches", max_matches, 1)
        self.target = target
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.max_depth, self.max_matches = max_depth, max_matches
        # occurrences looked at per n-gram length; repeats of one continuation do not count as
        # matches, so a long loop must not turn the scan into one over the whole history
        self.max_scan = 4 * max_matches + max_depth

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> NgramState:
        return NgramState()  # the prompt is indexed on first use, not at admission

    def on_verified(self, batch: VerifiedBatch) -> None:
        for r in batch.requests:
            self.extend(r.state, r.token_ids)

    def release(self, state: NgramState) -> None:
        state.index.clear()
        state.num_indexed = 0

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, request: DraftRequest) -> DraftTree:
        self.extend(request.state, request.token_ids)
        budget = request.budget
        paths = self.match(request.state, request.token_ids, budget.max_nodes)
        if not paths:
            return DraftTree.empty()
        depth = budget.depth_limit
        return DraftTree.from_paths([p[:depth] for p in paths], max_nodes=budget.max_nodes)

    def extend(self, state: NgramState, tokens: list[int]) -> None:
        """Index the n-grams ending at positions ``state.num_indexed .. len(tokens) - 1``."""
        assert len(tokens) >= state.num_indexed, "token lists only grow; a new request needs init_state"
        index, lo, hi = state.index, self.min_ngram, self.max_ngram
        for i in range(state.num_indexed, len(tokens)):
            for n in range(lo, min(hi, i + 1) + 1):
                key = tuple(tokens[i - n + 1 : i + 1])
                ends = index.get(key)
                if ends is None:
                    index[key] = [i]
                else:
                    ends.append(i)
        state.num_indexed = len(tokens)

    def match(self, state: NgramState, tokens: list[int], budget: int) -> list[list[int]]:
        """Continuations to draft, best first; [] when no suffix n-gram occurred before.

        ``tokens`` must be indexed (:meth:`extend`). Example, max_depth 2, tokens
        [1, 2, 3, 9, 1, 2, 4, 1, 2]: suffix (1, 2) ended at 5 and 1 -> [[4, 1], [3, 9]].
        """
        last = len(tokens) - 1
        paths: list[list[int]] = []
        seen: set[int] = set()
        for n in range(min(self.max_ngram, last), self.min_ngram - 1, -1):
            ends = state.index.get(tuple(tokens[last - n + 1 :]))
            if ends:
                self._collect(ends, tokens, paths, seen)
            if paths and (len(paths) >= self.max_matches or _num_nodes(paths) >= budget):
                break
        return paths

    def _collect(self, ends: list[int], tokens: list[int], paths: list[list[int]],
                 seen: set[int]) -> None:
        """Add the continuations after the most recent occurrences in ``ends``."""
        last, scanned = len(tokens) - 1, 0
        for p in reversed(ends):
            if len(paths) >= self.max_matches or scanned >= self.max_scan:
                return
            if p >= last or p in seen:  # the suffix itself, or found with a longer n-gram
                continue
            seen.add(p)
            scanned += 1
            _add_path(paths, tokens[p + 1 : p + 1 + self.max_depth])


def _add_path(paths: list[list[int]], cont: list[int]) -> None:
    """Add a continuation unless an earlier one already covers it; one it extends is replaced
    in place (an older occurrence of a loop runs further before hitting the sequence end)."""
    for j, old in enumerate(paths):
        if old[: len(cont)] == cont:
            return
        if cont[: len(old)] == old:
            paths[j] = cont
            return
    paths.append(cont)


def _num_nodes(paths: list[list[int]]) -> int:
    """Nodes of the trie the paths merge into."""
    return len({tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)})


def _check_int(name: str, value, low: int, low_name: str | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        bound = f"{low_name} = {low}" if low_name else str(low)
        raise ValueError(f"ngram drafter_args.{name} must be an int >= {bound}, got {value!r}")
