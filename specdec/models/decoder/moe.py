"""A mixture-of-experts MLP (qwen3_moe, mixtral, qwen2_moe) whose rows do not see each other.

HF transformers (5.x) is the oracle; per family it computes, for a row h (the normed input):

    logits = h @ router.T                              [E], in the model's dtype
    probs  = softmax(float32(logits))                  over all E experts
    w, idx = top-k(probs)                              k = num_experts_per_tok
    w      = w / sum(w)                                qwen*: iff norm_topk_prob; mixtral: always
    out    = sum over the k experts e of w_e * down_e(silu(gate_e h) * up_e h)
           (+ sigmoid(h @ shared_gate.T) * shared(h)   qwen2_moe's shared expert)

(qwen*: w rounded to the model's dtype before the product; mixtral: the product in float32,
rounded to the model's dtype after: as their routers hand the weights on.)

Row invariance (speculation stays exactly plain decoding): a row's output must not depend on
which or how many other rows share a step or an expert. So:

* every matmul (router, experts, shared expert, its gate) goes through ``mm``, the decoder's
  matmul hook (the engine's row-invariant kernels);
* the experts run over the rows routed to them (``index_select``) and each product is written
  (not added) into the row's own slot of a [T, k, H] buffer: slot s holds the row's s-th
  expert in increasing expert index, the order transformers' ``index_add_`` loop adds them in;
  the k slots are then summed in that order. No accumulation depends on the other rows;
* ties in the top-k go to the lowest expert index (a stable sort), a rule of the row alone.
  transformers' ``torch.topk`` breaks exact ties in an order of its own (on a CPU
  ``topk(zeros(8), 3)`` is experts 6, 5, 4): the two differ only where two experts' float32
  probabilities are exactly equal.

Two ways to run the experts, the same numbers:

* one expert at a time (``_experts_looped``) over its rows, through ``mm``: the woken experts
  are read to the host (``torch.unique(...).tolist()``);
* gathered (``_experts_gathered``, after ``stack_experts``: on a GPU with the row-invariant
  Triton kernels): every (row, expert) pair in one launch per matrix
  (``specdec.kernels.invariant_moe``), bitwise the loop's with ``invariant_linear`` as ``mm``,
  with no host read and shapes fixed by T.

(On a CPU with the compiled kernels the whole layer runs in C instead: specdec/native/moe.c.)

What a step woke (the goodput controller prices a draft tree by it, ``controllers/
expert_costs.py`` ``ExpertCosts``): each forward sets ``woken`` (distinct experts its rows
routed to) and ``rows``: host ints taken from the list the loop reads anyway (no read of their
own), or, gathered, ``woken`` a 0-d device count that the step's statistics read after the
step (``LlamaDecoder.experts_woken``: one tensor for every layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.decoder.config import ModelConfig

Matmul = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class Expert(nn.Module):
    """One SwiGLU expert: ``gate_up_weight`` [2 x width, hidden] (gate rows, then up rows, as
    the dense MLP fuses them), ``down_weight`` [hidden, width]."""

    def __init__(self, hidden: int, width: int, trainable: bool = False) -> None:
        super().__init__()
        self.gate_up_weight = nn.Parameter(torch.empty(2 * width, hidden),
                                           requires_grad=trainable)
        self.down_weight = nn.Parameter(torch.empty(hidden, width), requires_grad=trainable)

    def forward(self, x: torch.Tensor, mm: Matmul = F.linear) -> torch.Tensor:
        gate, up = mm(x, self.gate_up_weight, None).chunk(2, dim=-1)
        return mm(F.silu(gate) * up, self.down_weight, None)


class MoEMLP(nn.Module):
    """The routed experts (and qwen2_moe's shared expert) of one layer; see the module
    docstring. ``forward(h, mm)``: h [T, hidden] the post-attention-normed rows -> [T, hidden]
    the MLP's output (the residual is the caller's)."""

    def __init__(self, cfg: ModelConfig, trainable: bool = False) -> None:
        super().__init__()
        assert cfg.is_moe, cfg
        self.cfg = cfg
        h = cfg.hidden_size
        self.router_weight = nn.Parameter(torch.empty(cfg.num_experts, h),
                                          requires_grad=trainable)
        self.experts = nn.ModuleList(Expert(h, cfg.moe_intermediate_size, trainable)
                                     for _ in range(cfg.num_experts))
        self.shared = None
        if cfg.shared_expert_intermediate_size:
            self.shared = Expert(h, cfg.shared_expert_intermediate_size, trainable)
            self.shared_gate_weight = nn.Parameter(torch.empty(1, h), requires_grad=trainable)
        # the latest forward's distinct experts and rows (module docstring); 0 before any.
        # woken: a host int, or a 0-d device count where the experts ran gathered
        self.woken: int | torch.Tensor = 0
        self.rows = 0
        # the experts stacked for the gathered launch (stack_experts); None: one at a time
        self.stacked_gate_up: torch.Tensor | None = None
        self.stacked_down: torch.Tensor | None = None
        # mixtral hands its float32 weights on unrounded; qwen* round them to the model's dtype
        self.weights_in_float32 = cfg.model_type == "mixtral"

    def named_matrices(self) -> dict[str, torch.Tensor]:
        """``router``, ``experts.{j}.gate_up``, ``experts.{j}.down`` and, with a shared
        expert, ``shared.gate_up``, ``shared.down``, ``shared_gate``."""
        out = {"router": self.router_weight}
        for j, e in enumerate(self.experts):
            out[f"experts.{j}.gate_up"] = e.gate_up_weight
            out[f"experts.{j}.down"] = e.down_weight
        if self.shared is not None:
            out["shared.gate_up"] = self.shared.gate_up_weight
            out["shared.down"] = self.shared.down_weight
            out["shared_gate"] = self.shared_gate_weight
        return out

    def owner(self, name: str) -> tuple[nn.Module, str]:
        """(module, attribute) holding the matrix ``name`` of ``named_matrices``."""
        if name == "router":
            return self, "router_weight"
        if name == "shared_gate" and self.shared is not None:
            return self, "shared_gate_weight"
        where, _, what = name.rpartition(".")
        if where.startswith("experts."):
            return self.experts[int(where.removeprefix("experts."))], f"{what}_weight"
        if where == "shared" and self.shared is not None:
            return self.shared, f"{what}_weight"
        raise KeyError(f"no matrix {name!r} in a mixture-of-experts layer")

    def route(self, h: torch.Tensor, mm: Matmul = F.linear
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts [T, k] int64 in increasing index per row, their weights [T, k] float32)."""
        cfg = self.cfg
        logits = mm(h, self.router_weight, None)
        probs = torch.softmax(logits.float(), dim=-1)
        # the k largest, ties to the lowest index (stable sort), then back in expert order
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
        top = order[:, :cfg.num_experts_per_tok]
        weights = probs.gather(-1, top)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        experts, slot = top.sort(dim=-1)  # distinct indices: no ties
        return experts, weights.gather(-1, slot)

    def stack_experts(self) -> None:
        """Every expert's gate|up and down as views of one [E, 2 x width, hidden] and one
        [E, hidden, width] tensor (the weights move there: no second copy is kept), so that the
        experts run as one gathered launch per matrix (``specdec.kernels.invariant_moe``) with
        no host read: what the engine sets up on a GPU with the row-invariant Triton kernels."""
        for name in ("gate_up_weight", "down_weight"):
            params = [getattr(e, name) for e in self.experts]
            stacked = torch.stack([w.detach() for w in params])
            for j, w in enumerate(params):
                w.data = stacked[j]
            setattr(self, "stacked_" + name.removesuffix("_weight"), stacked)

    def forward(self, h: torch.Tensor, mm: Matmul = F.linear) -> torch.Tensor:
        k = self.cfg.num_experts_per_tok
        experts, weights = self.route(h, mm)
        if not self.weights_in_float32:
            weights = weights.to(h.dtype)
        if self.stacked_gate_up is not None:
            parts = self._experts_gathered(h, experts, weights)
        else:
            parts = self._experts_looped(h, experts, weights, mm)
        out = parts[:, 0]
        for s in range(1, k):  # the same order for every row, whatever its companions
            out = out + parts[:, s]
        if self.shared is not None:
            gate = torch.sigmoid(mm(h, self.shared_gate_weight, None))
            out = out + gate * self.shared(h, mm)
        return out

    def _experts_looped(self, h, experts, weights, mm) -> torch.Tensor:
        """[T, k, H]: row t's s-th expert's weighted output in slot s, one expert at a time
        over the rows routed to it (the woken experts read to the host)."""
        rows, k = h.shape[0], self.cfg.num_experts_per_tok
        parts = h.new_zeros(rows, k, h.shape[1])
        hit = torch.unique(experts).tolist()  # sorted
        self.woken, self.rows = len(hit), rows  # (host ints: no read of their own)
        for e in hit:
            t, s = (experts == e).nonzero(as_tuple=True)  # each row at most once
            y = self.experts[e](h.index_select(0, t), mm)
            parts[t, s] = (y * weights[t, s, None]).to(h.dtype)
        return parts

    def _experts_gathered(self, h, experts, weights) -> torch.Tensor:
        """``_experts_looped``'s result (bitwise, with the row-invariant Triton matmul as
        ``mm``) as two gathered launches over the stacked experts, nothing read to the host:
        ``woken`` is left a device count, read with the step's statistics."""
        from specdec.kernels.invariant_moe import invariant_moe_linear, moe_layout

        rows, k = experts.shape
        layout = moe_layout(experts.reshape(-1), self.cfg.num_experts)
        pairs = torch.arange(rows * k, device=h.device)
        gate, up = invariant_moe_linear(h.contiguous(), self.stacked_gate_up, pairs // k,
                                        layout).chunk(2, dim=-1)
        y = invariant_moe_linear(F.silu(gate) * up, self.stacked_down, pairs, layout)
        self.woken, self.rows = layout.woken, rows
        return (y * weights.reshape(-1, 1)).to(h.dtype).view(rows, k, -1)
