"""A decoder layer's element-wise steps as one kernel each: the ops a GPU forward runs.

On a GPU a small model's step is bound by how many kernels it launches, not by its bytes (the
SmolLM2-135M shape streams its weights in ~0.06 ms at 4.8 TB/s; its 30 layers of ~31 small
kernels each took ~2 ms inside a CUDA graph). Four steps of a layer are fused here, each a torch
custom op ("specdec::..."), so that one op is one kernel:

    add_rms_norm_(x, residual, w)   residual += x; x = rms_norm(residual) * w   (in place)
    rms_norm(x, w)                  (the first layer's input norm; Qwen3's q/k norms)
    rope_(q, k, positions, ...)     q, k rotated in place, RoPE's cos/sin from one table
    silu_and_mul(gate_up)           silu(gate) * up

On CUDA each runs flashinfer's kernel (fused_add_rmsnorm, rmsnorm, apply_rope_with_cos_sin_cache,
silu_and_mul) when flashinfer imports; elsewhere (and as the reference) the torch ops the layers
ran before, with bitwise their results. With the K/V write (one index_put_, kv_rows.write_kv),
the attention kernel and four matmuls, a layer is 10 kernels instead of ~31
(``docs/bench/host_overhead.py`` counts them on a CPU with a TorchDispatchMode).

flashinfer's kernels round once where the torch ops round at each step (the norm is computed
from the unrounded sum, RoPE in float32 from a float32 table): the same numbers up to bf16
rounding, and a row's result never depends on the other rows (each kernel reduces within a row).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from specdec.models.decoder.rope import apply_rotary


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in float32 at least (as HF does for half precision)."""
    if x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype) * weight


def _flashinfer():
    """flashinfer, or None where it is not installed (the torch ops run instead)."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    import flashinfer

    return flashinfer


@torch.library.custom_op("specdec::add_rms_norm_", mutates_args=("x", "residual"))
def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    """residual [T, H] += x [T, H]; x = rms_norm(residual) * weight [H] (both in place)."""
    residual.add_(x)
    x.copy_(rms_norm_reference(residual, weight, eps))


@add_rms_norm_.register_kernel("cuda")
def _add_rms_norm_cuda(x, residual, weight, eps) -> None:
    fi = _flashinfer()
    if fi is None or x.dtype not in (torch.bfloat16, torch.float16):
        residual.add_(x)
        x.copy_(rms_norm_reference(residual, weight, eps))
        return
    fi.norm.fused_add_rmsnorm(x, residual, weight, eps)


@torch.library.custom_op("specdec::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight over the last dim: x [T, H] or [T, heads, D]."""
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_kernel("cuda")
def _rms_norm_cuda(x, weight, eps):
    fi = _flashinfer()
    if fi is None or x.dtype not in (torch.bfloat16, torch.float16):
        return rms_norm_reference(x, weight, eps)
    return fi.norm.rmsnorm(x.contiguous(), weight, eps)


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("specdec::rope_", mutates_args=("q", "k"))
def rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """q [T, Hq, D] and k [T, Hk, D] rotated in place by their rows' positions [T] (HF's
    rotate-half convention). ``cos`` / ``sin`` [max_pos, D] in the model's dtype are what the
    torch ops read; ``cos_sin_cache`` [max_pos, D] float32 (cos of the D/2 frequencies, then
    their sin) is what flashinfer reads."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q.copy_(apply_rotary(q, c, s))
    k.copy_(apply_rotary(k, c, s))


@rope_.register_kernel("cuda")
def _rope_cuda(q, k, positions, cos, sin, cos_sin_cache) -> None:
    fi = _flashinfer()
    if fi is None or q.dtype not in (torch.bfloat16, torch.float16):
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        q.copy_(apply_rotary(q, c, s))
        k.copy_(apply_rotary(k, c, s))
        return
    t = q.shape[0]
    # [T, H * D] views of the q / k columns (rows keep their stride: no copy)
    fi.rope.apply_rope_with_cos_sin_cache_inplace(positions, q.view(t, -1), k.view(t, -1),
                                                  q.shape[-1], cos_sin_cache, is_neox=True)


@torch.library.custom_op("specdec::silu_and_mul", mutates_args=())
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@silu_and_mul.register_kernel("cuda")
def _silu_and_mul_cuda(gate_up):
    fi = _flashinfer()
    if fi is None or gate_up.dtype not in (torch.bfloat16, torch.float16) \
            or gate_up.shape[-1] * gate_up.element_size() % 32:  # 16-byte halves
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return fi.activation.silu_and_mul(gate_up)


@silu_and_mul.register_fake
def _silu_and_mul_fake(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
