"""Our Llama-family decoder (llama, qwen2, qwen3, mistral) over the paged KV cache.

Projections are fused at load time (q|k|v into one matrix, gate|up into another) so that a layer
is a handful of large ops. On CPU a step is bound by streaming the weights from memory, and
MKL's GEMV/small-M GEMM streams them with one core. `linear` keeps both cores streaming: a
multiply-reduce for one row; for up to 4 rows a batched product over blocks of the weight with
the rows on the right (weight-left), which streams the weight once for all rows; beyond that a
batched product with the rows on the left. Measured over SmolLM2's 30 layers + head (2-core
EPYC, fp32): 1 row 31 -> 15 ms, 4 rows 47 -> 17 ms, 9 rows 46 -> 38 ms (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention.backend import AttentionBackend
from specdec.kv.cache import KVCache
from specdec.models.config import ModelConfig
from specdec.models.rope import RotaryEmbedding, apply_rotary


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T, hidden_size] final-normed hidden states
    layer_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, hidden_size] (its output)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        qkv_out = cfg.q_size + 2 * cfg.kv_size
        self.qkv_weight = nn.Parameter(torch.empty(qkv_out, cfg.hidden_size), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.empty(qkv_out), requires_grad=False) if cfg.attention_bias else None
        )
        self.o_weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.q_size), requires_grad=False)
        self.gate_up_weight = nn.Parameter(
            torch.empty(2 * cfg.intermediate_size, cfg.hidden_size), requires_grad=False
        )
        self.down_weight = nn.Parameter(
            torch.empty(cfg.hidden_size, cfg.intermediate_size), requires_grad=False
        )
        self.input_norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.empty(cfg.head_dim), requires_grad=False)
            self.k_norm = nn.Parameter(torch.empty(cfg.head_dim), requires_grad=False)

    def forward(self, x, cos, sin, backend: AttentionBackend, kv_layer) -> torch.Tensor:
        cfg = self.cfg
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = linear(h, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = backend.run(q, k, v, kv_layer, cfg.head_dim**-0.5)
        x = x + linear(attn.reshape(-1, cfg.q_size), self.o_weight)
        h = rms_norm(x, self.post_attn_norm, cfg.rms_norm_eps)
        gate, up = linear(h, self.gate_up_weight).chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.down_weight)


class LlamaDecoder(nn.Module):
    """Token ids + positions + planned attention + paged KV -> hidden states; logits on request."""

    def __init__(self, cfg: ModelConfig, hf_config, max_positions: int, dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.Parameter(torch.empty(cfg.hidden_size), requires_grad=False)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size), requires_grad=False)
        )
        self.rope = RotaryEmbedding(hf_config, cfg.head_dim, max_positions, dtype, device)
        self.to(dtype=dtype, device=device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        backend: AttentionBackend,  # already planned for this step
        kv_cache: KVCache,
        capture_layers: tuple[int, ...] = (),
        num_layers: int | None = None,  # run only the first N layers (early-exit drafting)
    ) -> ForwardOutput:
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rope.lookup(positions)
        captured = {}
        for i, layer in enumerate(self.layers[:num_layers]):
            x = layer(x, cos, sin, backend, kv_cache.layer(i))
            if i in capture_layers:
                captured[i] = x
        return ForwardOutput(rms_norm(x, self.final_norm, self.cfg.rms_norm_eps), captured)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden_size] (only the rows that need logits) -> [R, vocab] float32+."""
        logits = linear(hidden, self.head_weight, splits=8 if self.cfg.vocab_size % 8 == 0 else 1)
        return logits if logits.dtype == torch.float64 else logits.float()

    @property
    def head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the LM head (the embedding when tied)."""
        return self.embed if self.lm_head is None else self.lm_head


# multiply-reduce materialises weight-sized products: beyond ~16 MB (an LM head) bmm wins
_VECDOT_MAX = 1 << 22
# up to here the weight-left batched product costs about one row's time (2-4 rows ~= 1 row over
# SmolLM2's layers); at 5-8 rows it is no better in isolation and 15% worse end to end at batch 8
_WEIGHT_LEFT_MAX_ROWS = 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           splits: int = 2) -> torch.Tensor:
    """x [T, in] @ weight[out, in].T (+ bias) -> [T, out], fast on CPU (see module docstring).

    `splits`: the weight's rows are cut into this many blocks for the batched paths (`out` must
    divide, else plain F.linear).
    """
    rows, out_features = x.shape[0], weight.shape[0]
    if x.device.type != "cpu" or rows > 64 or out_features % splits:
        return F.linear(x, weight, bias)
    blocks = weight.view(splits, out_features // splits, weight.shape[1])
    if rows == 1 and weight.numel() <= _VECDOT_MAX:
        out = torch.linalg.vecdot(weight, x).unsqueeze(0)
    elif rows <= _WEIGHT_LEFT_MAX_ROWS:
        # blocks @ x.T: MKL's kernel for a skinny right operand streams W once for all rows
        out = torch.bmm(blocks, x.t().unsqueeze(0).expand(splits, -1, -1))
        out = out.reshape(out_features, rows).t()
    else:
        out = torch.bmm(x.unsqueeze(0).expand(splits, -1, -1), blocks.transpose(1, 2))
        out = out.transpose(0, 1).reshape(rows, out_features)
    return out if bias is None else out + bias


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in float32 at least (as HF does for half precision)."""
    if x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype) * weight
