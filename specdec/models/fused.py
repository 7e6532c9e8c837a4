"""A decoder's layers as one compiled call each (specdec/native/layer.c), on a CPU.

One layer of the framework path is ~25 torch ops; on a small model their dispatch cost is a
large part of a step (SmolLM2-135M fp32, one row: ~14 ms of ~36 ms beside the weights'
streaming). ``FusedLayers`` runs each layer as one ``sd_layer`` call over the weights that
``PreparedLinears`` prepared, with the same row-invariance contract: fp32 activations (the
residual stream too), fp32 accumulation in a fixed order per element, K/V rounded to the cache's
dtype as they are written.

The engine installs it (``kernel_choice.install_kernels``) on a ``LlamaDecoder`` whose layers it
covers, and on an EAGLE-3 head (its one layer, whose projections take the caller's
``qkv_input``), beside the prepared linears; the model's forward takes it wherever the attention backend
offers per-row key lists (``TorchAttentionBackend.key_lists``: the compiled attention on a CPU)
and its framework path everywhere else (dense training attention, float64, no compiled kernels).
Which path a model takes is fixed by its configuration, never by the rows of a step, so a row's
output stays independent of its companions.

    fused = FusedLayers(kernels, linears, model)
    x, captured = fused.run(x, cos, sin, plan, kv_cache, num_layers, capture_layers)
    y, _ = head_fused.run(features, cos, sin, plan, kv_cache, qkv_input=h)  # EAGLE-3
"""

from __future__ import annotations

import torch

from specdec.models.native import FORMATS, Kernels, LayerArgs, Weight
from specdec.models.prepared import PreparedLinears


class FusedLayers:
    """Every layer of one model as prepared ``LayerArgs`` (see module docstring)."""

    def __init__(self, kernels: Kernels, linears: PreparedLinears, model) -> None:
        self.kernels, self.linears, self.model = kernels, linears, model
        self._build()

    @staticmethod
    def covers(model) -> bool:
        """Whether sd_layer runs this model's layers (else its framework path does)."""
        cfg = model.cfg
        return (model.embed.dtype in FORMATS and model.embed.is_cpu and cfg.head_dim % 8 == 0
                and cfg.head_dim <= 512 and cfg.num_heads % cfg.num_kv_heads == 0)

    @staticmethod
    def layers_of(model) -> list:
        """The decoder layers sd_layer runs: a decoder's, or an EAGLE-3 head's one."""
        return list(model.layers) if hasattr(model, "layers") else [model.layer]

    def _weights(self) -> list[torch.Tensor]:
        return [w for layer in self.layers_of(self.model) for w in self._layer_weights(layer)]

    @staticmethod
    def _layer_weights(layer) -> list[torch.Tensor]:
        ws = [layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight,
              layer.input_norm, layer.post_attn_norm]
        if layer.qkv_bias is not None:
            ws.append(layer.qkv_bias)
        if layer.cfg.qk_norm:
            ws += [layer.q_norm, layer.k_norm]
        return ws

    def _build(self) -> None:
        """The C view of every layer; fp32 copies of norms and biases are kept alive here."""
        self._watched = self._weights()
        self._versions = [w._version for w in self._watched]
        self._keep: list[torch.Tensor] = []
        self.args: list[LayerArgs] = []
        mm = self.linears
        for layer in self.layers_of(self.model):
            cfg = layer.cfg
            a = LayerArgs(hidden=cfg.hidden_size, heads=cfg.num_heads,
                          kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                          inter=cfg.intermediate_size, eps=cfg.rms_norm_eps,
                          scale=cfg.head_dim ** -0.5)
            a.qkv = Weight.of(mm.prepared(layer.qkv_weight), self._fp32(layer.qkv_bias))
            a.o = Weight.of(mm.prepared(layer.o_weight))
            a.gate_up = Weight.of(mm.prepared(layer.gate_up_weight))
            a.down = Weight.of(mm.prepared(layer.down_weight))
            a.input_norm = self._fp32(layer.input_norm).data_ptr()
            a.post_norm = self._fp32(layer.post_attn_norm).data_ptr()
            if cfg.qk_norm:
                a.q_norm = self._fp32(layer.q_norm).data_ptr()
                a.k_norm = self._fp32(layer.k_norm).data_ptr()
            self.args.append(a)

    def _fp32(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.detach().float().contiguous().clone()
        self._keep.append(t)
        return t

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan, kv_cache,
            num_layers: int | None = None, capture_layers: tuple[int, ...] = (),
            qkv_input: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x [T, hidden] (the embeddings; updated in place when fp32: pass one you own), cos/sin [T, 1, head_dim], ``plan`` the
        step's key lists; ``qkv_input`` [T, qkv_in]: the first layer's projection input instead
        of its normed x -> (the last layer's output in the model's dtype, {layer i: its
        output})."""
        if [w._version for w in self._watched] != self._versions:
            self._build()  # a weight changed in place since: prepare again
        dtype, t = x.dtype, x.shape[0]
        x = x.float().contiguous()  # updated in place, layer after layer
        if qkv_input is not None:
            qkv_input = qkv_input.float().contiguous()
        cos = cos.reshape(t, -1).float().contiguous()
        sin = sin.reshape(t, -1).float().contiguous()
        threads = torch.get_num_threads()
        first = self.args[0]
        first.T, first.max_keys, first.nthreads = t, plan.max_keys, threads
        scratch = torch.empty(self.kernels.layer_scratch(first), dtype=torch.float32)
        captured = {}
        for i, a in enumerate(self.args[:num_layers]):
            kv = kv_cache.layer(i)
            assert kv.is_contiguous() and kv.dtype in FORMATS
            a.T, a.max_keys, a.nthreads = t, plan.max_keys, threads
            a.x, a.cos, a.sin, a.scratch = (x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                            scratch.data_ptr())
            a.kv, a.kv_fmt, a.page_size = kv.data_ptr(), FORMATS[kv.dtype], plan.page_size
            a.write_index = plan.write_index.data_ptr()
            a.key_indptr, a.key_index = plan.indptr.data_ptr(), plan.index.data_ptr()
            given = qkv_input is not None and i == 0
            a.qkv_input = qkv_input.data_ptr() if given else None
            a.qkv_in = qkv_input.shape[1] if given else 0
            self.kernels.layer(a)
            if i in capture_layers:
                captured[i] = x.to(dtype, copy=True)
        return x.to(dtype), captured
