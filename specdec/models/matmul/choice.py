"""Which matmul hook a model gets (``EngineConfig.linear_kernels``), made and installed once.

* ``"invariant"`` on a CPU: the compiled row-invariant kernels (``PreparedLinears``), every
  weight prepared now, and on each decoder they cover its layers as compiled calls
  (``FusedLayers``); where they do not load, the timed table below, said in the log.
* ``"tuned"`` on a CPU: ``LinearKernels.tune`` (F.linear-based paths timed here, cached).
* ``"invariant"`` on CUDA: the Triton row-invariant matmul (``specdec.kernels``), where
  triton imports and the dtype is one it takes (bf16 / fp16 / fp32); else F.linear, said in
  the log (float64, the tests' dtype for exact argmaxes, among them).
* ``"plain"``, or any other device: F.linear.
"""

from __future__ import annotations

import logging

import torch

from specdec import native
from specdec.models.aliases import cache_dir
from specdec.models.matmul.fused import FusedLayers
from specdec.models.matmul.linear import LinearKernels
from specdec.models.matmul.prepared import PreparedLinears

logger = logging.getLogger("specdec")


def install_kernels(models: list, choice: str, dtype: torch.dtype, device: torch.device,
                    adopted: list[tuple[torch.Tensor, native.Panels]] = ()
                    ) -> LinearKernels | PreparedLinears:
    """Set ``m.matmul`` on every model (each once) to the hook ``choice`` names; returns it.
    ``adopted``: (weight, panels made for it elsewhere), for the compiled kernels only."""
    models = list(dict.fromkeys(models))
    kernels = _choose(models, choice, dtype, device, adopted)
    for m in models:
        m.matmul = kernels
        if getattr(kernels, "gathers_experts", False) and hasattr(m, "stack_experts"):
            m.stack_experts()  # a mixture of experts: one launch per matrix, no host read
        if hasattr(m, "fused"):  # a decoder, a draft head: layers as compiled calls if covered
            m.fused = None
            if isinstance(kernels, PreparedLinears):
                refusal = _refusal(m)
                if refusal is None:
                    m.fused = FusedLayers(kernels.kernels, kernels, m)
                else:
                    logger.info("%s: the compiled layer call does not take %s; its torch "
                                "forward runs instead", type(m).__name__, refusal)
    return kernels


def _refusal(model) -> str | None:
    """Why the compiled layer calls cannot run ``model`` (None: they can), naming the shape."""
    own = getattr(model, "compiled_refusal", None)
    reason = own() if own is not None else None
    if reason is None and not FusedLayers.covers(model):
        c = model.cfg
        reason = (f"{str(model.embed.dtype).removeprefix('torch.')} on "
                  f"{model.embed.device.type}, head_dim {c.head_dim}, {c.num_heads} heads over "
                  f"{c.num_kv_heads} KV heads (it takes float32/bf16/fp16 on the CPU, head_dim "
                  f"a multiple of 8 up to 512, heads a multiple of the KV heads)")
    return reason


def _choose(models: list, choice: str, dtype: torch.dtype, device: torch.device, adopted):
    on_cpu = device.type == "cpu"
    compiled = native.load() if on_cpu and choice == "invariant" else None
    if adopted and compiled is None:
        raise ValueError("native weights need the compiled kernels (linear_kernels='invariant' "
                         "on a CPU where they are built)")
    if compiled is not None:
        kernels = PreparedLinears(compiled)
        for weight, panels in adopted:
            kernels.adopt(weight, panels)
        for m in models:
            kernels.prepare_all(getattr(m, "matrices", list)())
        logger.info("linear kernels: %s, %d weights prepared (%.0f MB)", kernels.key,
                    kernels.num_prepared, kernels.weight_bytes / 1e6)
        return kernels
    if not on_cpu and choice == "invariant" and dtype == torch.float64:
        logger.info("linear kernels: float64 on %s runs F.linear (the Triton row-invariant "
                    "matmul takes bf16 / fp16 / fp32)", device.type)
    elif not on_cpu and choice == "invariant":
        from specdec.kernels import triton_available

        if triton_available():
            from specdec.kernels.invariant_matmul import InvariantLinear

            logger.info("linear kernels: %s", InvariantLinear.key)
            return InvariantLinear()
        logger.info("linear kernels: triton does not import here: F.linear (cuBLAS), whose "
                    "result for a row depends on the step's rows (not row-invariant)")
    if not on_cpu or choice == "plain":
        return LinearKernels.plain()
    if choice == "invariant":
        logger.info("linear kernels: the compiled ones are not available here, timing the "
                    "F.linear-based table instead (not row-invariant)")
    shapes = list(dict.fromkeys(s for m in models for s in getattr(m, "weight_shapes", list)()))
    kernels = LinearKernels.tune(shapes, dtype, cache_dir=cache_dir() / "kernels")
    logger.info("linear kernels: %s (%.2f s%s)", kernels.key, kernels.tuned_seconds,
                ", cached" if kernels.from_cache else "")
    return kernels
