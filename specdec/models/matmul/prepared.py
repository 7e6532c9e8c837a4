"""Row-invariant linear layers: every weight prepared once into the compiled kernel's panels.

The model calls its matmul hook like F.linear (``mm(x, weight, bias)``) and knows nothing of
formats; ``PreparedLinears`` is one such hook (``LinearKernels``, the timed table, and F.linear
are the others). It prepares each weight the first time it sees it — panels of 8 output rows,
in the weight's own dtype (fp32, bf16, fp16: half the bytes streamed for 16-bit weights) —
and from then on runs the compiled kernel, whose output rows are bitwise the same whatever
other rows share the call (specdec/native/linear.c). That is what makes speculative
output equal plain output in every precision the kernel covers.

    mm = PreparedLinears(kernels)       # kernels = specdec.native.load()
    mm.prepare_all([w1, w2, head])      # at load (else on first use)
    y = mm(x, w1, b1)                   # x [T, in] -> [T, out] in x's dtype, fp32 accumulation

Activations are rounded to float32 on the way in (exact for bf16 / fp16) and the result to
x's dtype on the way out. float64 (and any input on another device, or needing grad) goes to
F.linear: the kernel covers the dtypes a CPU serves in; float64 is the test precision, where a
row's reduction order does not decide an argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.models.gguf.block_weight import BlockWeight
from specdec.native import ABI, FORMATS, Kernels, PanelParts, Panels


class PreparedLinears:
    """The matmul hook over prepared weights (see module docstring)."""

    name = "invariant"

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels
        # (data_ptr, shape, dtype, version) -> panels: a weight updated in place is prepared
        # again, a new tensor at a reused address never matches a stale entry's version
        self._panels: dict[tuple, Panels | PanelParts] = {}
        # names the build and the instruction sets: step costs profiled with other kernels
        # (specdec.engine.step_profile caches them under this key) are not reused
        self.key = (f"invariant panels (specdec/native ABI {ABI}, build {kernels.build}, "
                    f"q8 {kernels.q8_isa}, float {kernels.float_isa})")
        self.from_cache = False
        self.tuned_seconds = 0.0

    @staticmethod
    def _key(weight: torch.Tensor) -> tuple:
        if isinstance(weight, BlockWeight):  # no storage of its own; read-only
            return "blocks", weight.key
        return weight.data_ptr(), tuple(weight.shape), weight.dtype, weight._version

    def adopt(self, weight: torch.Tensor, panels: Panels | PanelParts) -> None:
        """Compute ``weight`` with ``panels`` made elsewhere (a GGUF's own blocks, whose values
        are bitwise ``weight``'s, or are ``weight``, a ``BlockWeight``: specdec.models.
        gguf_weights; a fused matrix of several types in parts, ``PanelParts``); a weight changed in place later is prepared again from its new values."""
        if (panels.out_features, panels.in_features) != tuple(weight.shape):
            raise ValueError(f"panels of {panels.out_features}x{panels.in_features} for a "
                             f"weight of {tuple(weight.shape)}")
        self._panels[self._key(weight)] = panels

    def prepare_all(self, weights: list[torch.Tensor]) -> None:
        """Prepare now the weights the kernel will run (others go to F.linear anyway)."""
        for w in weights:
            if w.is_cpu and w.dtype in FORMATS:
                self.prepared(w)

    def prepared(self, weight: torch.Tensor) -> Panels | PanelParts:
        key = self._key(weight)
        panels = self._panels.get(key)
        if panels is None:
            panels = self._panels[key] = self.kernels.prepare(weight.detach())
        return panels

    def covers(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether a call goes to the kernel (else F.linear)."""
        return (x.is_cpu and weight.is_cpu and weight.dtype in FORMATS and x.dim() == 2
                and x.dtype in FORMATS
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in], weight [out, in], bias [out] | None -> [T, out] in x's dtype."""
        if not self.covers(x, weight):
            return F.linear(x, weight, bias)
        y = self.kernels.linear(x.float().contiguous(), self.prepared(weight))
        if bias is not None:
            y = y + bias.float()
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    @property
    def num_prepared(self) -> int:
        return len(self._panels)

    @property
    def weight_bytes(self) -> int:
        """Bytes of prepared weights (what one forward streams through the kernel)."""
        return sum(p.nbytes for p in self._panels.values())

    def describe(self) -> dict:
        return {"key": self.key, "choices": {}, "tuned_seconds": 0.0, "from_cache": False,
                "timings_ms": {}, "prepared_weights": len(self._panels),
                "prepared_bytes": self.weight_bytes}
