"""The drafter's side of a step: per-request drafter state, proposals, feedback.

    propose       init_state where a request has no state yet, then one propose call for the
                  step's drafting requests; each tree checked (a DraftTree within the budget,
                  valid draft_probs for a sampled request) and cut to what the request's
                  constraint allows (structured output: the target would reject the rest)
    restore       a request admitted with a prefix-cache hit: its state brought up to the cached
                  pages the drafter can restore (``Drafter.restore``)
    on_verified   what the step committed, with the hidden states of the drafter's layers
    stop          a request decodes on without drafter state (``RequestDrafting.undrafted``)
    release       a request ended or was preempted: its drafter state and bookkeeping go

A drafter that raises (in init_state, propose, on_verified or release), or returns something that
is not a valid tree within budget, fails only the request concerned (the message names the
plugin); the others go on. A raising propose / on_verified call is retried request by request
only for a drafter that is ``replay_safe``; for any other, nothing is called twice in a step
(drafters/base.py, "Failures"): its requests draft alone the next step (propose) or stop drafting
(on_verified). Each method returns what went wrong as ``Failures``: the engine acts on them.
Every exception is in ``Failures.raised`` (logged and counted by the engine), and a batched call
that raised though each request alone succeeded is reported too: the outputs do not show it.
"""

from __future__ import annotations

import torch

from specdec import plugins
from specdec.drafters.base import (
    BaseDrafter,
    DraftRequest,
    TokenView,
    VerifiedBatch,
    VerifiedRequest,
)
from specdec.engine.drafting.calls import (
    Unblamed,
    check_trees,
    first_problem,
    isolate,
    saved_by_retry,
)
from specdec.engine.sequence import RequestDrafting, Sequence
from specdec.engine.step import Failures, StepRequest
from specdec.tree import DraftTree


class DrafterStage:
    def __init__(self, drafter: BaseDrafter | None, vocab_size: int) -> None:
        self.drafter = drafter  # with the declared contract (specdec.drafters.adapter); or None
        self.vocab_size = vocab_size

    @property
    def name(self) -> str:
        return plugins.label(self.drafter)

    def _caught(self, failures: Failures, call: str, raised) -> None:
        """Each exception of ``raised`` ((number of requests, exception) pairs: calls.isolate)
        into ``failures``."""
        for _, e in raised:
            failures.caught(self.drafter.plugin_name, f"drafter {self.drafter.name!r} {call}", e)

    def _saved(self, failures: Failures, call: str, raised, outcomes: list) -> None:
        """Report a batched call that raised though each request alone succeeded."""
        e = saved_by_retry(raised, outcomes)
        if e is not None:
            failures.report(f"drafter {self.name} raised in {call} for several requests at once "
                            f"({e!r}) but not for any of them alone: retried request by request "
                            "(replay_safe), the outputs are right; its batched call has a bug")

    @property
    def source_seconds(self) -> dict[str, float]:
        """A composition's members' propose seconds in the latest step (StepReport)."""
        return {} if self.drafter is None else dict(self.drafter.last_source_seconds)

    def hidden_layers_for(self, records: list[StepRequest]) -> tuple[int, ...]:
        """The target layers to capture in this step's forward: none when no request of it
        has drafter state (no drafter, or every request decodes without one)."""
        if self.drafter is None:
            return ()
        layers = self.drafter.hidden_layers  # (most drafters capture none: no scan then)
        if not layers or not any(r.seq.drafting.ready for r in records):
            return ()
        return tuple(layers)

    # ---- propose ---------------------------------------------------------------------------

    def propose(self, records: list[StepRequest]) -> Failures:
        """Fill the tree of each record with a draft budget (``tree``, ``no_kv``,
        ``num_proposed``); a failed request gets none."""
        failures = self._ensure_states([r.seq for r in records])
        failed = failures.requests
        jobs = [r for r in records if r.budget.max_nodes > 0 and r.seq not in failed]
        if not jobs:
            return failures
        requests = [_request(r) for r in jobs]
        constrained = False
        for rec, req, outcome in zip(jobs, requests, self._proposals(jobs, requests, failures)):
            if type(outcome) is Unblamed:
                continue  # no draft this step
            error = outcome if isinstance(outcome, str) else _tree_problem(
                outcome, rec, self.vocab_size)
            if error is not None:
                failures.fail(rec.seq, f"drafter {self.name} {error}")
            else:
                rec.tree, rec.no_kv, rec.num_proposed = outcome, req.no_kv, outcome.num_nodes
                constrained = constrained or rec.seq.logits is not None
        if constrained:
            _constrain([r for r in jobs if r.seq.logits is not None and r.num_nodes])
        return failures

    def _proposals(self, jobs: list[StepRequest], requests: list[DraftRequest],
                   failures: Failures) -> list:
        """Per request a tree, an error string or ``Unblamed`` (no draft this step). Requests
        of an earlier call that raised for several at once (suspects) propose alone, the
        others together."""
        alone = [i for i, rec in enumerate(jobs) if rec.seq.drafting.suspect]
        if alone:
            together = [i for i, rec in enumerate(jobs) if not rec.seq.drafting.suspect]
            outcomes: list = [None] * len(jobs)
            for group in ([together] if together else []) + [[i] for i in alone]:
                for i, outcome in zip(group, self._call_propose([requests[i] for i in group],
                                                                failures)):
                    outcomes[i] = outcome
        else:  # (the usual step: one call for them all)
            outcomes = self._call_propose(requests, failures)
        unblamed = 0
        for rec, outcome in zip(jobs, outcomes):
            suspect = rec.seq.drafting.suspect = type(outcome) is Unblamed
            unblamed += suspect
        if unblamed:
            failures.report(f"drafter {self.name} failed in propose for {unblamed} requests at "
                            f"once ({first_problem(outcomes)}); none of them is drafted for this "
                            "step, and each proposes alone the next time")
        return outcomes

    def _call_propose(self, requests: list[DraftRequest], failures: Failures) -> list:
        """One propose call (``calls.isolate``), what it raised into ``failures``."""
        raised: list = []
        got = isolate(self.drafter.propose, requests, check_trees,
                      bool(self.drafter.replay_safe), raised)
        if raised:
            self._caught(failures, "propose", raised)
            self._saved(failures, "propose", raised, got)
        return got

    def _ensure_states(self, seqs: list[Sequence]) -> Failures:
        """Per-request drafter state from a request's first step on (and after preemption)."""
        failures = Failures()
        if self.drafter is None:
            return failures
        for seq in seqs:
            d = seq.drafting
            if d.ready or d.undrafted:
                continue
            try:
                d.state = self.drafter.init_state(seq.request_id, seq.prompt_token_ids)
                d.ready = True
            except Exception as e:
                failures.fail(seq, f"drafter {self.name} failed in init_state: {e!r}")
                self._caught(failures, "init_state", [(1, e)])
        return failures

    # ---- prefix-cache hits -----------------------------------------------------------------

    def restore(self, seq: Sequence, keys: list[bytes]) -> tuple[int, Failures]:
        """The target is about to reuse cached KV for the pages ``keys`` of a request being
        admitted: the drafter restores what it can (``Drafter.restore``); returns how many
        leading pages its state now covers. No drafter, or a request decoding without drafts:
        all. One that fails in it (reported, its state rebuilt from scratch): none, so the
        target computes those tokens and the drafter hears of them as usual."""
        if self.drafter is None or seq.drafting.undrafted:
            return len(keys), Failures()
        failures = self._drop_state(seq)  # a preempted request's stale state, if any
        if self._ensure_states([seq]).requests:
            # init_state failed: no reuse; the request is admitted as it is and fails (or
            # gets its state) at its first propose, as without the cache
            return 0, failures
        try:
            got = self.drafter.restore(seq.drafting.state, TokenView(seq.token_ids), list(keys))
            if not isinstance(got, int) or isinstance(got, bool) or not 0 <= got <= len(keys):
                raise plugins.PluginError(f"restore must return an int in [0, {len(keys)}] "
                                          f"(pages restored), got {got!r}")
        except Exception as e:
            failures.report(f"drafter {self.name} failed in restore: {e!r}; request "
                            f"{seq.request_id!r} computes its cached prefix instead")
            self._caught(failures, "restore", [(1, e)])
            return 0, failures.add(self._drop_state(seq))
        return got, failures

    # ---- feedback --------------------------------------------------------------------------

    def on_verified(self, records: list[StepRequest], hidden: dict[int, torch.Tensor]
                    ) -> Failures:
        """Tell the drafter what the step committed. ``hidden``: layer -> [T, H] of the whole
        batch."""
        failures = Failures()
        if self.drafter is None or not _hears_verified(self.drafter):
            return failures
        live = [r for r in records if r.seq.drafting.ready and r.seq.finish_reason is None]
        if not live:
            return failures
        raised: list = []
        outcomes = isolate(self.drafter.on_verified, _verified_batch(live, hidden),
                           lambda out, n: None, bool(self.drafter.replay_safe), raised)
        self._caught(failures, "on_verified", raised)
        self._saved(failures, "on_verified", raised, outcomes)
        for rec, outcome in zip(live, outcomes):
            if isinstance(outcome, str):
                detail = outcome.removeprefix("failed: ")
                failures.fail(rec.seq, f"drafter {self.name} failed in on_verified: {detail}")
        unblamed = [r.seq for r, o in zip(live, outcomes) if isinstance(o, Unblamed)]
        if unblamed:
            failures.report(f"drafter {self.name} failed in on_verified for {len(unblamed)} "
                            f"requests at once ({first_problem(outcomes)}); their drafter state "
                            "may be half updated and is not replayed: they decode on without "
                            "drafts")
            failures.add(self.stop(unblamed))
        return failures

    # ---- the end of a request's drafter state ----------------------------------------------

    def stop(self, seqs: list[Sequence]) -> Failures:
        """These requests decode on without drafter state until they end or are preempted
        (no budget asked, no layers captured for them, no drafter call)."""
        failures = Failures()
        for seq in seqs:
            failures.add(self._drop_state(seq))
            seq.drafting.undrafted, seq.drafting.idle_steps = True, 0
        return failures

    def release(self, seq: Sequence) -> Failures:
        """The request ends, or restarts from scratch (preemption: its drafter state is
        rebuilt, so it may draft again): its drafter state and bookkeeping go."""
        failures = self._drop_state(seq)
        seq.drafting = RequestDrafting()
        return failures

    def _drop_state(self, seq: Sequence) -> Failures:
        """``Drafter.release`` of the request's state; a failure there fails a running request
        and is reported for one that already finished."""
        failures, d = Failures(), seq.drafting
        if self.drafter is None or not d.ready:
            return failures
        state, d.state, d.ready = d.state, None, False
        try:
            self.drafter.release(state)
        except Exception as e:
            self._caught(failures, "release", [(1, e)])
            message = f"drafter {self.name} failed in release: {e!r}"
            if seq.finish_reason is None:
                failures.fail(seq, message)
            else:
                failures.report(message)
        return failures


def _hears_verified(drafter: BaseDrafter) -> bool:
    """Whether the drafter's ``on_verified`` does anything: BaseDrafter's default (nothing, and
    it cannot fail a request) is not called, and its batch (hidden rows gathered, a record per
    request) not built, every step. Looked up per step: an instance may get its own."""
    return getattr(drafter.on_verified, "__func__", None) is not BaseDrafter.on_verified


def _request(rec: StepRequest) -> DraftRequest:
    seq, d = rec.seq, rec.seq.drafting
    keys = seq.page_keys
    if d.keys_of is not keys or len(d.page_keys) != len(keys):  # (keys are only appended)
        d.page_keys, d.keys_of = tuple(keys), keys
    return DraftRequest(seq.request_id, TokenView(seq.token_ids), rec.budget, seq.params,
                        seq.seed, d.state, page_keys=d.page_keys)


def _tree_problem(tree, rec: StepRequest, vocab_size: int) -> str | None:
    """What is wrong with a proposal for ``rec`` (None: a valid tree within its budget)."""
    if not isinstance(tree, DraftTree):
        return f"returned {type(tree).__name__}, not a DraftTree"
    try:
        # tokens still on the device are checked once the step's read brought them
        # (verify_stage): checking them here would read them
        tree.validate(max_nodes=rec.budget.max_nodes, vocab_size=vocab_size,
                      max_depth=rec.budget.max_depth, check_probs=not rec.seq.params.greedy,
                      read_tokens=False)
    except ValueError as e:
        return f"returned a malformed tree: {e}"
    return None


def _constrain(records: list[StepRequest]) -> None:
    """Drafts the request's constraint forbids (structured output) are dropped before the
    forward: the target would reject them. Sampled drafts drop a forbidden node's later
    siblings too (each was drawn given the earlier ones were rejected)."""
    for rec in records:
        tree = rec.tree
        keep = rec.seq.logits.prune(tree.token_list, tree.parent_list,
                                    tree.draft_probs is not None)
        if keep is not None and len(keep) < tree.num_nodes:
            rec.tree, rec.kept = tree.select(keep), keep


def _verified_batch(records: list[StepRequest], hidden: dict[int, torch.Tensor]
                    ) -> VerifiedBatch:
    reqs, rows, start = [], [], 0
    for rec in records:
        seq = rec.seq
        accepted = rec.result.accepted if rec.result is not None else []
        committed = rec.num_new_tokens + len(accepted)
        # the drafter hears of the tree it proposed, whatever the controller pruned
        own = list(accepted) if rec.kept is None else [rec.kept[a] for a in accepted]
        reqs.append(VerifiedRequest(seq.request_id, seq.drafting.state,
                                    TokenView(seq.token_ids), seq.num_computed, committed,
                                    rec.num_proposed if rec.tree is not None else 0, own, start))
        start += committed
        fed = range(rec.row_start, rec.row_start + rec.num_new_tokens)
        rows.extend([*fed, *(rec.row_start + rec.num_new_tokens + a for a in accepted)])
    if not hidden:
        return VerifiedBatch(reqs)
    return VerifiedBatch(reqs, {layer: gather_rows(h, rows) for layer, h in hidden.items()})


def gather_rows(h: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``h[rows]`` without sending ``rows`` to the device: slices of its runs of consecutive
    rows (one for a step whose every request kept a chain), joined by one cat; a copy, like
    the index it replaces (a CUDA graph writes ``h`` again in the next step)."""
    runs, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append(h[rows[start]:rows[i - 1] + 1])
            start = i
    if len(runs) == 1:
        return runs[0].clone()
    return torch.cat(runs) if runs else h[:0].clone()
