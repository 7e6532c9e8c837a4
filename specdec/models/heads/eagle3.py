"""The EAGLE-3 draft head, built from our decoder's own layer class.

Forward of one row at position i (the same in vLLM, SGLang and SpecForge)::

    feat  = fc(cat(a_low, a_mid, a_high))   first row after target tokens: the target's states
          | y of the previous head row       deeper draft rows: the head's own output
    e     = input_layernorm(embed(x_{i+1}))  the target's embedding, frozen, never stored here
    y     = feat + attn(cat(e, hidden_norm(feat)))     RoPE at position i, paged KV of the head
    y     = y + mlp(post_attention_layernorm(y))
    logits over the draft vocabulary = lm_head(norm(y));  target id = d + d2t[d]

``a_*`` are the target's residual-stream states entering layers ``aux_layer_ids`` (vLLM's and
SGLang's convention: id j = HF ``hidden_states[j]`` = the output of our decoder layer j - 1,
which is what ``LlamaDecoder`` captures under index j - 1; see ``capture_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.models.decoder.config import ModelConfig
from specdec.models.decoder.llama import DecoderLayer, ForwardOutput, rms_norm
from specdec.models.heads.draft_vocab import check_made_for
from specdec.models.heads.feature_head import FeatureHead, LayerShape, head_layer_config


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's / SGLang's default (2, L // 2, L - 3): inputs of those target layers."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config(LayerShape):
    """What a head needs besides its weights; the target's shapes are checked against it."""

    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: tuple[int, int, int]  # vLLM convention (input of target layer j)
    max_position_embeddings: int

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int,
                   aux_layer_ids: tuple[int, int, int] | None = None) -> Eagle3Config:
        """A head shaped like one target layer (the usual EAGLE-3 choice)."""
        ids = tuple(aux_layer_ids or default_aux_layer_ids(target.num_layers))
        if not all(isinstance(j, int) and 1 <= j < target.num_layers for j in ids):
            raise ValueError(f"aux_layer_ids {ids} must be in [1, {target.num_layers - 1}]: "
                             "the inputs of the target's layers 1..L-1 (layer 0's input is the "
                             "embedding, which the head reads anyway)")
        return cls(target.hidden_size, target.num_heads, target.num_kv_heads, target.head_dim,
                   target.intermediate_size, target.rms_norm_eps, target.vocab_size,
                   draft_vocab_size, target.hidden_size, target.num_layers, ids,
                   target.max_position_embeddings)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Indices of LlamaDecoder's captured layer outputs that are these layers' inputs."""
        return tuple(j - 1 for j in self.aux_layer_ids)

    def layer_config(self) -> ModelConfig:
        """The midlayer as a one-layer ModelConfig (what runners and DecoderLayer read)."""
        return head_layer_config(self, 1, self.draft_vocab_size, self.max_position_embeddings)

    def check_target(self, target: ModelConfig) -> None:
        """ValueError naming both values when the head was made for another target."""
        check_made_for("this EAGLE-3 head", self.target_hidden_size, self.vocab_size,
                       self.target_num_layers, target)
        if not all(1 <= j < target.num_layers for j in self.aux_layer_ids):
            raise ValueError(f"aux layer ids {self.aux_layer_ids} must be in [1, "
                             f"{target.num_layers - 1}] (inputs of the target's layers 1..L-1)")


class Eagle3Head(FeatureHead):
    """fc + one decoder layer + norm + reduced-vocabulary LM head; the embedding is the target's.

    It runs through a ``ModelRunner`` like any model: ``forward`` takes the packed rows' token
    ids (x_{i+1}), positions and per-row features [T, hidden] (``features=``), and returns y
    (``ForwardOutput.hidden``, pre-norm: the next row's feature); ``compute_logits`` applies the
    final norm and the head.
    """

    def __init__(self, config: Eagle3Config, embed: torch.Tensor, hf_config,
                 trainable: bool = False) -> None:
        super().__init__(config, 3 * config.target_hidden_size, embed, trainable)
        self.layer = DecoderLayer(self.cfg, trainable, qkv_in=2 * config.hidden_size).to(
            embed.dtype).to(embed.device)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64,
                                                device=embed.device))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool,
                                                device=embed.device))
        self._share_target(embed, hf_config)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (a new head): normal(0, std) weights, unit norms."""
        with torch.no_grad():
            self.layer.reset_parameters(std)
            self.fc.normal_(0.0, std)
            self.lm_head.normal_(0.0, std)
            self.hidden_norm.fill_(1.0)
            self.norm_weight.fill_(1.0)

    def set_vocab(self, used_ids: torch.Tensor) -> None:
        """The draft vocabulary: ``used_ids`` [draft_vocab_size] ascending target ids."""
        ids = torch.as_tensor(used_ids, dtype=torch.int64, device=self.d2t.device)
        assert ids.numel() == self.config.draft_vocab_size and bool((ids[1:] > ids[:-1]).all())
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, 3 * target_hidden] (low | mid | high) -> features [T, hidden]."""
        return self.matmul(aux, self.fc, None)

    def forward(self, input_ids, positions, backend, kv_cache, capture_layers=(),
                num_layers=None, features: torch.Tensor | None = None) -> ForwardOutput:
        assert features is not None, "an EAGLE-3 head needs features [T, hidden] per row"
        eps = self.cfg.rms_norm_eps
        e = rms_norm(F.embedding(input_ids, self.embed_weight), self.layer.input_norm, eps)
        h = torch.cat([e, rms_norm(features, self.hidden_norm, eps)], dim=-1)
        cos, sin = self.rope.lookup(positions)
        key_lists = getattr(backend, "key_lists", None)
        if self.fused is not None and key_lists and kv_cache is not None and h.shape[0] > 0:
            # the features are the batch's: the layer updates its residual stream in place
            y, _ = self.fused.run(features.clone(), cos, sin, key_lists(), kv_cache, qkv_input=h)
            return ForwardOutput(y)
        kv_layer = None if kv_cache is None else kv_cache.layer(0)
        x = self.layer.attention(features, cos, sin, backend, kv_layer, self.matmul, h=h)
        return ForwardOutput(self.layer.mlp(x, self.matmul))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """y [R, hidden] -> [R, draft_vocab_size] float32+ (draft ids; target id = d + d2t[d])."""
        return self.head_logits(rms_norm(hidden, self.norm_weight, self.cfg.rms_norm_eps))

    def named_matrices(self) -> dict[str, torch.Tensor]:
        """Every weight matrix the forward multiplies by (not the target's embedding)."""
        return {"fc": self.fc, **self.layer.named_matrices(), "lm_head": self.lm_head}

