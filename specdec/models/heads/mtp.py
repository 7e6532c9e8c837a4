"""Multi-token-prediction heads (Medusa-style) on the target's last hidden state.

Head i maps the target's final-normed hidden state at position p (the row whose LM-head output
is token p + 1) to a distribution over token p + 2 + i::

    x   = final_norm(h_p)                          the target's own final norm
    y_i = x + SiLU(W_i,l x) ... (num_layers residual blocks per head, as vLLM's ResidualBlock)
    logits_i = lm_head(y_i)   over the draft vocabulary; target id = token_map[draft id]

All heads run in one pass from one state (no attention, no KV). ``lm_head`` is one matrix shared
by the heads (vLLM's ``original_lm_head``), its rows initialised from the target's LM head for
the draft vocabulary; the blocks start at zero, so an untrained head repeats the target's
next-token guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.decoder.config import ModelConfig
from specdec.models.heads.draft_vocab import TokenMap, check_made_for


@dataclass(frozen=True)
class MTPConfig:
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    num_heads: int  # head i predicts token p + 2 + i
    num_layers: int  # residual blocks per head
    target_num_layers: int

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int, num_heads: int = 4,
                   num_layers: int = 1) -> MTPConfig:
        return cls(target.hidden_size, target.vocab_size, draft_vocab_size, num_heads,
                   num_layers, target.num_layers)

    def check_target(self, target: ModelConfig) -> None:
        check_made_for("these MTP heads", self.hidden_size, self.vocab_size,
                       self.target_num_layers, target)


class MTPHeads(TokenMap):
    # the blocks draft_weights="auto" quantizes it to (specdec.models.heads.weights): drafts
    # need no exactness, and on SmolLM2 Q4_1 accepts within 1 % of Q8_0 (docs/benchmarks.md)
    auto_draft_weights = "Q4_1"

    def __init__(self, config: MTPConfig, dtype: torch.dtype, device=None,
                 trainable: bool = False) -> None:
        super().__init__()
        self.config = config
        h, n = config.hidden_size, config.num_heads
        kw = dict(dtype=dtype, device=device)
        self.blocks = nn.Parameter(torch.zeros(n, config.num_layers, h, h, **kw),
                                   requires_grad=trainable)
        self.lm_head = nn.Parameter(torch.zeros(config.draft_vocab_size, h, **kw),
                                    requires_grad=trainable)
        self.register_vocab(config.draft_vocab_size, config.vocab_size, device)
        self.matmul = F.linear  # the engine installs its kernels (specdec.models.matmul.prepared)

    def init_from_target(self, head_weight: torch.Tensor, used_ids: torch.Tensor) -> None:
        """A new head: zero blocks, the target's LM-head rows of the draft vocabulary."""
        self.set_vocab(used_ids)
        with torch.no_grad():
            self.blocks.zero_()
            self.lm_head.copy_(head_weight.index_select(0, self.token_map).to(self.lm_head))

    def forward(self, x: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """x [..., H] final-normed target states -> [..., n, H]: the first ``num_heads`` heads
        (all by default; a draft ``n`` deep needs only heads 0..n-1)."""
        n = self.config.num_heads if num_heads is None else min(num_heads, self.config.num_heads)
        return torch.stack([self.head(i, x) for i in range(n)], dim=-2)

    def head(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Head i's residual blocks: x [..., H] -> [..., H]."""
        for layer in range(self.config.num_layers):
            x = x + F.silu(self._mm(x, self.blocks[i, layer]))
        return x

    def _mm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ weight.T through the matmul hook (which takes 2-d rows)."""
        return self.matmul(x.reshape(-1, x.shape[-1]), weight, None).view(*x.shape[:-1], -1)

    def named_matrices(self) -> dict[str, torch.Tensor]:
        """Every weight matrix the forward multiplies by: ``blocks.{head}.{layer}`` (views of
        ``blocks``, the ones ``head`` passes to the hook) and ``lm_head``."""
        n, layers = self.config.num_heads, self.config.num_layers
        return {**{f"blocks.{i}.{j}": self.blocks[i, j] for i in range(n)
                   for j in range(layers)}, "lm_head": self.lm_head}

    def matrices(self) -> list[torch.Tensor]:
        return list(self.named_matrices().values())

    def compute_logits(self, y: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., draft_vocab_size], float32 at least."""
        logits = self._mm(y, self.lm_head)
        return logits if logits.dtype == torch.float64 else logits.float()
