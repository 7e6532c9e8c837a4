"""The suffix drafter's history of finished requests (drafters/suffix_history.py): tenant
isolation by cache salt, the least-recently-used token bound, bounded memory, and what a
restarted or never-drafting request files."""

from __future__ import annotations

import numpy as np
import pytest
from suffix_helpers import TREE, propose

from specdec.drafters.suffix import SuffixDrafter
from specdec.drafters.suffix_history import SuffixHistory

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_history_keeps_salts_apart():
    h = SuffixHistory(1000)
    h.add("a", "r1", [1, 2, 3, 4])
    assert h.draft("a", np.array([1, 2]), 8, 8, TREE).tokens.tolist() == [3, 4]
    assert h.draft("b", np.array([1, 2]), 8, 8, TREE) is None
    assert h.draft(None, np.array([1, 2]), 8, 8, TREE) is None


def test_history_evicts_the_least_recently_used_within_its_token_bound():
    h = SuffixHistory(90)
    for i, salt in enumerate(["a", "b", "a"]):  # 30 tokens each, each doc its own tokens
        h.add(salt, f"r{i}", list(range(100 * i, 100 * i + 30)))
    assert h.draft("a", np.array([5]), 4, 4, TREE) is not None  # r0 used: now the newest
    h.add("b", "r3", list(range(300, 330)))
    assert h.tokens == 90 and h.evicted == 1
    assert h.draft("b", np.array([105]), 4, 4, TREE) is None  # r1 went, not r0
    assert h.draft("a", np.array([5]), 4, 4, TREE) is not None
    h.add("c", "r4", list(range(1000, 1200)))  # longer than the bound: its last 90 tokens
    assert h.tokens == 90 and h.stats()["documents"] == 1 and set(h.spaces) == {"c"}


def test_history_memory_stays_bounded():
    h = SuffixHistory(3000)
    rng = np.random.default_rng(0)
    peak = 0
    for i in range(1500):
        h.add(str(i % 3), f"r{i}", rng.integers(0, 500, rng.integers(1, 60)).tolist())
        peak = max(peak, h.memory_bytes)
        assert h.tokens <= 3000
    assert h.evicted > 1000 and peak <= 40 * 3000, peak


def test_a_restarted_request_takes_its_partial_text_out():
    d = SuffixDrafter(None)
    state = d.init_state("r", [1, 2, 3])
    propose(d, state, [1, 2, 3, 4, 5], salt="s")
    d.release(state)  # preempted: its text so far is filed
    assert d.stats()["documents"] == 1
    d.init_state("r", [1, 2, 3])  # it starts again
    assert d.stats()["documents"] == 0 and d.stats()["tokens"] == 0


def test_a_request_never_asked_to_draft_files_nothing():
    d = SuffixDrafter(None)
    d.release(d.init_state("r", [1, 2, 3]))  # its salt was never seen
    assert d.stats()["documents"] == 0
