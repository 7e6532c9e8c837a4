"""Block-diffusion drafting (DFlash-style): B - 1 drafts from one forward of a small model.

Per request the drafter keeps paged KV (its runner's) holding the context keys/values of the
committed positions it has fed (``num_cached``), and the fused target features of committed
tokens not fed yet (``pending``, from ``on_verified``). A step, all requests in one forward:

    rows of request r:  pending context rows (positions num_cached .. N-2; causal, outputs unused)
                        block rows [token N-1, MASK_1 .. MASK_{B-1}] at positions N-1 .. N+B-2
                        (they see every context slot and every block row: non-causal), each
                        with the fused state of position N-2 added to its input

Block row k's distribution ranks token N-1+k (tree depth k). The tree is the calibrated rank-path
shape (``rank_tree``) cut to the budget: a chain of top-1 tokens when the budget is a chain, a
tree of per-position top-k otherwise. Block rows are scratch: the KV is cut back to the context
after the forward. Drafts are deterministic (top-k): verified losslessly as for any drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.attention.block_masks import block_mask
from specdec.drafters.base import BaseDrafter, DraftRequest, TargetInfo, VerifiedBatch
from specdec.drafters.rank_tree import DeviceTrees, default_rates, rank_paths
from specdec.kv.block_table import BlockTable
from specdec.models.heads.block_diffusion import BlockDiffusionConfig, BlockDiffusionModel
from specdec.tree import DraftTree

__all__ = ["BlockDiffusionConfig", "BlockDiffusionDrafter", "BlockDiffusionModel", "load_model"]



@dataclass
class BlockState:
    table: BlockTable = field(default_factory=BlockTable)  # the drafter's KV pages
    num_cached: int = 0  # positions whose context K/V is in the cache
    pending: list[torch.Tensor] = field(default_factory=list)  # [n_i, n * H] features to feed
    last: torch.Tensor | None = None  # [H] fused state of position num_cached - 1

    @property
    def num_pending(self) -> int:
        return sum(int(p.shape[0]) for p in self.pending)


class BlockDiffusionDrafter(BaseDrafter):
    name = "block_diffusion"
    # on_verified appends features (twice on a repeat); a propose that raises has changed only
    # `last` (the next one sets it again) and reserved KV slots (the next one truncates them)
    replay_safe = False

    def __init__(self, target: TargetInfo, path: str | None = None, topk: int = 4,
                 model: BlockDiffusionModel | None = None) -> None:
        """``path``: a block-diffusion folder (e.g. made by `specdec train block_diffusion`);
        or ``model``; neither: the drafter shipped for the target. ``topk``: ranks per block
        position considered for trees."""
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"block_diffusion drafter_args.topk must be an int >= 1, got "
                             f"{topk!r}")
        self.model = model if model is not None else load_model(path, target)
        self.model.config.check_target(target.model_config)
        self.model.requires_grad_(False)
        c = self.model.config
        rates = getattr(self.model, "rank_acceptance", None) or default_rates(
            c.block_size - 1, topk)
        self.rates = tuple(tuple(row[:topk]) for row in rates)
        self.topk = min(topk, c.draft_vocab_size)
        self.hidden_layers = tuple(c.target_layer_ids)
        self.runner = target.new_runner(self.model, name="block_diffusion")
        self._trees = DeviceTrees()

    def init_state(self, request_id, prompt_token_ids) -> BlockState:
        return BlockState()

    def release(self, state: BlockState) -> None:
        self.runner.kv.release(state.table)
        state.pending.clear()
        state.num_cached = 0
        state.last = None

    def restore(self, state: BlockState, token_ids, page_keys: list[bytes]) -> int:
        """The context KV of the cached pages, cached in this drafter's runner under the same
        keys (context slot i depends on the target's features of token i: tokens 0..i)."""
        kv = self.runner.kv
        pages = kv.cached_prefix(page_keys)
        kv.adopt(state.table, pages)
        state.num_cached = len(pages) * kv.page_size
        state.last = None  # the block's conditioning comes from the features heard next
        return len(pages)

    def on_verified(self, batch: VerifiedBatch) -> None:
        for i, r in enumerate(batch.requests):
            if r.num_committed:
                hidden = batch.hidden_of(i)
                r.state.pending.append(torch.cat([hidden[j] for j in self.hidden_layers], -1))

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        trees = [DraftTree.empty() for _ in requests]
        live = [j for j, r in enumerate(requests) if self._reserve(r)]
        if not live:
            return trees
        tokens, probs = self._forward([requests[j] for j in live])
        # the trees' tokens stay on the device: the step's verification read brings them
        for row, j in enumerate(live):
            b = requests[j].budget
            paths = rank_paths(self.rates, b.max_nodes, b.depth_limit)
            if paths:
                trees[j] = self._trees.tree(paths, tokens[row], probs[row])
        return trees

    def _reserve(self, r: DraftRequest) -> bool:
        """KV for the context rows and the block; none: no draft this step."""
        state: BlockState = r.state
        n = len(r.token_ids)
        assert state.num_cached + state.num_pending == n - 1, (state.num_cached,
                                                               state.num_pending, n)
        if n < 2:
            return False  # a one-token prompt's first step: no context yet
        if state.last is None and not state.num_pending:
            # a prefix hit that ended at the last prompt token (restore): the fused state of
            # position n - 2 came from the cache, not from the target's features, so nothing
            # to condition the block on; this step decodes plainly, and its on_verified brings
            # the features of position n - 1 for the next
            return False
        if not self.runner.kv.try_reserve(state.table, n - 1 + self.model.config.block_size):
            r.mark_no_kv()
            return False
        return True

    def _forward(self, reqs: list[DraftRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward for every request: (tokens [R, B-1, k] target ids, probs [R, B-1, k])."""
        c = self.model.config
        b = c.block_size
        masks_ids = [c.mask_id(k) for k in range(1, b)]
        pending = [p for r in reqs for p in r.state.pending]
        with torch.inference_mode():  # every request's new context rows, fused at once
            fused = (self.model.fuse(torch.cat(pending).to(self.model.embed.dtype)).split(
                [r.state.num_pending for r in reqs]) if pending else [None] * len(reqs))
        feeds, starts, positions, masks, feats, ctx, pick = [], [], [], [], [], [], []
        for r, rows in zip(reqs, fused):
            s: BlockState = r.state
            n = len(r.token_ids)
            m = s.num_pending
            if m:
                s.last = rows[-1]
                feats.append(rows)
            feeds.append([0] * m + [r.token_ids[n - 1]] + masks_ids)
            starts.append(s.num_cached)
            positions.append(list(range(s.num_cached, n - 1 + b)))
            masks.append(block_mask(s.num_cached, m, b))
            feats.append(s.last.expand(b, -1))
            ctx += [True] * m + [False] * b
            end = (pick[-1] + 1 if pick else 0) + len(feeds[-1])
            pick += range(end - (b - 1), end)  # its block rows 1 .. B-1: the last B - 1
        # the context flags and the block rows' indices go in the forward's one staging copy
        batch = self.runner.pack(feeds, starts, [r.state.table for r in reqs], logits=pick,
                                 positions=positions, masks=masks, features=torch.cat(feats),
                                 context_rows=torch.tensor(ctx))
        out = self.runner.forward(batch)
        with torch.inference_mode():
            top = out.logits.softmax(-1).topk(self.topk, dim=-1)
            tokens = self.model.token_map[top.indices].view(len(reqs), b - 1, -1)
        for r in reqs:
            s = r.state
            s.num_cached = len(r.token_ids) - 1
            s.pending.clear()
            self.runner.kv.truncate(s.table, s.num_cached)  # the block rows were scratch
            self.runner.kv.register_full(s.table, r.page_keys, s.num_cached)
        return tokens, top.values.view(len(reqs), b - 1, -1)


def load_model(path: str | None, target: TargetInfo) -> BlockDiffusionModel:
    """The drafter at ``path``, or the one shipped for the target, checked against it."""
    from specdec.drafters.catalog import checkpoint_folder
    from specdec.models.heads.block_diffusion_io import load_block_diffusion

    folder = checkpoint_folder("block_diffusion", path, target.model_path,
                               "a block-diffusion folder")
    return load_block_diffusion(folder, target.model_config, target.model.embed,
                                target.hf_config)
