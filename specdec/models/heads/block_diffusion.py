"""A DFlash-style block-diffusion drafter: a few decoder layers that fill a whole block at once.

Context: the target's states at ``target_layer_ids`` (layer outputs), fused per position::

    c_j = hidden_norm(fc(cat(h_l1[j], ..., h_ln[j])))        one row per committed position

Every draft layer projects c_j with its own k/v projections (no query, no residual stream): the
context keys/values, cached in the drafter's paged KV at position j (RoPE at j). A step feeds the
block ``[token N-1, MASK_1, ..., MASK_{B-1}]`` (B rows, positions N-1 .. N+B-2). Block rows attend
to every context key (positions < N-1: strictly before the anchor) and to every block row
(non-causal); the final norm and a reduced-vocabulary LM head give block row k's distribution
over token N-1+k, k = 1 .. B-1: B - 1 drafts from one forward.

Two departures from DFlash, both measured on SmolLM2 (docs/benchmarks.md): MASK_k is a learned
embedding per block position (SmolLM2 has no free token row; input id ``vocab_size + k - 1``),
and every block row's input also carries c_{N-2}, the fused state of the last committed row with
target features (the anchor's predecessor) — the information an EAGLE or MTP head starts from.
With attention alone, the drafter did not learn to use its context in a CPU budget (top-1 at
block position 1 stayed at the unigram rate, ~5 %, after 100 steps of 1,000 conversations).

Context rows and block rows run through the same forward (``context_rows`` marks the former):
a context row's projections read c_j instead of the normed residual stream, and its outputs are
never used. ``features`` carries, per row, c_j (context rows) or c_{N-2} (block rows). The same
code serves the paged runner (inference) and a dense mask (training).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.decoder.config import ModelConfig
from specdec.models.decoder.llama import DecoderLayer, ForwardOutput, rms_norm
from specdec.models.heads.draft_vocab import TokenMap, check_made_for
from specdec.models.heads.feature_head import FeatureHead, LayerShape, head_layer_config


def default_target_layer_ids(num_layers: int, n: int = 5) -> tuple[int, ...]:
    """DFlash's ``build_target_layer_ids``: round(1 + i (L - 4) / (n - 1)) (outputs of those
    layers); SmolLM2's 30 layers, n 5: (1, 8, 14, 20, 27)."""
    if n == 1:
        return (num_layers // 2,)
    return tuple(round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n))


@dataclass(frozen=True)
class BlockDiffusionConfig(LayerShape):
    vocab_size: int  # the target's (MASK's input id)
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    target_layer_ids: tuple[int, ...]  # outputs of these target layers are fused
    num_layers: int
    block_size: int  # B: the last token + B - 1 masks, B - 1 drafts
    max_position_embeddings: int

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int, num_layers: int = 1,
                   block_size: int = 8,
                   target_layer_ids: tuple[int, ...] | None = None) -> BlockDiffusionConfig:
        """Layers shaped like the target's (the usual choice; a mixture-of-experts target's:
        dense layers as wide as one of its experts)."""
        ids = tuple(target_layer_ids or default_target_layer_ids(target.num_layers))
        width = target.moe_intermediate_size if target.is_moe else target.intermediate_size
        return cls(target.hidden_size, target.num_heads, target.num_kv_heads, target.head_dim,
                   width, target.rms_norm_eps, target.vocab_size,
                   draft_vocab_size, target.hidden_size, target.num_layers, ids, num_layers,
                   block_size, target.max_position_embeddings)

    def mask_id(self, k: int) -> int:
        """The input id of MASK_k, block position k (1 .. block_size - 1)."""
        return self.vocab_size + k - 1

    def layer_config(self) -> ModelConfig:
        """The draft layers as a ModelConfig (what runners and DecoderLayer read)."""
        return head_layer_config(self, self.num_layers, self.draft_vocab_size,
                                 self.max_position_embeddings)

    def check_target(self, target: ModelConfig) -> None:
        """ValueError naming both values when the drafter was made for another target."""
        check_made_for("this block-diffusion drafter", self.target_hidden_size,
                       self.vocab_size, self.target_num_layers, target)
        if not all(0 <= j < target.num_layers for j in self.target_layer_ids):
            raise ValueError(f"target_layer_ids {list(self.target_layer_ids)} must be in "
                             f"[0, {target.num_layers - 1}] (outputs of the target's layers)")


class BlockDiffusionModel(TokenMap, FeatureHead):
    def __init__(self, config: BlockDiffusionConfig, embed: torch.Tensor, hf_config,
                 trainable: bool = False) -> None:
        super().__init__(config, len(config.target_layer_ids) * config.target_hidden_size,
                         embed, trainable)
        kw = dict(dtype=embed.dtype, device=embed.device)
        self.layers = nn.ModuleList(DecoderLayer(self.cfg, trainable).to(**kw)
                                    for _ in range(config.num_layers))
        self.mask_embedding = nn.Parameter(  # MASK_1 .. MASK_{B-1}
            torch.zeros(config.block_size - 1, config.hidden_size, **kw), requires_grad=trainable)
        self.register_vocab(config.draft_vocab_size, config.vocab_size, embed.device)
        # the compiled layer call runs one layer only (a context row's projections take its
        # fused context, which sd_layer's qkv_input gives the first layer only)
        self._share_target(embed, hf_config)

    def compiled_refusal(self) -> str | None:
        """Why the compiled layer cannot run this drafter's shape (None: it can)."""
        if self.config.num_layers != 1:
            return (f"{self.config.num_layers} layers (the compiled call takes one layer "
                    f"whose projections read the context rows' features)")
        return None

    def init_from_target(self, target, used_ids: torch.Tensor) -> None:
        """A new drafter that starts close to the target's top: its layers copied from the
        target's last ``num_layers`` layers, fc reading the last fused layer as is, the final
        norm and the draft-vocabulary rows of the LM head the target's, every MASK its mean
        embedding. A mixture-of-experts target's layer gives its attention and norms, and
        its experts' mean (weights averaged) as the dense MLP (``for_target``: as wide as an
        expert)."""
        self.set_vocab(used_ids)
        c, h = self.config, self.config.hidden_size
        with torch.no_grad():
            for mine, theirs in zip(self.layers, target.layers[-c.num_layers:]):
                for name, p in mine.named_parameters():
                    if theirs.moe is not None and name in ("gate_up_weight", "down_weight"):
                        experts = [getattr(e, name) for e in theirs.moe.experts]
                        p.copy_(torch.stack([w.float() for w in experts]).mean(0))
                    else:
                        p.copy_(getattr(theirs, name))
            self.fc.zero_()
            self.fc[:, -c.target_hidden_size:].copy_(torch.eye(h))
            self.hidden_norm.copy_(self.layers[0].input_norm)
            self.norm_weight.copy_(target.final_norm)
            self.lm_head.copy_(target.head_weight.index_select(0, self.token_map))
            self.mask_embedding.copy_(self.embed_weight.float().mean(0).expand_as(
                self.mask_embedding))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, n * target_hidden] -> context rows c [T, hidden]."""
        return rms_norm(self.matmul(aux, self.fc, None), self.hidden_norm, self.cfg.rms_norm_eps)

    def forward(self, input_ids, positions, backend, kv_cache, capture_layers=(),
                num_layers=None, features: torch.Tensor | None = None,
                context_rows: torch.Tensor | None = None) -> ForwardOutput:
        """Rows [T]: block rows (token ids; ``vocab_size + k - 1`` = MASK_k) and, where
        ``context_rows`` [T] bool, context rows. ``features`` [T, hidden]: a context row's
        fused context c_j, a block row's anchor state c_{N-2} (added to its input).
        Returns the final-normed hidden states (block rows' are the drafts' states)."""
        eps = self.cfg.rms_norm_eps
        v = self.config.vocab_size
        x = F.embedding(input_ids.clamp(max=v - 1), self.embed_weight)
        is_mask = input_ids >= v
        masks = self.mask_embedding.to(x.dtype).index_select(0, (input_ids - v).clamp_min(0))
        x = torch.where(is_mask[:, None], masks, x)
        ctx = None
        if features is not None:
            features = features.to(x.dtype)
            if context_rows is None:
                x = x + features
            else:
                ctx = context_rows[:, None]
                x = torch.where(ctx, x, x + features)
        cos, sin = self.rope.lookup(positions)
        key_lists = getattr(backend, "key_lists", None)
        if self.fused is not None and key_lists and kv_cache is not None and x.shape[0] > 0:
            h = rms_norm(x, self.layers[0].input_norm, eps)
            if ctx is not None:
                h = torch.where(ctx, features, h)
            x, _ = self.fused.run(x.contiguous(), cos, sin, key_lists(), kv_cache, qkv_input=h)
            return ForwardOutput(rms_norm(x, self.norm_weight, eps))
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, eps)
            if ctx is not None:
                h = torch.where(ctx, features, h)
            kv_layer = None if kv_cache is None else kv_cache.layer(i)
            x = layer.attention(x, cos, sin, backend, kv_layer, self.matmul, h=h)
            x = layer.mlp(x, self.matmul)
        return ForwardOutput(rms_norm(x, self.norm_weight, eps))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed [R, hidden] -> [R, draft_vocab_size] float32+ (target id: token_map)."""
        return self.head_logits(hidden)

    def named_matrices(self) -> dict[str, torch.Tensor]:
        """Every weight matrix the forward multiplies by (not the target's embedding)."""
        return {"fc": self.fc,
                **{f"layers.{i}.{n}": w for i, layer in enumerate(self.layers)
                   for n, w in layer.named_matrices().items()},
                "lm_head": self.lm_head}
