"""EAGLE-3 drafting with dynamic trees (EAGLE-2's expansion), through the head's own runner.

Per request the head keeps paged KV for the positions whose rows it computed from the target's
true features (``num_cached``) and the target features of committed tokens it has not fed yet
(``pending``, from ``on_verified``). A step, all requests batched:

1. catch-up: rows num_cached .. N-2 (N tokens; the last token has no target features yet), row
   i = (fc(target features of token i), embedding of token i+1) at position i. The last row's
   distribution ranks the first draft level (candidates for token N).
2. expansion, for each further level (as deep as the request's tree may go): the ``topk``
   candidates of the previous level with the highest cumulative draft probability (the
   frontier, chosen on the device) each contribute their top-k children as candidates of the
   next level. A frontier candidate d levels deep goes in as the chain of its path: d rows (its
   ancestors from the first level down, then itself; row i at position N-1+i, feature: the
   previous row's output, the first row's the catch-up row's), attending the prefix and its
   chain's rows up to itself, in scratch slots N-1 onwards, rewritten by every level. A row
   recomputed with the same inputs gives the same KV, so each row sees what it saw before;
   and the mask depends on the level alone, so the host builds it without reading what the
   device chose (the chains' token ids and features are gathered on the device).
3. the tree: the ``budget`` candidates with the highest cumulative probability (ancestor-closed,
   since probabilities only shrink along a path; ties to the shallower node, then the lower
   index), in that order, mapped to target ids by d2t, chosen on the device.

The host reads nothing: the trees' tokens, parents and probabilities stay on the device
(``DraftTree.on_device``), where the target's forward takes them (positions and tree mask made
there), and come back with the step's one read, the verification's. Drafts are deterministic (top-k) for greedy and
sampled requests alike: the verifier accepts them losslessly with the q = 1 rule. Expansion rows
are scratch: the head's KV is cut back to ``num_cached`` after every step, and the next catch-up
recomputes the accepted positions from the target's true features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from specdec.attention.metadata import host_tensor
from specdec.drafters.base import BaseDrafter, DraftRequest, TargetInfo, VerifiedBatch
from specdec.kv.block_table import BlockTable
from specdec.kv.prefix import next_token_key
from specdec.models.heads.eagle3 import Eagle3Config, Eagle3Head
from specdec.tree import DraftTree

__all__ = ["Eagle3Config", "Eagle3Drafter", "Eagle3Head", "load_head"]  # the head: drafter_args



@dataclass
class Eagle3State:
    table: BlockTable = field(default_factory=BlockTable)  # the head's KV pages
    num_cached: int = 0  # positions whose head KV came from the target's features
    pending: list[torch.Tensor] = field(default_factory=list)  # [n_i, 3 * H] features to feed

    @property
    def num_pending(self) -> int:
        return sum(int(p.shape[0]) for p in self.pending)


class Eagle3Drafter(BaseDrafter):
    name = "eagle3"
    # propose moves num_cached on and clears pending; on_verified appends features (twice on a
    # repeat). Raising anywhere leaves num_cached + num_pending right for the next on_verified
    replay_safe = False

    def __init__(self, target: TargetInfo, path: str | None = None, depth: int = 6,
                 topk: int = 4, head: Eagle3Head | None = None, variant: str = "all") -> None:
        """``path``: an EAGLE-3 checkpoint folder; or ``head``: an Eagle3Head object (e.g. one
        being trained, evaluated without saving it); neither: the drafter shipped for the
        target (``variant`` for SmolLM2-135M-Instruct: "all", trained on all of the training
        data, the best on unseen chat and code prompts; "general" or "code", its
        predecessors)."""
        for arg, value, low in (("depth", depth, 1), ("topk", topk, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"eagle3 drafter_args.{arg} must be an int >= {low}, got {value!r}")
        self.depth, self.topk = depth, topk
        if head is not None:
            head.config.check_target(target.model_config)
            self.head = head
        else:
            self.head = load_head(path, target, variant)
        self.hidden_layers = self.head.config.capture_layers
        self.runner = target.new_runner(self.head, name="eagle3")

    def init_state(self, request_id, prompt_token_ids) -> Eagle3State:
        return Eagle3State()

    def release(self, state: Eagle3State) -> None:
        self.runner.kv.release(state.table)
        state.pending.clear()
        state.num_cached = 0

    def restore(self, state: Eagle3State, token_ids, page_keys: list[bytes]) -> int:
        """The head's KV of the cached pages, cached in its runner: head slot i depends on
        tokens 0..i + 1 (the target's features of token i, the embedding of token i + 1), so
        its page p is keyed by the target's key and the token after the page."""
        kv = self.runner.kv
        pages = kv.cached_prefix(_head_keys(page_keys, token_ids, kv.page_size))
        kv.adopt(state.table, pages)
        state.num_cached = len(pages) * kv.page_size
        return len(pages)

    def on_verified(self, batch: VerifiedBatch) -> None:
        layers = self.head.config.capture_layers
        for i, r in enumerate(batch.requests):
            state: Eagle3State = r.state
            hidden = batch.hidden_of(i)
            if r.num_committed:
                state.pending.append(torch.cat([hidden[j] for j in layers], dim=-1))
            # expansion rows were scratch; the accepted positions are recomputed from features
            self.runner.kv.truncate(state.table, min(state.num_cached, state.table.num_slots))

    # ---- propose ---------------------------------------------------------------------------

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        trees = [DraftTree.empty() for _ in requests]
        live = [(i, r) for i, r in enumerate(requests) if self._reserve(r)]
        if not live:
            return trees
        # deepest first (stable): the requests that a level expands are a leading run of the
        # batch, so every level's device tensors are slices of the level before's
        live.sort(key=lambda ir: -self._levels(ir[1]))
        reqs = [r for _, r in live]
        levels = [self._levels(r) for r in reqs]
        y, logp = self._catch_up(reqs)
        tok, lp, par = self._expand(reqs, levels, y, logp)
        for (i, _), tree in zip(live, self._select(tok, lp, par, levels,
                                                   [r.budget.max_nodes for r in reqs])):
            trees[i] = tree
        return trees

    def _levels(self, r: DraftRequest) -> int:
        """Candidate levels the request may use (its tree's depth limit)."""
        return min(self.depth, r.budget.depth_limit)

    def _reserve(self, r: DraftRequest) -> bool:
        """Head KV for the catch-up rows and the expansion rows; none: no draft this step."""
        state: Eagle3State = r.state
        n = len(r.token_ids)
        # every committed token's features arrived through on_verified
        assert state.num_cached + state.num_pending == n - 1, (state.num_cached,
                                                               state.num_pending, n)
        if not state.num_pending:
            return False  # a one-token prompt's first step: no target features yet
        # the largest expansion level: topk chains of levels - 1 rows after the prefix
        need = n - 1 + self.topk * max(self._levels(r) - 1, 0)
        if not self.runner.kv.try_reserve(state.table, need):
            r.mark_no_kv()
            return False
        return True

    def _catch_up(self, reqs: list[DraftRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every request's pending rows; (y [B, H], log-probs [B, Vd]) of each last row."""
        feeds, starts, feats = [], [], []
        for r in reqs:
            s: Eagle3State = r.state
            feeds.append(list(r.token_ids[s.num_cached + 1:]))
            starts.append(s.num_cached)
            feats.extend(s.pending)
        features = self.head.fuse(torch.cat(feats).to(self.head.embed.dtype))
        batch = self.runner.pack(feeds, starts, [r.state.table for r in reqs], logits="last",
                                 features=features)
        out = self.runner.forward(batch)
        kv = self.runner.kv
        for r in reqs:
            r.state.num_cached = len(r.token_ids) - 1
            r.state.pending.clear()
            if r.page_keys:
                kv.register_full(r.state.table, _head_keys(r.page_keys, r.token_ids, kv.page_size,
                                                           r.state.table.num_keyed),
                                 r.state.num_cached)
        return out.logits_hidden, out.logits.log_softmax(-1)

    def _expand(self, reqs, levels: list[int], y: torch.Tensor, logp: torch.Tensor):
        """Every candidate level, on the device: per level c, (draft ids, cumulative log-probs
        (float64), parents: index in level c - 1, None for level 0), each [m_c, n_c] for the
        m_c leading requests that use the level; n_0 = topk, n_c = topk ** 2 after (candidate
        j * topk + t: frontier slot j's child of rank t).

        Level s's candidates are the children of level s - 1's frontier: its ``topk`` best
        candidates (best first, ties to the lower index), chosen on the device, each fed as the
        chain of its path (its ancestors from level 0 down, then itself: s rows), so that the
        forward's mask depends on s alone, never on what the device chose. The requests are
        the leading ones whose trees may be s + 1 deep."""
        k = self.topk
        top = logp.topk(k, dim=-1)
        # cumulative log-probs in float64: what the host lists summed (python floats)
        tok, lp, par = [top.indices], [top.values.double()], [None]
        chain_tok = chain_y = None  # the previous level's chains: draft ids, row outputs
        for s in range(1, max(levels)):
            m = sum(lv > s for lv in levels)
            front = lp[-1][:m].sort(dim=-1, descending=True, stable=True).indices[:, :k]
            own = tok[-1][:m].gather(1, front)[:, :, None]
            first = y[:m, None, None, :].expand(m, k, 1, y.shape[-1])  # the catch-up row's y
            if s == 1:
                ctok, feats = own, first
            else:
                # a frontier node's ancestors are its parent's chain: that chain's tokens, and
                # its rows' outputs as the features of the rows after them
                up = (front // k)[:, :, None]
                ctok = torch.cat([chain_tok[:m].gather(1, up.expand(m, k, s - 1)), own], 2)
                above = chain_y[:m].gather(1, up[..., None].expand(m, k, s - 1, y.shape[-1]))
                feats = torch.cat([first, above], 2)
            out = self._forward_chains(reqs[:m], ctok, feats.reshape(m * k * s, -1), s)
            chain_tok, chain_y = ctok, out.final_hidden[:m * k * s].view(m, k, s, -1)
            child = out.logits.log_softmax(-1).topk(k, dim=-1)  # [m * k, k]: chain ends
            flp = lp[-1][:m].gather(1, front)
            tok.append(child.indices.view(m, k * k))
            lp.append((flp[:, :, None] + child.values.double().view(m, k, k)).view(m, k * k))
            par.append(front[:, :, None].expand(m, k, k).reshape(m, k * k))
        return tok, lp, par

    def _forward_chains(self, reqs, ctok: torch.Tensor, features: torch.Tensor, s: int):
        """One forward of ``topk`` chains of ``s`` rows per request (``ctok`` [m, topk, s]
        draft ids, on the device), into the scratch slots after each request's prefix: chain
        row i at position n - 1 + i, attending the prefix and its chain's rows up to itself.
        Logits of each chain's last row."""
        k = self.topk
        rows = k * s
        tail = _chain_mask(k, s)
        feeds, starts, positions, masks, tables = [], [], [], [], []
        for r in reqs:
            n = len(r.token_ids)
            mask = torch.ones(rows, n - 1 + rows, dtype=torch.bool)
            mask[:, n - 1:] = tail
            feeds.append([0] * rows)  # placeholders: the ids are the device's (device_ids)
            starts.append(n - 1)
            positions.append(list(range(n - 1, n - 1 + s)) * k)
            masks.append(mask)
            tables.append(r.state.table)
        batch = self.runner.pack(feeds, starts, tables, logits="none", positions=positions,
                                 masks=masks, features=features)
        batch.logits_indices = host_tensor(list(range(s - 1, len(reqs) * rows, s)))
        ids = ctok.reshape(-1)
        batch.device_ids = ((0, ids + self.head.d2t.index_select(0, ids)),)  # target ids
        return self.runner.forward(batch)

    def _select(self, tok, lp, par, levels: list[int], budgets: list[int]) -> list[DraftTree]:
        """Per request, the ``budget`` most probable candidates of its levels, as a tree: chosen
        on the device, left there (no read)."""
        k = self.topk
        counts = [min(b, k + (lv - 1) * k * k) if lv else 0 for b, lv in zip(budgets, levels)]
        n = max(counts)
        if not n:
            return [DraftTree.empty() for _ in counts]
        # every candidate of a request in (level, index) order; levels it does not use: -inf,
        # after all of its own
        sizes = [int(t.shape[1]) for t in tok]
        total, dev = sum(sizes), lp[0].device
        all_lp = torch.full((len(levels), total), float("-inf"), dtype=torch.float64, device=dev)
        all_tok = torch.zeros(len(levels), total, dtype=torch.int64, device=dev)
        all_par = torch.full((len(levels), total), -1, dtype=torch.int64, device=dev)
        off = 0
        for c, size in enumerate(sizes):
            m = int(tok[c].shape[0])
            all_lp[:m, off:off + size] = lp[c]
            all_tok[:m, off:off + size] = tok[c]
            if c:
                all_par[:m, off:off + size] = par[c] + (off - sizes[c - 1])
            off += size
        # best first; a child's log-prob is its parent's plus a log-prob <= 0, and ties go to
        # the shallower node (then the lower index): the stable sort over (level, index) order.
        # So the first `budget` are ancestor-closed and topological
        order = all_lp.sort(dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(
            1, order, torch.arange(total, device=dev).expand(len(levels), total))
        chosen = order[:, :n]
        ids = all_tok.gather(1, chosen)
        ids = ids + self.head.d2t.index_select(0, ids.reshape(-1)).view(ids.shape)
        parent = all_par.gather(1, chosen)
        node = rank.gather(1, parent.clamp(min=0)).masked_fill(parent < 0, -1)
        # the trees stay on the device, their shape too: the target's forward takes them
        # there and the step's verification read brings them along (DraftTree.on_device)
        probs = all_lp.gather(1, chosen).float().exp()
        return [DraftTree.on_device(ids[b, :count], node[b, :count], probs[b, :count])
                if count else DraftTree.empty() for b, count in enumerate(counts)]


@lru_cache(maxsize=64)
def _chain_mask(k: int, s: int) -> torch.Tensor:
    """[k * s, k * s] bool: ``k`` chains of ``s`` rows, each row attending its chain's rows up
    to itself."""
    return torch.block_diag(*[torch.ones(s, s).tril()] * k).bool()


def _head_keys(page_keys, token_ids, page_size: int, start: int = 0) -> list:
    """The head's page keys: the target's page key and the token right after the page (for the
    pages whose next token exists); entries before ``start`` (already registered) are None."""
    n = min(len(page_keys), (len(token_ids) - 1) // page_size)
    return [None] * start + [next_token_key(page_keys[p], token_ids[(p + 1) * page_size])
                             for p in range(start, n)]


def load_head(path: str | None, target: TargetInfo, variant: str = "all") -> Eagle3Head:
    """The head at ``path`` (EAGLE-3 format), or the one shipped for the target, checked
    against the target."""
    from specdec.drafters.catalog import checkpoint_folder
    from specdec.models.heads.eagle3_io import load_eagle3

    folder = checkpoint_folder("eagle3", path, target.model_path,
                               "a folder in the EAGLE-3 format", variant)
    head = load_eagle3(folder, target.model_config, target.model.embed, target.hf_config)
    head.requires_grad_(False)
    return head
