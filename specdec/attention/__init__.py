"""Attention backends by name: `torch` (reference, any device), `invariant` (CUDA, Triton: one
row-invariant kernel for every row, CUDA graphs), `flashinfer` (CUDA, bf16/fp16, CUDA graphs),
`flex` (torch FlexAttention: the GPU fallback without flashinfer; eager on CPU). `auto` on CUDA
is `invariant` where the engine computes row-invariantly (linear_kernels "invariant") and triton
imports, else flashinfer with a half dtype when it imports, else torch; on the CPU torch."""

from __future__ import annotations

import importlib.util
from types import MappingProxyType

import torch

from specdec.attention.backend import AttentionSpec


def _torch_backend(spec: AttentionSpec):
    from specdec.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(spec)


def _flashinfer_backend(spec: AttentionSpec):
    from specdec.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(spec)


def _invariant_backend(spec: AttentionSpec):
    from specdec.attention.invariant_backend import InvariantAttentionBackend

    return InvariantAttentionBackend(spec)


def _flex_backend(spec: AttentionSpec):
    from specdec.attention.flex_backend import FlexAttentionBackend

    return FlexAttentionBackend(spec)


BACKENDS = MappingProxyType(
    {"torch": _torch_backend, "invariant": _invariant_backend, "flashinfer": _flashinfer_backend,
     "flex": _flex_backend})
CHOICES = ("auto", *BACKENDS)


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype,
                    invariant: bool = False) -> str:
    """The backend `name` stands for on this device and dtype ("auto" resolved; ``invariant``:
    the engine's matmuls are row-invariant, so attention should be too)."""
    if name not in CHOICES:
        raise ValueError(f"attention_backend must be one of {', '.join(CHOICES)}, got {name!r}")
    if name != "auto":
        return name
    if torch.device(device).type != "cuda":
        return "torch"
    from specdec.kernels import triton_available

    if invariant and dtype != torch.float64 and triton_available():
        return "invariant"
    if dtype in (torch.float16, torch.bfloat16) and flashinfer_available():
        return "flashinfer"
    return "torch"


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def create_backend(name: str, spec: AttentionSpec, invariant: bool = False):
    """A backend instance by name ("auto" resolved for spec's device and dtype)."""
    return BACKENDS[resolve_backend(name, spec.device, spec.dtype, invariant)](spec)
