"""The model facts our decoder needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# mixture-of-experts families (specdec.models.decoder.moe): routed experts in every layer's MLP
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", *MOE_MODEL_TYPES)
# MoE families refused by name, with what they need that the decoder does not have
UNSUPPORTED_MOE = {
    "deepseek_v2": "multi-head latent attention (MLA) and grouped top-k routing",
    "deepseek_v3": "multi-head latent attention (MLA) and grouped top-k routing",
    "gpt_oss": "attention sinks and MXFP4 experts",
    "olmoe": "OLMoE's q/k norms over the whole projection",
    "qwen3_next": "its linear-attention (gated DeltaNet) layers",
}
# RoPE types whose frequencies do not depend on the running sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (llama, qwen2, qwen3, mistral, phi3), dense or
    with a mixture of experts in every layer's MLP (qwen3_moe, mixtral, qwen2_moe: the
    ``num_experts``... fields; 0 / False for a dense model)."""

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
    # mixture of experts (specdec.models.decoder.moe); all 0 / False: a dense MLP
    num_experts: int = 0  # routed experts per layer
    num_experts_per_tok: int = 0  # k: the experts each row is routed to
    moe_intermediate_size: int = 0  # one expert's SwiGLU width
    norm_topk_prob: bool = False  # the k routing weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # qwen2_moe's shared expert (0: none)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                             f"1..num_experts ({self.num_experts})")

    @property
    def is_moe(self) -> bool:
        """Whether every layer's MLP is a mixture of experts."""
        return self.num_experts > 0

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
    if model_type in UNSUPPORTED_MOE:
        raise ValueError(
            f"unsupported mixture-of-experts architecture model_type={model_type!r} "
            f"({UNSUPPORTED_MOE[model_type]}); supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
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
        attention_bias=_attention_bias(hf_config, model_type),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        max_position_embeddings=hf_config.max_position_embeddings,
        sliding_window=_sliding_window(hf_config),
        eos_token_ids=eos_ids,
        **_moe_fields(hf_config, model_type),
    )


def _attention_bias(hf_config, model_type: str) -> bool:
    if model_type == "qwen2_moe":  # its config calls it qkv_bias (default True)
        return bool(getattr(hf_config, "qkv_bias", True))
    return bool(getattr(hf_config, "attention_bias", model_type == "qwen2"))


def _moe_fields(hf_config, model_type: str) -> dict:
    """The mixture-of-experts fields of ``ModelConfig`` ({} for a dense family).

    qwen3_moe / qwen2_moe: ``num_experts`` experts of ``moe_intermediate_size``, top
    ``num_experts_per_tok`` of the softmax, renormalised iff ``norm_topk_prob``; qwen2_moe
    adds a shared expert (``shared_expert_intermediate_size``) scaled by sigmoid(its gate).
    mixtral: ``num_local_experts`` experts of ``intermediate_size``, top
    ``num_experts_per_tok`` of the softmax, always renormalised (transformers'
    MixtralTopKRouter). Only the all-MoE layout is taken: ``decoder_sparse_step`` 1 and no
    ``mlp_only_layers`` (a dense MLP in some layers is refused by name)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    if model_type == "mixtral":
        num = hf_config.num_local_experts
        width, norm, shared = hf_config.intermediate_size, True, 0
    else:
        num = hf_config.num_experts
        width = hf_config.moe_intermediate_size
        norm = bool(getattr(hf_config, "norm_topk_prob", False))
        shared = (hf_config.shared_expert_intermediate_size if model_type == "qwen2_moe"
                  else 0)
        step = getattr(hf_config, "decoder_sparse_step", 1)
        dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
        if step != 1 or dense:
            raise ValueError(
                f"unsupported {model_type} layout decoder_sparse_step={step}, "
                f"mlp_only_layers={dense}: the decoder runs experts in every layer "
                f"(decoder_sparse_step=1, mlp_only_layers=[])")
    if num < 1:
        raise ValueError(f"{model_type} with {num} experts: the decoder runs dense MLPs only "
                         f"for the dense families")
    return dict(num_experts=num, num_experts_per_tok=hf_config.num_experts_per_tok,
                moe_intermediate_size=width, norm_topk_prob=norm,
                shared_expert_intermediate_size=shared)


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
