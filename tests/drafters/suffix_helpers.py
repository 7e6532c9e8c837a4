"""Shared by the suffix drafter's tests: the speculation parameters of a tree draft, and one
proposal of a drafter for a request."""

from specdec import SamplingParams
from specdec.controllers.base import DraftBudget
from specdec.drafters.base import DraftRequest, TokenView
from specdec.drafters.suffix import SuffixDrafter
from specdec.drafters.suffix_speculate import SpeculateParams

TREE = SpeculateParams(max_spec_factor=1.0, max_spec_offset=0.0, min_token_prob=0.1,
                       max_candidates=1 << 20, tree=True)


def propose(d: SuffixDrafter, state, tokens, salt=None, budget=8):
    req = DraftRequest("r", TokenView(tokens), DraftBudget(budget), SamplingParams(
        temperature=0, cache_salt=salt), None, state)
    (tree,) = d.propose([req])
    tree.validate(max_nodes=budget)
    return tree
