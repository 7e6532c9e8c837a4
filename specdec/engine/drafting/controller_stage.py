"""The controller's side of a step: how much each request drafts, which drafted nodes are
verified, when a request stops drafting, and what the controller hears back.

    budgets        the scheduler's BudgetFn: the controller's DraftBudget per decode request
                   (checked), clipped to what max_model_len and max_tokens leave
    idle           requests kept at budget 0 whose drafter state may go (``keep_drafting``)
    keep_drafting  the controller's answer for a request: keep its drafter state or not
    prune          the controller's second phase: per drafted tree the nodes to verify
    observe        the step's costs and per-request outcomes (``StepReport``), and the
                   controller's decision figures into the step's stats
    release        requests that ended: the controller forgets them (after the step's observe)

A controller that returns something malformed stops the step with a PluginError naming it; one
that raises in keep_drafting or release is reported (``Failures``), not fatal.
"""

from __future__ import annotations

from collections.abc import Mapping

from specdec import plugins
from specdec.controllers.base import (
    NO_DRAFT,
    BaseController,
    BatchComposition,
    DraftBudget,
    RequestOutcome,
    RequestView,
    StepReport,
)
from specdec.engine.sequence import Sequence
from specdec.engine.step import Failures, StepRequest
from specdec.metrics import StepStats, forward_seconds
from specdec.tree_read import read_to_host

IDLE_CHECK = 32  # decode steps at budget 0 between two keep_drafting questions (the first at 1)


class ControllerStage:
    def __init__(self, controller: BaseController, with_drafter: bool,
                 sources: tuple[str, ...], max_model_len: int) -> None:
        self.controller = controller  # with the declared contract (specdec.controllers.adapter)
        self.with_drafter = with_drafter
        self.sources = sources  # what DraftBudget.sources may name (Drafter.sources)
        self.max_model_len = max_model_len

    @property
    def name(self) -> str:
        return repr(self.controller.name)

    def _error(self, message: str) -> plugins.PluginError:
        """The step stops: the controller broke its contract (counted against its plugin)."""
        return plugins.PluginError(message, self.controller.plugin_name)

    # ---- budgets ---------------------------------------------------------------------------

    def budgets(self, records: list[StepRequest], batch: BatchComposition) -> list[DraftBudget]:
        """The budget of each decode request: the controller's answer (``controller_asked``)
        clipped to what max_model_len and max_tokens leave (the bonus token comes on top).
        Without a drafter none; a request decoding on without its drafter state is not asked
        (it cannot draft again until it ends or is preempted, and asking would cost every
        step)."""
        if not self.with_drafter:
            return [NO_DRAFT] * len(records)
        asking = [r for r in records if not r.seq.drafting.undrafted]
        if asking:
            for rec, budget in zip(asking, self._answer(asking, batch)):
                rec.controller_asked = budget
        out, max_model_len = [], self.max_model_len
        for r in records:
            asked = r.controller_asked
            if asked is None:
                out.append(NO_DRAFT)
                continue
            seq = r.seq
            n = len(seq.token_ids)  # (num_tokens; num_output_tokens below)
            room = min(max_model_len - n, seq.params.max_tokens - (n - len(seq.prompt_token_ids))
                       - 1)
            out.append(asked if room >= asked.max_nodes else asked.clip(room))
        return out

    def _answer(self, asking: list[StepRequest], batch: BatchComposition) -> list[DraftBudget]:
        views = []
        for rec in asking:  # (the step's one view of each: prune shows the same)
            rec.view = view = _view(rec.seq)
            views.append(view)
        answer = self.controller.budgets(views, batch)
        sourced = False
        well_formed = isinstance(answer, (list, tuple)) and len(answer) == len(asking)
        for b in answer if well_formed else ():
            if not isinstance(b, DraftBudget):
                well_formed = False
                break
            sourced = sourced or b.sources is not None
        if not well_formed:
            raise self._error(
                f"controller {self.name} must return {len(asking)} DraftBudget values (one per "
                f"request), got {answer!r}")
        for b in answer if sourced else ():
            if b.sources is not None and not set(b.sources) <= set(self.sources):
                raise self._error(
                    f"controller {self.name} asked for drafts from {list(b.sources)}; this "
                    f"drafter's sources are {sorted(self.sources) or 'none'}")
        return list(answer)

    # ---- whether a request keeps drafting ------------------------------------------------

    def idle(self, records: list[StepRequest]) -> tuple[list[Sequence], Failures]:
        """The decode requests kept at budget 0 whose drafter state goes. ``keep_drafting``
        (nothing to recompute) is asked at a request's first such step and every IDLE_CHECK in
        a row after; False, and it decodes on without its drafter state — no features kept, no
        layers captured for it, no on_verified (outputs unchanged; the controller had stopped
        drafting for it anyway). Asked at once, a drafter the controller keeps off costs its
        planning only, not 32 steps of keeping up (a controller that means to explore a request
        keeps its state by answering True)."""
        stop, failures = [], Failures()
        for rec in records if self.with_drafter else ():
            d = rec.seq.drafting
            if rec.asked is None or d.undrafted or not d.ready:
                continue
            if rec.asked.max_nodes > 0:
                d.idle_steps = 0
                continue
            d.idle_steps += 1
            if d.idle_steps == 1 or d.idle_steps % IDLE_CHECK == 0:
                keep, asked = self.keep_drafting(rec.seq, 0)
                failures.add(asked)
                if not keep:
                    stop.append(rec.seq)
        return stop, failures

    def keep_drafting(self, seq: Sequence, recompute_tokens: int) -> tuple[bool, Failures]:
        """The controller's ``keep_drafting``: recompute what the drafter could not restore and
        keep drafting (True; also when the controller fails in it, reported), or reuse it and
        decode this request without drafts."""
        failures = Failures()
        try:
            keep = self.controller.keep_drafting(_view(seq), recompute_tokens)
            if not isinstance(keep, bool):
                raise self._error(f"keep_drafting must return a bool, got {keep!r}")
        except Exception as e:
            failures.caught(self.controller.plugin_name, f"controller {self.name} keep_drafting",
                            e)
            failures.report(f"controller {self.name} failed in keep_drafting: {e!r}; request "
                            f"{seq.request_id!r} computes its cached prefix for the drafter")
            return True, failures
        return keep, failures

    # ---- pruning ---------------------------------------------------------------------------

    def prune(self, records: list[StepRequest], batch: BatchComposition | None) -> None:
        """The controller's second phase (``prune``): verify only the nodes it keeps of each
        drafted tree (``rec.kept``: their node indices in the proposal). BaseController's
        (every tree kept whole) is not called: no views, no trees listed."""
        if getattr(self.controller.prune, "__func__", None) is BaseController.prune:
            return
        records = [r for r in records if r.num_nodes]
        if not records or batch is None:
            return
        # a controller that prunes reads the trees: drafts left on the device come to the
        # host in one read for the batch (DraftTree.on_device), not one per tree or field
        read_to_host([r.tree for r in records])
        # (what a view shows changes only once the step's tokens are out: budgets' views hold)
        views = [_view(r.seq) if r.view is None else r.view for r in records]
        kept = self.controller.prune(views, [r.tree for r in records], batch)
        if not isinstance(kept, (list, tuple)) or len(kept) != len(records):
            raise self._error(f"controller {self.name}: prune must return one entry "
                              f"per tree ({len(records)}), got {kept!r}")
        for rec, keep in zip(records, kept):
            if keep is None:
                continue
            try:
                rec.tree = rec.tree.select(keep)
            except (ValueError, TypeError) as e:
                raise self._error(
                    f"controller {self.name}: prune returned {keep!r} for a tree of "
                    f"{rec.num_proposed} nodes: {e}") from e
            # node indices of the proposal (through the constraint's selection, if any)
            rec.kept = [int(i) if rec.kept is None else rec.kept[int(i)] for i in keep]

    # ---- feedback --------------------------------------------------------------------------

    def observe(self, records: list[StepRequest], stats: StepStats,
                source_seconds: Mapping[str, float]) -> None:
        """The controller hears the step's costs and, per asked request, asked / proposed /
        accepted; its decision figures go into ``stats``. A step in which no request was asked
        and nothing was prefilled (every decode request without its drafter state) says
        nothing the controller acts on: not reported."""
        if not self.with_drafter:
            return
        asked = [r for r in records if r.controller_asked is not None]
        if not (asked or stats.num_prefill_tokens):
            return
        self.controller.observe(_report(asked, stats, source_seconds))
        if self.controller.decision:
            stats.controller = dict(self.controller.decision)

    def release(self, seqs: list[Sequence]) -> Failures:
        """The controller's ``release(request_id)`` for requests that ended; a failure there is
        reported, not raised (the request has already ended)."""
        failures = Failures()
        for seq in seqs:
            try:
                self.controller.release(seq.request_id)
            except Exception as e:
                failures.caught(self.controller.plugin_name, f"controller {self.name} release", e)
                failures.report(f"controller {self.name} failed in release: {e!r}")
        return failures


def _report(asked: list[StepRequest], stats: StepStats,
            source_seconds: Mapping[str, float]) -> StepReport:
    outcomes = []
    for r in asked:
        tree, result = r.tree, r.result
        accepted = () if result is None else tuple(result.accepted)
        outcomes.append(RequestOutcome(
            r.seq.request_id, r.controller_asked, 0 if tree is None else r.num_proposed,
            len(accepted), r.no_kv, tree if tree is not None and tree.num_nodes else None,
            accepted))
    return StepReport(
        draft_seconds=stats.draft_seconds, forward_seconds=forward_seconds(stats),
        verify_seconds=stats.verify_seconds, step_seconds=stats.step_seconds,
        num_verified_rows=stats.num_verified_rows, num_decode=stats.num_decode,
        num_prefill_tokens=stats.num_prefill_tokens, outcomes=tuple(outcomes),
        source_seconds=dict(source_seconds), experts_woken=tuple(stats.experts_woken or ()),
        num_prefill_requests=stats.num_requests - stats.num_decode)


def _view(seq: Sequence) -> RequestView:
    n = len(seq.token_ids)  # (num_tokens, and num_output_tokens below: no property calls)
    return RequestView(seq.request_id, n, n - len(seq.prompt_token_ids),
                       seq.num_steps_decoding, seq.draft_tokens_proposed,
                       tuple(seq.accepted_by_depth), seq.last_proposed, seq.last_accepted)
