"""MTP drafting: Medusa-style heads on the target's last hidden state, one pass per step.

Only the heads a step's deepest budget reaches run (a depth-1 draft costs one head, not all).

After each step the drafter keeps, per request, the target's hidden state of the last committed
row (position N - 2: the row whose LM-head output is the newest token N - 1). Head i of that
state ranks token N + i, i.e. tree depth i. All requests' heads run in one batched pass; each
request's tree is the calibrated rank-path shape (``rank_tree``) cut to its budget: the
``max_nodes`` most likely combinations of the heads' top choices, at most ``depth_limit`` deep.

Drafts are deterministic (top-k): the verifier accepts them losslessly (greedy equality; q = 1
rule for sampled requests). No KV, no runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.drafters.base import BaseDrafter, DraftRequest, TargetInfo, VerifiedBatch
from specdec.drafters.rank_tree import DeviceTrees, default_rates, rank_paths
from specdec.models.heads.mtp import MTPConfig, MTPHeads
from specdec.tree import DraftTree

__all__ = ["MTPConfig", "MTPDrafter", "MTPHeads", "load_heads"]  # the heads: drafter_args



@dataclass
class MTPState:
    hidden: torch.Tensor | None = None  # [H] the target's last committed row (pre-norm)
    position: int = -1  # that row's position


class MTPDrafter(BaseDrafter):
    name = "mtp"
    # propose only reads the state; on_verified overwrites it with the step's last row
    replay_safe = True
    prefix_cache_safe = True  # only the last committed token's hidden state is kept

    def __init__(self, target: TargetInfo, path: str | None = None, topk: int = 4,
                 heads: MTPHeads | None = None) -> None:
        """``path``: a Medusa-format folder (e.g. made by `specdec train mtp`); or ``heads``;
        neither: the drafter shipped for the target. ``topk``: ranks per head considered."""
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"mtp drafter_args.topk must be an int >= 1, got {topk!r}")
        self.target = target.model
        self.heads = heads if heads is not None else load_heads(path, target)
        self.heads.config.check_target(target.model_config)
        self.heads.requires_grad_(False)
        self.matmul_models = (self.heads,)  # the engine installs its linear kernels on these
        n = self.heads.config.num_heads
        rates = getattr(self.heads, "rank_acceptance", None) or default_rates(n, topk)
        self.rates = tuple(tuple(row[:topk]) for row in rates)
        self.topk = min(topk, self.heads.config.draft_vocab_size)
        self.hidden_layers = (target.model_config.num_layers - 1,)
        self._trees = DeviceTrees()

    def init_state(self, request_id, prompt_token_ids) -> MTPState:
        return MTPState()

    def release(self, state: MTPState) -> None:
        state.hidden, state.position = None, -1

    def on_verified(self, batch: VerifiedBatch) -> None:
        layer = self.hidden_layers[0]
        for i, r in enumerate(batch.requests):
            if r.num_committed:
                r.state.hidden = batch.hidden_of(i)[layer][-1].clone()
                r.state.position = r.num_computed - 1

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        trees = [DraftTree.empty() for _ in requests]
        live = [j for j, r in enumerate(requests)
                if r.state.hidden is not None and r.state.position == len(r.token_ids) - 2]
        if not live:
            return trees
        # only the heads as deep as the deepest budget asks (head i drafts depth i + 1)
        deepest = max(1, max(requests[j].budget.depth_limit for j in live))
        with torch.inference_mode():
            x = self.target.norm(torch.stack([requests[j].state.hidden for j in live]))
            y = self.heads(x.to(self.heads.lm_head.dtype), deepest)  # [R, heads used, H]
            probs = self.heads.compute_logits(y).softmax(-1)
            top = probs.topk(self.topk, dim=-1)  # [R, heads used, k]
            tokens = self.heads.token_map[top.indices]
            # the trees' tokens stay on the device: the step's verification read brings them
            for row, j in enumerate(live):
                b = requests[j].budget
                paths = rank_paths(self.rates, b.max_nodes, b.depth_limit)
                if paths:
                    trees[j] = self._trees.tree(paths, tokens[row], top.values[row])
        return trees


def load_heads(path: str | None, target: TargetInfo) -> MTPHeads:
    """The heads at ``path`` (Medusa format), or the ones shipped for the target."""
    from specdec.drafters.catalog import checkpoint_folder
    from specdec.models.heads.mtp_io import load_mtp

    folder = checkpoint_folder("mtp", path, target.model_path, "a folder in the Medusa format")
    return load_mtp(folder, target.model_config, target.dtype, target.device)
