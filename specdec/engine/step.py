"""One record per request per engine step: what was scheduled, drafted, run and kept.

The scheduler creates the records (the controller stage fills the budgets); the drafter stage
fills ``tree``; batch building fills the row fields; verification fills ``result``; the output
stage fills ``appended``. What goes wrong in a stage's plugin calls it returns as ``Failures``.
Example, a request with 10 tokens at its frontier, a 3-node tree, second in the batch after a
5-token prefill chunk::

    num_new_tokens 1, computed_before 9, budget DraftBudget(4) -> tree of 3 nodes
    row_start 5 (rows 5..8: the last token, then nodes 0..2), logits_start 0 (logits rows 0..3)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from specdec.controllers.base import NO_DRAFT, DraftBudget, RequestView
from specdec.engine.sequence import Sequence
from specdec.plugins import Raised
from specdec.tree import DraftTree
from specdec.verifiers.base import VerifyResult


@dataclass(eq=False)
class StepRequest:
    seq: Sequence
    num_new_tokens: int  # tokens fed from seq.token_ids[computed_before:]
    budget: DraftBudget = NO_DRAFT  # draft nodes it may use (clipped; its slots are reserved)
    # the budget asked this step after the engine's max_model_len / max_tokens clipping (None: no
    # draft asked), and the controller's own answer (None: not asked; RequestOutcome.asked)
    asked: DraftBudget | None = None
    controller_asked: DraftBudget | None = None
    view: RequestView | None = None  # the controller's view of it this step (budgets)
    tree: DraftTree | None = None  # the tree verified: the drafter's proposal, maybe pruned
    # pruned by the controller: the proposal's node index of each node of ``tree`` (None: the
    # whole proposal is verified), and the proposal's size
    kept: list[int] | None = None
    num_proposed: int = 0
    no_kv: bool = False  # the drafter had no KV for this request
    row_start: int = 0  # first row of the request in the packed batch
    logits_start: int = -1  # first of its 1 + num_nodes logits rows (-1: needs no logits)
    result: VerifyResult | None = None  # at the frontier: accepted path and emitted tokens
    appended: int = 0  # tokens appended to the request this step (stop conditions cut them)
    logprobs: list | None = None  # TokenLogprob per emitted token, when the request asked
    # prompt logprobs: (first logits row, first position, rows); position j decides token j + 1
    prompt_rows: tuple[int, int, int] | None = None
    computed_before: int = field(init=False)  # seq.num_computed when scheduled
    at_frontier: bool = field(init=False)  # this step ends at the last token: it emits tokens

    def __post_init__(self) -> None:
        self.computed_before = self.seq.num_computed
        self.at_frontier = self.computed_before + self.num_new_tokens == self.seq.num_tokens

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes if self.tree is not None else 0

    @property
    def num_rows(self) -> int:
        """Rows in the packed batch: fed tokens plus tree nodes."""
        return self.num_new_tokens + self.num_nodes

    @property
    def num_accepted(self) -> int:
        return len(self.result.accepted) if self.result is not None else 0


@dataclass
class Failures:
    """What went wrong in a stage's plugin calls, as a value the stage returns: requests to fail,
    each with the message naming the plugin (the engine finishes them, all of a step's in one
    place: ``LLMEngine.step``), failures no request can be failed for (warned as a
    RuntimeWarning when found; the engine keeps them in ``plugin_errors``), and every exception a
    plugin raised, whatever came of it (``raised``: the engine logs and counts them,
    ``plugins.Faults``; a retry that saved the step included)."""

    requests: dict[Sequence, str] = field(default_factory=dict)  # request -> error (first wins)
    reports: list[str] = field(default_factory=list)
    raised: list[Raised] = field(default_factory=list)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self.requests

    def fail(self, seq: Sequence, error: str) -> None:
        self.requests.setdefault(seq, error)

    def report(self, message: str) -> None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.reports.append(message)

    def caught(self, plugin: str, where: str, error: BaseException) -> None:
        """``error`` was raised by ``plugin`` in ``where`` (e.g. "drafter 'ngram' propose")."""
        self.raised.append(Raised.of(plugin, where, error))

    def add(self, other: Failures) -> Failures:
        """Those of ``other`` too; returns self."""
        for seq, error in other.requests.items():
            self.fail(seq, error)
        self.reports += other.reports
        self.raised += other.raised
        return self
