"""Draft-model drafting: a small causal LM (or the target's first N layers) proposes a chain.

Two sources, one mechanism (both run through a runner the engine gives them, whose paged KV comes
out of the engine's memory budget):
- `model=...`: a separate small causal LM with the target's tokenizer/vocabulary (any model
  specdec loads: alias, HF folder, .gguf);
- `early_exit_layers=N`: self-speculation with the target's first N layers, its final norm and
  LM head (no extra weights; useful when no smaller sibling model exists, as for SmolLM2-135M).

Per step and request: the draft model catches up on the tokens committed since its last step
(a short prefill), then decodes `depth` tokens one at a time, all requests batched. Greedy
requests get argmax drafts; sampled requests get drafts sampled from the draft distribution q
(processed with the request's temperature/top-k/top-p/min-p) with the noise of the draft's own
position (``specdec.randomness``: the noise the ``gumbel`` verifier races the target with, so a
draft is accepted whenever q and p race to the same token), and q as `draft_probs`, which the
``rejection`` verifier needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec import randomness
from specdec.drafters.base import BaseDrafter, DraftRequest, TargetInfo, VerifiedBatch
from specdec.kv.block_table import BlockTable
from specdec.models.loader import load_model, resolve_model_path
from specdec.sampling import greedy, logits_to_probs, params_to_tensors
from specdec.tree import DraftTree


@dataclass
class DraftState:
    table: BlockTable = field(default_factory=BlockTable)
    num_cached: int = 0  # tokens of the request whose KV the draft model holds
    # the request's length when the chain in flight was started (None: none since the last
    # on_verified, which resolves it whatever came of it: verified, or a propose that raised)
    base: int | None = None


class DraftModelDrafter(BaseDrafter):
    """A chain from a draft LM (or the target's first layers), through its own runner."""

    name = "draft_model"
    # propose feeds drafts into the draft cache (num_cached moves on): a repeat call would draft
    # from the wrong position; a raising one is resolved by on_verified through ``base``
    replay_safe = False

    def __init__(self, target: TargetInfo, model: str | None = None,
                 early_exit_layers: int | None = None, max_depth: int = 6):
        _check_args(model, early_exit_layers, max_depth, target)
        self.max_depth = max_depth
        self.max_len = target.max_model_len
        if model is not None:
            draft, name, layers = _load_draft(model, target), "draft_model", None
        else:
            if getattr(target.model, "tp_size", 1) > 1:  # its layers reduce over every rank
                raise ValueError(
                    f"draft_model early_exit_layers={early_exit_layers} runs the target's own "
                    f"layers, which tensor_parallel_size={target.model.tp_size} splits over "
                    "the ranks (the drafter runs on rank 0 only); give drafter_args.model (a "
                    "draft model) or tensor_parallel_size=1")
            draft, name, layers = target.model, f"early_exit[{early_exit_layers}]", early_exit_layers
        self.runner = target.new_runner(draft, name=name, num_layers=layers)

    def init_state(self, request_id, prompt_token_ids) -> DraftState:
        return DraftState()

    def release(self, state: DraftState) -> None:
        self.runner.kv.release(state.table)
        state.num_cached = 0

    def restore(self, state: DraftState, token_ids, page_keys: list[bytes]) -> int:
        """The draft model's own KV of the cached pages, cached in its runner under the same
        keys (its slot i depends on tokens 0..i, as the target's)."""
        kv = self.runner.kv
        pages = kv.cached_prefix(page_keys)
        kv.adopt(state.table, pages)
        state.num_cached = len(pages) * kv.page_size
        return len(pages)

    def on_verified(self, batch: VerifiedBatch) -> None:
        for r in batch.requests:
            state: DraftState = r.state
            if state.base is None:
                continue  # no chain since the last step: the draft cache is still all valid
            # the drafts the target accepted are exactly what the draft cache holds past `base`
            # (none when the engine got no tree from us: num_proposed 0)
            state.num_cached = min(state.num_cached, state.base + r.num_accepted)
            state.base = None
            self.runner.kv.truncate(state.table, min(state.num_cached, state.table.num_slots))

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        trees = [DraftTree.empty() for _ in requests]
        live = [i for i, r in enumerate(requests) if self._reserve(r)]
        if not live:
            return trees
        reqs = [requests[i] for i in live]
        depth = [min(r.budget.depth_limit, self.max_depth) for r in reqs]
        tokens, qs = self._draft(reqs, depth)
        for j, i in enumerate(live):
            d = depth[j]
            probs = None if reqs[j].params.greedy else torch.stack(qs[j][:d])
            trees[i] = DraftTree.chain(torch.tensor(tokens[j][:d], dtype=torch.int64), probs)
        return trees

    def _reserve(self, r: DraftRequest) -> bool:
        """Room for catch-up + drafts in the draft cache; without it, no draft this step."""
        state: DraftState = r.state
        # every slot below num_cached holds a committed token's KV (on_verified cut the rest)
        self.runner.kv.register_full(state.table, r.page_keys, state.num_cached)
        need = len(r.token_ids) + min(r.budget.depth_limit, self.max_depth)
        if need > self.max_len or not self.runner.kv.try_reserve(state.table, need):
            r.mark_no_kv()
            return False
        state.base = len(r.token_ids)
        return True

    def _draft(self, reqs: list[DraftRequest], depth: list[int]):
        """Chains of drafted tokens and (for sampled requests) their distributions."""
        feeds = [r.token_ids[r.state.num_cached:] for r in reqs]
        tokens: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        for step in range(max(depth)):
            active = [j for j, d in enumerate(depth) if step < d]
            logits = self._forward([reqs[j] for j in active], [feeds[j] for j in active])
            picks, probs = self._pick([reqs[j] for j in active], logits, step)
            for k, j in enumerate(active):
                tokens[j].append(picks[k])
                if probs is not None and probs[k] is not None:
                    qs[j].append(probs[k])
                feeds[j] = [picks[k]]
        return tokens, qs

    def _forward(self, reqs: list[DraftRequest], feeds: list[list[int]]) -> torch.Tensor:
        """Feed each request's new tokens; last-row logits [len(reqs), V]."""
        starts = [r.state.num_cached for r in reqs]
        batch = self.runner.pack(feeds, starts, [r.state.table for r in reqs], logits="last")
        out = self.runner.forward(batch)
        for r, f in zip(reqs, feeds):
            r.state.num_cached += len(f)
        return out.logits

    def _pick(self, reqs: list[DraftRequest], logits: torch.Tensor, step: int):
        """Each request's draft at depth ``step`` (position len(token_ids) + step): the argmax,
        or for sampled requests a draw from q with that position's noise, and q."""
        picks = greedy(logits)
        sampled = [k for k, r in enumerate(reqs) if not r.params.greedy]
        if not sampled:
            return picks.tolist(), None
        idx = torch.tensor(sampled, device=logits.device)
        q = logits_to_probs(logits.index_select(0, idx),
                            *params_to_tensors([reqs[k].params for k in sampled], logits.device))
        keys = [randomness.key(reqs[k].seed, len(reqs[k].token_ids) + step) for k in sampled]
        picks[idx] = randomness.draw(q, keys)
        probs: list[torch.Tensor | None] = [None] * len(reqs)
        for row, k in enumerate(sampled):
            probs[k] = q[row]
        return picks.tolist(), probs

def _check_args(model, early_exit_layers, max_depth, target: TargetInfo) -> None:
    if (model is None) == (early_exit_layers is None):
        raise ValueError("draft_model needs exactly one of drafter_args.model (a small LM with "
                         "the target's vocabulary) or drafter_args.early_exit_layers (int)")
    n = target.model_config.num_layers
    if early_exit_layers is not None and not (
            isinstance(early_exit_layers, int) and 1 <= early_exit_layers < n):
        raise ValueError(f"early_exit_layers must be an int in [1, {n - 1}], got {early_exit_layers!r}")
    if not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth must be an int >= 1, got {max_depth!r}")


def _load_draft(model: str, target: TargetInfo):
    """The draft LM; from a GGUF its matrices stay the file's blocks (no fp32 copy): the engine
    runs them through the kernels where they can, else dequantizes them once (build.py)."""
    folder = resolve_model_path(model)
    draft, cfg, _ = load_model(folder, target.dtype, target.device, target.max_model_len,
                               blocks=True)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {model!r} has vocab_size {cfg.vocab_size}, the target "
                         f"{target.vocab_size}: they must share a tokenizer")
    return draft
