"""Attention backends by name: `torch` (reference, any device)."""

from __future__ import annotations

from types import MappingProxyType


def _torch_backend():
    from specdec.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


BACKENDS = MappingProxyType({"torch": _torch_backend})


def create_backend(name: str):
    """A backend instance by name; ValueError lists the choices."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return BACKENDS[name]()
