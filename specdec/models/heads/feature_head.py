"""What the EAGLE-3 head and the block-diffusion drafter share: decoder layers of their own over
the target's features, fused by ``fc``, with the target's embedding (shared, frozen, never
saved with the drafter), RoPE as the target's, a final norm and a reduced-vocabulary LM head.

Both run through a ``ModelRunner`` like any model (``embed`` gives the runner the dtype); the
engine installs the matmul hook (``matmul``) and, where it runs their layer, the compiled layer
call (``fused``, specdec.models.matmul.fused). Their configs start with the layers' shape
(``LayerShape``), read from a config.json by ``layer_shape``:

    Eagle3Config(**layer_shape(raw), vocab_size=..., ...)
    cfg = head_layer_config(config, 1, config.draft_vocab_size, config.max_position_embeddings)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.decoder.config import ModelConfig
from specdec.models.decoder.llama import Matmul
from specdec.models.decoder.rope import RotaryEmbedding


@dataclass(frozen=True)
class LayerShape:
    """The shape of a drafter's decoder layers (usually a target layer's): the first fields
    of its config."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float


def layer_shape(raw: dict) -> dict:
    """``LayerShape``'s fields from a drafter's config.json (Hugging Face names; KeyError
    names a missing one)."""
    h, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    return dict(hidden_size=h, num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or h // heads),
                intermediate_size=int(raw["intermediate_size"]),
                rms_norm_eps=float(raw["rms_norm_eps"]))


def head_layer_config(c: LayerShape, num_layers: int, vocab_size: int,
                      max_position_embeddings: int) -> ModelConfig:
    """The head's layers as a ModelConfig over its (draft) vocabulary, what runners and
    ``DecoderLayer`` read: Llama layers without biases, q/k norms or a sliding window."""
    return ModelConfig(
        model_type="llama", vocab_size=vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=num_layers, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=False, attention_bias=False, qk_norm=False,
        max_position_embeddings=max_position_embeddings, sliding_window=None,
        eos_token_ids=())


class FeatureHead(nn.Module):
    """The parts both drafters have (see the module docstring); a subclass builds its layers
    between ``__init__`` and ``_share_target``."""

    # the blocks draft_weights="auto" quantizes it to (specdec.models.heads.weights): drafts
    # need no exactness, and on SmolLM2 Q4_1 accepts within 1 % of Q8_0 (docs/benchmarks.md)
    auto_draft_weights = "Q4_1"

    def __init__(self, config, fc_inputs: int, embed: torch.Tensor, trainable: bool) -> None:
        """``config`` (an Eagle3Config, a BlockDiffusionConfig) and its layers' ``cfg``;
        ``fc`` [hidden, fc_inputs], ``hidden_norm`` and the final norm ``norm_weight``
        [hidden], ``lm_head`` [draft_vocab_size, hidden], in ``embed``'s dtype and device: zeros
        until loaded or initialised."""
        super().__init__()
        self.config = config
        self.cfg: ModelConfig = config.layer_config()
        h = config.hidden_size

        def param(*shape):
            return nn.Parameter(torch.zeros(*shape, dtype=embed.dtype, device=embed.device),
                                requires_grad=trainable)

        self.fc = param(h, fc_inputs)
        self.hidden_norm = param(h)
        self.norm_weight = param(h)
        self.lm_head = param(config.draft_vocab_size, h)

    def _share_target(self, embed: torch.Tensor, hf_config) -> None:
        # the target's [vocab, hidden]: shared, frozen, and not a parameter of the head (detach
        # keeps nn.Module from registering it, so it is never trained, moved or saved here)
        self.embed_weight = embed.detach()
        c = self.config
        self.rope = RotaryEmbedding(hf_config, c.head_dim, c.max_position_embeddings,
                                    embed.dtype, embed.device)
        self.matmul: Matmul = F.linear
        self.fused = None  # the compiled layer call, installed with the kernels where it runs

    @property
    def embed(self) -> torch.Tensor:  # what runners read for the dtype
        return self.embed_weight

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Final-normed [R, hidden] -> [R, draft_vocab_size], float32 at least."""
        logits = self.matmul(normed, self.lm_head, None)
        return logits if logits.dtype == torch.float64 else logits.float()

    def named_matrices(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def matrices(self) -> list[torch.Tensor]:
        """Every weight matrix the forward multiplies by (not the target's embedding)."""
        return list(self.named_matrices().values())

    def weight_shapes(self) -> list[tuple[int, int]]:
        return list(dict.fromkeys(tuple(w.shape) for w in self.matrices()))
