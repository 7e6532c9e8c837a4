"""Our Llama-family decoder (llama, qwen2, qwen3, mistral, phi3), paged or dense (training).

Projections are fused at load time (q|k|v into one matrix, gate|up into another) so that a layer
is a handful of large ops. Every matmul goes through ``LlamaDecoder.matmul``: F.linear by
default; the engine installs its kernels (``specdec.models.matmul.choice``). With the compiled
row-invariant kernels on a CPU it also installs ``LlamaDecoder.fused``, which runs each layer
as one compiled call (``specdec.models.matmul.fused``) wherever the attention backend offers per-row
key lists; this module's layers are then the reference it is tested against.

Mixture-of-experts families (qwen3_moe, mixtral, qwen2_moe: ``cfg.is_moe``): every layer's MLP
is a ``MoEMLP`` (specdec.models.decoder.moe), its router, experts and shared expert through
the same matmul hook, row-invariant as the dense MLP. The compiled layer call runs such layers
too (specdec/native/moe.c); on a GPU with the row-invariant Triton kernels the experts are
stacked (``stack_experts``) and run gathered, with no host read.

Tensor parallelism (specdec.distributed.shard_model): a rank's decoder holds its share of each
layer (its query / KV heads' rows of q|k|v, its MLP share of gate|up, the matching columns of o
and down) and a per-rank ``cfg``; each layer's ``reduce`` (the group's exact all-reduce) sums
the o and down projections' partial outputs before the residual add (a mixture of experts: the
rank's share of every expert's width and of the shared expert's, the MoE output reduced once).
``reduce`` None (TP 1,
every model not sharded) is the plain layer, bitwise. A sharded model (``tp_size > 1``) never
runs the compiled layer call ``fused`` (it has no all-reduce between its matmuls):
``compiled_refusal`` says so to the kernel setup, and ``forward`` skips ``fused`` at
``tp_size > 1`` whatever is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention.backend import AttentionBackend
from specdec.kv.cache import KVCache
from specdec.models.decoder import layer_ops
from specdec.models.decoder.config import ModelConfig
from specdec.models.decoder.layer_ops import rms_norm_reference as rms_norm
from specdec.models.decoder.moe import MoEMLP
from specdec.models.decoder.rope import RotaryEmbedding, apply_rotary


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T, hidden_size] (dense: [B, S, hidden_size]) final-normed hidden states
    # layer i -> its output (the input of layer i + 1), same leading shape as `hidden`
    layer_hidden: dict[int, torch.Tensor] = field(default_factory=dict)


Matmul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class DecoderLayer(nn.Module):
    """One pre-norm attention + SwiGLU block over packed rows [T, hidden].

    Attention goes through ``backend.run`` (the paged backends for inference, ``DenseAttention``
    for training), so the same layer serves the target, drafters and training. ``trainable``
    layers (drafter heads) get gradients; the target's are frozen. ``qkv_in``: the width of the
    projections' input when it is not the hidden size (an EAGLE-3 layer reads [embedding; feature],
    2 x hidden).

    ``reduce``: None, or the row-parallel all-reduce of tensor parallelism (a rank's partial
    sums [T, hidden] -> their sum over the ranks; specdec.distributed.shard_model installs
    it): the o and down projections' outputs (an MoE: the routed experts' and the shared
    expert's sum) go through it before the residual add.
    """

    # tensor parallelism's all-reduce of the o / down outputs (None: not sharded, no call)
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig, trainable: bool = False, qkv_in: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        qkv_out = cfg.q_size + 2 * cfg.kv_size

        def param(*shape):
            return nn.Parameter(torch.empty(*shape), requires_grad=trainable)

        self.qkv_weight = param(qkv_out, qkv_in or cfg.hidden_size)
        self.qkv_bias = param(qkv_out) if cfg.attention_bias else None
        self.o_weight = param(cfg.hidden_size, cfg.q_size)
        # a mixture of experts in place of the dense MLP (specdec.models.decoder.moe)
        self.moe = MoEMLP(cfg, trainable) if cfg.is_moe else None
        if self.moe is None:
            self.gate_up_weight = param(2 * cfg.intermediate_size, cfg.hidden_size)
            self.down_weight = param(cfg.hidden_size, cfg.intermediate_size)
        self.input_norm = param(cfg.hidden_size)
        self.post_attn_norm = param(cfg.hidden_size)
        if cfg.qk_norm:
            self.q_norm = param(cfg.head_dim)
            self.k_norm = param(cfg.head_dim)

    def named_matrices(self) -> dict[str, torch.Tensor]:
        """The layer's weight matrices by name: ``qkv``, ``o``, ``gate_up``, ``down`` (a
        mixture of experts: ``qkv``, ``o`` and ``MoEMLP.named_matrices``)."""
        if self.moe is not None:
            return {"qkv": self.qkv_weight, "o": self.o_weight, **self.moe.named_matrices()}
        return {n: getattr(self, f"{n}_weight") for n in ("qkv", "o", "gate_up", "down")}

    def owner(self, name: str) -> tuple[nn.Module, str]:
        """(module, attribute) holding the matrix ``name`` of ``named_matrices``."""
        if name in ("qkv", "o") or (self.moe is None and name in ("gate_up", "down")):
            return self, f"{name}_weight"
        if self.moe is None:
            raise KeyError(f"no matrix {name!r} in a dense layer")
        return self.moe.owner(name)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init for a new (trainable) layer: normal(0, std) weights, unit norms, 0 bias."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, std)

    def forward(self, x, cos, sin, backend: AttentionBackend, kv_layer,
                mm: Matmul = F.linear) -> torch.Tensor:
        return self.mlp(self.attention(x, cos, sin, backend, kv_layer, mm), mm)

    def attention(self, x, cos, sin, backend: AttentionBackend, kv_layer, mm: Matmul = F.linear,
                  h: torch.Tensor | None = None) -> torch.Tensor:
        """x + attn(norm(x)); ``h`` replaces norm(x) as the projections' input when given (an
        EAGLE head feeds [embedding; feature] there)."""
        cfg = self.cfg
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps) if h is None else h
        q, k, v = mm(h, self.qkv_weight, self.qkv_bias).split(
            [cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
        k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = backend.run(q, k, v, kv_layer, cfg.head_dim**-0.5)
        out = mm(attn.reshape(-1, cfg.q_size), self.o_weight, None)
        if self.reduce is not None:  # tensor parallel: this rank's heads' partial sums
            out = self.reduce(out)
        return x + out

    def mlp(self, x: torch.Tensor, mm: Matmul = F.linear) -> torch.Tensor:
        h = rms_norm(x, self.post_attn_norm, self.cfg.rms_norm_eps)
        if self.moe is not None:  # (tensor parallel: the rank's share of every expert)
            out = self.moe(h, mm)
        else:
            gate, up = mm(h, self.gate_up_weight, None).chunk(2, dim=-1)
            out = mm(F.silu(gate) * up, self.down_weight, None)
        if self.reduce is not None:  # tensor parallel: this rank's MLP share's partial sums
            out = self.reduce(out)
        return x + out


class LlamaDecoder(nn.Module):
    """Token ids + positions + planned attention + paged KV -> hidden states; logits on request.

    Two ways to run the same weights: ``forward`` over packed rows and a paged KV cache (the
    engine, through a ``ModelRunner``), and ``forward_dense`` over a padded [B, S] batch with no
    cache (training: target features without grad, drafter layers with grad). Neither enters
    ``inference_mode`` itself; the runner does.

    Tensor parallel (specdec.distributed.shard_model.shard_decoder): ``tp_size`` ranks,
    ``tp_rank`` this one, ``cfg`` the rank's shape (its heads, KV heads, MLP share: what the
    runner sizes attention and the KV cache from), ``full_cfg`` the model's. At ``tp_size > 1``
    the compiled layer call (``fused``) never runs: ``compiled_refusal`` refuses it.
    """

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
        self.matmul: Matmul = F.linear  # the runner installs the kernels it measured fastest
        # the compiled layers (specdec.models.matmul.fused), installed with the row-invariant kernels
        self.fused = None
        # True: the layers run as one kernel per step (specdec.models.decoder.layer_ops; the engine
        # turns it on for CUDA runners), else as the torch ops below
        self.layer_ops = False
        self.source_folder = None  # the folder it was loaded from (specdec.models.loader)
        # tensor parallelism (specdec.distributed.shard_model): 1 / 0 / cfg unless sharded
        self.tp_size, self.tp_rank, self.full_cfg = 1, 0, cfg
        self.to(dtype=dtype, device=device)

    def compiled_refusal(self) -> str | None:
        """Why the compiled layer call (``fused``) cannot run this model, or None: a sharded
        model (``tp_size > 1``) needs an all-reduce after o and down that sd_layer does not
        make (its matmuls still run through the installed kernels, layer by layer). A mixture
        of experts runs there too (specdec/native/moe.c)."""
        if self.tp_size > 1:
            return (f"a tensor-parallel shard (rank {self.tp_rank} of {self.tp_size}: its "
                    f"layers all-reduce the o and down outputs)")
        return None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        backend: AttentionBackend,  # already planned for this step
        kv_cache: KVCache | None,  # None for backends that keep no cache (DenseAttention)
        capture_layers: tuple[int, ...] = (),
        num_layers: int | None = None,  # run only the first N layers (early-exit drafting)
    ) -> ForwardOutput:
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rope.lookup(positions)
        key_lists = getattr(backend, "key_lists", None)
        plan = (key_lists() if self.fused is not None and key_lists and kv_cache is not None
                and self.tp_size == 1 else None)
        if plan is not None and x.shape[0] > 0:
            x, captured = self.fused.run(x, cos, sin, plan, kv_cache, num_layers, capture_layers)
            return ForwardOutput(self.norm(x), captured)
        if self.layer_ops and kv_cache is not None:
            return self._forward_ops(x, positions, backend, kv_cache, capture_layers, num_layers)
        captured = {}
        for i, layer in enumerate(self.layers[:num_layers]):
            kv_layer = None if kv_cache is None else kv_cache.layer(i)
            x = layer(x, cos, sin, backend, kv_layer, self.matmul)
            if i in capture_layers:
                captured[i] = x
        return ForwardOutput(self.norm(x), captured)

    def stack_experts(self) -> None:
        """A mixture of experts: each layer's experts stacked for the gathered launch
        (``MoEMLP.stack_experts``); nothing for a dense model."""
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.stack_experts()

    def experts_woken(self, num_layers: int | None = None
                      ) -> tuple[int, ...] | torch.Tensor | None:
        """Per layer the latest forward ran (the first ``num_layers``), the distinct experts
        its rows routed to: host ints (``MoEMLP.woken``: the forward read them anyway), or
        where the experts ran gathered one int64 device tensor of them (read by whoever needs
        the counts, after the step); None for a dense model."""
        if not self.cfg.is_moe:
            return None
        counts = [layer.moe.woken for layer in self.layers[:num_layers]]
        if any(isinstance(c, torch.Tensor) for c in counts):
            return torch.stack([torch.as_tensor(c, device=self.embed.device) for c in counts])
        return tuple(counts)

    def _forward_ops(self, x, positions, backend, kv_cache, capture_layers, num_layers):
        """``forward``'s layers as one kernel per step (specdec.models.decoder.layer_ops): the residual
        stream is carried beside the normed input, each add fused into the next norm. Bitwise
        the torch loop's result where the ops run as torch ops (on a CPU)."""
        cfg, mm, rope = self.cfg, self.matmul, self.rope
        eps, sizes = cfg.rms_norm_eps, [cfg.q_size, cfg.kv_size, cfg.kv_size]
        layers = self.layers[:num_layers]
        residual, h = x, layer_ops.rms_norm(x, layers[0].input_norm, eps)
        captured = {}
        for i, layer in enumerate(layers):
            if i:  # the previous layer's MLP output into the stream, normed for this one
                layer_ops.add_rms_norm_(h, residual, layer.input_norm, eps)
            q, k, v = mm(h, layer.qkv_weight, layer.qkv_bias).split(sizes, dim=-1)
            q = q.view(-1, cfg.num_heads, cfg.head_dim)
            k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = layer_ops.rms_norm(q, layer.q_norm, eps)
                k = layer_ops.rms_norm(k, layer.k_norm, eps)
            layer_ops.rope_(q, k, positions, rope.cos, rope.sin, rope.cos_sin_cache)
            attn = backend.run(q, k, v, kv_cache.layer(i), cfg.head_dim**-0.5)
            h = mm(attn.reshape(-1, cfg.q_size), layer.o_weight, None)
            if layer.reduce is not None:  # tensor parallel: the ranks' partial sums
                h = layer.reduce(h)
            layer_ops.add_rms_norm_(h, residual, layer.post_attn_norm, eps)
            if layer.moe is not None:
                h = layer.moe(h, mm)
            else:
                h = mm(layer_ops.silu_and_mul(mm(h, layer.gate_up_weight, None)),
                       layer.down_weight, None)
            if layer.reduce is not None:
                h = layer.reduce(h)
            if i in capture_layers:  # the layer's output (the stream is added to in place)
                captured[i] = residual + h
        layer_ops.add_rms_norm_(h, residual, self.final_norm, eps)
        return ForwardOutput(h, captured)

    def forward_dense(
        self,
        input_ids: torch.Tensor,  # [B, S] int64
        attention_mask: torch.Tensor | None = None,  # [B, S] bool/int, 1 = real token
        capture_layers: tuple[int, ...] = (),
        num_layers: int | None = None,
    ) -> ForwardOutput:
        """Causal forward over a padded batch without KV cache; outputs [B, S, hidden].

        Positions count real tokens (left or right padding both work). Gradients flow where the
        caller enables them; wrap in ``torch.no_grad()`` for feature extraction.
        """
        from specdec.attention.dense import DenseAttention

        b, s = input_ids.shape
        valid = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                 else attention_mask.bool())
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        backend = DenseAttention.causal(valid)
        out = self.forward(input_ids.reshape(-1), positions.reshape(-1), backend, None,
                           capture_layers, num_layers)
        return ForwardOutput(out.hidden.view(b, s, -1),
                             {i: h.view(b, s, -1) for i, h in out.layer_hidden.items()})

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm (before the LM head)."""
        return rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden_size] (only the rows that need logits) -> [R, vocab] float32+."""
        logits = self.matmul(hidden, self.head_weight, None)
        return logits if logits.dtype == torch.float64 else logits.float()

    @property
    def head_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the LM head (the embedding when tied)."""
        return self.embed if self.lm_head is None else self.lm_head

    def named_matrices(self) -> dict[str, torch.Tensor]:
        """Every weight matrix the forward multiplies by, by name: ``head`` and
        ``layers.{i}.{qkv,o,gate_up,down}`` (the names a GGUF's blocks are read under,
        gguf/weights.py)."""
        return {"head": self.head_weight,
                **{f"layers.{i}.{name}": w for i, layer in enumerate(self.layers)
                   for name, w in layer.named_matrices().items()}}

    def matrices(self) -> list[torch.Tensor]:
        """Every weight matrix the forward multiplies by (prepared once at load)."""
        return list(self.named_matrices().values())

    def weight_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of every matrix the forward multiplies by (for kernel tuning)."""
        mats = [*self.layers[0].named_matrices().values(), self.head_weight]
        return list(dict.fromkeys(tuple(w.shape) for w in mats))

    def owner(self, name: str) -> tuple[nn.Module, str]:
        """(module, attribute) holding the matrix ``name`` (``embed``, ``head``, or one of
        ``named_matrices``' ``layers.{i}.*``)."""
        if name in ("embed", "head"):
            return self, "embed" if name == "embed" else "lm_head"
        _, i, rest = name.split(".", 2)
        return self.layers[int(i)].owner(rest)
