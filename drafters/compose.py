"""Several drafters as one (``drafter="eagle3+ngram"``): every drafter proposes within the step's
budget and their trees are merged in the order named (``specdec.tree.merge_trees``: earlier
drafters' nodes first, equal tokens under equal parents shared, cut at the budget).

Written once for any drafters: each keeps its own per-request state, and hears back the part of
the verified step that concerns its own nodes (the longest prefix of the accepted path made of
nodes it proposed, in its own node indices), so a drafter that keeps KV for its drafts stays
consistent. Merged trees carry no draft probabilities (the verifier then uses the q = 1 rule,
lossless for any tokens): sampled drafts from different drafters are not one distribution.

A controller may name the members that draft for a request (``DraftBudget.sources``, e.g. the
goodput controller measuring each member's acceptance and cost apart): the others do not run for
it (and not at all in a step none of its requests asks for them). Each member's propose time is
kept in ``last_source_seconds`` for the step report.

Failures (drafters/base.py): a member marking a request failed fails it (the message names the
member); a member that raises or returns something malformed raises a ``PluginError`` naming the
member and its plugin (its ``plugin`` attribute: the engine counts it against that plugin),
chained to the member's error; the composition is replay_safe only when every member is, since a
raising member leaves the members before it having proposed or updated already. The
composition's ``plugin_name`` is its members', joined by "+".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from specdec.drafters.adapter import as_drafter
from specdec.drafters.base import BaseDrafter, DraftRequest, VerifiedBatch
from specdec.plugin_errors import PluginError, label
from specdec.tree import DraftTree, merge_trees


@dataclass
class ComposedState:
    states: list  # one per drafter
    maps: list[list[int]]  # per drafter: its last tree's node -> merged node (-1: dropped)
    request: tuple = ()  # (request_id, prompt_token_ids): to rebuild a member's state


class ComposedDrafter(BaseDrafter):
    def __init__(self, drafters: list) -> None:
        assert len(drafters) >= 2
        self.drafters = drafters = [as_drafter(d) for d in drafters]
        self.name = "+".join(d.name for d in drafters)
        self.plugin_name = "+".join(dict.fromkeys(d.plugin_name for d in drafters))
        self.sources = tuple(d.name for d in drafters)
        self.hidden_layers = tuple(sorted({i for d in drafters for i in d.hidden_layers}))
        self.matmul_models = tuple(m for d in drafters for m in d.matmul_models)
        self.replay_safe = all(d.replay_safe for d in drafters)
        self.last_source_seconds: dict[str, float] = {}  # the last propose's, by member

    def init_state(self, request_id: str, prompt_token_ids: list[int]) -> ComposedState:
        return ComposedState([_call(d, "init_state", d.init_state, request_id, prompt_token_ids)
                              for d in self.drafters],
                             [[] for _ in self.drafters], (request_id, prompt_token_ids))

    def restore(self, state: ComposedState, token_ids, page_keys: list[bytes]) -> int:
        """The pages every member restores: a member that restored more than a later one is
        rebuilt from scratch and asked again for fewer, until all agree."""
        m, done = len(page_keys), [None] * len(self.drafters)
        while True:
            for k, d in enumerate(self.drafters):
                if done[k] is not None and done[k] != m:  # restored more: start it afresh
                    _call(d, "release", d.release, state.states[k])
                    state.states[k] = _call(d, "init_state", d.init_state, *state.request)
                    done[k] = None
                if done[k] is None:
                    got = _call(d, "restore", d.restore, state.states[k], token_ids,
                                page_keys[:m])
                    done[k] = min(m, got)
                    m = done[k]
            if all(v == m for v in done):
                return m

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        per_drafter = []
        self.last_source_seconds = {}
        for k, d in enumerate(self.drafters):
            subs = [replace(r, state=r.state.states[k], no_kv=False, error=None)
                    for r in requests]
            asked = [i for i, r in enumerate(requests)
                     if r.budget.sources is None or d.name in r.budget.sources]
            trees = [DraftTree.empty() for _ in requests]
            if asked:
                start = time.perf_counter()
                got = _call(d, "propose", d.propose, [subs[i] for i in asked])
                self.last_source_seconds[d.name] = time.perf_counter() - start
                _pass_failures(d, [subs[i] for i in asked], [requests[i] for i in asked])
                _call(d, "propose", _check_trees, got, [subs[i] for i in asked])
                for i, tree in zip(asked, got):
                    trees[i] = tree
            per_drafter.append((subs, trees, set(asked)))
        out = []
        for i, r in enumerate(requests):
            maps: list[list[int]] = []
            out.append(merge_trees([trees[i] for _, trees, _ in per_drafter],
                                   r.budget.max_nodes, maps))
            r.state.maps = maps
            if all(subs[i].no_kv for subs, _, asked in per_drafter if i in asked):
                r.mark_no_kv()
        return out

    def on_verified(self, batch: VerifiedBatch) -> None:
        for k, d in enumerate(self.drafters):
            reqs = []
            for r in batch.requests:
                own = _own_prefix(r.accepted, r.state.maps[k] if r.num_proposed else [])
                # what it proposed, kept or not: its own draft state (e.g. KV) covered all of it
                reqs.append(replace(r, state=r.state.states[k], accepted=own, error=None,
                                    num_proposed=len(r.state.maps[k]) if r.num_proposed else 0))
            _call(d, "on_verified", d.on_verified, VerifiedBatch(reqs, batch.hidden))
            _pass_failures(d, reqs, batch.requests)
        for r in batch.requests:
            r.state.maps = [[] for _ in self.drafters]

    def release(self, state: ComposedState) -> None:
        errors = []
        for d, s in zip(self.drafters, state.states):
            try:
                _call(d, "release", d.release, s)
            except PluginError as e:  # release every drafter's resources, then report
                errors.append(e)
        if errors:
            raise PluginError("; ".join(map(str, errors)), errors[0].plugin) from errors[0]


def _call(drafter, call: str, fn: Callable, *args):
    """``fn(*args)``, a member's call: what it raises is re-raised naming the member and its
    plugin."""
    try:
        return fn(*args)
    except Exception as e:
        raise PluginError(f"member {label(drafter)} failed in {call}: {e!r}",
                          drafter.plugin_name) from e


def _check_trees(got, requests: list[DraftRequest]) -> None:
    if not isinstance(got, list) or len(got) != len(requests):
        raise TypeError(f"returned {type(got).__name__} for {len(requests)} requests")
    for r, tree in zip(requests, got):
        if not isinstance(tree, DraftTree):
            raise TypeError(f"returned {type(tree).__name__}, not a DraftTree")
        tree.validate(max_nodes=r.budget.max_nodes, max_depth=r.budget.max_depth)


def _pass_failures(drafter, subs: list, requests: list) -> None:
    """A member's ``fail`` marks on its copies of the requests, onto the requests themselves."""
    for sub, r in zip(subs, requests):
        if sub.error is not None and r.error is None:
            r.fail(f"{drafter.name}: {sub.error}")


def _own_prefix(accepted: list[int], node_map: list[int]) -> list[int]:
    """The longest prefix of the accepted (merged) path whose nodes this drafter proposed, in
    its own node indices."""
    back = {m: i for i, m in enumerate(node_map) if m >= 0}
    own = []
    for a in accepted:
        if a not in back:
            break
        own.append(back[a])
    return own
