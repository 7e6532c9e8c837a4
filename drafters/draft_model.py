"""Draft-model drafting: a small causal LM (or the target's first N layers) proposes a chain.

Two sources, one mechanism (both keep their own paged KV cache):
- `model=...`: a separate small causal LM with the target's tokenizer/vocabulary (any model
  specdec loads: alias, HF folder, .gguf);
- `early_exit_layers=N`: self-speculation with the target's first N layers, its final norm and
  LM head (no extra weights; useful when no smaller sibling model exists, as for SmolLM2-135M).

Per step and request: the draft model catches up on the tokens committed since its last step
(a short prefill), then decodes `depth` tokens one at a time, all requests batched. Greedy
requests get argmax drafts; sampled requests get drafts sampled from the draft distribution
(processed with the request's temperature/top-k/top-p/min-p) and that distribution as
`draft_probs`, so the verifier's rejection sampling stays lossless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.attention.metadata import build_metadata
from specdec.attention.torch_backend import TorchAttentionBackend
from specdec.drafters.base import BaseDrafter, DraftRequest, TargetInfo, VerifiedStep
from specdec.kv.block_table import BlockTable, KVCacheManager
from specdec.kv.cache import KVCache
from specdec.kv.page_pool import PagePool
from specdec.models.loader import load_model, resolve_model_path
from specdec.sampling import logits_to_probs, params_to_tensors, sample
from specdec.tree import DraftTree


@dataclass
class DraftState:
    table: BlockTable = field(default_factory=BlockTable)
    num_cached: int = 0  # tokens of the request whose KV the draft model holds
    base: int = 0  # the request's length when the last chain was proposed


class DraftModelDrafter(BaseDrafter):
    name = "draft_model"

    def __init__(self, target: TargetInfo, model: str | None = None,
                 early_exit_layers: int | None = None, max_depth: int = 6,
                 page_size: int = 16, max_seqs: int = 16, max_model_len: int | None = None):
        _check_args(model, early_exit_layers, max_depth, target)
        self.max_depth = max_depth
        self.device = target.device
        self.max_len = max_model_len or min(target.model_config.max_position_embeddings, 4096)
        if model is not None:
            self.model, cfg, self.num_layers = _load_draft(model, target, self.max_len)
        else:
            self.model, cfg, self.num_layers = target.model, target.model_config, early_exit_layers
        num_pages = max_seqs * -(-self.max_len // page_size)
        self.kv_cache = KVCache(self.num_layers, num_pages, page_size, cfg.num_kv_heads,
                                cfg.head_dim, target.dtype, target.device)
        self.kv = KVCacheManager(PagePool(num_pages), page_size)
        self.backend = TorchAttentionBackend()

    def init_state(self, request_id, prompt_token_ids) -> DraftState:
        return DraftState()

    def release(self, state: DraftState) -> None:
        self.kv.release(state.table)
        state.num_cached = 0

    def on_verified(self, state: DraftState, step: VerifiedStep) -> None:
        if step.num_proposed == 0:
            return  # nothing of ours was verified: the draft cache is still all valid
        # the drafts the target accepted are exactly what the draft cache holds past `base`
        state.num_cached = min(state.num_cached, state.base + step.num_accepted)
        self.kv.truncate(state.table, state.num_cached)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        trees = [DraftTree.empty() for _ in requests]
        live = [i for i, r in enumerate(requests) if self._reserve(r)]
        if not live:
            return trees
        reqs = [requests[i] for i in live]
        depth = [min(r.budget, self.max_depth) for r in reqs]
        tokens, qs = self._draft(reqs, depth)
        for j, i in enumerate(live):
            d = depth[j]
            probs = None if reqs[j].params.greedy else torch.stack(qs[j][:d])
            trees[i] = DraftTree.chain(torch.tensor(tokens[j][:d], dtype=torch.int64), probs)
        return trees

    def _reserve(self, r: DraftRequest) -> bool:
        """Room for catch-up + drafts in the draft cache; no room means no draft this step."""
        state: DraftState = r.state
        need = len(r.token_ids) + min(r.budget, self.max_depth)
        if need > self.max_len or not self.kv.can_reserve(state.table, need):
            return False
        self.kv.reserve(state.table, need)
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
            picks, probs = self._pick([reqs[j] for j in active], logits)
            for k, j in enumerate(active):
                tokens[j].append(picks[k])
                if probs is not None and probs[k] is not None:
                    qs[j].append(probs[k])
                feeds[j] = [picks[k]]
        return tokens, qs

    def _forward(self, reqs: list[DraftRequest], feeds: list[list[int]]) -> torch.Tensor:
        """Feed each request's new tokens; last-row logits [len(reqs), V]."""
        starts = [r.state.num_cached for r in reqs]
        ends = [s + len(f) for s, f in zip(starts, feeds)]
        md = build_metadata([r.state.table.pages for r in reqs], ends, [len(f) for f in feeds],
                            self.kv.page_size, device=self.device)
        self.backend.plan(md)
        ids = torch.tensor([t for f in feeds for t in f], dtype=torch.int64, device=self.device)
        pos = torch.tensor([p for s, e in zip(starts, ends) for p in range(s, e)],
                           dtype=torch.int64, device=self.device)
        out = self.model(ids, pos, self.backend, self.kv_cache, num_layers=self.num_layers)
        last = torch.tensor([len(f) for f in feeds], device=self.device).cumsum(0) - 1
        for r, e in zip(reqs, ends):
            r.state.num_cached = e
        return self.model.compute_logits(out.hidden.index_select(0, last))

    def _pick(self, reqs: list[DraftRequest], logits: torch.Tensor):
        picks = logits.argmax(dim=-1)
        sampled = [k for k, r in enumerate(reqs) if not r.params.greedy]
        if not sampled:
            return picks.tolist(), None
        idx = torch.tensor(sampled, device=logits.device)
        q = logits_to_probs(logits.index_select(0, idx),
                            *params_to_tensors([reqs[k].params for k in sampled], logits.device))
        picks[idx] = sample(q, [reqs[k].generator for k in sampled])
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


def _load_draft(model: str, target: TargetInfo, max_len: int):
    folder = resolve_model_path(model)
    draft, cfg, _ = load_model(folder, target.dtype, target.device, max_len)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {model!r} has vocab_size {cfg.vocab_size}, the target "
                         f"{target.vocab_size}: they must share a tokenizer")
    return draft, cfg, cfg.num_layers
