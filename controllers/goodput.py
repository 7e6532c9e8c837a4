"""Goodput controller: per-request draft budgets (0 allowed) that maximise the batch's expected
committed tokens per second, from measured acceptance and a measured cost model.

    expected tokens  = sum over decode requests of (1 + expected accepted nodes)
    step seconds     = T(rows) + draft(depth) + overhead
    rows             = prefill tokens + decode requests + draft nodes

* ``T(rows)``: the target's forward time by rows on this machine (``specdec.controllers.costs``), profiled at
  start-up (cached) and refined from every step's measured forward time.
* On a mixture-of-experts target (``ControllerContext.expert_costs``), ``T`` is priced by the
  experts a step is expected to wake instead: ``T = a + b * x + c * rows`` with ``x`` the
  distinct experts per layer that ``rows`` rows over the step's sequences are expected to wake
  (``expert_costs.ExpertCosts``: the expert growth ``g`` of an extra row learned from the routing of
  recent steps, ``a, b, c`` fitted to the profile and every step's measured forward). Where
  neighbouring tokens route alike (small ``g``) a deeper tree wakes few new experts and costs
  little more; where they do not, each node streams new experts and the plan holds back. Both
  phases price rows this way; the routing itself is never touched (no expert dropped or
  capped), so the output stays exactly the target's. Dense targets: ``T(rows)`` as above.
* ``draft(depth)``: a line ``a + b * depth`` fitted online (exponentially weighted least squares)
  to the measured draft time against the deepest tree of the step (drafters run one batched
  forward per depth); 0 while nothing has been drafted.
* ``overhead``: the rest of a step (scheduling, verification, bookkeeping), averaged online.
* Acceptance: ``controllers/acceptance.py`` — by depth per request (shrunk towards the drafter's),
  and, where trees carry per-node draft probabilities, calibrated from them.
* A composed drafter (``ControllerContext.sources``): acceptance by depth per arm — each member
  alone, all of them together — and a draft-time line per member (``StepReport.
  source_seconds``); phase 1 is planned for every arm and the best one drafts
  (``DraftBudget.sources``), the explorations taking the arms in turn.

Two phases, each the rule DSpark uses to pick a verification length: admit candidates in order of
expected gain and keep the prefix with the highest expected tokens per second.

1. ``budgets``: candidates are chain nodes (request r's d-th node gains P(depth d accepted));
   admitting one adds a row, and deepening the step adds draft time. A request whose nodes do not
   pay gets ``DraftBudget(0)``: plain decoding. Its budget is ``DraftBudget(k * width, k)`` — the
   depth that paid, with room for ``width`` alternatives per level, which the second phase prunes.
2. ``prune``: candidates are the drafted nodes, each with its estimated chance of being on the
   accepted path; admissible once its parent is (and, for sampled trees, its earlier siblings:
   the rejection walk needs them). Draft time is spent by then, so only rows count.

What is kept per request (its acceptance counts, its exploration clock) goes in ``release`` when
the request ends; what was learned of the drafter and the machine stays.

Every decision and the figures behind it are in ``decision`` (shown in the step stats and the
bench report): estimated acceptance, expected tokens, predicted and measured step time.
"""

from __future__ import annotations

import heapq
import math

from specdec.controllers.acceptance import ConfidenceCalibration, DepthAcceptance
from specdec.controllers.base import (
    NO_DRAFT,
    BaseController,
    BatchComposition,
    ControllerContext,
    DraftBudget,
    RequestView,
    StepReport,
)
from specdec.controllers.costs import StepCosts
from specdec.controllers.expert_costs import ExpertCosts
from specdec.controllers.exploration import ExplorationClock

GAIN_FLOOR = 0.01  # chain nodes less likely than this to be accepted are not planned
# keep_drafting keeps an idle request's drafter state while its exploration is due this soon
# (the engine asks again every 32 idle steps: specdec.engine.drafting.controller_stage.IDLE_CHECK)
EXPLORE_HORIZON = 32
# a plan that drafted nothing is reused for this many steps while nothing it reads changed
REPLAN = 16


class _Line:
    """y = a + b * x, exponentially weighted least squares (x >= 0)."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.s = [0.0] * 5  # sum w, sum w x, sum w y, sum w x x, sum w x y

    def add(self, x: float, y: float) -> None:
        s = [v * self.decay for v in self.s]
        self.s = [s[0] + 1, s[1] + x, s[2] + y, s[3] + x * x, s[4] + x * y]

    def __call__(self, x: float) -> float:
        n, sx, sy, sxx, sxy = self.s
        if n < 1e-9:
            return 0.0
        var = sxx - sx * sx / n
        if var < 1e-9 * max(n, 1.0):  # one x value seen: proportional through its mean
            mean_x = sx / n
            return max(sy / n * (x / mean_x if mean_x > 0 else 1.0), 0.0)
        b = (sxy - sx * sy / n) / var
        a = (sy - b * sx) / n
        return max(a + b * x, 0.0)


class GoodputController(BaseController):
    """Budgets from expected accepted tokens against measured step cost (see module docstring).

    budget: most draft nodes per request per step; max_depth: deepest tree (None: budget);
    width: nodes per level a budget allows beyond the paying depth (tree drafters);
    prune: run the second phase; costs: a ``StepCosts`` to use instead of profiling (tests);
    experts: an ``ExpertCosts`` to price steps by on a mixture-of-experts target, instead of
    the engine's (tests);
    prior: the acceptance assumed at depth 1 before anything was verified; explore_every: a
    request kept at budget 0 drafts one level every explore_every x batch-size steps, so its
    estimate can recover (0: never), with a backoff while that does not pay
    (``controllers/exploration.py``).
    """

    name = "goodput"

    def __init__(self, budget: int = 16, max_depth: int | None = None, width: int = 2,
                 prune: bool = True, costs: StepCosts | None = None, prior: float = 0.6,
                 explore_every: int = 16, experts: ExpertCosts | None = None) -> None:
        for key, value, low in (("budget", budget, 1), ("width", width, 1),
                                ("explore_every", explore_every, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"controller_args.{key} must be an int >= {low}, got {value!r}")
        if max_depth is not None and (not isinstance(max_depth, int)
                                      or isinstance(max_depth, bool) or max_depth < 1):
            raise ValueError(
                f"controller_args.max_depth must be None or an int >= 1, got {max_depth!r}")
        if not isinstance(prior, (int, float)) or not 0 < prior < 1:
            raise ValueError(f"controller_args.prior must be in (0, 1), got {prior!r}")
        self.budget, self.width, self.prune_trees = budget, width, bool(prune)
        self.explore_every = explore_every
        self.exploration = ExplorationClock(explore_every)
        self._observed = 0  # steps whose drafts observe() learned from
        self._last_plan = None  # (requests and batch shape, _observed, uses, arm): drafted none
        self.max_depth = min(max_depth or budget, budget)
        self.costs = costs
        self.experts = experts  # a mixture-of-experts target's pricing (None: dense)
        self.prior = float(prior)
        # what a step may draft with: None (the drafter as a whole) until setup names a
        # composed drafter's members; then each member alone and all together, each with its
        # own acceptance, and each member its own draft-time line
        self.arms: list[tuple[str, ...] | None] = [None]
        self.depths = {None: DepthAcceptance(max_depth=max(self.max_depth, 1), prior=self.prior)}
        self.member_draft: dict[str, _Line] = {}
        self._explored = 0
        self._asked_arm: dict = {}  # request id -> the arm of its budget this step
        self.confidence = ConfidenceCalibration()
        self.draft = _Line()
        self.overhead = 0.0
        self._overhead_n = 0
        self.decision: dict = {}
        self._predicted = 0.0

    # ---- set-up ----------------------------------------------------------------------------

    def setup(self, context: ControllerContext) -> None:
        if self.costs is None:
            self.costs = context.step_costs()
        if self.experts is None and context.expert_costs is not None:
            self.experts = context.expert_costs()  # None for a dense target
        self.set_sources(tuple(context.sources))

    def set_sources(self, sources: tuple[str, ...]) -> None:
        """A composed drafter's members: each gets measured alone and all together (arms)."""
        if len(sources) < 2:
            return
        self.arms = [*((m,) for m in sources), tuple(sources)]
        self.depths = {a: DepthAcceptance(max_depth=max(self.max_depth, 1), prior=self.prior)
                       for a in self.arms}
        self.member_draft = {m: _Line() for m in sources}

    @property
    def depth(self) -> DepthAcceptance:
        """The acceptance of the whole drafter (all members together)."""
        return self.depths[self.arms[-1]]

    def _forward(self, rows: float) -> float:
        if self.costs is None:  # not set up (a controller used outside an engine): rows cost alike
            return 1.0
        return self.costs.seconds(rows)

    def _step_forward(self, rows: float, sequences: int) -> float:
        """Forward seconds of a step of ``rows`` rows over ``sequences`` sequences: on a
        mixture of experts priced by the experts they are expected to wake, else T(rows)."""
        if self.experts is not None:
            return self.experts.seconds(sequences, rows)
        return self._forward(rows)

    def _moe_figures(self, key: str, rows: int, sequences: int) -> None:
        """On a mixture of experts, the decision's expert terms: the experts per layer the
        step's ``rows`` are expected to wake (under ``key``) and the pricing's figures."""
        if self.experts is not None:
            self.decision[key] = round(self.experts.experts(sequences, rows), 3)
            self.decision["expert_costs"] = self.experts.describe()

    # ---- phase 1: budgets -------------------------------------------------------------------

    def budgets(self, requests: list[RequestView], batch: BatchComposition) -> list[DraftBudget]:
        depths, arm = self._plans(requests, batch)
        arms = [arm] * len(requests)
        # explore: a request kept at 0 drafts one level now and then; with several arms (a
        # composed drafter's members) the explorations take them in turn
        for i in self.exploration.step([r.request_id for r in requests], depths):
            arms[i] = self.arms[self._explored % len(self.arms)]
            self._explored += 1
        out = [NO_DRAFT if k == 0 else DraftBudget(min(self.budget, k * self.width), k, a)
               for k, a in zip(depths, arms)]
        self._asked_arm = {r.request_id: a for r, a in zip(requests, arms)}
        expected = _decoding(requests, batch) + sum(
            sum(self._gains(r.request_id, a)[:k]) for r, k, a in zip(requests, depths, arms)
            if k)
        rows = batch.num_prefill_tokens + _decoding(requests, batch) + sum(depths)
        sequences = _decoding(requests, batch) + batch.num_prefill_requests
        self._predicted = self._step_forward(rows, sequences) + self._draft_time(
            {a: max((k for k, b in zip(depths, arms) if b == a), default=0) for a in arms}
        ) + self.overhead
        self.decision = {
            "depths": depths, "expected_tokens": round(expected, 3),
            "predicted_step_seconds": self._predicted,
            "acceptance_by_depth": self.depth.summary(min(self.max_depth, 6)),
        }
        self._moe_figures("expected_experts_per_layer", rows, sequences)
        if arm is not None:
            self.decision["sources"] = list(arm)
            self.decision["acceptance_by_sources"] = {
                "+".join(a): self.depths[a].summary(min(self.max_depth, 6)) for a in self.arms}
        return out

    def _plans(self, requests: list[RequestView], batch: BatchComposition):
        """(depth per request, arm) of the best arm's plan. A plan that drafted nothing is
        reused, without planning, for the same requests and batch shape until an observation
        changes what the plan reads (acceptance: a drafted outcome; the forward's costs drift
        slowly, so every REPLAN steps): a drafter kept off costs its planning once in a while,
        not every step."""
        shape = (tuple(r.request_id for r in requests), batch.num_prefill_tokens,
                 batch.max_draft_rows)
        last = self._last_plan
        if last is not None and last[0] == shape and last[1] == self._observed \
                and last[2] < REPLAN:
            self._last_plan = (shape, self._observed, last[2] + 1, last[3])
            return [0] * len(requests), last[3]
        plans = [self._plan(requests, batch, arm) for arm in self.arms]
        _, depths, arm = max(plans, key=lambda p: p[0])  # ties: the first arm
        self._last_plan = None if any(depths) else (shape, self._observed, 1, arm)
        return depths, arm

    def keep_drafting(self, request: RequestView, recompute_tokens: int) -> bool:
        """Keep what drafting for ``request`` needs (recompute a prefix hit the drafter cannot
        restore; keep an idle request's drafter state) only while drafting pays now: the plan
        for it alone at its frontier (its own acceptance if known, else the drafter's) drafts
        with some arm; or, for an idle request (nothing to recompute), while its next
        exploration is due within EXPLORE_HORIZON steps (an exploration drafts from that
        state). For a drafter the plan keeps off it would only cost."""
        lone = BatchComposition(1, 0, 0, 0, max(self.budget, 1))
        if any(max(self._plan([request], lone, arm)[1]) > 0 for arm in self.arms):
            return True
        return recompute_tokens == 0 and self.exploration.due_within(request.request_id,
                                                                     EXPLORE_HORIZON)

    def _gains(self, request_id: str, arm) -> list[float]:
        """Chain gains by depth, cut after the first below GAIN_FLOOR: a node accepted less
        than once in a hundred steps pays nowhere (a row costs more than 1 % of a step on any
        machine measured), and planning each would cost more than it could save."""
        return self.depths[arm].chain_gains(request_id, self.max_depth, GAIN_FLOOR)

    def _arm_draft(self, arm, depth: int) -> float:
        """Draft seconds of a step drafting ``depth`` deep with one arm: the drafter's line, or
        its members' lines."""
        if arm is None:
            return self.draft(depth)
        return sum(self.member_draft[m](depth) for m in arm) if depth > 0 else 0.0

    def _draft_time(self, depth_by_arm: dict) -> float:
        """Draft seconds of a step whose requests draft ``depth_by_arm`` deep with each arm
        (explorations may use other arms than the step's): each member at the deepest depth
        asked of it."""
        if self.arms == [None]:
            return self.draft(max(depth_by_arm.values(), default=0))
        deepest: dict[str, int] = {}
        for arm, d in depth_by_arm.items():
            for m in arm:
                deepest[m] = max(deepest.get(m, 0), d)
        return sum(self.member_draft[m](d) for m, d in deepest.items() if d > 0)

    def _plan(self, requests: list[RequestView], batch: BatchComposition, arm):
        """(expected tokens per second, depth per request, arm) of the best prefix of
        chain nodes admitted in order of expected gain, every request drafting with ``arm``."""
        decoding = _decoding(requests, batch)
        base_rows = batch.num_prefill_tokens + decoding
        cap = max(0, batch.max_draft_rows)
        gains = {i: self._gains(r.request_id, arm) for i, r in enumerate(requests)}
        heap = [(-gains[i][0], i, 0) for i in gains if self.max_depth > 0]
        heapq.heapify(heap)
        tokens, depth_now = float(decoding), 0
        # the step's seconds by admitted count and depth, read once (planning is per step)
        most = min(cap, sum(len(g) for g in gains.values()))
        if self.experts is not None:  # a mixture of experts: by the experts expected woken
            forward = self.experts.table(decoding + batch.num_prefill_requests,
                                         max(base_rows, 1), most + 1)
        elif self.costs is not None:
            forward = self.costs.table(max(base_rows, 1), most + 1)
        else:
            forward = [1.0] * (most + 1)
        draft = [self._arm_draft(arm, d) + self.overhead for d in range(self.max_depth + 1)]
        best = (tokens / (forward[0] + draft[0]), 0)  # (goodput, admitted count)
        order: list[int] = []
        while heap and len(order) < cap:
            g, i, d = heapq.heappop(heap)
            order.append(i)
            tokens = tokens - g
            depth_now = max(depth_now, d + 1)
            rate = tokens / (forward[len(order)] + draft[depth_now])
            if rate > best[0]:
                best = (rate, len(order))
            if d + 1 < len(gains[i]):
                heapq.heappush(heap, (-gains[i][d + 1], i, d + 1))
        depths = [0] * len(requests)
        for i in order[:best[1]]:
            depths[i] += 1
        return best[0], depths, arm

    # ---- phase 2: prune ---------------------------------------------------------------------

    def prune(self, requests: list[RequestView], trees: list, batch: BatchComposition):
        """Kept node indices per tree (None: all): admit nodes by estimated acceptance while
        expected tokens per forward second still rise (the best prefix)."""
        if not self.prune_trees:
            return [None] * len(trees)
        est = [self._node_estimates(r.request_id, t) for r, t in zip(requests, trees)]
        rows = batch.num_prefill_tokens + batch.num_decode
        sequences = batch.num_decode + batch.num_prefill_requests
        tokens = float(batch.num_decode)
        heap = []
        for k, t in enumerate(trees):
            for i in _admissible_roots(t):
                heapq.heappush(heap, (-est[k][i], k, i))
        best, order = (tokens / (self._step_forward(rows, sequences) + self.overhead), 0), []
        admitted = [set() for _ in trees]
        while heap:
            g, k, i = heapq.heappop(heap)
            order.append((k, i))
            admitted[k].add(i)
            tokens, rows = tokens - g, rows + 1
            rate = tokens / (self._step_forward(rows, sequences) + self.overhead)
            if rate > best[0]:
                best = (rate, len(order))
            for j in _opened(trees[k], i, admitted[k]):
                heapq.heappush(heap, (-est[k][j], k, j))
        kept = [[] for _ in trees]
        for k, i in order[:best[1]]:
            kept[k].append(i)
        out = []
        for k, t in enumerate(trees):
            out.append(None if len(kept[k]) == t.num_nodes else sorted(kept[k]))
        self.decision["kept_nodes"] = sum(len(x) for x in kept)
        self.decision["proposed_nodes"] = sum(t.num_nodes for t in trees)
        self._moe_figures("expected_experts_per_layer_kept",
                          batch.num_prefill_tokens + batch.num_decode + self.decision["kept_nodes"],
                          sequences)
        return out

    def _node_estimates(self, request_id: str, tree) -> list[float]:
        """P(node on the accepted path), non-increasing along every path."""
        parents = tree.parent_list  # (host ints: the engine read drafts left on the device)
        probs = tree.path_probs.tolist() if tree.path_probs is not None else None
        est, rank, seen, depths = [], [], {}, []
        for i, p in enumerate(parents):
            rank.append(seen.get(p, 0))
            seen[p] = rank[-1] + 1
            depths.append(depth := depths[p] + 1 if p >= 0 else 0)
            if probs is not None:
                e = self.confidence.probability(probs[i])
            else:  # no confidences: depth-based, later siblings discounted
                rates = self.depths[self._asked_arm.get(request_id, self.arms[-1])]
                e = math.prod(rates.rate(request_id, d) for d in range(1, depth + 2))
                e *= 0.5 ** rank[-1]
            est.append(min(e, est[p]) if p >= 0 else e)
        return est

    # ---- feedback ---------------------------------------------------------------------------

    def observe(self, report: StepReport) -> None:
        rows = report.num_prefill_tokens + report.num_verified_rows
        if self.costs is not None and rows > 0 and report.forward_seconds > 0:
            self.costs.observe(rows, report.forward_seconds)
        if self.experts is not None and report.experts_woken:
            self.experts.observe(rows, report.num_decode + report.num_prefill_requests,
                                 report.experts_woken, report.forward_seconds)
            self.decision["measured_experts_per_layer"] = round(
                sum(report.experts_woken) / len(report.experts_woken), 3)
        # the depth drafted (what the draft time paid for), not the pruned tree's
        depth = max((o.asked.depth_limit for o in report.outcomes if o.num_proposed),
                    default=0)
        self.draft.add(depth, report.draft_seconds)
        for member, seconds in report.source_seconds.items():
            if member in self.member_draft:
                asked = [o.asked.depth_limit for o in report.outcomes if o.asked.max_nodes
                         and member in self._arm(o.asked)]
                self.member_draft[member].add(max(asked, default=0), seconds)
        rest = max(report.step_seconds - report.forward_seconds - report.draft_seconds, 0.0)
        self._overhead_n = min(self._overhead_n + 1, 50)
        self.overhead += (rest - self.overhead) / self._overhead_n
        if any(o.num_proposed for o in report.outcomes):
            self._observed += 1  # what the plan reads of acceptance changed
        for o in report.outcomes:
            if o.num_proposed:
                self.exploration.drafted(o.request_id)
            if o.num_proposed:
                # what asking for this depth yielded, pruning included: a depth counts as tried
                # when it was drafted, not only when it was verified (otherwise the estimate
                # would see just the nodes pruning kept, and budgets would keep paying for
                # drafts that pruning then drops)
                drafted = min(o.asked.depth_limit, self.max_depth)
                self.depths[self._arm(o.asked)].observe(o.request_id, drafted, len(o.accepted))
            if o.tree is not None and o.tree.num_nodes:
                self.confidence.observe(o.tree, list(o.accepted))
        self.decision["measured_step_seconds"] = report.step_seconds
        self.decision["predicted_step_seconds"] = self._predicted

    def _arm(self, budget: DraftBudget):
        """The arm a budget drafted with (a budget naming no sources: all members)."""
        arm = budget.sources
        return arm if arm in self.depths else self.arms[-1]

    def release(self, request_id: str) -> None:
        """The request ended: its own acceptance counts and exploration clock go (the
        drafter-wide estimates, the confidence calibration and the cost model stay), so a request
        reusing the id starts from the drafter's history. Not called on preemption."""
        self.exploration.forget(request_id)
        for d in self.depths.values():
            d.forget(request_id)


def _decoding(requests: list[RequestView], batch: BatchComposition) -> int:
    """Decode requests of the step: those asked and those decoding without a drafter (which the
    engine does not ask about), each a row and a token."""
    return max(len(requests), batch.num_decode)


def _admissible_roots(tree) -> list[int]:
    """Nodes admissible before any is admitted: the root's children (for sampled trees only
    the first, since siblings are drawn one after another)."""
    kids = tree.children(-1)
    return kids[:1] if tree.draft_probs is not None else kids


def _opened(tree, i: int, admitted: set[int]) -> list[int]:
    """Nodes that become admissible when node i is admitted."""
    kids = tree.children(i)
    if tree.draft_probs is None:
        return kids
    out = kids[:1]
    parent = int(tree.parents[i])
    sibs = tree.children(parent)
    nxt = sibs.index(i) + 1
    if nxt < len(sibs):
        out.append(sibs[nxt])
    return out
