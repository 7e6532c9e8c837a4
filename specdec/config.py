"""Engine configuration (validated on construction; errors name the field)."""

from __future__ import annotations

from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from specdec.attention import CHOICES as ATTENTION_CHOICES
from specdec.models.aliases import DEFAULT_MODEL
from specdec.models.checkpoints.quantize import CHOICES as QUANTIZE_CHOICES
from specdec.models.decoder.config import DTYPES
from specdec.models.heads.weights import CHOICES as DRAFT_WEIGHT_CHOICES

LINEAR_CHOICES = ("invariant", "tuned", "plain")
WEIGHT_CHOICES = ("auto", "native", "dequantized")
ACTIVATION_CHOICES = ("auto", "float", "q8")
TP_REDUCE_CHOICES = ("exact", "library")

@dataclass
class EngineConfig:
    """Everything that is fixed for the life of an engine.

    KV capacity: `num_pages` (per model) if given, else `kv_cache_memory` bytes, else enough for
    `max_num_seqs` sequences of `max_model_len` tokens (capped at 1 GiB). The bytes are split
    between the target and any drafter that runs a model, the same number of pages each
    (`specdec.engine.memory`); the split is logged and kept in `LLMEngine.kv_split`.
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on the CPU
    device: str = "cpu"
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: int | None = None
    max_model_len: int | None = None  # default: min(model's max positions, 4096)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    # "auto": torch on the CPU; on CUDA "invariant" (Triton) with linear_kernels="invariant"
    # where triton imports, else flashinfer in bf16/fp16 when it imports, else torch
    # (specdec.attention.resolve_backend)
    attention_backend: str = "auto"
    # replay CUDA graphs for decode and verify steps (specdec.engine.cuda_graphs); used on CUDA with a
    # backend that supports them (invariant, flashinfer), ignored elsewhere; False: always eager
    cuda_graphs: bool = True
    # a registered verifier ("gumbel", "rejection", "greedy", or a plugin's)
    verifier: str = "gumbel"
    # CPU matmul paths: "invariant" (the compiled row-invariant kernels, weights prepared once
    # at load; falls back to "tuned" where they are not built or cannot run); "tuned" times the
    # candidates at start-up (cached per machine, torch version, dtype and threads) and keeps
    # the fastest, F.linear among them; "plain": F.linear
    linear_kernels: str = "invariant"
    # a GGUF model's weights: "native" computes with the file's own Q4_1 / Q8_0 blocks (the
    # compiled kernels dequantize in registers, bitwise to the fp32 weights: the same tokens,
    # a sixth of the bytes streamed; float32, CPU, linear_kernels="invariant"); "dequantized"
    # with the fp32 weights transformers makes of them; "auto": native wherever it can run
    weights: str = "auto"
    # the activations the GGUF's blocks meet: "float" (fp32: the fp32 model's numbers, bitwise);
    # "q8": each row rounded to int8 per block of 32 as llama.cpp's CPU backend does
    # (specdec.models.gguf.q8_activations: still row-invariant, so speculation stays exactly plain
    # decoding; ~2-3x cheaper rows, numbers within ~0.5 % of the fp32 model's); needs the
    # native weights. "auto", one rule: q8 wherever the target computes with quantized blocks
    # (a GGUF's, also a model.gguf beside fp32 safetensors it equals, or quantize's), what
    # llama.cpp computes for such weights; float wherever it computes with float matrices (a
    # checkpoint as stored, dequantized weights, the GPU). ``LLMEngine.activations`` says which
    activations: str = "auto"
    # a safetensors checkpoint's matrices quantized at load into GGUF blocks, matrix by matrix:
    # "q8_0" or "q4_k" (Q8_0 where in_features % 256 != 0), then computed as a GGUF's blocks
    # are (float or q8 activations; specdec.models.checkpoints.quantize); None: as stored (a bf16 / fp16
    # checkpoint on its own bytes where the kernels run). Needs float32 on the CPU with the
    # compiled kernels, and a model that is not a GGUF
    quantize: str | None = None
    # a learned drafter's matrices in the compiled kernels: "q8_0" / "q4_1" blocks quantized at
    # load (drafts need no exactness; a fifth / a seventh of fp32's bytes), "float" as loaded,
    # "auto": wherever they can run (float32, CPU, linear_kernels="invariant") q4_1 for the
    # learned heads (eagle3, mtp, block_diffusion) and q8_0 for a draft model, else float
    draft_weights: str = "auto"
    drafter: str | None = None
    drafter_args: dict[str, Any] = field(default_factory=dict)
    controller: str | None = None  # None: "goodput" with a drafter, "static" without
    controller_args: dict[str, Any] = field(default_factory=dict)
    # reuse the KV of cached full pages across requests (specdec.kv.prefix: content keys,
    # LRU eviction of pages no running request maps); outputs are the same either way
    enable_prefix_caching: bool = True
    # a second KV tier (specdec.kv.tier): cached pages evicted from memory are kept in this file
    # on local disk (at most kv_tier_bytes) and brought back on a hit when reading beats
    # recomputing; None: no tier. Needs prefix caching.
    kv_tier_path: str | None = None
    kv_tier_bytes: int = 2 << 30
    # or a tier in (pinned) host memory of this many bytes, below a GPU's KV (specdec.kv.
    # host_tier); on a CPU engine it only rehearses that path
    kv_host_tier_bytes: int | None = None
    # unseeded sampled requests draw their seeds from an RNG seeded with this (None: from
    # torch's global RNG, so torch.manual_seed applies)
    seed: int | None = None
    # ranks the target is split over (tensor parallelism on torch.distributed: gloo on CPUs;
    # specdec.distributed, docs/distributed.md): N divides the attention heads and the MLP
    # width; rank 0 runs the engine, ranks 1..N-1 (started here, or by torchrun) their shards
    tensor_parallel_size: int = 1
    # how the ranks sum the row-parallel layers' partial sums (o, down): "exact" (an all-gather
    # and a sum in rank order: a row's bits never depend on its step's other rows, so
    # speculation is plain decoding token for token) or "library" (the backend's ring
    # all-reduce: less data moved; at N >= 3 a row's bits change with the message size, so
    # speculative output may part from plain decoding at near-ties). No effect at N = 1
    tensor_parallel_reduce: str = "exact"

    @property
    def torch_dtype(self):
        if self.dtype == "auto":
            return DTYPES["bfloat16" if str(self.device).startswith("cuda") else "float32"]
        return DTYPES[self.dtype]

    @property
    def controller_name(self) -> str:
        if self.controller is not None:
            return self.controller
        return "goodput" if self.drafter is not None else "static"

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_numerics(self)
        _check_sizes(self)
        _check_tiers(self)
        _check_parallel(self)
        _check_plugin_args(self)


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _check_choices(c: EngineConfig) -> None:
    """The options with a fixed set of values (each ValueError names the option)."""
    if c.dtype != "auto" and c.dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(DTYPES)}, got {c.dtype!r}")
    for name in ("cuda_graphs", "enable_prefix_caching"):
        if not isinstance(getattr(c, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(c, name)!r}")
    if not (c.device == "cpu" or str(c.device).startswith("cuda")):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {c.device!r}")
    _choice("attention_backend", c.attention_backend, ATTENTION_CHOICES)
    _choice("linear_kernels", c.linear_kernels, LINEAR_CHOICES)
    _choice("weights", c.weights, WEIGHT_CHOICES)
    _choice("activations", c.activations, ACTIVATION_CHOICES)
    if c.quantize is not None and c.quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be None or one of {', '.join(QUANTIZE_CHOICES)}, "
                         f"got {c.quantize!r}")
    _choice("draft_weights", c.draft_weights, DRAFT_WEIGHT_CHOICES)


def _check_numerics(c: EngineConfig) -> None:
    """q8 activations and quantize compute with blocks: not with dequantized weights."""
    if c.activations == "q8" and c.weights == "dequantized":
        raise ValueError("activations='q8' computes with a GGUF's own blocks: it needs "
                         "weights='native' or 'auto', not 'dequantized'")
    if c.quantize is not None and c.weights == "dequantized":
        raise ValueError(f"quantize={c.quantize!r} computes with the blocks it makes: it "
                         "needs weights='native' or 'auto', not 'dequantized'")


def _check_sizes(c: EngineConfig) -> None:
    for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "kv_tier_bytes"):
        _positive(name, getattr(c, name))
    for name in ("num_pages", "kv_cache_memory", "max_model_len", "kv_host_tier_bytes"):
        if getattr(c, name) is not None:
            _positive(name, getattr(c, name))
    if c.seed is not None and (not isinstance(c.seed, int) or isinstance(c.seed, bool)
                               or not 0 <= c.seed < 2**63):
        raise ValueError(f"seed must be None or an int in [0, 2**63 - 1], got {c.seed!r}")


def _check_tiers(c: EngineConfig) -> None:
    """At most one second KV tier, and only over the prefix cache whose pages it keeps."""
    if c.kv_tier_path is not None and (not isinstance(c.kv_tier_path, (str, PathLike))
                                       or not str(c.kv_tier_path)):
        raise ValueError(f"kv_tier_path must be a file path or None, got {c.kv_tier_path!r}")
    if c.kv_host_tier_bytes is not None and c.kv_tier_path is not None:
        raise ValueError("give one second tier: kv_tier_path (disk) or kv_host_tier_bytes "
                         "(host memory), not both")
    for name in ("kv_tier_path", "kv_host_tier_bytes"):
        if getattr(c, name) is not None and not c.enable_prefix_caching:
            raise ValueError(f"{name} keeps cached pages: it needs enable_prefix_caching=True")


def _check_parallel(c: EngineConfig) -> None:
    """tensor_parallel_size: an int >= 1; above 1 (this version), on CPUs without a second
    KV tier (the model's own limits are checked with its config: specdec.distributed);
    tensor_parallel_reduce: one of TP_REDUCE_CHOICES."""
    n = c.tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {n!r}")
    if c.tensor_parallel_reduce not in TP_REDUCE_CHOICES:
        raise ValueError(f"tensor_parallel_reduce must be one of {', '.join(TP_REDUCE_CHOICES)} "
                         f"(exact: speculation equals plain decoding; library: the backend's "
                         f"all-reduce, faster, not exact at N >= 3), got "
                         f"{c.tensor_parallel_reduce!r}")
    if n == 1:
        return
    if str(c.device).startswith("cuda"):
        raise ValueError(f"tensor_parallel_size={n} runs on CPUs (gloo) in this version, not "
                         f"device {c.device!r}: NCCL is not verified on a GPU yet; use "
                         "tensor_parallel_size=1 on CUDA")
    for name in ("kv_tier_path", "kv_host_tier_bytes"):
        if getattr(c, name) is not None:
            raise ValueError(f"tensor_parallel_size={n} does not take a second KV tier yet "
                             f"({name}): every rank would need its share of each page")
    members = (c.drafter or "").split("+")
    args = c.drafter_args if len(members) == 1 else c.drafter_args.get("draft_model", {})
    if "draft_model" in members and isinstance(args, dict) and "early_exit_layers" in args:
        raise ValueError(f"draft_model early_exit_layers={args['early_exit_layers']} runs "
                         f"the target's own layers, which tensor_parallel_size={n} splits over the ranks (the drafter runs on "
                         "rank 0 only); give drafter_args.model (a draft model) or "
                         "tensor_parallel_size=1")


def _check_plugin_args(c: EngineConfig) -> None:
    """drafter_args / controller_args are forwarded as **kwargs: a dict with str keys."""
    for name, owner in (("drafter_args", "the drafter"), ("controller_args", "the controller")):
        value = getattr(c, name)
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict of keyword arguments for {owner}, "
                            f"got {type(value).__name__} {value!r}")
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{name} must be a dict of keyword arguments for {owner} with "
                            f"str keys, got keys {list(value)!r}")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
