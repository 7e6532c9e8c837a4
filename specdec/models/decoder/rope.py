"""Rotary position embeddings, with the config's scaling, as one cos/sin table."""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specdec.models.decoder.config import rope_parameters


def inverse_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """([head_dim // 2] float32 inverse frequencies, attention scaling) as transformers computes them."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", 10000.0)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")


class RotaryEmbedding:
    """cos/sin table [max_positions, head_dim] computed once; `apply` rotates q and k in place-free ops."""

    def __init__(self, hf_config, head_dim: int, max_positions: int, dtype, device) -> None:
        inv_freq, scaling = inverse_frequencies(hf_config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scaling).to(dtype=dtype, device=device)
        # [max_positions, head_dim] float32: cos of the head_dim / 2 frequencies, then their sin
        # (flashinfer's RoPE table: specdec.models.decoder.layer_ops.rope_)
        self.cos_sin_cache = (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scaling).to(
            device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) each [T, 1, head_dim], shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by the (cos, sin) of its row's position (HF's rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
