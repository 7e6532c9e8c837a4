"""What the drafter tests share: prompts, a greedy float64 run, and a spy on proposals."""

from __future__ import annotations

from specdec import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 5, 6], [3, 4, 3, 4, 3], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9],
           [11, 12], [7, 7, 7, 7], [40, 41, 42, 40, 41], [60]]


def greedy(folder, prompts, **kw) -> list:
    """Greedy float64 outputs (24 tokens, static controller unless given), none failed."""
    llm = LLM(model=str(folder), dtype="float64", **{"controller": "static", **kw})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert [o.error for o in outs] == [None] * len(prompts)
    return outs


def record_proposals(monkeypatch, drafter_cls) -> list:
    """Record (token ids, budget, tree) of every proposal of ``drafter_cls``."""
    seen = []
    original = drafter_cls.propose

    def spy(self, requests):
        trees = original(self, requests)
        seen.extend((r.token_ids.tolist(), r.budget, t) for r, t in zip(requests, trees))
        return trees

    monkeypatch.setattr(drafter_cls, "propose", spy)
    return seen
