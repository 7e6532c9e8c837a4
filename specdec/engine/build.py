"""Building what a step needs, once: ``build_engine(config) -> EngineParts``.

    model folder -> config, max_model_len, model, tokenizer -> target runner
    -> verifier, drafter and controller (the registries; a drafter may ask for runners)
    -> one KV budget split over every runner -> CUDA graphs (on CUDA)
    -> prepared weights: the GGUF's own blocks or a checkpoint's own bytes / blocks
       quantized at load, quantized draft matrices, the kernels
    -> controller set-up (step costs) -> cache namespace -> second KV tier

The engine (``specdec.engine.core``) only steps over these parts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec import plugins
from specdec.config import EngineConfig
from specdec.controllers.base import ControllerContext
from specdec.drafters.base import TargetInfo
from specdec.engine.costs import StepCosts
from specdec.engine.cuda_graphs import scratch_pages
from specdec.engine.drafter_setup import create_drafter_and_controller, drafter_sources
from specdec.engine.memory import KVSplit, split_kv
from specdec.engine.runner import ModelRunner
from specdec.engine.step_profile import engine_step_costs
from specdec.engine.verify_stage import VerifyStage
from specdec.kv.fingerprint import weights_fingerprint
from specdec.kv.host_tier import HostTier
from specdec.kv.tier import DiskTier
from specdec.models import native
from specdec.models.aliases import GGUF_NAME
from specdec.models.block_weight import BlockWeight
from specdec.models.checkpoint_weights import checkpoint_panels, from_checkpoint
from specdec.models.config import ModelConfig, model_config_from_hf
from specdec.models.draft_weights import draft_panels, mode_of
from specdec.models.gguf_model import materialize
from specdec.models.gguf_weights import native_panels
from specdec.models.kernel_choice import install_kernels
from specdec.models.linear import LinearKernels
from specdec.models.loader import load_hf_config, load_model, resolve_model_path
from specdec.models.prepared import PreparedLinears
from specdec.models.tokenizer import load_tokenizer

DEFAULT_KV_MEMORY_CAP = 1 << 30
logger = logging.getLogger("specdec")


@dataclass(eq=False)
class EngineParts:
    """Everything a step runs with (built by ``build_engine``; read-only afterwards)."""

    config: EngineConfig
    pm: object  # the plugin manager
    folder: Path  # the model's folder
    model_config: ModelConfig
    hf_config: object
    max_model_len: int
    model: torch.nn.Module
    tokenizer: object
    runner: ModelRunner  # the target's
    drafter_runners: list[ModelRunner]
    verifier: VerifyStage
    drafter: object | None
    controller: object
    kv_split: KVSplit | None = None
    # the target's: "native" (a GGUF's blocks, a bf16 / fp16 checkpoint's own bytes),
    # "dequantized" (float32 copies), or the quantize mode its blocks were made in ("q8_0" ...)
    weights: str = "dequantized"
    draft_weights: str = "none"  # "none" | "float" | a quantized mode (draft_weights)
    kernels: LinearKernels | PreparedLinears | None = None
    cache_namespace: str = ""  # everything that changes the KV a token sequence leaves
    tier: DiskTier | HostTier | None = None
    build_seconds: dict[str, float] = field(default_factory=dict)  # seconds per build stage
    # what the target's blocks multiply: "float" | "q8" (EngineConfig.activations, "auto"
    # resolved by what the weights turned out to be: _resolve_activations)
    activations: str = "float"

    @property
    def sources(self) -> tuple[str, ...]:
        return drafter_sources(self.drafter)

    @property
    def dtype(self) -> torch.dtype:
        return self.config.torch_dtype

    @property
    def device(self) -> torch.device:
        return torch.device(self.config.device)


    @property
    def weight_bytes_per_forward(self) -> int:
        """Bytes of target and drafter matrices one forward of each streams: the prepared
        panels (native GGUF blocks or fp32/bf16 panels), else the models' weights."""
        return getattr(self.kernels, "weight_bytes", None) or sum(
            w.numel() * w.element_size() for r in [self.runner, *self.drafter_runners]
            for w in r.model.matrices())

    def step_costs(self) -> StepCosts:
        """The target's forward seconds by rows on this machine (specdec.engine.step_profile:
        profiled once within what the KV and max_model_len allow, cached)."""
        return engine_step_costs(self)


def build_engine(config: EngineConfig, plugins_: tuple = ()) -> EngineParts:
    clock = _Clock()
    device = torch.device(config.device)
    _check_device(device)
    pm = plugins.get_plugin_manager(plugins_)
    folder = resolve_model_path(config.model)
    cfg = model_config_from_hf(load_hf_config(folder))
    max_model_len = _max_model_len(config, cfg)
    # a GGUF's matrices stay its blocks unless the dequantized ones are asked for (the kernels
    # run the blocks; where they cannot, _native_weights dequantizes them)
    if config.quantize is not None:
        _check_quantize(config)  # before the minutes quantizing takes
    model, _, hf_config = load_model(folder, config.torch_dtype, device, max_model_len,
                                     blocks=config.weights != "dequantized",
                                     quantize=config.quantize)
    tokenizer = load_tokenizer(folder)
    clock.mark("load")
    drafter_runners: list[ModelRunner] = []

    def new_runner(model, name: str = "drafter", num_layers: int | None = None) -> ModelRunner:
        """`TargetInfo.new_runner`: a drafter's runner, allocated with the target's."""
        runner = _runner(config, model, name, num_layers)
        drafter_runners.append(runner)
        return runner

    target = TargetInfo(model, cfg, hf_config, tokenizer, str(folder), config.torch_dtype,
                        device, config.page_size, max_model_len, new_runner)
    parts = EngineParts(config, pm, folder, cfg, hf_config, max_model_len, model, tokenizer,
                        _runner(config, model, "target"), drafter_runners,
                        VerifyStage.create(pm, config.verifier, cfg.vocab_size),
                        *create_drafter_and_controller(pm, config, target))
    clock.mark("runners, drafter")
    parts.kv_split = _allocate_kv(parts)
    _enable_cuda_graphs(parts)
    clock.mark("kv")
    _prepare_weights(parts)
    clock.mark("weights, kernels")
    _capture_graphs(parts)
    clock.mark("cuda graphs")
    if parts.drafter is not None and hasattr(parts.controller, "setup"):
        parts.controller.setup(ControllerContext(parts.step_costs, str(device),
                                                 config.max_num_seqs,
                                                 config.max_num_batched_tokens,
                                                 sources=parts.sources))
        clock.mark("controller setup")
    # pages are shared only within one namespace (and a tier file of another is re-made): the
    # weights (path and fingerprint), the numbers (dtype, weights, activations, kernels) and
    # the KV layout of one page
    parts.cache_namespace = "|".join(map(str, (
        folder.resolve(), weights_fingerprint(folder), config.torch_dtype, parts.weights,
        parts.activations, config.linear_kernels,
        tuple(parts.runner.kv.cache.tensor[:, 0].shape))))
    parts.tier = _open_tier(parts)
    parts.build_seconds = clock.seconds
    logger.info("engine built in %.1f s: %s", sum(clock.seconds.values()),
                ", ".join(f"{k} {v:.1f} s" for k, v in clock.seconds.items()))
    return parts


class _Clock:
    """Seconds per build stage (``EngineParts.build_seconds``: where a slow start goes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = round(now - self._last, 3)
        self._last = now


def _runner(config: EngineConfig, model, name: str, num_layers: int | None = None):
    return ModelRunner(model, name, config.attention_backend, config.page_size,
                       torch.device(config.device), num_layers,
                       invariant=config.linear_kernels == "invariant")


def _allocate_kv(parts: EngineParts) -> KVSplit:
    """One memory budget, the same pages for the target and every drafter runner."""
    runners = [parts.runner, *parts.drafter_runners]
    names = [r.name if i == 0 else f"drafter {r.name}" for i, r in enumerate(runners)]
    per_page = dict(zip(names, (r.bytes_per_page for r in runners)))
    c = parts.config
    memory = c.kv_cache_memory
    if c.num_pages is None and memory is None:
        per_token = sum(per_page.values()) // c.page_size
        one = per_token * parts.max_model_len
        memory = max(one, min(DEFAULT_KV_MEMORY_CAP, one * c.max_num_seqs))
    split = split_kv(per_page, c.page_size, parts.max_model_len, memory, c.num_pages)
    graphed = _graphed_runners(parts)
    for runner in runners:
        # a graphed runner's padding dummies get pages of their own, beside the requests'
        extra = scratch_pages(c.max_num_batched_tokens, c.page_size) if runner in graphed else 0
        runner.allocate(split.num_pages + extra)
    logger.info(split.describe())
    return split


def _graphed_runners(parts: EngineParts) -> list[ModelRunner]:
    """The runners that replay CUDA graphs: on CUDA (unless ``cuda_graphs`` is off) those whose
    attention backend supports them; the others stay eager."""
    c = parts.config
    if not c.cuda_graphs or parts.device.type != "cuda":
        return []
    return [r for r in [parts.runner, *parts.drafter_runners] if r.backend.supports_cuda_graphs]


def _enable_cuda_graphs(parts: EngineParts) -> None:
    c = parts.config
    for runner in _graphed_runners(parts):
        runner.enable_cuda_graphs(c.max_num_seqs, c.max_num_batched_tokens, parts.max_model_len)


def _capture_graphs(parts: EngineParts) -> None:
    """The target's graphs captured now, with its kernels in place, for every shape: no step
    pays a capture (a drafter runner's are captured at their first use: they take features)."""
    if parts.runner.graphs is None:
        return
    t0 = time.perf_counter()
    n = parts.runner.capture_graphs(tuple(getattr(parts.drafter, "hidden_layers", ())))
    logger.info("CUDA graphs: %d captured for the target in %.1f s", n, time.perf_counter() - t0)


def _prepare_weights(parts: EngineParts) -> None:
    """The target's GGUF blocks (``weights``), the draft models' quantized matrices
    (``draft_weights``) and the kernels that run them (``linear_kernels``)."""
    draft_models = _draft_models(parts)
    parts.activations = _resolve_activations(parts)
    adopted = _native_weights(parts)
    parts.weights = (parts.config.quantize or "native") if adopted else "dequantized"
    quantized = _draft_weights(parts, draft_models, adopted)
    parts.draft_weights = ("none" if not draft_models else
                           mode_of(quantized) if quantized else "float")
    models = [*(r.model for r in [parts.runner, *parts.drafter_runners]),
              *getattr(parts.drafter, "matmul_models", ())]
    parts.kernels = install_kernels(models, parts.config.linear_kernels, parts.dtype,
                                    parts.device, adopted + quantized)
    _install_layer_ops(parts, models)


def _install_layer_ops(parts: EngineParts, models: list) -> None:
    """On CUDA the decoders run a layer as one kernel per step (specdec.models.layer_ops)."""
    if parts.device.type != "cuda":
        return
    for m in models:
        if hasattr(m, "layer_ops"):
            m.layer_ops = True


def _resolve_activations(parts: EngineParts) -> str:
    """``EngineConfig.activations``, "auto" resolved: "q8" where the target computes with
    quantized blocks in the compiled kernels (a GGUF's own, or blocks ``quantize`` makes of a
    checkpoint), what llama.cpp computes for such a file; "float" for float weights (an fp32,
    bf16 or fp16 checkpoint as stored, a float GGUF), dequantized weights, other dtypes and
    devices."""
    c = parts.config
    if c.activations != "auto":
        return c.activations
    if (c.weights == "dequantized" or _kernels_refusal(c) is not None
            or parts.device.type != "cpu"):
        return "float"
    if from_checkpoint(parts.model):
        return "q8" if c.quantize is not None else "float"
    blocks = any(isinstance(w, BlockWeight) for w in parts.model.matrices())
    return "q8" if blocks else "float"


def _native_weights(parts: EngineParts) -> list:
    """The panels ``EngineConfig.weights`` gives the target: a safetensors checkpoint's own
    bf16 / fp16 bytes or its blocks quantized at load (specdec.models.checkpoint_weights), or
    a GGUF's blocks (specdec.models.gguf_weights); without them its BlockWeights, if any, are
    dequantized once. Unless it says "dequantized", a draft model loaded from a GGUF too (as
    "auto": where they can run)."""
    c = parts.config
    if from_checkpoint(parts.model):  # a checkpoint's own bytes, or blocks quantized at load
        adopted = checkpoint_panels(parts.model, c.weights, parts.activations,
                                    _kernels_refusal(c))
    else:
        adopted = native_panels(parts.model, parts.folder / GGUF_NAME, c.weights, parts.dtype,
                                parts.device, c.linear_kernels, parts.activations,
                                strict=c.activations == "q8")
    if not adopted:
        materialize(parts.model)  # its blocks, if any, cannot run here: fp32 matrices instead
        if c.activations == "auto":
            parts.activations = "float"
    for runner in parts.drafter_runners:
        m = runner.model
        if m is parts.model or getattr(m, "source_folder", None) is None:
            continue
        panels = [] if c.weights == "dequantized" else native_panels(
            m, m.source_folder / GGUF_NAME, "auto", parts.dtype, parts.device,
            c.linear_kernels, parts.activations, strict=False)
        if not panels:
            materialize(m)
        adopted += panels
    return adopted


def _kernels_refusal(config: EngineConfig) -> str | None:
    """Why the compiled kernels cannot run a model's float32 matrices here (None: they can)."""
    if config.torch_dtype != torch.float32:
        return f"they compute in float32, not {str(config.torch_dtype).removeprefix('torch.')}"
    if (torch.device(config.device).type != "cpu" or config.linear_kernels != "invariant"
            or native.load() is None):
        return "they need the compiled CPU kernels (linear_kernels='invariant' on a CPU)"
    return None


def _check_quantize(config: EngineConfig) -> None:
    reason = _kernels_refusal(config)
    if reason is not None:
        raise ValueError(f"quantize={config.quantize!r} cannot run here: {reason}")


def _draft_models(parts: EngineParts) -> list:
    """The models a drafter computes with besides the target (its runners' models, e.g. an
    EAGLE-3 head, and its ``matmul_models``, e.g. MTP heads)."""
    models = [r.model for r in parts.drafter_runners if r.model is not parts.model]
    return list(dict.fromkeys([*models, *getattr(parts.drafter, "matmul_models", ())]))


def _draft_weights(parts: EngineParts, models: list, adopted: list) -> list:
    """Quantized panels (``EngineConfig.draft_weights``, specdec.models.draft_weights) for
    the draft models whose matrices have no panels yet (a draft model from a GGUF computes
    with the file's own blocks)."""
    have = {id(w) for w, _ in adopted}
    models = [m for m in models if not any(id(w) in have for w in m.matrices())]
    c = parts.config
    return draft_panels(models, c.draft_weights, parts.dtype, parts.device, c.linear_kernels,
                        parts.activations)


def _open_tier(parts: EngineParts) -> DiskTier | HostTier | None:
    """The second KV tier below the target's KV (EngineConfig.kv_tier_path: a file on disk;
    kv_host_tier_bytes: host memory), if asked for. Drafters' own caches have none: after a
    hit they restore what they still hold in memory (specdec.drafters.base, "Prefix
    caching")."""
    c = parts.config
    if c.kv_host_tier_bytes is not None:
        tier = HostTier(parts.runner.bytes_per_page, c.kv_host_tier_bytes, parts.device)
    elif c.kv_tier_path is not None:
        tier = DiskTier(c.kv_tier_path, parts.runner.bytes_per_page, c.kv_tier_bytes,
                        parts.cache_namespace)
    else:
        return None
    parts.runner.kv.attach_tier(tier)
    return tier


def _check_device(device: torch.device) -> None:
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} but CUDA is not available here (torch "
                         f"{torch.__version__}); use device 'cpu'")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} but this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    # streams, graph captures and flashinfer's JIT follow the current device: make it ours
    # ("cuda" alone names the current one; set_device wants an index)
    torch.cuda.set_device(torch.cuda.current_device() if device.index is None else device.index)


def _max_model_len(config: EngineConfig, cfg) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)  # attention here is full; stay inside the window
    if config.max_model_len is None:
        return min(limit, 4096)
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit {limit}")
    return config.max_model_len
