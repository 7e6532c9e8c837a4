"""The controller protocol: how much each request may draft this step (0 allowed), and what it
hears back.

Each step the engine first schedules the batch (decode rows, prefill chunks), then asks
``budgets(requests, batch)`` for the requests at their decode frontier, knowing the step's
composition; after the step it calls ``observe(report)`` with the step's costs and, per
request, the budget asked, the nodes proposed and the nodes accepted, kept apart.

A request decoding on without its drafter state (``keep_drafting`` below answered False, or its
drafter failed in ``on_verified``) is not asked again until it ends or is preempted: its budget
is 0 and it has no outcome in the report, though ``BatchComposition.num_decode`` and the
report's rows count it. A step in which no request was asked and nothing was prefilled is not
reported: a drafter the controller keeps off costs nothing of it.

Four optional methods and one attribute (the ``Controller`` protocol below names them with
their defaults; ``BaseController`` has the defaults):

* ``setup(context)`` once, after the engine is built: a ``ControllerContext`` that can measure
  the target's forward time by rows on this machine (``step_costs()``, cached) and, on a
  mixture-of-experts target, by rows and experts woken (``expert_costs()``).
* ``prune(requests, trees, batch)`` after drafting: per tree, the node indices to verify
  (ascending, closed under parents; None keeps the whole tree). The second phase of a two-phase
  controller: the drafted trees carry per-node confidences the budget could not know. Pruning is
  invisible to drafters (their ``on_verified`` gets node indices of the tree they proposed).
* ``release(request_id)`` once a request has ended (finished, aborted or failed): drop what was
  kept for it, so that a later request reusing the id starts from fresh estimates (what was
  learned of the drafter as a whole may stay). Called after the ``observe`` of the step in which
  the request ended (that report still carries its last outcome), or at once for an abort
  between steps. Not called on preemption: a preempted request comes back under the same id
  with the same text, and its estimates still hold. It may be called for an id the controller
  never saw (a request that ended before its first decode step), or without a drafter; a
  controller that raises there is reported, not fatal.
* ``keep_drafting(request, recompute_tokens) -> bool`` when a request is admitted with a prefix
  hit its drafter cannot restore in full (a drafter kept off never made its own KV of those
  pages): True, the target recomputes those ``recompute_tokens`` so that the drafter hears of
  them and may draft for the request; False, the target reuses its cached KV and the request
  decodes without drafts until it ends or is preempted (outputs are the same either way).
  Also asked, with ``recompute_tokens`` 0, of a request at its first decode step at budget 0
  and every 32 such steps in a row after: False drops its drafter state (no features kept, no
  layers captured for it, no more budgets asked for it); a controller that means to draft or
  explore for it soon answers True.
  Without the method: True.
* ``decision``: the latest decision's figures, a mapping (shown in the step stats,
  ``StepStats.controller``); without it: none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from specdec.controllers.costs import StepCosts
    from specdec.controllers.expert_costs import ExpertCosts
    from specdec.tree import DraftTree


@dataclass(frozen=True)
class DraftBudget:
    """At most ``max_nodes`` draft-tree nodes, at most ``max_depth`` deep (None: no depth limit
    beyond ``max_nodes``). ``DraftBudget(0)`` turns speculation off for the request.
    ``sources``: for a composed drafter, the members that draft (by name, a subset of
    ``ControllerContext.sources``); None: all of them (a single drafter ignores it)."""

    max_nodes: int
    max_depth: int | None = None
    sources: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_nodes, int) or isinstance(self.max_nodes, bool) \
                or self.max_nodes < 0:
            raise ValueError(f"DraftBudget.max_nodes must be an int >= 0, got {self.max_nodes!r}")
        if self.max_depth is not None and (not isinstance(self.max_depth, int)
                                           or isinstance(self.max_depth, bool)
                                           or self.max_depth < 1):
            raise ValueError(
                f"DraftBudget.max_depth must be None or an int >= 1, got {self.max_depth!r}")
        if self.sources is not None and (not isinstance(self.sources, tuple) or not self.sources
                                         or not all(isinstance(x, str) for x in self.sources)):
            raise ValueError("DraftBudget.sources must be None or a non-empty tuple of drafter "
                             f"names, got {self.sources!r}")

    @property
    def depth_limit(self) -> int:
        """The deepest a tree within this budget can be (in nodes along a path)."""
        return self.max_nodes if self.max_depth is None else min(self.max_nodes, self.max_depth)

    def clip(self, max_nodes: int) -> DraftBudget:
        """The same budget with at most ``max_nodes`` nodes (>= 0)."""
        n = max(0, min(self.max_nodes, max_nodes))
        return self if n == self.max_nodes else DraftBudget(n, self.max_depth, self.sources)


NO_DRAFT = DraftBudget(0)


@dataclass(frozen=True)
class RequestView:
    """What a controller sees of one request at the decode frontier (history so far)."""

    request_id: str
    num_tokens: int
    num_output_tokens: int
    num_verify_steps: int  # target forwards that ended at this request's frontier
    draft_tokens_proposed: int  # nodes proposed over all steps
    accepted_by_depth: tuple[int, ...]  # [d]: steps in which depth d (0-based) was accepted
    last_proposed: int  # nodes proposed in the request's latest verify step
    last_accepted: int  # of which accepted


@dataclass(frozen=True)
class BatchComposition:
    """This step's batch before drafting."""

    num_decode: int  # requests at their frontier (each verifies 1 + its draft nodes rows)
    num_prefill_requests: int  # requests feeding a prefill chunk
    num_prefill_tokens: int  # rows of those chunks
    num_waiting: int  # requests still queued after this step's admissions
    max_draft_rows: int  # token budget left for draft nodes this step (all requests together)


@dataclass(frozen=True)
class RequestOutcome:
    request_id: str
    asked: DraftBudget  # what the controller asked for (before the engine's clipping)
    num_proposed: int  # nodes the drafter proposed (<= the clipped budget)
    num_accepted: int  # nodes accepted
    no_kv: bool = False  # the drafter had no KV for the request and drafted nothing
    tree: DraftTree | None = None  # the tree verified (after pruning); None: no draft
    accepted: tuple[int, ...] = ()  # its accepted nodes (a root path, in depth order)


@dataclass(frozen=True)
class StepReport:
    """One step, as a controller hears it."""

    draft_seconds: float  # budgets + drafting
    forward_seconds: float  # the target forward
    verify_seconds: float  # verification and commit
    step_seconds: float
    num_verified_rows: int  # logits rows verified: sum over decode requests of 1 + nodes
    num_decode: int
    num_prefill_tokens: int
    outcomes: tuple[RequestOutcome, ...]  # one per request that was asked for a budget
    # a composed drafter's members that ran this step: name -> seconds of its propose
    source_seconds: dict[str, float] = field(default_factory=dict)
    # a mixture-of-experts target: per layer, the distinct experts the forward's rows routed
    # to (``StepStats.experts_woken``); () for a dense target
    experts_woken: tuple[int, ...] = ()
    # requests feeding a prefill chunk this step (each a sequence of its own beside the decode
    # requests: rows of different sequences route independently of each other)
    num_prefill_requests: int = 0


@dataclass
class ControllerContext:
    """What the engine offers a controller's optional ``setup``."""

    step_costs: Callable[[], StepCosts]  # the target's forward seconds by rows (profiled, cached)
    device: str
    max_num_seqs: int
    max_num_batched_tokens: int
    extra: dict = field(default_factory=dict)
    # a composed drafter's members, in merge order ("eagle3+ngram": ("eagle3", "ngram")); ()
    # for a single drafter. A controller may name a subset in DraftBudget.sources
    sources: tuple[str, ...] = ()
    # a mixture-of-experts target: its forward seconds by rows and experts woken, the prior
    # profiled on the target (``controllers.expert_costs.ExpertCosts``, cached); None: a dense target
    expert_costs: Callable[[], ExpertCosts | None] | None = None


@runtime_checkable
class Controller(Protocol):
    """What the engine asks of a controller. ``budgets`` and ``observe`` are required; the rest is
    optional, with ``BaseController``'s defaults (a plugin that does not subclass it gets them
    through ``specdec.controllers.adapter``, once at start-up)."""

    name: str
    plugin_name: str  # set by the registry: the plugin that registered it
    # the latest decision's figures (shown in the step stats); default: none
    decision: Mapping[str, Any]

    def budgets(self, requests: list[RequestView], batch: BatchComposition) -> list[DraftBudget]:
        """One DraftBudget per request, in order."""

    def observe(self, report: StepReport) -> None:
        """What happened in the step that used the budgets."""

    def setup(self, context: ControllerContext) -> None:
        """Once, after the engine is built (with a drafter only). Default: nothing."""

    def prune(self, requests: list[RequestView], trees: list[DraftTree],
              batch: BatchComposition) -> list[list[int] | None]:
        """Per tree the node indices to verify (None: all of it). Default: all of every tree."""

    def keep_drafting(self, request: RequestView, recompute_tokens: int) -> bool:
        """Keep the request's drafter state (True) or decode on without drafts (False).
        Default: True."""

    def release(self, request_id: str) -> None:
        """The request ended: forget what was kept for it. Default: nothing."""


class BaseController:
    """Defaults for the optional parts of the protocol (a controller subclasses this and writes
    ``budgets`` and ``observe``)."""

    name = "base"
    plugin_name = "?"
    decision: Mapping[str, Any] = MappingProxyType({})  # read-only: assign a dict of your own

    def setup(self, context: ControllerContext) -> None:
        return None

    def prune(self, requests: list[RequestView], trees: list[DraftTree],
              batch: BatchComposition) -> list[list[int] | None]:
        return [None] * len(trees)

    def keep_drafting(self, request: RequestView, recompute_tokens: int) -> bool:
        return True

    def release(self, request_id: str) -> None:
        return None
