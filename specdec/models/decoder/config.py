"""The model facts our decoder needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3")
# RoPE types whose frequencies do not depend on the running sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (llama, qwen2, qwen3, mistral, phi3)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool  # RMSNorm over head_dim on q and k before RoPE (qwen3)
    max_position_embeddings: int
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def model_config_from_hf(hf_config) -> ModelConfig:
    """Validate an HF `PretrainedConfig` and extract a `ModelConfig`.

    Raises ValueError naming the unsupported field (architecture, RoPE type, activation).
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture model_type={model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act={act!r}; only 'silu' (SwiGLU) is supported")
    rope_type = rope_parameters(hf_config).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type={rope_type!r}; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    partial = rope_parameters(hf_config).get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor={partial}; the decoder rotates "
                         "whole heads only (1.0)")
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    eos = hf_config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(hf_config, "attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
        max_position_embeddings=hf_config.max_position_embeddings,
        sliding_window=_sliding_window(hf_config),
        eos_token_ids=eos_ids,
    )


def rope_parameters(hf_config) -> dict:
    """RoPE settings across transformers versions (`rope_parameters` or `rope_scaling`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def _sliding_window(hf_config) -> int | None:
    if not getattr(hf_config, "use_sliding_window", True):
        return None
    return getattr(hf_config, "sliding_window", None)


DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a user dtype (name or torch.dtype) to a torch.dtype; ValueError lists the choices."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
