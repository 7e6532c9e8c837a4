"""The `phrase` drafter: when the text generated so far ends inside a known phrase, propose the
rest of it. Useful for domain boilerplate (licence headers, API names, fixed answer formats).

    LLM(drafter="phrase", drafter_args={"phrases": ["Sincerely yours,", "import numpy as np"]})
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.drafters.base import BaseDrafter, DraftRequest, TargetInfo
from specdec.hookspecs import hookimpl
from specdec.tree import DraftTree


@dataclass
class PhraseState:
    checked: int = 0  # not needed by this drafter; shows where per-request state lives


class PhraseDrafter(BaseDrafter):
    name = "phrase"
    replay_safe = True  # propose only reads: the engine may retry a raising call per request
    # nothing per position (it reads token_ids): prefix-cache hits are reused as they are
    prefix_cache_safe = True

    def __init__(self, target: TargetInfo, phrases: list[str] | None = None,
                 token_phrases: list[list[int]] | None = None, min_match: int = 1) -> None:
        seqs = [list(p) for p in token_phrases or []]
        if phrases:
            if target.tokenizer is None:
                raise ValueError("phrases need a tokenizer; pass token_phrases instead")
            seqs += [target.tokenizer(p, add_special_tokens=False).input_ids for p in phrases]
        if not seqs or not all(seqs):
            raise ValueError("give at least one non-empty phrase (phrases or token_phrases)")
        if not isinstance(min_match, int) or min_match < 1:
            raise ValueError(f"min_match must be an int >= 1, got {min_match!r}")
        self.phrases = seqs
        self.min_match = min_match

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> PhraseState:
        return PhraseState()

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, r: DraftRequest) -> DraftTree:
        continuations = []
        for phrase in self.phrases:
            k = _longest_overlap(r.token_ids, phrase, self.min_match)
            if k and k < len(phrase):
                continuations.append(phrase[k:])
        return DraftTree.from_paths([c[:r.budget.depth_limit] for c in continuations],
                                    max_nodes=r.budget.max_nodes)


def _longest_overlap(tokens: list[int], phrase: list[int], min_match: int) -> int:
    """Largest k >= min_match such that tokens end with phrase[:k] (0 if none)."""
    for k in range(min(len(phrase) - 1, len(tokens)), min_match - 1, -1):
        if tokens[-k:] == phrase[:k]:
            return k
    return 0


@hookimpl
def specdec_drafters() -> dict:
    return {"phrase": PhraseDrafter}
