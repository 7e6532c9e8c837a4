"""The EAGLE-3 drafter's propose as it was before its levels ran without reads (commit
e221eb9, drafters/eagle3.py): the reference its device-side successor must match, tree for tree.

Per level, two device -> host reads of the top-k and a host -> device copy of the features'
row index; only the candidates whose children a budget could take get a row (``_useful``).
``install(monkeypatch)`` makes ``Eagle3Drafter.propose`` this one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.drafters.base import DraftRequest
from specdec.drafters.eagle3 import Eagle3Drafter, Eagle3State
from specdec.tree import DraftTree


def install(monkeypatch) -> None:
    """Eagle3Drafter proposes as the reference does (for the test's duration)."""
    monkeypatch.setattr(Eagle3Drafter, "propose", ReferenceEagle3.propose)


@dataclass
class _Level:
    """Candidates of one tree level for one request."""

    parent: list[int]  # index into the previous level's expanded rows (-1: the catch-up row)
    token: list[int]  # draft-vocabulary ids
    logp: list[float]  # cumulative log-probability


def _host_d2t(drafter) -> list[int]:
    """The head's draft -> target offsets as host ints, read once per drafter (as the old
    ``__init__`` did)."""
    if "_ref_d2t" not in drafter.__dict__:
        drafter._ref_d2t = drafter.head.d2t.tolist()
    return drafter._ref_d2t


class ReferenceEagle3:
    """The old methods, called with an Eagle3Drafter as ``self`` (``Ref`` for short)."""

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        trees = [DraftTree.empty() for _ in requests]
        live = [r for r in requests if Ref._reserve(self, r)]
        if not live:
            return trees
        y, logp = Eagle3Drafter._catch_up(self, live)  # (unchanged since)
        levels, rows = Ref._expand(self, live, y, logp)
        index = {id(r): i for i, r in enumerate(requests)}
        for j, r in enumerate(live):
            trees[index[id(r)]] = Ref._select(self, levels[j], rows[j], r.budget.max_nodes)
        return trees

    def _reserve(self, r: DraftRequest) -> bool:
        """Head KV for the catch-up rows and the expansion rows; none: no draft this step."""
        state: Eagle3State = r.state
        n = len(r.token_ids)
        # every committed token's features arrived through on_verified
        assert state.num_cached + state.num_pending == n - 1, (state.num_cached,
                                                               state.num_pending, n)
        if not state.num_pending:
            return False  # a one-token prompt's first step: no target features yet
        # expansion runs as deep as the deepest request of the step: reserve for the maximum
        need = n - 1 + self.topk * (self.depth - 1)
        if not self.runner.kv.try_reserve(state.table, need):
            r.mark_no_kv()
            return False
        return True

    def _expand(self, reqs, y: torch.Tensor, logp: torch.Tensor):
        """Levels of candidates per request, and per request the expanded rows as
        (level, candidate index) in row order. Of each level's ``topk`` most probable
        candidates only those whose children could still be among the request's ``budget``
        best get a row (``_useful``); a request without one sits the level out, and the
        expansion stops when no request has one. The trees are those of the full expansion,
        without the rows whose candidates the budgets would all drop."""
        k = self.topk
        top_i, top_v = _host_topk(logp, k)
        levels = [[_Level([-1] * k, top_i[b], top_v[b])] for b in range(len(reqs))]
        rows: list[list[tuple[int, int]]] = [[] for _ in reqs]
        # per request, per expanded row: its mask over the rows so far (ancestors and itself)
        seen: list[list[list[bool]]] = [[] for _ in reqs]
        depths = [min(self.depth, r.budget.depth_limit) for r in reqs]
        parent_y = y  # the last forward's outputs; request b's catch-up row is row b of y
        out_row = [{-1: b} for b in range(len(reqs))]  # per request: rows[b] index -> row
        for level in range(1, max(depths)):
            picks = [_useful(levels[b], k, r.budget.max_nodes) if level < depths[b] else []
                     for b, r in enumerate(reqs)]
            if not any(picks):
                break
            out, out_row = Ref._forward_level(self, reqs, levels, rows, seen, picks, parent_y,
                                               out_row, level)
            parent_y = out.final_hidden
            top_i, top_v = _host_topk(out.logits.log_softmax(-1), k)
            for b, pick in enumerate(picks):
                if not pick:
                    continue
                cand = levels[b][-1]
                first = len(rows[b]) - len(pick)
                parent, token, lp = [], [], []
                for j, c in enumerate(pick):
                    row = out_row[b][first + j]
                    parent += [first + j] * k
                    token += top_i[row]
                    lp += [cand.logp[c] + v for v in top_v[row]]
                levels[b].append(_Level(parent, token, lp))
        return levels, rows

    def _forward_level(self, reqs, levels, rows, seen, picks, parent_y, out_row, level: int):
        """One row per pick of every request that has picks, batched; extends ``rows`` and
        ``seen`` (each row's ancestors-or-self among the expanded rows, as host lists: no tree
        object or tensor op per row). Returns the forward's output and, per request, its new
        rows' rows[b] index -> row of that output (each row's feature is its parent's output
        row in ``out_row``)."""
        feeds, starts, positions, masks, tables, feat_rows = [], [], [], [], [], []
        new_row: list[dict[int, int]] = [{} for _ in reqs]
        d2t = _host_d2t(self)
        for b, r in enumerate(reqs):
            pick = picks[b]
            if not pick:
                continue
            n = len(r.token_ids)
            cand = levels[b][-1]
            prev_rows = len(rows[b])
            total = prev_rows + len(pick)
            mask_rows = []
            for j, c in enumerate(pick):
                rows[b].append((level - 1, c))
                new_row[b][prev_rows + j] = len(feat_rows)
                feat_rows.append(out_row[b][cand.parent[c]])
                parent = cand.parent[c]  # its parent's expanded row (-1: the catch-up row)
                above = seen[b][parent] if parent >= 0 else []
                own = above + [False] * (total - len(above))
                own[prev_rows + j] = True
                seen[b].append(own)
                mask_rows.append(own)
            tail = torch.tensor(mask_rows, dtype=torch.bool).reshape(len(pick), total)
            mask = torch.ones(len(pick), n - 1 + total, dtype=torch.bool)
            mask[:, n - 1:] = tail
            feeds.append([cand.token[c] + d2t[cand.token[c]] for c in pick])  # target ids
            starts.append(n - 1 + prev_rows)
            positions.append([n - 1 + level - 1] * len(pick))
            masks.append(mask)
            tables.append(r.state.table)
        features = parent_y.index_select(0, torch.tensor(feat_rows, device=parent_y.device))
        batch = self.runner.pack(feeds, starts, tables, logits="all", positions=positions,
                                 masks=masks, features=features)
        return self.runner.forward(batch), new_row

    def _select(self, levels: list[_Level], rows: list[tuple[int, int]],
                budget: int) -> DraftTree:
        """The ``budget`` most probable candidates of the levels (as deep as the request's
        depth: ``_expand`` stops there), as a tree."""
        flat = [(lv, c) for lv in range(len(levels)) for c in range(len(levels[lv].token))]
        # best first; a child's log-prob is its parent's plus a log-prob <= 0, and ties go to
        # the shallower node, so the first `budget` are ancestor-closed and topological
        flat.sort(key=lambda lc: (-levels[lc[0]].logp[lc[1]], lc[0], lc[1]))
        chosen = flat[:budget]
        node = {lc: i for i, lc in enumerate(chosen)}
        tokens, parents, probs = [], [], []
        d2t = _host_d2t(self)
        for lv, c in chosen:
            p = _parent_of(levels, rows, (lv, c))
            parents.append(-1 if p is None else node[p])
            t = levels[lv].token[c]
            tokens.append(t + d2t[t])
            probs.append(levels[lv].logp[c])
        return DraftTree(torch.tensor(tokens, dtype=torch.int64),
                         torch.tensor(parents, dtype=torch.int64), None,
                         torch.tensor(probs, dtype=torch.float32).exp())


def _useful(levels: list[_Level], k: int, budget: int) -> list[int]:
    """The last level's ``k`` most probable candidates (EAGLE-2's frontier), best first, cut to
    those a child of which could be among the tree's ``budget`` best candidates. A child's
    cumulative log-prob is at most its parent's, and on a tie the shallower candidate ranks
    first, so every candidate at least as probable as a pick ranks ahead of all its
    descendants: when ``budget`` of them exist, none of its descendants can enter."""
    last = levels[-1].logp
    frontier = sorted(range(len(last)), key=lambda i: -last[i])[:k]
    every = sorted((v for level in levels for v in level.logp), reverse=True)
    if len(every) < budget:
        return frontier
    cut = every[budget - 1]  # the budget-th best log-prob: a pick at most this probable is out
    return [c for c in frontier if last[c] > cut]


def _host_topk(logp: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Top-k ids and log-probs of every row, as host lists (one device -> host copy each)."""
    top = logp.topk(k, dim=-1)
    return top.indices.tolist(), top.values.tolist()


def _parent_of(levels: list[_Level], rows: list[tuple[int, int]], lc: tuple[int, int]):
    """(level, candidate) of a candidate's parent, None for the first level."""
    lv, c = lc
    p = levels[lv].parent[c]
    return None if p < 0 else rows[p]


Ref = ReferenceEagle3
