"""The draft stage of a step: controller budgets, drafter proposals and feedback, their failures.

A drafter that raises (in init_state, propose, on_verified or release), or returns something that
is not a valid tree within budget, fails only the request concerned (finish_reason "error", the
message names the plugin); the others go on. A raising propose / on_verified call is retried
request by request only for a drafter that is ``replay_safe``; for any other, nothing is called
twice in a step (drafters/base.py, "Failures"): its requests draft alone the next step (propose)
or stop drafting (on_verified).
"""

from __future__ import annotations

import warnings

import torch

from specdec import plugins
from specdec.controllers.base import (
    NO_DRAFT,
    BatchComposition,
    DraftBudget,
    RequestOutcome,
    RequestView,
    StepReport,
)
from specdec.drafters.base import (
    DraftRequest,
    TokenView,
    VerifiedBatch,
    VerifiedRequest,
)
from specdec.engine.drafter_calls import Unblamed, check_trees, first_problem, isolate
from specdec.engine.drafter_setup import drafter_sources
from specdec.engine.sequence import Sequence
from specdec.engine.step import StepRequest
from specdec.kv.block_table import KVCacheManager
from specdec.metrics import StepStats, forward_seconds
from specdec.tree import DraftTree

IDLE_CHECK = 32  # decode steps at budget 0 between two keep_drafting questions (the first at 1)


class DraftStage:
    def __init__(self, drafter, controller, vocab_size: int, max_model_len: int,
                 kv: KVCacheManager) -> None:
        self.drafter = drafter
        self.controller = controller
        self.sources = drafter_sources(drafter)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv = kv  # the target's KV: draft slots a tree does not use go back here
        self.errors: list[str] = []  # failures that could not fail a request (release at finish)
        self.ended: list[str] = []  # requests ended this step: the controller's release is due
        # this step's budgets as the controller asked for them (before clipping), by request id
        self.asked: dict[str, DraftBudget] = {}
        self.batch: BatchComposition | None = None  # this step's composition (for pruning)
        # request ids (kept here, not on the drafter's state, which may be what went wrong):
        # requests of a propose call that raised for several at once, each to propose alone the
        # next time; requests whose on_verified raised so, no more drafting until release
        self.suspects: set[str] = set()
        self.undrafted: set[str] = set()
        self.idle: dict[str, int] = {}  # request id -> decode steps in a row with budget 0

    @property
    def name(self) -> str:
        return f"{self.drafter.name!r} (plugin {getattr(self.drafter, 'plugin_name', '?')!r})"

    @property
    def replay_safe(self) -> bool:
        return bool(getattr(self.drafter, "replay_safe", False))

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(self.drafter.hidden_layers) if self.drafter is not None else ()

    def hidden_layers_for(self, records: list[StepRequest]) -> tuple[int, ...]:
        """The target layers to capture in this step's forward: none when no request of it
        has drafter state (no drafter, or every request decodes without one)."""
        if not any(r.seq.drafter_ready for r in records):
            return ()
        return self.hidden_layers

    # ---- budgets ---------------------------------------------------------------------------

    def budgets(self, frontier: list[Sequence], batch: BatchComposition) -> list[DraftBudget]:
        """The controller's budget per decode request (none without a drafter)."""
        if self.drafter is None:
            return [NO_DRAFT] * len(frontier)
        # a request decoding on without its drafter state (undrafted) is not asked: it cannot
        # draft again until it ends or is preempted, and asking would cost every step
        asking = [s for s in frontier if s.request_id not in self.undrafted]
        self.batch = batch
        if not asking:
            self.asked = {}
            return [NO_DRAFT] * len(frontier)
        answer = self.controller.budgets([_view(s) for s in asking], batch)
        if not isinstance(answer, (list, tuple)) or len(answer) != len(asking) \
                or not all(isinstance(b, DraftBudget) for b in answer):
            raise plugins.PluginError(
                f"controller {self.controller.name!r} must return {len(asking)} DraftBudget "
                f"values (one per request), got {answer!r}")
        if len(asking) < len(frontier):
            by_id = {s.request_id: b for s, b in zip(asking, answer)}
            wanted = [by_id.get(s.request_id, NO_DRAFT) for s in frontier]
        else:
            wanted = list(answer)
        for b in wanted:
            if b.sources is not None and not set(b.sources) <= set(self.sources):
                raise plugins.PluginError(
                    f"controller {self.controller.name!r} asked for drafts from "
                    f"{list(b.sources)}; this drafter's sources are {sorted(self.sources) or 'none'}")
        self.asked = {s.request_id: b for s, b in zip(asking, answer)}
        # drafts past max_model_len or past max_tokens (the bonus token comes on top) are waste
        out = [b.clip(0 if s.request_id in self.undrafted else
                      min(self.max_model_len - s.num_tokens,
                          s.params.max_tokens - s.num_output_tokens - 1))
               for b, s in zip(wanted, frontier)]
        self._stop_idle([s for s, b in zip(frontier, out) if b.max_nodes == 0],
                        [s for s, b in zip(frontier, out) if b.max_nodes > 0])
        return out

    def _stop_idle(self, idle: list[Sequence], drafting: list[Sequence]) -> None:
        """A request kept at budget 0 asks the controller's ``keep_drafting`` (nothing to
        recompute) at its first such decode step and every IDLE_CHECK in a row after: False,
        and it decodes on without its drafter state — no more features kept, no layers
        captured for it, no on_verified (outputs unchanged; the controller had stopped drafting
        for it anyway). Asked at once, a drafter the controller keeps off costs its planning
        only, not 32 steps of keeping up (a controller that means to explore a request keeps
        its state by answering True)."""
        for seq in drafting:
            self.idle.pop(seq.request_id, None)
        for seq in idle:
            rid = seq.request_id
            if rid in self.undrafted or not seq.drafter_ready:
                continue
            self.idle[rid] = self.idle.get(rid, 0) + 1
            n = self.idle[rid]
            if (n == 1 or n % IDLE_CHECK == 0) and not self._keep_drafting(seq, 0):
                self._drop_state(seq)
                self.undrafted.add(rid)
                self.idle.pop(rid, None)

    # ---- propose ---------------------------------------------------------------------------

    def propose(self, records: list[StepRequest]) -> list[Sequence]:
        """Fill each record's tree (or fail it); returns the requests that failed."""
        failed = self._ensure_states(records)
        jobs = [r for r in records if r.budget.max_nodes > 0 and r.seq not in failed]
        if jobs:
            requests = [_request(r) for r in jobs]
            outcomes = self._proposals(requests)
            for rec, req, outcome in zip(jobs, requests, outcomes):
                if isinstance(outcome, Unblamed):
                    continue  # no draft this step
                error = outcome if isinstance(outcome, str) else self._check(outcome, rec)
                if error is not None:
                    self._fail(rec.seq, f"drafter {self.name} {error}")
                    failed.append(rec.seq)
                    continue
                rec.tree, rec.no_kv, rec.num_proposed = outcome, req.no_kv, outcome.num_nodes
            self._constrain([r for r in jobs if r.tree is not None and r.tree.num_nodes
                             and r.seq.logits is not None])
            self._prune([r for r in jobs if r.tree is not None and r.tree.num_nodes])
            for rec in jobs:
                if rec.seq.finish_reason is None:
                    self.kv.shrink(rec.seq.block_table, rec.computed_before + 1 + rec.num_nodes)
        return failed

    def _proposals(self, requests: list[DraftRequest]) -> list:
        """Per request a tree, an error string or ``Unblamed`` (no draft this step). Requests
        of an earlier call that raised for several at once propose alone, the others together."""
        alone = [i for i, r in enumerate(requests) if r.request_id in self.suspects]
        together = [i for i in range(len(requests)) if i not in set(alone)]
        outcomes: list = [None] * len(requests)
        for group in ([together] if together else []) + [[i] for i in alone]:
            got = isolate(self.drafter.propose, [requests[i] for i in group], check_trees,
                           self.replay_safe)
            for i, outcome in zip(group, got):
                outcomes[i] = outcome
        self.suspects -= {r.request_id for r in requests}
        unblamed = [r.request_id for r, o in zip(requests, outcomes) if isinstance(o, Unblamed)]
        if unblamed:
            self.suspects.update(unblamed)
            self._report(f"drafter {self.name} failed in propose for {len(unblamed)} requests at "
                         f"once ({first_problem(outcomes)}); none of them is drafted for this step, "
                         "and each proposes alone the next time")
        return outcomes

    @staticmethod
    def _constrain(records: list[StepRequest]) -> None:
        """Drafts the request's constraint forbids (structured output) are dropped before the
        forward: the target would reject them. Sampled drafts drop a forbidden node's later
        siblings too (each was drawn given the earlier ones were rejected)."""
        for rec in records:
            tree = rec.tree
            keep = rec.seq.logits.prune(tree.tokens.tolist(), tree.parents.tolist(),
                                        tree.draft_probs is not None)
            if keep is not None and len(keep) < tree.num_nodes:
                rec.tree, rec.kept = tree.select(keep), keep

    def _prune(self, records: list[StepRequest]) -> None:
        """The controller's second phase (optional ``prune``): verify only the nodes it keeps."""
        prune = getattr(self.controller, "prune", None)
        if prune is None or not records or self.batch is None:
            return
        kept = prune([_view(r.seq) for r in records], [r.tree for r in records], self.batch)
        if not isinstance(kept, (list, tuple)) or len(kept) != len(records):
            raise plugins.PluginError(f"controller {self.controller.name!r}: prune must return "
                                      f"one entry per tree ({len(records)}), got {kept!r}")
        for rec, keep in zip(records, kept):
            if keep is None:
                continue
            try:
                rec.tree = rec.tree.select(keep)
            except (ValueError, TypeError) as e:
                raise plugins.PluginError(
                    f"controller {self.controller.name!r}: prune returned {keep!r} for a tree "
                    f"of {rec.num_proposed} nodes: {e}") from e
            # node indices of the proposal (through the constraint's selection, if any)
            rec.kept = [int(i) if rec.kept is None else rec.kept[int(i)] for i in keep]

    def restore(self, seq: Sequence, keys: list[bytes]) -> int:
        """The target is about to reuse cached KV for the pages ``keys`` of a request being
        admitted: the drafter restores what it can (``Drafter.restore``) and says how many
        leading pages its state now covers. No drafter: all. A drafter without the hook, or one
        that fails in it (reported, its state rebuilt from scratch): none, so the target
        computes those tokens and the drafter hears of them as usual."""
        if self.drafter is None or seq.request_id in self.undrafted:
            return len(keys)
        self._drop_state(seq)  # a preempted request's stale state, if any
        if self._ensure_states([StepRequest(seq, 0)]):
            # init_state failed: no reuse; the request is admitted as it is and fails (or
            # gets its state) at its first propose, as without the cache
            seq.finish_reason = seq.error = None
            return 0
        hook = getattr(self.drafter, "restore", None)
        if hook is None:
            return 0
        try:
            got = hook(seq.drafter_state, TokenView(seq.token_ids), list(keys))
            if not isinstance(got, int) or isinstance(got, bool) or not 0 <= got <= len(keys):
                raise plugins.PluginError(f"restore must return an int in [0, {len(keys)}] "
                                          f"(pages restored), got {got!r}")
        except Exception as e:
            self._report(f"drafter {self.name} failed in restore: {e!r}; request "
                         f"{seq.request_id!r} computes its cached prefix instead")
            self._drop_state(seq)
            return 0
        missing = (len(keys) - got) * self.kv.page_size
        if missing and not self._keep_drafting(seq, missing):
            self._drop_state(seq)  # the target reuses the whole hit; no drafts for this request
            self.undrafted.add(seq.request_id)
            return len(keys)
        return got

    def _keep_drafting(self, seq: Sequence, recompute_tokens: int) -> bool:
        """The controller's optional ``keep_drafting``: recompute what the drafter could not
        restore (True, the default), or reuse it and decode this request without drafts."""
        ask = getattr(self.controller, "keep_drafting", None)
        if ask is None:
            return True
        try:
            keep = ask(_view(seq), recompute_tokens)
            if not isinstance(keep, bool):
                raise plugins.PluginError(f"keep_drafting must return a bool, got {keep!r}")
        except Exception as e:
            self._report(f"controller {self.controller.name!r} failed in keep_drafting: {e!r}; "
                         f"request {seq.request_id!r} computes its cached prefix for the drafter")
            return True
        return keep

    def _ensure_states(self, records: list[StepRequest]) -> list[Sequence]:
        """Per-request drafter state from a request's first step on (and after preemption)."""
        failed = []
        if self.drafter is None:
            return failed
        for rec in records:
            seq = rec.seq
            if seq.drafter_ready or seq.request_id in self.undrafted:
                continue
            try:
                seq.drafter_state = self.drafter.init_state(seq.request_id, seq.prompt_token_ids)
                seq.drafter_ready = True
            except Exception as e:
                self._fail(seq, f"drafter {self.name} failed in init_state: {e!r}")
                failed.append(seq)
        return failed

    def _check(self, tree, rec: StepRequest) -> str | None:
        if not isinstance(tree, DraftTree):
            return f"returned {type(tree).__name__}, not a DraftTree"
        try:
            tree.validate(max_nodes=rec.budget.max_nodes, vocab_size=self.vocab_size,
                          max_depth=rec.budget.max_depth, check_probs=not rec.seq.params.greedy)
        except ValueError as e:
            return f"returned a malformed tree: {e}"
        return None

    # ---- feedback --------------------------------------------------------------------------

    def on_verified(self, records: list[StepRequest], hidden: dict[int, torch.Tensor]) -> None:
        """Tell the drafter what the step committed; a request whose drafter call fails is
        marked failed (the caller finishes it). ``hidden``: layer -> [T, H] of the whole batch."""
        live = [r for r in records if self.drafter is not None and r.seq.drafter_ready
                and not r.seq.is_finished and r.seq.finish_reason is None]
        if not live:
            return
        batch = self._verified_batch(live, hidden)
        outcomes = isolate(self.drafter.on_verified, batch, lambda out, n: None,
                            self.replay_safe)
        for rec, outcome in zip(live, outcomes):
            if isinstance(outcome, str):
                detail = outcome.removeprefix("failed: ")
                self._fail(rec.seq, f"drafter {self.name} failed in on_verified: {detail}")
        unblamed = [r.seq for r, o in zip(live, outcomes) if isinstance(o, Unblamed)]
        if unblamed:
            self._report(f"drafter {self.name} failed in on_verified for {len(unblamed)} "
                         f"requests at once ({first_problem(outcomes)}); their drafter state may be "
                         "half updated and is not replayed: they decode on without drafts")
            for seq in unblamed:
                self._drop_state(seq)
                self.undrafted.add(seq.request_id)

    def _verified_batch(self, records: list[StepRequest], hidden) -> VerifiedBatch:
        reqs, rows, start = [], [], 0
        for rec in records:
            seq = rec.seq
            accepted = rec.result.accepted if rec.result is not None else []
            committed = rec.num_new_tokens + len(accepted)
            # the drafter hears of the tree it proposed, whatever the controller pruned
            own = list(accepted) if rec.kept is None else [rec.kept[a] for a in accepted]
            reqs.append(VerifiedRequest(seq.request_id, seq.drafter_state, TokenView(seq.token_ids),
                                        seq.num_computed, committed,
                                        rec.num_proposed if rec.tree is not None else 0,
                                        own, start))
            start += committed
            fed = range(rec.row_start, rec.row_start + rec.num_new_tokens)
            rows.extend([*fed, *(rec.row_start + rec.num_new_tokens + a for a in accepted)])
        if not hidden:
            return VerifiedBatch(reqs)
        index = torch.tensor(rows, dtype=torch.int64, device=next(iter(hidden.values())).device)
        return VerifiedBatch(reqs, {layer: h.index_select(0, index) for layer, h in hidden.items()})

    def release(self, seq: Sequence) -> None:
        """Drop the request's drafter state; a drafter failing here fails a running request, and
        is reported (not raised) for one that already finished. The request ends, or restarts
        from scratch (preemption: its drafter state is rebuilt, so it may draft again)."""
        self.suspects.discard(seq.request_id)
        self.undrafted.discard(seq.request_id)
        self.idle.pop(seq.request_id, None)
        self._drop_state(seq)

    def _drop_state(self, seq: Sequence) -> None:
        if self.drafter is None or not seq.drafter_ready:
            return
        state, seq.drafter_state, seq.drafter_ready = seq.drafter_state, None, False
        try:
            self.drafter.release(state)
        except Exception as e:
            message = f"drafter {self.name} failed in release: {e!r}"
            if seq.finish_reason is None:
                self._fail(seq, message)
            else:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                self.errors.append(message)

    def end(self, seq: Sequence) -> None:
        """The request is over (finished, aborted, failed): its drafter state goes now
        (``release``); the controller hears of it in ``release_ended``, after the step's
        ``observe`` (whose report still carries the request's last outcome)."""
        self.release(seq)
        self.ended.append(seq.request_id)

    def release_ended(self) -> None:
        """The controller's optional ``release(request_id)`` for every request ended since the
        last call; a failure there is reported, not raised (the request has already ended)."""
        ended, self.ended = self.ended, []
        release = getattr(self.controller, "release", None)
        for request_id in ended if release is not None else ():
            try:
                release(request_id)
            except Exception as e:
                message = f"controller {self.controller.name!r} failed in release: {e!r}"
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                self.errors.append(message)

    def observe(self, records: list[StepRequest], stats: StepStats) -> None:
        """The controller hears the step's costs and, per asked request, asked/proposed/accepted;
        then the release of the requests that ended."""
        # a step in which no request was asked and nothing was prefilled (every decode
        # request without its drafter state) says nothing the controller acts on: not reported
        if self.drafter is not None and (self.asked or stats.num_prefill_tokens):
            self._report_step(records, stats)
            decision = getattr(self.controller, "decision", None)
            if isinstance(decision, dict) and decision:  # the controller's figures, after it
                stats.controller = dict(decision)
        self.release_ended()

    def _report_step(self, records: list[StepRequest], stats: StepStats) -> None:
        asked, self.asked = self.asked, {}
        outcomes = tuple(RequestOutcome(r.seq.request_id, asked.get(r.seq.request_id, r.asked),
                                        r.num_proposed if r.tree is not None else 0,
                                        r.num_accepted, r.no_kv,
                                        r.tree if r.num_nodes else None,
                                        tuple(r.result.accepted) if r.result is not None else ())
                         for r in records if r.seq.request_id in asked)
        self.controller.observe(StepReport(
            draft_seconds=stats.draft_seconds, forward_seconds=forward_seconds(stats),
            verify_seconds=stats.verify_seconds, step_seconds=stats.step_seconds,
            num_verified_rows=stats.num_verified_rows, num_decode=stats.num_decode,
            num_prefill_tokens=stats.num_prefill_tokens, outcomes=outcomes,
            source_seconds=dict(getattr(self.drafter, "last_source_seconds", {}))))

    @staticmethod
    def _fail(seq: Sequence, error: str) -> None:
        seq.finish_reason, seq.error = "error", error

    def _report(self, message: str) -> None:
        """A drafter failure no request could be failed for."""
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.errors.append(message)


def _request(rec: StepRequest) -> DraftRequest:
    seq = rec.seq
    return DraftRequest(seq.request_id, TokenView(seq.token_ids), rec.budget, seq.params,
                        seq.seed, seq.drafter_state, page_keys=tuple(seq.page_keys))


def _view(seq: Sequence) -> RequestView:
    return RequestView(seq.request_id, seq.num_tokens, seq.num_output_tokens,
                       seq.num_steps_decoding, seq.draft_tokens_proposed,
                       tuple(seq.accepted_by_depth), seq.last_proposed, seq.last_accepted)
