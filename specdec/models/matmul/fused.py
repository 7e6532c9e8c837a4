"""A decoder's layers as one compiled call each (specdec/native/layer.c), on a CPU.

One layer of the framework path is ~25 torch ops; on a small model their dispatch cost is a
large part of a step (SmolLM2-135M fp32, one row: ~14 ms of ~36 ms beside the weights'
streaming). ``FusedLayers`` runs each layer as one ``sd_layer`` call over the weights that
``PreparedLinears`` prepared (a fused q|k|v or gate|up whose parts differ in format, as a Q4_K_M
file's, as ``native.PanelParts``: each part into its own columns), with the same row-invariance
contract: fp32 activations (the residual stream too), fp32 accumulation in a fixed order per
element, K/V rounded to the cache's dtype as they are written. A step's layers go in one
``sd_layers`` call (the layers' arguments are one C array made at load; what a step changes is
one ``StepArgs``), so the host work of a forward does not grow with the layers: the tensors
behind the pointers are checked once here, the values of the write rows and key lists in C
before any layer runs.

A mixture-of-experts layer (``layer.moe``) goes in the same call: its router, each expert's
gate|up and down and a shared expert as ``MoEArgs`` (specdec/native/moe.c: the routing, then only
the experts some row routed to), and the count of experts each layer woke written to a tensor
here, handed to ``MoEMLP.woken`` after the step (what the goodput controller prices trees by).

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

import ctypes
import weakref

import torch

from specdec.kv.cache import KVCache
from specdec.models.matmul.prepared import PreparedLinears
from specdec.native import (
    FORMATS,
    ROW_ERRORS,
    Kernels,
    LayerArgs,
    MoEArgs,
    StepArgs,
    Weight,
)


class FusedLayers:
    """Every layer of one model as prepared ``LayerArgs`` (see module docstring)."""

    def __init__(self, kernels: Kernels, linears: PreparedLinears, model) -> None:
        # the model holds this (model.fused): a weak reference back, so that no cycle keeps
        # a dropped model's weights until the garbage collector runs
        self.kernels, self.linears, self.model = kernels, linears, weakref.proxy(model)
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
        moe = getattr(layer, "moe", None)
        mlp = (list(moe.named_matrices().values()) if moe is not None
               else [layer.gate_up_weight, layer.down_weight])
        ws = [layer.qkv_weight, layer.o_weight, *mlp, layer.input_norm, layer.post_attn_norm]
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
        # the prepared weights (Panels, or PanelParts: a fused matrix in parts of different
        # formats, whose parts' C array the struct points at), alive as long as these structs
        self._panels: list = []
        self.args: list[LayerArgs] = []
        mm = self.linears
        cfg = self.layers_of(self.model)[0].cfg
        self._hidden, self._head_dim = cfg.hidden_size, cfg.head_dim
        self._kv_shape = (cfg.num_kv_heads, cfg.head_dim)  # a cache row's
        # a mixture of experts' C structs (MoEArgs, its experts' Weight arrays), and where each
        # layer's count of experts woken is written (read after a step: MoEMLP.woken)
        self._moe: list = []
        self._woken = torch.zeros(len(self.layers_of(self.model)), dtype=torch.int64)
        for i, layer in enumerate(self.layers_of(self.model)):
            cfg = layer.cfg
            moe = getattr(layer, "moe", None)
            a = LayerArgs(hidden=cfg.hidden_size, heads=cfg.num_heads,
                          kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                          inter=cfg.moe_intermediate_size if moe is not None
                          else cfg.intermediate_size, eps=cfg.rms_norm_eps,
                          scale=cfg.head_dim ** -0.5)
            qkv, o = mm.prepared(layer.qkv_weight), mm.prepared(layer.o_weight)
            self._panels += [qkv, o]  # what the structs point into
            if not self.args:  # the width qkv_input must have (it replaces the first layer's)
                self._qkv_in = qkv.in_features
            a.qkv = Weight.of(qkv, self._fp32(layer.qkv_bias))
            a.o = Weight.of(o)
            if moe is None:
                gate_up, down = mm.prepared(layer.gate_up_weight), mm.prepared(layer.down_weight)
                self._panels += [gate_up, down]
                a.gate_up, a.down = Weight.of(gate_up), Weight.of(down)
            else:
                a.moe = ctypes.addressof(self._moe_args(moe, i))
            a.input_norm = self._fp32(layer.input_norm).data_ptr()
            a.post_norm = self._fp32(layer.post_attn_norm).data_ptr()
            if cfg.qk_norm:
                a.q_norm = self._fp32(layer.q_norm).data_ptr()
                a.k_norm = self._fp32(layer.k_norm).data_ptr()
            self.args.append(a)
        # the layers as one C array (sd_layers reads it); self.args are views into it
        self._array = (LayerArgs * len(self.args))(*self.args)
        self.args = list(self._array)
        self._step = StepArgs()

    def _moe_args(self, moe, i: int) -> MoEArgs:
        """Layer ``i``'s mixture of experts as the C side sees it (kept alive here)."""
        cfg, mm = moe.cfg, self.linears

        def weight(w: torch.Tensor) -> Weight:
            panels = mm.prepared(w)
            self._panels.append(panels)
            return Weight.of(panels)

        gate_up = (Weight * cfg.num_experts)(*(weight(e.gate_up_weight) for e in moe.experts))
        down = (Weight * cfg.num_experts)(*(weight(e.down_weight) for e in moe.experts))
        m = MoEArgs(n_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                    inter=cfg.moe_intermediate_size, norm_topk=int(cfg.norm_topk_prob),
                    router=weight(moe.router_weight), gate_up=ctypes.addressof(gate_up),
                    down=ctypes.addressof(down),
                    woken=self._woken.data_ptr() + i * self._woken.element_size())
        if moe.shared is not None:
            m.shared_inter = cfg.shared_expert_intermediate_size
            m.shared_gate_up = weight(moe.shared.gate_up_weight)
            m.shared_down = weight(moe.shared.down_weight)
            m.shared_gate = weight(moe.shared_gate_weight)
        self._moe += [m, gate_up, down]
        return m

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
        output}). One sd_layers call runs the layers between two captured ones when the cache
        is a ``KVCache`` (layer i is its tensor[i]); any other cache runs layer by layer."""
        if [w._version for w in self._watched] != self._versions:
            self._build()  # a weight changed in place since: prepare again
        n = len(range(len(self.args))[:num_layers])  # as many as self.args[:num_layers]
        cache = self._cache_tensor(kv_cache, n)
        step = (x, cos, sin, plan, kv_cache, num_layers, qkv_input)
        if cache is None or not self._fits(x, cos, sin, plan, qkv_input):
            self._check_step(*step)  # raises what does not fit (else: a cache of another kind)
        dtype, t = x.dtype, x.shape[0]
        h = _fp32(x)  # updated in place, layer after layer
        cos, sin = _fp32(cos), _fp32(sin)  # [T, head_dim] in memory (numel checked)
        first = None if qkv_input is None else _fp32(qkv_input)
        st = self._step
        st.T, st.x, st.cos, st.sin = t, h.data_ptr(), cos.data_ptr(), sin.data_ptr()
        st.page_size, st.max_keys = plan.page_size, plan.max_keys
        st.write_index, st.key_indptr = plan.write_index.data_ptr(), plan.indptr.data_ptr()
        st.key_index, st.n_keys = plan.index.data_ptr(), plan.index.numel()
        st.nthreads = torch.get_num_threads()
        captured = {}
        for start, stop, st.kv, st.kv_stride, st.kv_rows, st.kv_fmt in self._runs(
                cache, kv_cache, n, capture_layers):
            given = start == 0 and first is not None  # qkv_input replaces layer 0's input
            st.qkv_input, st.qkv_in = (first.data_ptr(), first.shape[1]) if given else (None, 0)
            rc = self.kernels.layers(self._array, start, stop - start, st)
            if rc:
                self._refused(rc, *step)
            if stop - 1 in capture_layers:
                captured[stop - 1] = h.to(dtype, copy=True)
        if self._moe:  # what each mixture-of-experts layer woke (MoEMLP.woken, .rows)
            for layer, woken in zip(self.layers_of(self.model)[:n], self._woken[:n].tolist()):
                layer.moe.woken, layer.moe.rows = woken, t
        return (h if dtype == torch.float32 else h.to(dtype)), captured

    def _runs(self, cache: torch.Tensor | None, kv_cache, n: int, capture_layers):
        """(first layer, end, its cache's address, bytes from one layer's cache to the next,
        rows of one layer's cache, their format) of each sd_layers call of a step over n
        layers: runs ending at the captured layers in ``cache`` (``_cache_tensor``), else one
        call per layer of ``kv_cache`` (each layer's shape checked by _check_step)."""
        per_row = self._kv_shape[0] * self._kv_shape[1]
        if cache is None:
            for i in range(n):
                kv = kv_cache.layer(i)
                yield i, i + 1, kv.data_ptr(), 0, kv.numel() // per_row, FORMATS[kv.dtype]
            return
        stride = cache.stride(0) * cache.element_size()
        rows, fmt, start = cache.numel() // (cache.shape[0] * per_row), FORMATS[cache.dtype], 0
        for stop in sorted({i + 1 for i in capture_layers if 0 <= i < n} | {n}):
            yield start, stop, cache.data_ptr() + start * stride, stride, rows, fmt
            start = stop

    def _cache_tensor(self, kv_cache, n: int) -> torch.Tensor | None:
        """A ``KVCache``'s one tensor [layers >= n, ..., kv_heads, head_dim] (layer i is its
        tensor[i]) when sd_layers can read n layers of it, else None."""
        if type(kv_cache) is not KVCache or n < 1:
            return None
        kv = kv_cache.tensor
        ok = (isinstance(kv, torch.Tensor) and kv.dtype in FORMATS and kv.is_cpu
              and kv.is_contiguous() and kv.dim() >= 3 and kv.shape[0] >= n
              and kv.shape[-2:] == self._kv_shape)
        return kv if ok else None

    def _fits(self, x, cos, sin, plan, qkv_input) -> bool:
        """Whether the step's tensors have the sizes sd_layers reads: ``_check_step``'s checks
        as one expression (it explains a failure); the values of the write rows and the key
        lists are checked in C (sd_layers), the cache by ``_cache_tensor``."""
        hidden, d = self._hidden, self._head_dim
        if x.dim() != 2:
            return False
        t = x.shape[0]
        w, ptr, index = plan.write_index, plan.indptr, plan.index
        return (x.shape[1] == hidden and x.is_cpu
                and cos.numel() == t * d and cos.is_cpu and (cos.dim() < 1 or cos.shape[0] == t)
                and sin.numel() == t * d and sin.is_cpu and (sin.dim() < 1 or sin.shape[0] == t)
                and (qkv_input is None or (qkv_input.dim() == 2 and qkv_input.is_cpu
                                           and qkv_input.shape == (t, self._qkv_in)))
                and _int64s(w) and w.shape == (2 * t,) and _int64s(ptr)
                and ptr.shape == (t + 1,) and _int64s(index) and index.dim() == 1)

    def _refused(self, rc: int, *step) -> None:
        """Raise for sd_layers' refusal ``rc`` of ``step`` (run's arguments): _check_step's
        message when it finds what did not fit."""
        if rc in ROW_ERRORS:
            self._check_step(*step)
        a = self.args[0]
        raise RuntimeError(f"sd_layer refused its arguments (code {rc}: "
                           f"{ROW_ERRORS.get(rc, 'a layer or the step')}; T {step[0].shape[0]}, "
                           f"hidden {a.hidden}, heads {a.heads}/{a.kv_heads} x {a.head_dim}, "
                           f"inter {a.inter})")

    def _check_step(self, x, cos, sin, plan, kv_cache, num_layers, qkv_input) -> None:
        """Raise (naming the tensor, its shape and what is allowed) unless every tensor behind
        the pointers sd_layer gets has the sizes it reads: the C side cannot check them."""
        a = self.args[0]
        t, hidden, d, hkv = x.shape[0] if x.dim() else -1, a.hidden, a.head_dim, a.kv_heads

        def need(ok: bool, name: str, got, allowed) -> None:  # allowed() made only to raise
            if not ok:
                shape = tuple(got.shape) if isinstance(got, torch.Tensor) else got
                raise ValueError(f"sd_layer: {name} of shape {shape}; allowed: {allowed()}")

        need(x.dim() == 2 and x.shape[1] == hidden and x.is_cpu, "x", x,
             lambda: f"[T, {hidden}] on the CPU")
        for name, c in (("cos", cos), ("sin", sin)):
            need(c.numel() == t * d and c.is_cpu and (c.dim() < 1 or c.shape[0] == t), name, c,
                 lambda: f"[{t}, 1, {d}] (T rows of head_dim) on the CPU")
        if qkv_input is not None:
            k = self._qkv_in
            need(qkv_input.dim() == 2 and tuple(qkv_input.shape) == (t, k) and qkv_input.is_cpu,
                 "qkv_input", qkv_input,
                 lambda: f"[{t}, {k}] (T rows of the qkv projection's input)")
        kvs = [kv_cache.layer(i) for i in range(len(self.args[:num_layers]))]
        for i, kv in enumerate(kvs):
            need(isinstance(kv, torch.Tensor) and kv.dtype in FORMATS and kv.is_cpu
                 and kv.is_contiguous() and kv.dim() >= 2 and tuple(kv.shape[-2:]) == (hkv, d)
                 and kv.shape == kvs[0].shape, f"layer {i}'s cache", kv,
                 lambda: f"[..., {hkv}, {d}] of {sorted(map(str, FORMATS))}, contiguous, on "
                 "the CPU, the same for every layer")
        if not kvs:
            return
        rows, w = kvs[0].numel() // (hkv * d), plan.write_index
        need(isinstance(w, torch.Tensor) and w.dtype == torch.int64 and w.is_cpu
             and w.is_contiguous() and tuple(w.shape) == (2 * t,), "write_index", w,
             lambda: f"[{2 * t}] int64 (K rows, then V rows), contiguous, on the CPU")
        if t:
            lo, hi = (int(v) for v in w.aminmax())
            need(0 <= lo and hi < rows, "write_index", w,
                 lambda: f"cache rows in 0..{rows - 1} (got {lo}..{hi})")
        self.kernels._check_keys("sd_layer", plan.indptr, plan.index, t, plan.max_keys,
                                 rows - plan.page_size)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous float32 (itself when it is: the pointer is all the C side reads)."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def _int64s(t) -> bool:
    """A contiguous int64 CPU tensor."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.is_cpu
            and t.is_contiguous())
